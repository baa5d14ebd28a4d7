"""What a gateway of its own (`stoker gateway`) measures for the controller's cost meter and
dashboard, and how the controller adds the gateways' figures up.

    gateway: InferenceEndpoint ─▶ GatewayMeter.tap/done ─▶ the unit's `usage` ─┐
             its registry ─▶ changed_samples(SERIES) ──────────────────────────┤ POST /cluster/v1/load
    controller: CostMeter.record (tokens, requests, the arrival log) ◀─────────┤
                CostMeter.remote_in_flight (each gateway's held + in flight) ◀─┤
                GatewaySeries.update ─▶ .reading() ─▶ HistorySampler (dashboard)

**Cost.** In one process (`stoker up`) the cost meter sees every answer (`stoker.control.cost`). Split,
the answers are the gateways': each one's `GatewayMeter` reads an answer's token usage as the one-
process meter does (`MeterTap`, a `limits.UsageTap`) and hands `[wall, tokens_in, tokens_out,
status]` to the answering revision's next report; the controller counts it (`CostMeter.record`),
so `stoker_tokens_total`, `stoker_cost_usd_total` and the arrival log have one writer, the
controller. An adapter's answer goes with a unit of its base, its name and revision after the
four (its base's instances served it); its loads go as `[engine name, seconds]`
(`RemoteSource.loads`). The busy-second integral's n (requests between arrival and the end of their answers)
is each live gateway's reported held + in flight, summed: stepwise at the report interval (1 s by
default) rather than at every change.

**Dashboard.** The request rate, 5xx rate, requests held and time held are counted where requests
are: in each gateway's registry (`stoker_requests_total`, `stoker_queue_length`,
`stoker_queue_wait_seconds`). A gateway sends the samples of those `SERIES` that changed since its
last delivered report; the controller keeps each gateway's latest and its `reading()` sums them
over the gateways (counters over every gateway ever seen, so a gateway that leaves does not look
like a reset; gauges over the live ones only), in the shape `stoker.control.history` reads. Its own
registry is not given these samples: Prometheus scrapes them from the gateways, and a second copy
would count twice in a sum.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry

from stoker.errors import invalid
from stoker.gateway.limits import MeterTap

COUNTERS = frozenset(
    {"stoker_requests_total", "stoker_queue_wait_seconds_sum", "stoker_queue_wait_seconds_count"}
)
GAUGES = frozenset({"stoker_queue_length"})
SERIES = COUNTERS | GAUGES
MAX_SERIES = 20_000  # samples one report may carry
MAX_LABELS, MAX_LABEL_LEN = 8, 256
MAX_GATEWAYS = 256  # gateways kept one by one; the least recently heard beyond it are folded together

# A reading: (sample name, its labels sorted) → value, e.g.
# ("stoker_requests_total", (("code", "200"), ("deployment", "chat"))) → 135.0
Labels = tuple[tuple[str, str], ...]
Reading = Mapping[tuple[str, Labels], float]


def read_registry(registry: CollectorRegistry) -> dict[tuple[str, Labels], float]:
    """Every sample the registry holds now, flattened to a `Reading`."""
    out: dict[tuple[str, Labels], float] = {}
    for family in registry.collect():
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


class GatewayMeter:
    """The gateway's side of the cost meter: `InferenceEndpoint` calls `tap` before a request to a
    deployment and `done` after, as it calls `stoker.control.cost.CostMeter`'s."""

    def __init__(self, plane: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self._plane = plane  # a `GatewayPlane`: its deployments' units and their sources
        self._clock = clock

    def tap(self, send: Callable, name: str, prompt_estimate: int) -> MeterTap | None:
        d = self._plane.get(name)
        if getattr(d, "units", None) is None and getattr(d, "revisions", None) is None:
            return None  # a cascade route (neither deployment's request), as in one process
        return MeterTap(send, name, prompt_estimate, self._clock())

    def done(self, tap: MeterTap, scope: Mapping[str, Any]) -> None:
        revision = scope.get("stoker.revision")
        d = self._plane.get(tap.deployment)
        if not isinstance(revision, int) or d is None:
            return  # refused before a revision took it
        usage = [round(tap.wall, 3), *(tap.tokens() or (0, 0)), tap.status or 499]
        if getattr(d, "units", None) is None:  # an adapter: reported with a unit of its base
            spec = d.revisions.get(revision)
            base = self._plane.get(spec.base) if spec is not None else None
            units = getattr(base, "units", None)
            if not units:
                return  # its base is not routed here any more
            usage += [tap.deployment, revision]
            unit = units.get(base.spec.revision) or next(iter(units.values()))
        else:
            unit = d.units.get(revision)
        if unit is None:
            return  # retired meanwhile
        unit.source.usage.append(usage)


def changed_samples(registry: Any, sent: dict[tuple[str, Labels], float]) -> list[list]:
    """The samples of `SERIES` in `registry` whose value is not the one in `sent` (what the
    controller last received), as `[name, labels, value]`; `sent` is not changed here."""
    out = []
    for (name, labels), value in read_registry(registry).items():
        if name in SERIES and sent.get((name, labels)) != value:
            out.append([name, dict(labels), value])
    return out


def parse_series(value: object) -> list[tuple[str, Labels, float]]:
    """A report's `series`, every sample checked (400 naming the field)."""
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_SERIES:
        raise invalid(f"'series' must be a list of at most {MAX_SERIES} samples.", "series")
    out = []
    for item in value:
        ok = isinstance(item, list) and len(item) == 3 and item[0] in SERIES
        labels = item[1] if ok else None
        ok = ok and isinstance(labels, dict) and len(labels) <= MAX_LABELS
        ok = ok and all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= MAX_LABEL_LEN
            for k, v in labels.items()
        )
        number = item[2] if ok else None
        ok = ok and isinstance(number, int | float) and not isinstance(number, bool)
        if not ok or not math.isfinite(number) or number < 0:
            raise invalid(
                "'series' holds [name, labels, value ≥ 0] samples of the gateway's series.", "series"
            )
        out.append((item[0], tuple(sorted(labels.items())), float(number)))
    return out


