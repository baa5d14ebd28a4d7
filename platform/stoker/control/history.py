"""The last hour of every deployment: what `GET /admin/v1/history` and the web dashboard plot.

Every `interval_s` the sampler reads the platform's own metrics registry (the numbers `/metrics`
shows, so the page and Prometheus never disagree) and keeps one point: per deployment, the answer
and 5xx rates over the interval, the arrival rate (`stoker_scaler_arrivals_total`: what the scaler
heard of, held requests included) and the forecast it planned for, requests held now, instances by
state, and what happened in the interval: cold-start requests by tier, the mean start-up seconds of
the starts that finished (by tier), the mean time held of the requests whose hold ended, instance-
seconds by state, and cost (USD) where `stoker_cost_usd_total` is registered. Rates and means are
deltas of counters and histogram sums between two readings, e.g. `stoker_requests_total` at 120 then
135 over 5 s → 3.0 requests/s; 2 holds ending with `stoker_queue_wait_seconds_sum` up by 7.0 → 3.5 s.

A controller with gateways of their own (`stoker controller`) reads the requests' figures from
them (`extra`: `stoker.gateway.metering.GatewaySeries`), added to its own registry's.

Bounded: `window_s / interval_s` points (3600 / 5 = 720), the oldest dropped. The point-making is a
pure function of two readings and the seconds between them; the loop only reads, calls it, sleeps.

Checkpointed (`stoker.control.checkpoint`: the sampler's `checkpoint` and `restore`): the points, by
their wall-clock times, so a restart keeps the hour (with a gap while it was down). Those older
than the window by the time it is back are dropped; the first reading after it sets a new baseline,
since the counters it reads start from zero in the new process.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from stoker.control.checkpoint import count, fields, items, label, number
from stoker.gateway.metering import Reading, read_registry

INTERVAL_ENV = "STOKER_HISTORY_INTERVAL"  # seconds between samples (default 5)


@dataclass(frozen=True)
class HistoryConfig:
    interval_s: float = 5.0
    window_s: float = 3600.0

    def __post_init__(self) -> None:
        if not (0.1 <= self.interval_s <= 300):
            raise ValueError(f"history interval must be in [0.1, 300] s, got {self.interval_s!r}")
        if not (self.interval_s <= self.window_s <= 86400):
            raise ValueError(
                f"history window must be in [interval ({self.interval_s:g}), 86400] s, got {self.window_s!r}"
            )

    @property
    def max_points(self) -> int:
        return math.ceil(self.window_s / self.interval_s)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> HistoryConfig:
        """The interval from $STOKER_HISTORY_INTERVAL (seconds), else the default."""
        text = (os.environ if environ is None else environ).get(INTERVAL_ENV, "").strip()
        if not text:
            return cls()
        try:
            interval = float(text)
        except ValueError:
            raise ValueError(f"{INTERVAL_ENV} must be a number of seconds, got {text!r}") from None
        return cls(interval_s=interval)


def _by(reading: Reading, name: str, key: str | None = None, **prefix: str) -> dict[tuple[str, str], float]:
    """Sum of `name`'s samples by (deployment, the `key` label's value or ""), over those whose
    labels start with `prefix`'s values (code="5": the 5xx)."""
    out: dict[tuple[str, str], float] = {}
    for (sample, labels), value in reading.items():
        if sample != name:
            continue
        d = dict(labels)
        if "deployment" not in d or any(not d.get(k, "").startswith(v) for k, v in prefix.items()):
            continue
        k = (d["deployment"], d.get(key, "") if key else "")
        out[k] = out.get(k, 0.0) + value
    return out


def _delta(now: dict, before: dict) -> dict:
    # A counter never goes down; one that did was reset (its process restarted): count from zero.
    return {k: (v - before.get(k, 0.0) if v >= before.get(k, 0.0) else v) for k, v in now.items()}


def _mean(sums: dict, counts: dict, deployment: str, key: str = "") -> float | None:
    n = counts.get((deployment, key), 0.0)
    return round(sums.get((deployment, key), 0.0) / n, 3) if n > 0 else None


