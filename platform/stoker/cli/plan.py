"""Capacity planning from a bench: how many instances a deployment needs for a rate and a p99 TTFT.

Pure arithmetic over what `stoker bench` measured (`stoker.cli.loadgen` does the I/O). Every request
the bench sent is a `Sample`: when it was sent, its TTFT and end-to-end time, the tokens it got,
the instance that answered (`x-stoker-instance`) and whether it was a cold start
(`x-stoker-cold-start`).

**In-flight level.** Each warm answered request is tagged with the requests in flight per
instance when it was sent: the requests the bench had sent and not yet heard the end of (itself
included; held ones queued in the activator count, as they do for the scaler's target
concurrency), over the instances up by then (those seen answering since, by `x-stoker-instance`;
one a cold request came from was up by that request's first token), rounded up. Grouping by level
gives, for each per-instance concurrency the bench drove, the p99 TTFT and the mean end-to-end time
W(c) of the requests sent at it. Cold starts are left out: their TTFT is a start's, not the load's.

**Little's law.** An instance holding c requests in flight, each taking W(c) seconds, completes
X(c) = c / W(c) requests a second (L = λ × W, solved for λ). The plan takes the sustained
concurrency C: the highest level whose p99 TTFT, and every lower level's, meets the target
(levels with fewer than `min_samples` requests are not evidence either way and are skipped).
Then, for a rate Q:

    instances = ceil(Q × W(C) / C) + K            (K: redundancy, `N+K`)
    max       = ceil(P × W(C) / C) + K            (P: the peak rate, default Q)
    devices   = ceil(instances / instances per device)

Worked: C = 4, W(4) = 0.8 s, Q = 20 req/s, K = 1: each instance completes 4 / 0.8 = 5 req/s,
so 20 / 5 = 4 instances carry the load, 5 with one spare; `--target-concurrency 4` makes the
scaler aim at the same 4 in flight per instance, and `--min-warm 5` keeps them READY.
"""

from __future__ import annotations

import math
import re
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass

from stoker.errors import CLIError

BENCH_KIND = "stoker-bench"
MAX_INSTANCES = 64  # a deployment's --max at most


class PlanError(CLIError):
    """A plan that cannot be made from this bench (one line, said as the CLI says it)."""


@dataclass(frozen=True)
class Sample:
    start: float  # seconds after the run began, when the request was sent
    ttft: float | None  # to the first content token; None if none came
    e2e: float | None  # to the last byte; None on an error
    tokens: int  # output tokens (the usage figure, else content chunks)
    instance: str | None  # x-stoker-instance (absent on a held stream)
    cold: bool  # x-stoker-cold-start: true
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.e2e is not None and self.ttft is not None

    @property
    def tpot(self) -> float | None:
        """(e2e − TTFT) / (tokens − 1): the mean gap between output tokens after the first."""
        if not self.ok or self.tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.tokens - 1)

    def to_json(self) -> dict:
        return {
            "start": round(self.start, 6),
            "ttft": None if self.ttft is None else round(self.ttft, 6),
            "e2e": None if self.e2e is None else round(self.e2e, 6),
            "tokens": self.tokens,
            "instance": self.instance,
            "cold": self.cold,
            "error": self.error,
        }

    @classmethod
    def from_json(cls, raw: dict) -> Sample:
        return cls(
            start=float(raw["start"]),
            ttft=None if raw.get("ttft") is None else float(raw["ttft"]),
            e2e=None if raw.get("e2e") is None else float(raw["e2e"]),
            tokens=int(raw.get("tokens") or 0),
            instance=raw.get("instance"),
            cold=bool(raw.get("cold")),
            error=raw.get("error"),
        )


def percentile(values: list[float], p: float) -> float | None:
    """Nearest rank: the smallest value with at least p % of them at or below it. With few values a
    p99 is their maximum, which errs on the safe side for a plan."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


@dataclass(frozen=True)
class Level:
    in_flight: int  # requests on the instance when these were sent, themselves included
    requests: int
    ttft_p99_s: float
    ttft_p50_s: float
    e2e_mean_s: float

    @property
    def throughput_rps(self) -> float:
        """Little's law: what one instance completes at this many in flight."""
        return self.in_flight / self.e2e_mean_s if self.e2e_mean_s > 0 else math.inf

    def to_json(self) -> dict:
        return {
            "in_flight": self.in_flight,
            "requests": self.requests,
            "ttft_p50_s": self.ttft_p50_s,
            "ttft_p99_s": self.ttft_p99_s,
            "e2e_mean_s": self.e2e_mean_s,
            "throughput_rps": self.throughput_rps,
        }


