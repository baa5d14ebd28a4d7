"""A deployment, as a user asks for it with `stoker deploy`: a name, the model (as they wrote it and
as the snapshot id it resolved to), the engine and its settings (`stoker.spec.engine`), the scaling
policy and its bounds. Every field's type, default, range and validation, written once; the admin
API, the registry, the CLI and the planes all read them from here. In JSON (the deploy body, the
registry, the admin API) the engine settings sit beside the other fields, flat.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import asdict, dataclass, fields
from typing import Any

from activator.affinity import LEAST_OUTSTANDING, MODES, Balance
from stoker.errors import APIError, invalid
from stoker.spec.engine import ENGINES, SETTINGS, validate_engine
from stoker.spec.engine import default as engine_default
from warm_pool.engine_settings import EngineSettings
from warm_pool.policies import DEFAULT_POLICY, POLICIES
from warm_pool.policies.base import IDLE_TIMEOUT_S, TARGET_CONCURRENCY
from warm_pool.policies.settings import idle_timeout_error
from warm_pool.recycle import max_age_error

NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")


@dataclass(frozen=True)
class DeploymentSpec:
    name: str
    model: str  # as the user gave it: a snapshot name or id, or a local path
    snapshot_id: str
    engine: str = "cpu"
    policy: str = DEFAULT_POLICY  # a name in warm_pool.policies.POLICIES
    min_warm: int = 0
    max: int = 1
    idle_timeout_s: float = IDLE_TIMEOUT_S
    target_concurrency: int = TARGET_CONCURRENCY
    grace_period_s: float = 30.0
    revision: int = 0  # given by the registry when the revision is created (1, 2, ...)
    balance: str = LEAST_OUTSTANDING  # which READY instance takes a request (`activator.affinity`)
    affinity_bound: float = Balance.bound  # prefix mode: no instance above this × the mean load
    # A canary of this revision rolled back by itself when, over `rollback_window_s` (and at least
    # `rollback_min_requests`), its 5xx share or its share of TTFTs over `rollback_ttft_s` (0: no
    # TTFT objective) exceeds `rollback_error_rate`.
    auto_rollback: bool = False
    rollback_error_rate: float = 0.05
    rollback_ttft_s: float = 0.0
    rollback_window_s: float = 60.0
    rollback_min_requests: int = 10
    # The request log (`stoker.gateway.request_log`): this deployment's requests, de-identified; with
    # `log_content` also their prompts and answers, credentials masked.
    log_requests: bool = False
    log_content: bool = False
    # Instances older than this (from their first READY) are replaced without a dip
    # (`warm_pool.recycle`); 0: the platform's `--max-instance-age`, off unless it sets one.
    max_instance_age_s: float = 0.0
    # How its engine runs: devices, vLLM's settings, a pod's resources and placement.
    engine_settings: EngineSettings = dataclasses.field(default_factory=EngineSettings)
    # A LoRA adapter's deployment: the deployment whose instances serve it (`model` is then the
    # adapter, `snapshot_id` its snapshot); None for a model's own (`stoker.control.adapters`).
    base: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Flat: the engine settings beside the other fields."""
        out = asdict(self)
        out.update(out.pop("engine_settings"))
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> DeploymentSpec:
        """From `to_dict`'s shape (or a validated deploy body with its snapshot id). Fields a later
        version dropped are ignored, fields it added take their defaults."""
        own = {f.name for f in fields(cls)} - {"engine_settings"}
        settings = EngineSettings(**{k: values[k] for k in SETTINGS if k in values})
        return cls(**{k: v for k, v in values.items() if k in own}, engine_settings=settings)

    def serves_like(self, other: DeploymentSpec) -> bool:
        """Whether instances of `other` can serve this revision as they are: the same bytes on the
        same engine run the same way (scaling settings apply to running instances; a model, engine
        or engine-setting change needs new ones)."""
        return (self.snapshot_id, self.engine, self.engine_settings) == (
            other.snapshot_id,
            other.engine,
            other.engine_settings,
        )


