"""A policy's learned state as JSON and back, for a controller that restarts: `encode` and `decode`.

The state a pool keeps between ticks (`RuledState`, the shared rules' part around the policy's own:
`POLICIES[name].state`) is frozen dataclasses of numbers and tuples, so it is written field by
field into plain JSON (never pickle: a checkpoint may be read from a data dir someone else could
write), and read back with every field checked: its type, that it is finite, its range, that
sequences are no longer than `MAX_ITEMS` and their times rise. A bad field is a `ValueError` that
names it, and nothing of the state is returned.

Times. The policies count in the pool's clock, which is monotonic: its origin moves with every
reboot (and with every container a controller moves to), so the file holds wall-clock times
(`to_wall` = wall − monotonic at that moment, added on the way out and the new one's taken away on
the way in). Worked example: saved at monotonic 5000 = wall 1764568800, a `last_up` at monotonic
4990 is written as 1764568790; restored after a reboot at monotonic 12 = wall 1764568900, it is
monotonic −88: 100 s before now, as it was. The one place where only whole steps will do is the
time-of-day profile (`forecast.DayProfile`): its slots are minutes of the clock's day, so its rates
turn by the whole slots nearest the change of origin (within half a slot, 30 s, of the wall time),
and the slot being counted keeps its alignment.

Not kept: NaN has no JSON spelling, so a profile slot no day has filled yet is `null`. Each
adapter's window and cost are not written: they follow from its histogram and are computed again.
A predictive state written before adapters were tracked (no `adapters` field) reads as one that
tracks none.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any

from warm_pool.policies import POLICIES
from warm_pool.policies.adapter_forecast import AdapterTrack
from warm_pool.policies.base import SecondSample
from warm_pool.policies.forecast import DayProfile, Forecast, ForecastConfig, Holt
from warm_pool.policies.histogram import HistogramState
from warm_pool.policies.idle_histogram import IdleHistogram
from warm_pool.policies.keepalive import KeepaliveState
from warm_pool.policies.kpa import KpaState
from warm_pool.policies.predictive import PredictiveState
from warm_pool.policies.reactive import PolicyState
from warm_pool.policies.rules import RuledState

MAX_ITEMS = 10_000  # the longest sequence any state holds: 1440 profile slots, ≤ 3600 kpa seconds
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")  # an adapter deployment's name (`stoker.spec.deployment`)


# ---- out ---------------------------------------------------------------------------------------------


def encode(name: str, state: RuledState, to_wall: float) -> dict[str, Any]:
    """`state` of policy `name` as JSON-able data, its times moved by `to_wall` (wall − clock)."""
    w = _Out(to_wall)
    inner = state.inner
    if not isinstance(inner, POLICIES[name].state):
        raise TypeError(f"a {type(inner).__name__} is not the state of policy {name}")
    return {
        "rules": {
            "last_ready": state.last_ready,
            "last_up": w.t(state.last_up),
            "last_down": w.t(state.last_down),
        },
        "inner": _ENCODERS[name](inner, w),
    }


class _Out:
    def __init__(self, to_wall: float) -> None:
        self.to_wall = to_wall

    def t(self, t: float | None) -> float | None:
        return None if t is None else t + self.to_wall

    def pairs(self, items: tuple[tuple[float, Any], ...]) -> list[list[Any]]:
        return [[t + self.to_wall, v] for t, v in items]

    def seconds(self, samples: tuple[SecondSample, ...]) -> list[list[Any]]:
        return [[s.start + self.to_wall, s.arrivals, s.concurrency] for s in samples]


def _histogram_out(h: IdleHistogram) -> dict[str, Any]:
    return {"counts": list(h.counts), "out_of_range": h.out_of_range}


def _profile_out(p: DayProfile, w: _Out, c: ForecastConfig) -> dict[str, Any]:
    turn = round(w.to_wall / c.slot_s)  # whole slots: the profile's alignment kept
    rates = [None if math.isnan(r) else r for r in p.rates]
    if rates:
        rates = [rates[(j - turn) % len(rates)] for j in range(len(rates))]
    return {
        "slot_s": c.slot_s,
        "day_s": c.day_s,
        "rates": rates,
        "first": w.t(p.first),
        "slot_start": None if p.slot_start is None else p.slot_start + turn * c.slot_s,
        "count": p.count,
    }


def _predictive_out(s: PredictiveState, w: _Out) -> dict[str, Any]:
    holt = s.forecast.holt
    return {
        "holt": {"level": holt.level, "trend": holt.trend, "seen": holt.seen},
        "profile": _profile_out(s.forecast.profile, w, POLICIES["predictive"].config().forecast),
        "histogram": _histogram_out(s.histogram),
        "readies": w.pairs(s.readies),
        "samples": w.seconds(s.samples),
        "held": w.pairs(s.held),
        "queued": None if s.queued is None else [s.queued[0] + w.to_wall, s.queued[1]],
        "adapters": [[name, w.t(t.last), _histogram_out(t.gaps), t.named] for name, t in s.adapters],
    }


def _kpa_out(s: KpaState, w: _Out) -> dict[str, Any]:
    return {
        "samples": w.seconds(s.samples),
        "panic_since": w.t(s.panic_since),
        "panic_peak": s.panic_peak,
        "zero_since": w.t(s.zero_since),
    }


def _keepalive_out(s: KeepaliveState, w: _Out) -> dict[str, Any]:
    return {"peaks": w.pairs(s.peaks)}


def _histogram_policy_out(s: HistogramState, w: _Out) -> dict[str, Any]:
    return {"histogram": _histogram_out(s.histogram), "peaks": w.pairs(s.peaks)}


def _reactive_out(s: PolicyState, w: _Out) -> dict[str, Any]:
    return {"history": w.pairs(s.history), "last_active": w.t(s.last_active), "last_desired": s.last_desired}


_ENCODERS: dict[str, Callable[[Any, _Out], dict[str, Any]]] = {
    "predictive": _predictive_out,
    "kpa": _kpa_out,
    "keepalive": _keepalive_out,
    "histogram": _histogram_policy_out,
    "reactive": _reactive_out,
}


# ---- in ----------------------------------------------------------------------------------------------


def decode(name: str, doc: object, to_wall: float) -> RuledState:
    """The state of policy `name` that `encode` wrote, its times moved back by this clock's
    `to_wall`; ValueError naming the first bad field (nothing is returned half-read)."""
    if name not in POLICIES:
        raise ValueError(f"policy {name!r}: not one this version has ({', '.join(POLICIES)})")
    r = _In(name, to_wall)
    body = r.obj(doc, "", ("rules", "inner"))
    rules = r.obj(body["rules"], "rules", ("last_ready", "last_up", "last_down"))
    raw = body["inner"]
    if name == "predictive" and isinstance(raw, dict) and "adapters" not in raw:
        raw = {**raw, "adapters": []}  # written before adapters were tracked
    inner = _DECODERS[name](r, r.obj(raw, "inner", _KEYS[name]))
    return RuledState(
        inner=inner,
        last_ready=r.count(rules["last_ready"], "rules.last_ready"),
        last_up=r.time(rules["last_up"], "rules.last_up", optional=True),
        last_down=r.time(rules["last_down"], "rules.last_down", optional=True),
    )


def fits(name: str, state: RuledState, config: Any) -> bool:
    """Whether a decoded state can run under `config` (the pool's bound policy config): the sizes
    its fixed-length parts were written with are this config's (profile slots, histogram bins)."""
    inner = state.inner
    if not isinstance(inner, POLICIES[name].state):
        return False
    if isinstance(inner, PredictiveState):
        rates, counts = inner.forecast.profile.rates, inner.histogram.counts
        gaps = (len(t.gaps.counts) in (0, config.adapters.histogram.bins) for _, t in inner.adapters)
        return (
            len(rates) in (0, config.forecast.slots)
            and len(counts) in (0, config.histogram.bins)
            and all(gaps)
        )
    if isinstance(inner, HistogramState):
        return len(inner.histogram.counts) in (0, config.histogram.bins)
    return True


class _In:
    """Readers of one document's fields; each raises ValueError naming the field."""

    def __init__(self, policy: str, to_wall: float) -> None:
        self.policy = policy
        self.to_wall = to_wall

    def fail(self, where: str, why: str) -> ValueError:
        return ValueError(f"policy {self.policy} state{'.' + where if where else ''}: {why}")

    def obj(self, value: object, where: str, keys: tuple[str, ...]) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(where, f"want an object, got {_kind(value)}")
        if set(value) != set(keys):
            extra, missing = sorted(set(value) - set(keys)), sorted(set(keys) - set(value))
            raise self.fail(where, f"want the fields {', '.join(keys)} (missing {missing}, unknown {extra})")
        return value

    def list(self, value: object, where: str, length: int | None = None) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(where, f"want a list, got {_kind(value)}")
        if len(value) > MAX_ITEMS:
            raise self.fail(where, f"{len(value)} items, more than any state holds ({MAX_ITEMS})")
        if length is not None and len(value) != length:
            raise self.fail(where, f"want {length} items, got {len(value)}")
        return value

    def number(self, value: object, where: str, *, low: float | None = 0.0) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise self.fail(where, f"want a finite number, got {value!r:.40}")
        if low is not None and value < low:
            raise self.fail(where, f"want a number ≥ {low:g}, got {value!r}")
        return float(value)

    def count(self, value: object, where: str, high: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.fail(where, f"want a whole number ≥ 0, got {value!r:.40}")
        if high is not None and value > high:
            raise self.fail(where, f"want at most {high}, got {value}")
        return value

    def time(self, value: object, where: str, *, optional: bool = False) -> float | None:
        if value is None and optional:
            return None
        return self.number(value, where, low=None) - self.to_wall

    def pairs(self, value: object, where: str, second: Callable[[object, str], Any]) -> tuple:
        out, last = [], -math.inf
        for i, item in enumerate(self.list(value, where)):
            t, v = self.list(item, f"{where}[{i}]", 2)
            t = self.time(t, f"{where}[{i}][0]")
            if t < last:
                raise self.fail(f"{where}[{i}]", "times must not go back")
            last = t
            out.append((t, second(v, f"{where}[{i}][1]")))
        return tuple(out)

    def seconds(self, value: object, where: str) -> tuple[SecondSample, ...]:
        out, last = [], -math.inf
        for i, item in enumerate(self.list(value, where)):
            start, arrivals, concurrency = self.list(item, f"{where}[{i}]", 3)
            t = self.time(start, f"{where}[{i}][0]")
            if t < last:
                raise self.fail(f"{where}[{i}]", "times must not go back")
            last = t
            n = self.count(arrivals, f"{where}[{i}][1]")
            out.append(SecondSample(t, n, self.number(concurrency, f"{where}[{i}][2]")))
        return tuple(out)

    def histogram(self, value: object, where: str, bins: int) -> IdleHistogram:
        h = self.obj(value, where, ("counts", "out_of_range"))
        counts = self.list(h["counts"], f"{where}.counts")
        if len(counts) not in (0, bins):
            raise self.fail(f"{where}.counts", f"want 0 or {bins} bins, got {len(counts)}")
        return IdleHistogram(
            tuple(self.number(n, f"{where}.counts[{i}]") for i, n in enumerate(counts)),
            self.number(h["out_of_range"], f"{where}.out_of_range"),
        )

    def profile(self, value: object, where: str, c: ForecastConfig) -> DayProfile:
        p = self.obj(value, where, _PROFILE_KEYS)
        if p["slot_s"] != c.slot_s or p["day_s"] != c.day_s:
            raise self.fail(
                where,
                f"slots of {p['slot_s']!r} s in a day of {p['day_s']!r} s, not {c.slot_s:g} in {c.day_s:g}",
            )
        rates = self.list(p["rates"], f"{where}.rates")
        if len(rates) not in (0, c.slots):
            raise self.fail(f"{where}.rates", f"want 0 or {c.slots} slots, got {len(rates)}")
        turn = round(self.to_wall / c.slot_s)
        read = [math.nan if r is None else self.number(r, f"{where}.rates[{j}]") for j, r in enumerate(rates)]
        if read:
            read = [read[(i + turn) % len(read)] for i in range(len(read))]
        slot_start = p["slot_start"]
        if slot_start is not None:
            slot_start = self.number(slot_start, f"{where}.slot_start", low=None) - turn * c.slot_s
        return DayProfile(
            tuple(read),
            self.time(p["first"], f"{where}.first", optional=True),
            slot_start,
            self.count(p["count"], f"{where}.count"),
        )


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__


_PROFILE_KEYS = ("slot_s", "day_s", "rates", "first", "slot_start", "count")


def _predictive_in(r: _In, d: dict[str, Any]) -> PredictiveState:
    config = POLICIES["predictive"].config()
    holt = r.obj(d["holt"], "inner.holt", ("level", "trend", "seen"))
    adapters, tracked = [], r.list(d["adapters"], "inner.adapters")
    if len(tracked) > config.adapters.max_tracked:
        raise r.fail("inner.adapters", f"{len(tracked)} adapters, more than {config.adapters.max_tracked}")
    bins = config.adapters.histogram
    for i, item in enumerate(tracked):
        name, last, gaps, named = r.list(item, f"inner.adapters[{i}]", 4)
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise r.fail(f"inner.adapters[{i}][0]", f"want an adapter deployment's name, got {name!r:.40}")
        if not isinstance(named, bool):
            raise r.fail(f"inner.adapters[{i}][3]", f"want true or false, got {named!r:.40}")
        gaps = r.histogram(gaps, f"inner.adapters[{i}][2]", bins.bins)
        track = AdapterTrack.of(r.time(last, f"inner.adapters[{i}][1]"), gaps, bins)
        adapters.append((name, replace(track, named=named)))
    if len({name for name, _ in adapters}) != len(adapters):
        raise r.fail("inner.adapters", "an adapter is named twice")
    queued = d["queued"]
    if queued is not None:
        when, n = r.list(queued, "inner.queued", 2)
        queued = (r.time(when, "inner.queued[0]"), r.count(n, "inner.queued[1]"))
    return PredictiveState(
        forecast=Forecast(
            Holt(
                r.number(holt["level"], "inner.holt.level", low=None),
                r.number(holt["trend"], "inner.holt.trend", low=None),
                r.count(holt["seen"], "inner.holt.seen", high=math.ceil(1 / config.forecast.alpha)),
            ),
            r.profile(d["profile"], "inner.profile", config.forecast),
        ),
        histogram=r.histogram(d["histogram"], "inner.histogram", config.histogram.bins),
        readies=r.pairs(d["readies"], "inner.readies", r.count),
        samples=r.seconds(d["samples"], "inner.samples"),
        held=r.pairs(d["held"], "inner.held", r.number),
        queued=queued,
        adapters=tuple(adapters),
    )


def _kpa_in(r: _In, d: dict[str, Any]) -> KpaState:
    return KpaState(
        samples=r.seconds(d["samples"], "inner.samples"),
        panic_since=r.time(d["panic_since"], "inner.panic_since", optional=True),
        panic_peak=r.count(d["panic_peak"], "inner.panic_peak"),
        zero_since=r.time(d["zero_since"], "inner.zero_since", optional=True),
    )


def _keepalive_in(r: _In, d: dict[str, Any]) -> KeepaliveState:
    return KeepaliveState(peaks=r.pairs(d["peaks"], "inner.peaks", r.count))


def _histogram_policy_in(r: _In, d: dict[str, Any]) -> HistogramState:
    bins = POLICIES["histogram"].config().histogram.bins
    return HistogramState(
        histogram=r.histogram(d["histogram"], "inner.histogram", bins),
        peaks=r.pairs(d["peaks"], "inner.peaks", r.count),
    )


def _reactive_in(r: _In, d: dict[str, Any]) -> PolicyState:
    return PolicyState(
        history=r.pairs(d["history"], "inner.history", r.count),
        last_active=r.time(d["last_active"], "inner.last_active", optional=True),
        last_desired=r.count(d["last_desired"], "inner.last_desired"),
    )


_DECODERS: dict[str, Callable[[_In, dict[str, Any]], Any]] = {
    "predictive": _predictive_in,
    "kpa": _kpa_in,
    "keepalive": _keepalive_in,
    "histogram": _histogram_policy_in,
    "reactive": _reactive_in,
}
# Each state's fields, as written: a field added to a state without its codec fails the tests.
_KEYS: dict[str, tuple[str, ...]] = {
    "predictive": ("holt", "profile", "histogram", "readies", "samples", "held", "queued", "adapters"),
    "kpa": tuple(f.name for f in fields(KpaState)),
    "keepalive": tuple(f.name for f in fields(KeepaliveState)),
    "histogram": tuple(f.name for f in fields(HistogramState)),
    "reactive": tuple(f.name for f in fields(PolicyState)),
}