def levels(samples: list[Sample]) -> list[Level]:
    """The warm answered requests grouped by the in-flight count per instance at their send."""
    answered = [s for s in samples if s.ok]
    begins = sorted(s.start for s in answered)
    ends = sorted(s.start + s.e2e for s in answered)
    up: dict[str, float] = {}  # instance -> when it was first seen serving
    for s in answered:
        if s.instance is not None:
            seen = s.start + s.ttft if s.cold else s.start  # a cold one was held until it came up
            up[s.instance] = min(up.get(s.instance, seen), seen)
    ups = sorted(up.values())
    by_level: dict[int, list[Sample]] = defaultdict(list)
    for s in answered:
        if s.cold:
            continue  # its TTFT is a start's, not the load's
        # In flight at its send: begun at or before it and not yet ended, itself included.
        in_flight = bisect_right(begins, s.start) - bisect_right(ends, s.start)
        instances = max(1, bisect_right(ups, s.start))
        by_level[max(1, math.ceil(in_flight / instances))].append(s)
    return [
        Level(
            in_flight=c,
            requests=len(group),
            ttft_p99_s=percentile([s.ttft for s in group], 99),
            ttft_p50_s=percentile([s.ttft for s in group], 50),
            e2e_mean_s=sum(s.e2e for s in group) / len(group),
        )
        for c, group in sorted(by_level.items())
    ]


def summarize(samples: list[Sample], wall_s: float) -> dict:
    """The bench's figures: latency percentiles, throughput, errors, cold starts, and the in-flight
    count Little's law gives (mean in flight = Σ e2e / wall time)."""
    ok = [s for s in samples if s.ok]
    errors: dict[str, int] = defaultdict(int)
    for s in samples:
        if not s.ok:
            errors[s.error or "no output"] += 1
    ttft = [s.ttft for s in ok]
    warm_ttft = [s.ttft for s in ok if not s.cold]
    tpot = [t for s in ok if (t := s.tpot) is not None]
    e2e = [s.e2e for s in ok]
    instances = {s.instance for s in ok if s.instance is not None}
    mean_in_flight = sum(e2e) / wall_s if wall_s > 0 else 0.0
    return {
        "requests": len(samples),
        "answered": len(ok),
        "errors": len(samples) - len(ok),
        "error_kinds": dict(sorted(errors.items())),
        "cold_starts": sum(1 for s in samples if s.cold),
        "wall_s": wall_s,
        "throughput_rps": len(ok) / wall_s if wall_s > 0 else 0.0,
        "output_tokens_per_s": sum(s.tokens for s in ok) / wall_s if wall_s > 0 else 0.0,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "ttft_warm_p99_s": percentile(warm_ttft, 99),
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p99_s": percentile(e2e, 99),
        "e2e_mean_s": sum(e2e) / len(e2e) if e2e else None,
        "mean_in_flight": mean_in_flight,
        "instances_seen": len(instances),
        "in_flight_per_instance": mean_in_flight / len(instances) if instances else None,
    }


_REDUNDANCY = re.compile(r"\s*(?:n\s*\+\s*)?(\d+)\s*")


def parse_redundancy(text: str) -> int:
    """`N+1` (or `1`): spare instances beyond what the load needs."""
    m = _REDUNDANCY.fullmatch(text.lower())
    if not m:
        raise ValueError(f"{text!r} is not a redundancy: give N+K (spare instances K ≥ 0), e.g. N+1")
    return int(m.group(1))


@dataclass(frozen=True)
class Plan:
    qps: float
    peak_qps: float
    p99_ttft_s: float
    concurrency: int  # C: sustained in flight per instance
    service_time_s: float  # W(C): mean e2e at C
    per_instance_rps: float  # C / W(C)
    base_instances: int  # ceil(Q × W / C)
    redundancy: int
    instances: int  # base + redundancy = min_warm
    max_instances: int  # ceil(P × W / C) + redundancy
    instances_per_device: int
    devices: int
    devices_at_max: int
    highest_level_seen: int
    considered: tuple[Level, ...]

    @property
    def target_concurrency(self) -> int:
        return self.concurrency

    @property
    def min_warm(self) -> int:
        return self.instances

    def to_json(self) -> dict:
        return {
            "qps": self.qps,
            "peak_qps": self.peak_qps,
            "p99_ttft_s": self.p99_ttft_s,
            "concurrency": self.concurrency,
            "service_time_s": self.service_time_s,
            "per_instance_rps": self.per_instance_rps,
            "base_instances": self.base_instances,
            "redundancy": self.redundancy,
            "instances": self.instances,
            "instances_per_device": self.instances_per_device,
            "devices": self.devices,
            "devices_at_max": self.devices_at_max,
            "target_concurrency": self.target_concurrency,
            "min_warm": self.min_warm,
            "max": self.max_instances,
            "highest_level_seen": self.highest_level_seen,
            "levels": [lv.to_json() for lv in self.considered],
        }


def _ceil(x: float) -> int:
    return math.ceil(x - 1e-9)  # 20 × 0.8 / 4 is 4.000000000000001 in floats, and 4 instances


