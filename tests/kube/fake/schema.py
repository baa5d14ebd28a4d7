"""The official OpenAPI schemas of the built-in kinds, as `kubernetes_validate` bundles them: every
object a client writes is checked against them (strict: an unknown field is an error, as a
misspelt one must be), and strategic merge patch reads its list tags from them. Beyond the schema,
what the API server's own validation refuses that the tests meet: a Secret's data not base64; a
ConfigMap's keys not config keys, binaryData not base64, or data and binaryData over 1 MiB."""

from __future__ import annotations

import base64
import functools
import json
import re
from pathlib import Path

import kubernetes_validate

SCHEMA_VERSION = "1.33.0"
# A ConfigMap's data and binaryData together (core.MaxSecretSize, which ConfigMaps share; binaryData
# counted decoded), and its keys (validation.IsConfigMapKey).
MAX_CONFIGMAP_BYTES = 1 << 20
_CONFIG_KEY = re.compile(r"[-._a-zA-Z0-9]+")
_CONFIG_KEY_MAX = 253


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
    if obj.get("kind") == "ConfigMap":
        errors = configmap_errors(obj)
        if errors:
            listed = errors[0] if len(errors) == 1 else f"[{', '.join(errors)}]"
            raise SchemaError(f'ConfigMap "{obj["metadata"].get("name", "")}" is invalid: {listed}')


def configmap_errors(obj: dict) -> list[str]:
    """The API server's field errors for a ConfigMap's keys and size, in its words."""
    data, binary = obj.get("data") or {}, obj.get("binaryData") or {}
    errors, total = [], 0
    for field, bag in (("data", data), ("binaryData", binary)):
        for key, value in bag.items():
            errors += [f'{field}[{key}]: Invalid value: "{key}": {why}' for why in _config_key_errors(key)]
            if field == "data":
                total += len(value.encode())
                continue
            if key in data:
                errors.append(f'{field}[{key}]: Invalid value: "{key}": duplicate of key present in data')
            try:
                total += len(base64.b64decode(value, validate=True))
            except ValueError:
                errors.append(f"binaryData[{key}]: not base64")
    if total > MAX_CONFIGMAP_BYTES:
        errors.append(f"[]: Too long: must have at most {MAX_CONFIGMAP_BYTES} bytes")
    return errors


def _config_key_errors(key: str) -> list[str]:
    errors = []
    if len(key) > _CONFIG_KEY_MAX:
        errors.append(f"must be no more than {_CONFIG_KEY_MAX} characters")
    if not _CONFIG_KEY.fullmatch(key):
        errors.append(
            "a valid config key must consist of alphanumeric characters, '-', '_' or '.' "
            f"(regex used for validation is '{_CONFIG_KEY.pattern}')"
        )
    if key in (".", "..") or key.startswith(".."):
        errors.append(f"must not be '{key}'" if key in (".", "..") else "must not start with '..'")
    return errors


@functools.cache
def definitions() -> dict[str, dict]:
    """Every type's definition by name (`io.k8s.api.core.v1.Pod`)."""
    root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    path = root / f"v{SCHEMA_VERSION}-local-strict" / "_definitions.json"
    return json.loads(path.read_text())["$defs"]
