"""The official OpenAPI schemas of the built-in kinds, as `kubernetes_validate` bundles them: every
object a client writes is checked against them (strict: an unknown field is an error, as a
misspelt one must be), and strategic merge patch reads its list tags from them."""

from __future__ import annotations

import base64
import functools
import json
from pathlib import Path

import kubernetes_validate

SCHEMA_VERSION = "1.33.0"


class SchemaError(ValueError):
    """What the API server answers 422 Invalid for: `message` in its `Kind field: why` shape."""


def validate(obj: dict) -> None:
    try:
        kubernetes_validate.validate(obj, SCHEMA_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(p) for p in exc.path)
        raise SchemaError(f"{obj.get('kind')} {where}: {exc.message}") from None
    if obj.get("kind") == "Secret":
        for key, value in (obj.get("data") or {}).items():
            try:
                base64.b64decode(value, validate=True)
            except ValueError:
                raise SchemaError(f"Secret data.{key}: not base64") from None


@functools.cache
def definitions() -> dict[str, dict]:
    """Every type's definition by name (`io.k8s.api.core.v1.Pod`)."""
    root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    path = root / f"v{SCHEMA_VERSION}-local-strict" / "_definitions.json"
    return json.loads(path.read_text())["$defs"]