def plan(
    measured: list[Level],
    *,
    qps: float,
    p99_ttft_s: float,
    redundancy: int = 0,
    peak_qps: float | None = None,
    instances_per_device: int = 1,
    min_samples: int = 5,
) -> Plan:
    """The instances and settings for `qps` at `p99_ttft_s`, from the bench's levels."""
    peak = qps if peak_qps is None else peak_qps
    if not (math.isfinite(qps) and qps > 0):
        raise PlanError(f"--qps must be a number > 0, got {qps!r}")
    if not (math.isfinite(peak) and peak >= qps):
        raise PlanError(f"--peak-qps must be at least --qps ({qps:g}), got {peak!r}")
    if not (math.isfinite(p99_ttft_s) and p99_ttft_s > 0):
        raise PlanError(f"--p99-ttft must be more than 0 s, got {p99_ttft_s!r}")
    if redundancy < 0:
        raise PlanError(f"--redundancy must be N+K with K ≥ 0, got N+{redundancy}")
    if instances_per_device < 1:
        raise PlanError(f"--instances-per-device must be 1 or more, got {instances_per_device}")
    if min_samples < 1:
        raise PlanError(f"--min-samples must be 1 or more, got {min_samples}")
    usable = [lv for lv in measured if lv.requests >= min_samples]
    if not usable:
        seen = ", ".join(f"{lv.requests} at {lv.in_flight}" for lv in measured) or "none"
        raise PlanError(
            f"the bench has no in-flight level with {min_samples} or more warm answered requests "
            f"(it has: {seen}); bench longer or at a higher rate, or lower --min-samples"
        )
    sustained: Level | None = None
    for lv in usable:  # ascending: stop at the first level that misses the target
        if lv.ttft_p99_s > p99_ttft_s:
            break
        sustained = lv
    if sustained is None:
        first = usable[0]
        raise PlanError(
            f"a p99 TTFT of {p99_ttft_s:g} s cannot be met: at {first.in_flight} in flight per instance, "
            f"the lightest load the bench measured, p99 TTFT was {first.ttft_p99_s:.3g} s"
            + ("; bench at a lower rate to measure lighter loads" if first.in_flight > 1 else "")
        )
    c, w = sustained.in_flight, sustained.e2e_mean_s
    base = max(1, _ceil(qps * w / c))
    instances = base + redundancy
    max_instances = max(instances, max(1, _ceil(peak * w / c)) + redundancy)
    if max_instances > MAX_INSTANCES:
        raise PlanError(
            f"the plan needs {max_instances} instances, more than one deployment may have "
            f"({MAX_INSTANCES}): split the traffic across deployments, or bench a larger instance"
        )
    return Plan(
        qps=qps,
        peak_qps=peak,
        p99_ttft_s=p99_ttft_s,
        concurrency=c,
        service_time_s=w,
        per_instance_rps=sustained.throughput_rps,
        base_instances=base,
        redundancy=redundancy,
        instances=instances,
        max_instances=max_instances,
        instances_per_device=instances_per_device,
        devices=_ceil(instances / instances_per_device),
        devices_at_max=_ceil(max_instances / instances_per_device),
        highest_level_seen=max(lv.in_flight for lv in measured),
        considered=tuple(measured),
    )


def explain(p: Plan, *, min_samples: int) -> list[str]:
    """How the plan got there, in plain lines."""
    out = [
        "in flight on an instance   requests   p99 TTFT s   mean e2e s   req/s per instance   meets target"
    ]
    for lv in p.considered:
        meets = (
            f"too few (< {min_samples})"
            if lv.requests < min_samples
            else ("yes" if lv.ttft_p99_s <= p.p99_ttft_s else "no")
        )
        out.append(
            f"  {lv.in_flight:<24} {lv.requests:<10} {lv.ttft_p99_s:<12.3f} {lv.e2e_mean_s:<12.3f} "
            f"{lv.throughput_rps:<20.2f} {meets}"
        )
    c, w = p.concurrency, p.service_time_s
    out += [
        f"sustained concurrency C = {c} in flight per instance: the highest level whose p99 TTFT, "
        f"and every lower measured level's, is within {p.p99_ttft_s:g} s",
        f"service time W = {w:.3f} s: the mean end-to-end time of the requests sent at {c} in flight",
        f"per instance (Little's law, L = λ × W): λ = C / W = {c} / {w:.3f} = {p.per_instance_rps:.2f} req/s",
        f"instances = ceil(Q × W / C) = ceil({p.qps:g} × {w:.3f} / {c}) = {p.base_instances}"
        + (f", + {p.redundancy} spare (N+{p.redundancy}) = {p.instances}" if p.redundancy else ""),
    ]
    if p.peak_qps != p.qps:
        out.append(
            f"at the peak, ceil({p.peak_qps:g} × {w:.3f} / {c}) + {p.redundancy} = {p.max_instances} instances"
        )
    out.append(
        f"devices = ceil({p.instances} / {p.instances_per_device} per device) = {p.devices}"
        + (f" ({p.devices_at_max} at max)" if p.devices_at_max != p.devices else "")
    )
    if c >= p.highest_level_seen:
        out.append(
            f"note: the bench never put more than {p.highest_level_seen} in flight on an instance; "
            "a heavier bench may show an instance sustains more"
        )
    out.append(
        f"settings: target_concurrency {p.target_concurrency} (the scaler aims at C), "
        f"min_warm {p.min_warm} (the load never waits for a start), max {p.max_instances}"
    )
    return out