# field -> (kind, low, high); the one table of the ranges a deploy accepts. Each field's default is
# its `DeploymentSpec` default (`default`), so the API, the registry and the CLI share one.
FIELDS: dict[str, tuple[type, float, float]] = {
    "min_warm": (int, 0, 64),
    "max": (int, 1, 64),
    "idle_timeout_s": (float, 1.0, 7 * 86400.0),
    "target_concurrency": (int, 1, 1024),
    "grace_period_s": (float, 0.0, 3600.0),
    "affinity_bound": (float, 1.0, 10.0),
    "rollback_error_rate": (float, 0.0, 1.0),
    "rollback_ttft_s": (float, 0.0, 3600.0),
    "rollback_window_s": (float, 1.0, 86400.0),
    "rollback_min_requests": (int, 1, 1_000_000),
    "max_instance_age_s": (float, 0.0, 365 * 86400.0),
}


def default(field: str) -> Any:
    """A deployment field's default: `default("idle_timeout_s")` is 300.0."""
    return _DEFAULTS[field]


_DEFAULTS = {f.name: f.default for f in fields(DeploymentSpec) if f.name != "engine_settings"}
BALANCES = MODES
LOG_FLAGS = ("log_requests", "log_content")  # true or false, default false
# Every field a deploy body may hold, in the order the reference and the errors list them.
# `canary_percent` is the deploy's, not the revision's: the platform reads it (`stoker.control.rollout`).
DEPLOY_FIELDS = (
    "name",
    "model",
    "adapter",
    "base",
    "engine",
    "policy",
    "balance",
    "auto_rollback",
    "canary_percent",
    *LOG_FLAGS,
    *FIELDS,
    *SETTINGS,
)


# What an adapter deployment may set: the rest is its base's, whose instances serve it.
ADAPTER_FIELDS = frozenset(
    {"name", "adapter", "base", "auto_rollback", "canary_percent", *LOG_FLAGS}
    | {f for f in FIELDS if f.startswith("rollback_")}
)


def validate(body: Any) -> dict[str, Any]:
    """Check a deploy request; returns its fields (model not yet resolved). Raises 400 naming the field."""
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    if body.get("adapter") is not None or body.get("base") is not None:
        return _validate_adapter(body)
    unknown = sorted(set(body) - set(DEPLOY_FIELDS))
    if unknown:
        raise invalid(f"Unknown field(s) {unknown}; allowed: {', '.join(DEPLOY_FIELDS)}.", unknown[0])
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
    balance = body.get("balance", BALANCES[0])
    if balance not in BALANCES:
        raise invalid(f"'balance' must be one of {list(BALANCES)}, got {balance!r}.", "balance")
    auto_rollback = body.get("auto_rollback", False)
    if not isinstance(auto_rollback, bool):
        raise invalid(f"'auto_rollback' must be true or false, got {auto_rollback!r}.", "auto_rollback")
    out: dict[str, Any] = {
        "name": name,
        "model": model.strip(),
        "engine": engine,
        "policy": policy,
        "balance": balance,
        "auto_rollback": auto_rollback,
    }
    for flag in LOG_FLAGS:
        value = body.get(flag, False)
        if not isinstance(value, bool):
            raise invalid(f"'{flag}' must be true or false, got {value!r}.", flag)
        out[flag] = value
    for field, (kind, low, high) in FIELDS.items():
        value = body.get(field)
        if value is None:
            value = _DEFAULTS[field]
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
    if (message := idle_timeout_error(out["policy"], out["idle_timeout_s"])) is not None:
        raise invalid(message[0].upper() + message[1:] + ".", "idle_timeout_s")
    if (message := max_age_error(out["max_instance_age_s"], allow_zero=True)) is not None:
        raise invalid(f"'max_instance_age_s' {message}.", "max_instance_age_s")
    out.update(validate_engine(body, engine))
    return out


def _body_default(field: str) -> Any:
    return _DEFAULTS.get(field, engine_default(field) if field in SETTINGS else None)


