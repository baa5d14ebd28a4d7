"""Tenant keys and their limits, as the admin API takes them: what a key is (`KeyRecord`, stored as
the SHA-256 of `PREFIX` and 32 random bytes), the body of a key request and its validation, and
`Limits` (requests per second, tokens per minute, concurrent requests, and the key's priority
class: its requests' default `priority` and the floor they may not ask below, `stoker.spec.priority`;
400 naming the field). The gateway enforces them (`stoker.gateway.limits`, `stoker.gateway.keys`); the store keeps them
(`stoker.control.keys`).
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from stoker.errors import invalid
from stoker.spec import priority
from stoker.spec.deployment import NAME


@dataclass(frozen=True)
class Limits:
    """One key's limits; None: not limited on that axis."""

    rps: float | None = None  # requests per second (bucket of max(1, rps))
    tpm: int | None = None  # tokens (prompt + completion) per minute
    max_concurrent: int | None = None  # requests held + in flight at once
    # Its priority class (`stoker.spec.priority`; lower is served first): its requests' priority
    # where their body names none (None: 0), and the lowest one they may name (None: any).
    priority: int | None = None
    priority_min: int | None = None

    @property
    def any(self) -> bool:
        return self.rps is not None or self.tpm is not None or self.max_concurrent is not None

    def over(self, defaults: Limits) -> Limits:
        """These limits, with `defaults` where these say nothing."""
        return Limits(
            self.rps if self.rps is not None else defaults.rps,
            self.tpm if self.tpm is not None else defaults.tpm,
            self.max_concurrent if self.max_concurrent is not None else defaults.max_concurrent,
            self.priority if self.priority is not None else defaults.priority,
            self.priority_min if self.priority_min is not None else defaults.priority_min,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def parse(cls, body: dict[str, Any], prefix: str = "") -> Limits:
        """`rps`, `tpm`, `max_concurrent`, `priority`, `priority_min` from a request body (absent or
        null: not set), or a 400 naming the field."""
        rps = body.get("rps")
        if rps is not None and not (is_number(rps) and 0 < rps <= 1e6):
            raise invalid(f"'{prefix}rps' must be a number in (0, 1000000], got {rps!r}.", f"{prefix}rps")
        values: dict[str, Any] = {"rps": float(rps) if rps is not None else None}
        for name, high in (("tpm", 10**12), ("max_concurrent", 1_000_000)):
            value = body.get(name)
            if value is not None and not (is_integer(value) and 1 <= value <= high):
                raise invalid(
                    f"'{prefix}{name}' must be an integer in [1, {high}], got {value!r}.", f"{prefix}{name}"
                )
            values[name] = value
        for name in ("priority", "priority_min"):
            value = body.get(name)
            values[name] = None if value is None else priority.checked(value, prefix + name)
        if values["priority_min"] is not None and (values["priority"] or 0) < values["priority_min"]:
            raise invalid(
                f"'{prefix}priority' ({values['priority'] or 0}) must be at least '{prefix}priority_min' "
                f"({values['priority_min']}): a key's own requests may not be refused for its default.",
                f"{prefix}priority",
            )
        return cls(**values)


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def is_integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


NO_LIMITS = Limits()
LIMIT_FIELDS = frozenset(f.name for f in fields(Limits))  # as a key's JSON holds them


PREFIX = "sk-stoker-"


TENANT = NAME  # same alphabet as deployment names: safe in logs, tables and URLs


@dataclass(frozen=True)
class KeyRecord:
    id: str
    tenant: str
    deployments: tuple[str, ...]
    created: float  # unix seconds
    limits: Limits = NO_LIMITS  # its own; the platform's defaults apply where these say nothing

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "tenant": self.tenant,
            "deployments": list(self.deployments),
            "created": self.created,
            **self.limits.to_dict(),
        }

    @functools.cached_property
    def principal(self) -> Principal:
        return Principal(False, self.tenant, frozenset(self.deployments), self.id, self.limits)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


KEY_FIELDS = ("tenant", "deployments", "rps", "tpm", "max_concurrent", "priority", "priority_min")


def validate_key_request(body: Any) -> tuple[str, tuple[str, ...], Limits]:
    """A `POST /admin/v1/keys` body: `{"tenant": str, "deployments": [name, ...]}` and optional
    limits `rps`, `tpm`, `max_concurrent` and priority class `priority`, `priority_min`; or a 400
    naming the field."""
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    unknown = sorted(set(body) - set(KEY_FIELDS))
    if unknown:
        raise invalid(f"Unknown field(s) {unknown}; allowed: {', '.join(KEY_FIELDS)}.", unknown[0])
    tenant = body.get("tenant")
    if not isinstance(tenant, str) or not TENANT.fullmatch(tenant):
        raise invalid(
            f"'tenant' must be 1-63 lowercase letters, digits, '.', '_' or '-', starting with a letter or digit; got {tenant!r}.",
            "tenant",
        )
    names = body.get("deployments")
    if not isinstance(names, list) or not names or len(names) > 1024:
        raise invalid("'deployments' must be a list of 1 to 1024 deployment names.", "deployments")
    for name in names:
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise invalid(f"'deployments' holds {name!r}, which is no deployment name.", "deployments")
    return tenant, tuple(dict.fromkeys(names)), Limits.parse(body)


@dataclass(frozen=True)
class Principal:
    """Who a request comes from: the admin (may call everything) or a tenant's key."""

    admin: bool
    tenant: str | None = None
    deployments: frozenset[str] = frozenset()
    key_id: str = "admin"  # the key's id: whose limits, and whose turn in a hold queue
    limits: Limits = NO_LIMITS

    def may_call(self, deployment: str) -> bool:
        return self.admin or deployment in self.deployments


ADMIN = Principal(admin=True)
