"""Deployments by name: their validated spec, and their persistence in SQLite under the data dir.

A deployment is what a user asked for with `stoker deploy`: a name, the model (as they wrote it
and as the snapshot id it resolved to), the engine, the scaling policy and its bounds. The registry
survives restarts: `stoker up` brings every deployment back from it. A row written before a field
existed reads as that field's default (rows are JSON, read into `DeploymentSpec` by name).
"""

from __future__ import annotations

import json
import math
import re
import sqlite3
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from stoker.openai_errors import APIError, invalid
from warm_pool.policies import DEFAULT_POLICY, POLICIES

NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
ENGINES = ("cpu", "vllm")


@dataclass(frozen=True)
class DeploymentSpec:
    name: str
    model: str  # as the user gave it: a snapshot name or id, or a local path
    snapshot_id: str
    engine: str = "cpu"
    policy: str = DEFAULT_POLICY  # a name in warm_pool.policies.POLICIES
    min_warm: int = 0
    max: int = 1
    idle_timeout_s: float = 300.0
    target_concurrency: int = 4
    grace_period_s: float = 30.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# field -> (kind, low, high, default); the one table of what a deploy accepts
FIELDS: dict[str, tuple[type, float, float, Any]] = {
    "min_warm": (int, 0, 64, 0),
    "max": (int, 1, 64, 1),
    "idle_timeout_s": (float, 1.0, 7 * 86400.0, 300.0),
    "target_concurrency": (int, 1, 1024, 4),
    "grace_period_s": (float, 0.0, 3600.0, 30.0),
}


def validate(body: Any) -> dict[str, Any]:
    """Check a deploy request; returns its fields (model not yet resolved). Raises 400 naming the field."""
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    unknown = sorted(set(body) - {"name", "model", "engine", "policy", *FIELDS})
    if unknown:
        raise invalid(
            f"Unknown field(s) {unknown}; allowed: name, model, engine, policy, {', '.join(FIELDS)}.",
            unknown[0],
        )
    name = body.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise invalid(
            f"'name' must be 1-63 lowercase letters, digits, '.', '_' or '-', starting with a letter or digit; got {name!r}.",
            "name",
        )
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise invalid(
            "'model' is required: a snapshot name or id, an s3://bucket/prefix snapshot, or a local model directory or .gguf file.",
            "model",
        )
    engine = body.get("engine", "cpu")
    if engine not in ENGINES:
        raise invalid(f"'engine' must be one of {list(ENGINES)}, got {engine!r}.", "engine")
    policy = body.get("policy", DEFAULT_POLICY)
    if (message := policy_error(policy)) is not None:
        raise invalid(message, "policy")
    out: dict[str, Any] = {"name": name, "model": model.strip(), "engine": engine, "policy": policy}
    for field, (kind, low, high, default) in FIELDS.items():
        value = body.get(field, default)
        if value is None:
            value = default
        ok_type = isinstance(value, int) if kind is int else isinstance(value, int | float)
        if isinstance(value, bool) or not ok_type or (kind is float and not math.isfinite(value)):
            raise invalid(
                f"'{field}' must be {'an integer' if kind is int else 'a number'}, got {value!r}.", field
            )
        if not low <= value <= high:
            raise invalid(f"'{field}' must be in {low:g}..{high:g}, got {value}.", field)
        out[field] = kind(value)
    if out["min_warm"] > out["max"]:
        raise invalid(f"'min_warm' must be in 0..max (0..{out['max']}), got {out['min_warm']}.", "min_warm")
    return out


def policy_error(policy: object) -> str | None:
    """Why `policy` is no scaling policy's name, or None if it is one (shared with the CLI)."""
    if isinstance(policy, str) and policy in POLICIES:
        return None
    return f"'policy' must be one of {', '.join(POLICIES)}; got {policy!r}."


class Registry:
    """Deployment specs in SQLite (`$STOKER_HOME/stoker.db`). Writes are single transactions."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, isolation_level=None)  # autocommit; `with` for transactions
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS deployments ("
            " name TEXT PRIMARY KEY, spec TEXT NOT NULL, created_at REAL NOT NULL, updated_at REAL NOT NULL)"
        )

    def put(self, spec: DeploymentSpec) -> None:
        now = time.time()
        with self._db:
            self._db.execute(
                "INSERT INTO deployments (name, spec, created_at, updated_at) VALUES (?, ?, ?, ?)"
                " ON CONFLICT(name) DO UPDATE SET spec = excluded.spec, updated_at = excluded.updated_at",
                (spec.name, json.dumps(spec.to_dict()), now, now),
            )

    def delete(self, name: str) -> None:
        with self._db:
            self._db.execute("DELETE FROM deployments WHERE name = ?", (name,))

    def all(self) -> list[DeploymentSpec]:
        rows = self._db.execute("SELECT spec FROM deployments ORDER BY created_at, name").fetchall()
        return [DeploymentSpec(**json.loads(spec)) for (spec,) in rows]

    def close(self) -> None:
        self._db.close()


def not_found(name: str) -> APIError:
    return APIError(
        404,
        f"No deployment named {name!r}.",
        type="not_found_error",
        param="name",
        code="deployment_not_found",
    )