class GatewaySeries:
    """The gateways' latest samples, summed for the controller's dashboard (see the module)."""

    def __init__(self, max_gateways: int = MAX_GATEWAYS) -> None:
        # By gateway, the least recently heard first (ids are per process: they come and go).
        self._latest: dict[str, dict[tuple[str, Labels], float]] = {}
        self._before: dict[str, dict[tuple[str, Labels], float]] = {}  # counted before a restart
        self._folded: dict[tuple[str, Labels], float] = {}  # the counters of gateways long gone
        self._max = max_gateways

    def update(self, gateway: str, samples: Iterable[tuple[str, Labels, float]]) -> None:
        """A gateway's changed samples. A counter lower than its last value is a gateway restarted
        under the same id: what it had counted stays counted (e.g. 40, then 3 after its restart:
        43). Bounded: past `max_gateways`, the least recently heard one's counters are folded into
        one sum (its gauges dropped), so memory does not grow with every gateway process ever run."""
        mine = self._latest.pop(gateway, None) or {}
        self._latest[gateway] = mine  # now the most recently heard
        while len(self._latest) > self._max:
            oldest = next(iter(self._latest))
            for key, value in self._latest.pop(oldest).items():
                if key[0] in COUNTERS:
                    self._folded[key] = self._folded.get(key, 0.0) + value
            self._before.pop(oldest, None)
        before = self._before.setdefault(gateway, {})
        for name, labels, value in samples:
            key = (name, labels)
            if name in COUNTERS and value < mine.get(key, 0.0) - before.get(key, 0.0):
                before[key] = mine[key]
            mine[key] = value + (before.get(key, 0.0) if name in COUNTERS else 0.0)

    def reading(self, live: Iterable[str]) -> Reading:
        """Counters summed over every gateway seen, gauges over the `live` ones. E.g. gateway a
        reports 10 answers and 2 held, b 5 answers and 1 held, then b goes silent: 15 answers,
        2 held."""
        live = set(live)
        out: dict[tuple[str, Labels], float] = dict(self._folded)
        for gateway, samples in self._latest.items():
            for key, value in samples.items():
                if key[0] in GAUGES and gateway not in live:
                    continue
                out[key] = out.get(key, 0.0) + value
        return out