def point(before: Reading, now: Reading, dt: float) -> dict[str, dict[str, Any]]:
    """Each deployment's figures over the `dt` seconds between two readings (see the module's
    docstring)."""

    def delta(name: str, key: str | None = None, **prefix: str) -> dict:
        return _delta(_by(now, name, key, **prefix), _by(before, name, key, **prefix))

    requests, errors = delta("stoker_requests_total"), delta("stoker_requests_total", code="5")
    arrivals = delta("stoker_scaler_arrivals_total")
    cold = delta("stoker_cold_start_requests_total", "tier")
    start_sum = delta("stoker_instance_startup_seconds_sum", "tier")
    start_n = delta("stoker_instance_startup_seconds_count", "tier")
    hold_sum, hold_n = delta("stoker_queue_wait_seconds_sum"), delta("stoker_queue_wait_seconds_count")
    held_seconds = delta("stoker_instance_seconds_total", "state")
    cost = delta("stoker_cost_usd_total")
    forecast = _by(now, "stoker_scaler_forecast_requests_per_second")
    queued = _by(now, "stoker_queue_length")
    instances = _by(now, "stoker_instances", "state")
    # Deployments that are here now (the pool's gauges go with a removed one), or answered lately;
    # a removed deployment's counters stay, as history, but it leaves the points.
    names = sorted({d for d, _ in instances} | {d for (d, _), n in requests.items() if n})
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        out[name] = {
            "requests_per_s": round(requests.get((name, ""), 0.0) / dt, 4),
            "arrivals_per_s": round(arrivals.get((name, ""), 0.0) / dt, 4),
            "errors_per_s": round(errors.get((name, ""), 0.0) / dt, 4),
            "forecast_per_s": forecast.get((name, "")),
            "queued": int(queued.get((name, ""), 0)),
            "instances": {s: int(n) for (d, s), n in sorted(instances.items()) if d == name and n},
            "cold_starts": {t: int(n) for (d, t), n in sorted(cold.items()) if d == name and n},
            "start_s": {
                t: _mean(start_sum, start_n, name, t)
                for (d, t), n in sorted(start_n.items())
                if d == name and n
            },
            "hold_s": _mean(hold_sum, hold_n, name),
            "instance_seconds": {
                s: round(v, 3) for (d, s), v in sorted(held_seconds.items()) if d == name and v
            },
            "cost_usd": round(cost[(name, "")], 6) if (name, "") in cost else None,
        }
    return out


class History:
    """The bounded series: `record` a reading at `now` (monotonic seconds) and `wall` (epoch
    seconds, what the page's time axis shows); the first reading only sets the baseline."""

    def __init__(self, config: HistoryConfig) -> None:
        self.config = config
        self._points: deque[dict[str, Any]] = deque(maxlen=config.max_points)
        self._last: tuple[Reading, float] | None = None

    def record(self, reading: Reading, now: float, wall: float) -> None:
        if self._last is not None and now > self._last[1]:
            dt = now - self._last[1]
            deployments = point(self._last[0], reading, dt)
            self._points.append({"t": round(wall, 3), "dt": round(dt, 3), "deployments": deployments})
        self._last = (reading, now)

    def restore(self, points: list[dict[str, Any]]) -> None:
        """Points from a checkpoint (`restored_points`), older than every point recorded here."""
        first = self._points[0]["t"] if self._points else math.inf
        kept = [p for p in points if p["t"] < first]
        self._points = deque([*kept, *self._points], maxlen=self.config.max_points)

    def snapshot(self, since: float | None = None) -> dict[str, Any]:
        points = [p for p in self._points if since is None or p["t"] > since]
        return {
            "interval_s": self.config.interval_s,
            "window_s": self.config.window_s,
            "points": points,
        }


_FIGURES = (
    "requests_per_s",
    "arrivals_per_s",
    "errors_per_s",
    "forecast_per_s",
    "queued",
    "instances",
    "cold_starts",
    "start_s",
    "hold_s",
    "instance_seconds",
    "cost_usd",
)
_MOST_DEPLOYMENTS = 10_000
_MOST_LABELS = 64


