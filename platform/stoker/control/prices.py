"""The price table: what an instance-second in each state and a byte of snapshot storage cost.

`stoker up --prices FILE` and `stoker simulate --prices FILE` read it, YAML or JSON (by suffix:
`.json` is JSON, anything else YAML):

    ready_hour: {cpu: 0.12, vllm: 3.00}   # $ per device-hour READY or DRAINING; a number: every engine
    starting_hour: 3.00                   # $ per device-hour PENDING, STARTING or FAILED (default: ready_hour)
    sleeping_hour: 0.08                   # $ per hour SLEEPING (host RAM; default 0.08)
    snapshot_gb_month: 0.023              # $ per GB-month of the revision's snapshot (default 0)

Each `*_hour` is a number or a map of engine (`cpu`, `vllm`, or `default` for any engine not
named) to a number. An instance counts as one device. STOPPED costs nothing. A GB is 10^9 bytes
and a month 30 days (2,592,000 s). Without a file, every engine costs the simulator's list prices
(`warm_pool.simulate.Prices`): $3.00 per device-hour awake or starting, $0.08 per hour asleep.

Worked example: a `cpu` revision READY 1,800 s, STARTING 9 s, SLEEPING 3,600 s, with a 270 MB
snapshot held for 5,409 s, at the table above: 1800 × 0.12/3600 + 9 × 3.00/3600 + 3600 × 0.08/3600
+ 0.27 × 0.023 × 5409/2592000 = 0.06 + 0.0075 + 0.08 + 0.000013 = $0.147513.

Every bad value is a `PriceError`, one line naming the field: `ready_hour.tpu: unknown engine
(known: cpu, vllm, default)`.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENGINES = ("cpu", "vllm")  # `stoker.spec.deployment.ENGINES`, kept here so the simulator's CLI stays light
HOURLY = ("ready_hour", "starting_hour", "sleeping_hour")
FIELDS = (*HOURLY, "snapshot_gb_month")
MONTH_S = 30 * 86400
GB = 1e9
MAX_FILE_BYTES = 1 << 20
# The price each state is charged at; STOPPED is free.
STATE_PRICE = {
    "READY": "ready_hour",
    "DRAINING": "ready_hour",
    "PENDING": "starting_hour",
    "STARTING": "starting_hour",
    "FAILED": "starting_hour",
    "SLEEPING": "sleeping_hour",
}


class PriceError(ValueError):
    """A price table that cannot be read, or a field in it that makes no sense (one line)."""


def _flat(value: float) -> dict[str, float]:
    return dict.fromkeys(ENGINES, value)


@dataclass(frozen=True)
class PriceTable:
    """$ per hour by engine for each of the three hourly fields, and $ per GB-month of snapshot."""

    ready_hour: Mapping[str, float] = field(default_factory=lambda: _flat(3.00))
    starting_hour: Mapping[str, float] = field(default_factory=lambda: _flat(3.00))
    sleeping_hour: Mapping[str, float] = field(default_factory=lambda: _flat(0.08))
    snapshot_gb_month: float = 0.0

    def per_second(self, engine: str, state: str) -> float:
        """$ one instance of `engine` costs per second in `state` (0 for STOPPED)."""
        name = STATE_PRICE.get(state)
        if name is None:
            return 0.0
        table: Mapping[str, float] = getattr(self, name)
        return table.get(engine, table.get("default", 0.0)) / 3600

    def storage_per_second(self, size_bytes: int) -> float:
        """$ per second of holding a snapshot of `size_bytes`."""
        return size_bytes / GB * self.snapshot_gb_month / MONTH_S

    def to_dict(self) -> dict[str, Any]:
        return {
            **{name: dict(getattr(self, name)) for name in HOURLY},
            "snapshot_gb_month": self.snapshot_gb_month,
        }

    @classmethod
    def parse(cls, data: object) -> PriceTable:
        """A table from a parsed file's top-level mapping; `PriceError` naming the field."""
        if not isinstance(data, dict):
            raise PriceError(f"must be a mapping of {', '.join(FIELDS)}; got {type(data).__name__}")
        unknown = sorted(str(k) for k in data if k not in FIELDS)
        if unknown:
            raise PriceError(f"{unknown[0]}: unknown field (known: {', '.join(FIELDS)})")
        ready = _by_engine("ready_hour", data.get("ready_hour", 3.00))
        starting = _by_engine("starting_hour", data["starting_hour"]) if "starting_hour" in data else ready
        sleeping = _by_engine("sleeping_hour", data.get("sleeping_hour", 0.08))
        storage = _price("snapshot_gb_month", data.get("snapshot_gb_month", 0.0))
        return cls(ready, starting, sleeping, storage)


def _price(where: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise PriceError(f"{where} must be a number ≥ 0 ($), got {value!r}")
    return float(value)


def _by_engine(name: str, value: object) -> dict[str, float]:
    """Every engine's price from a number or a map of engine (or `default`) to a number."""
    if not isinstance(value, dict):
        return _flat(_price(name, value))
    known = (*ENGINES, "default")
    for key in value:
        if key not in known:
            raise PriceError(f"{name}.{key}: unknown engine (known: {', '.join(known)})")
    prices = {str(k): _price(f"{name}.{k}", v) for k, v in value.items()}
    missing = [e for e in ENGINES if e not in prices and "default" not in prices]
    if missing:
        raise PriceError(f"{name}: no price for engine {missing[0]} (give it, or `default`)")
    return {e: prices.get(e, prices.get("default", 0.0)) for e in ENGINES}


def load_prices(path: Path) -> PriceTable:
    """The table in `path`, read without following a link; `PriceError` naming the file."""
    try:
        before = os.lstat(path)
        if stat.S_ISLNK(before.st_mode) or not stat.S_ISREG(before.st_mode):
            raise PriceError(f"{path}: not a regular file (links are not followed)")
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise PriceError(f"{path}: no such file") from None
    except OSError as exc:
        raise PriceError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise PriceError(f"{path}: larger than {MAX_FILE_BYTES} bytes; a price table is a few lines")
    try:
        text = raw.decode()
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except (UnicodeDecodeError, ValueError) as exc:
        raise PriceError(
            f"{path}: not {'JSON' if path.suffix.lower() == '.json' else 'YAML'}: {exc}"
        ) from None
    except Exception as exc:  # yaml.YAMLError, imported lazily
        raise PriceError(f"{path}: not YAML: {' '.join(str(exc).split())}") from None
    try:
        return PriceTable.parse(data)
    except PriceError as exc:
        raise PriceError(f"{path}: {exc}") from None