def _validate_adapter(body: dict[str, Any]) -> dict[str, Any]:
    """An adapter deployment's body: `adapter` (its source, as `model` is a model's) and `base`."""
    for field in ("adapter", "base"):
        if body.get(field) is None:
            other = "base" if field == "adapter" else "adapter"
            raise invalid(
                f"'{field}' is required with '{other}': an adapter deployment names the adapter and the "
                "deployment whose instances serve it.",
                field,
            )
    if body.get("model") is not None:
        raise invalid("An adapter deployment takes 'adapter' (and 'base'), not 'model'.", "model")
    # A base's field at its default is no setting (a resource's schema writes every default in).
    theirs = sorted(
        k
        for k, v in body.items()
        if k in DEPLOY_FIELDS and k not in ADAPTER_FIELDS and k != "model" and v != _body_default(k)
    )
    if theirs:
        raise invalid(
            f"'{theirs[0]}' is the base's to set: an adapter runs on its base deployment's instances.",
            theirs[0],
        )
    base = body["base"]
    if not isinstance(base, str) or not NAME.fullmatch(base):
        raise invalid(f"'base' must be a deployment's name; got {base!r}.", "base")
    if base == body.get("name"):
        raise invalid("'base' must be another deployment than the adapter's own.", "base")
    adapter = body["adapter"]
    rest = {k: v for k, v in body.items() if k in ADAPTER_FIELDS and k not in ("adapter", "base")}
    return {**validate({**rest, "model": adapter}), "base": base}


def deploy_schema() -> dict[str, Any]:
    """The deploy body's JSON schema, from the tables above and `stoker.spec.engine.SETTINGS`: the
    admin API's OpenAPI description, the reference page (for the fields the spec does not hold:
    `canary_percent`) and the custom resource's schema (`stoker.spec.resources`) are made from it."""
    fields: dict[str, Any] = {}
    for name, (kind, low, high) in FIELDS.items():
        fields[name] = {
            "type": "integer" if kind is int else "number",
            "minimum": low,
            "maximum": high,
            "default": default(name),
        }
    fields["idle_timeout_s"]["description"] = "at least 2 for a policy that sleeps (predictive)"
    fields["max_instance_age_s"]["description"] = (
        "0: the platform's --max-instance-age (off unless set); else at least 10"
    )
    for name, setting in SETTINGS.items():  # the engine settings (`stoker.spec.engine`); null: the default
        only = "" if setting.engines == ENGINES else f" ({' and '.join(setting.engines)} engine only)"
        fields[name] = {
            "anyOf": [setting.schema, {"type": "null"}],
            "default": engine_default(name),
            "description": setting.help + only,
        }
    return {
        "type": "object",
        "required": ["name"],  # and 'model', or 'adapter' with 'base' (`validate` says which is missing)
        "additionalProperties": False,
        "properties": {
            "name": {"type": "string", "pattern": f"^{NAME.pattern}$"},
            "model": {
                "type": "string",
                "minLength": 1,
                "description": "a snapshot name or id, s3://bucket/prefix, or a local model dir or .gguf file",
            },
            "engine": {"enum": list(ENGINES)},
            "policy": {"enum": list(POLICIES)},
            "balance": {"enum": list(BALANCES)},
            "auto_rollback": {
                "type": "boolean",
                "description": "a canary of it rolls itself back when it fails",
            },
            "log_requests": {
                "type": "boolean",
                "description": "its requests in the request log (no content)",
            },
            "log_content": {"type": "boolean", "description": "prompts and answers too, secrets masked"},
            "adapter": {
                "type": "string",
                "minLength": 1,
                "description": "a LoRA adapter (a snapshot, s3:// or a local PEFT directory) served by 'base'",
            },
            "base": {
                "type": "string",
                "pattern": f"^{NAME.pattern}$",
                "description": "the deployment whose instances serve the adapter",
            },
            "canary_percent": {
                "type": "integer",
                "minimum": 1,
                "maximum": 100,
                "description": "an update takes only this share once warm (default: all of it)",
            },
            **fields,
        },
    }


def policy_error(policy: object) -> str | None:
    """Why `policy` is no scaling policy's name, or None if it is one (shared with the CLI)."""
    if isinstance(policy, str) and policy in POLICIES:
        return None
    return f"'policy' must be one of {', '.join(POLICIES)}; got {policy!r}."


def not_found(name: str) -> APIError:
    return APIError(
        404,
        f"No deployment named {name!r}.",
        type="not_found_error",
        param="name",
        code="deployment_not_found",
    )