def _by_label(value: object, where: str, read) -> dict[str, Any]:
    if not isinstance(value, dict) or len(value) > _MOST_LABELS:
        raise ValueError(f"{where}: want an object of at most {_MOST_LABELS} entries")
    return {label(k, where): read(v, f"{where}.{k}") for k, v in value.items()}


def _figures(value: object, where: str) -> dict[str, Any]:
    """One deployment's figures in a point, as `point` makes them."""
    f = fields(value, where, _FIGURES)
    rate = lambda key: number(f[key], f"{where}.{key}")  # noqa: E731
    maybe = lambda v, at: number(v, at, optional=True)  # noqa: E731
    return {
        "requests_per_s": rate("requests_per_s"),
        "arrivals_per_s": rate("arrivals_per_s"),
        "errors_per_s": rate("errors_per_s"),
        "forecast_per_s": maybe(f["forecast_per_s"], f"{where}.forecast_per_s"),
        "queued": count(f["queued"], f"{where}.queued"),
        "instances": _by_label(f["instances"], f"{where}.instances", count),
        "cold_starts": _by_label(f["cold_starts"], f"{where}.cold_starts", count),
        "start_s": _by_label(f["start_s"], f"{where}.start_s", maybe),
        "hold_s": maybe(f["hold_s"], f"{where}.hold_s"),
        "instance_seconds": _by_label(f["instance_seconds"], f"{where}.instance_seconds", number),
        "cost_usd": number(f["cost_usd"], f"{where}.cost_usd", optional=True),
    }


def restored_points(body: object, config: HistoryConfig, wall: float) -> list[dict[str, Any]]:
    """The points of a checkpoint's body that are still within the window at `wall` (epoch
    seconds), the newest `max_points` of them; ValueError naming the first bad field."""
    doc = fields(body, "history", ("points",))
    points, last = [], -math.inf
    for i, raw in enumerate(items(doc["points"], "history.points", 1_000_000)):
        where = f"history.points[{i}]"
        p = fields(raw, where, ("t", "dt", "deployments"))
        t = number(p["t"], f"{where}.t")
        if t <= last:
            raise ValueError(f"{where}.t: the points' times must rise")
        last = t
        dt = number(p["dt"], f"{where}.dt")
        d = p["deployments"]
        if not isinstance(d, dict) or len(d) > _MOST_DEPLOYMENTS:
            raise ValueError(
                f"{where}.deployments: want an object of at most {_MOST_DEPLOYMENTS} deployments"
            )
        deployments = {
            label(k, f"{where}.deployments"): _figures(v, f"{where}.deployments.{k}") for k, v in d.items()
        }
        if t > wall - config.window_s:
            points.append({"t": t, "dt": dt, "deployments": deployments})
    return points[-config.max_points :]


class HistorySampler:
    """The thin loop: every `interval_s`, read the registry and record it."""

    def __init__(
        self,
        registry: CollectorRegistry,
        config: HistoryConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        extra: Callable[[], Reading] | None = None,
    ) -> None:
        self.history = History(config)
        self._registry = registry
        self._extra = extra  # samples from elsewhere: the gateways' (`stoker.gateway.metering`)
        self._clock = clock
        self._wall = wall
        self._task: asyncio.Task | None = None

    checkpoint_kind = "history"

    def checkpoint(self) -> dict[str, Any]:
        """The points, as JSON data (a point is never changed once made)."""
        return {"points": list(self.history.snapshot()["points"])}

    def restore(self, body: dict[str, Any]) -> None:
        """The points of a previous run still within the window, before this one's; all or nothing."""
        points = restored_points(body, self.history.config, self._wall())
        self.history.restore(points)

    def sample(self) -> None:
        reading = read_registry(self._registry)
        if self._extra is not None:
            reading.update(self._extra())
        self.history.record(reading, self._clock(), self._wall())

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="stoker-history")

    async def _run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.history.config.interval_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
