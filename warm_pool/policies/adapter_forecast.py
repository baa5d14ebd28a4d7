"""Each LoRA adapter's own traffic on its base, for the predictive policy: which adapters' next
request is due soon, so that the base is READY for it and the adapter is loaded before it arrives.

An adapter deployment has no pool (docs/guide/adapters.md): its requests are its base's, and the
base's forecast and idle-gap histogram see them only in the sum. An adapter called by a job every
ten minutes, on a base whose other adapters are called at random, is lost in that sum: the base's
idle gaps are short and spread out, its histogram flat (not representative). So each adapter is
tracked on its own, from the arrivals the observation names it in (`Observation.adapter_arrivals`):

- its last arrival, and a histogram of its gaps, from one of its requests to its next
  (`idle_histogram.IdleHistogram`, 10-second bins up to an hour: "a few requests an hour"; the
  base's own gaps are seconds to minutes, in 1-second bins up to 10 minutes). A gap shorter than
  `burst_s` (10 s) is inside a burst and is not counted: otherwise most of a bursty adapter's gaps
  would be 0 s, and the window below would open at every request and say nothing of the next burst;
- its window, (head × 0.9, tail × 1.1) of that histogram in seconds after its last arrival, when the
  histogram is representative (the base's tests: at least 5 gaps, at most half beyond the range,
  a coefficient of variation of at least 2); head the 5th percentile, tail the 90th, as the
  predictive policy takes them for the base (`predictive.py`, step 3);
- the READY seconds per hit a base would spend to be up over that window: each gap that ends
  inside it costs the time from the window's start to its end, each gap that runs past it the whole
  window, over the number of gaps that end inside (`predictive._ready_per_hit`'s measure).

At each call an adapter is *due* when `now` lies in [last + head − lead, last + tail), `lead` being
what it takes to serve it: on a READY instance the adapter load (the adapter tier,
`TierTimes.adapter`, measured from the loads) plus `margin_s`; with no READY instance the base's
start (or wake) from its tier first. A due adapter whose READY seconds per hit are within the
budget (the predictive policy's `stable_window_s`, 60 s: kpa's price of one chance to avoid a cold
start) keeps its base READY through its window, from zero if need be (the base's pre-warm for an
adapter's forecast), and is named in the decision's `adapters`, to be loaded onto a READY instance
ahead of its request (the adapter's own pre-warm): once per gap, at the first call that finds an
instance READY, so that a load ahead whose adapter a request-driven load evicts again is not
repeated at every call; and only while the instances' LRUs turn over slowly: no more than
`churn_loads` (1) load per READY instance in the last minute (`Observation.adapter_loads`). A base
whose instances load an adapter every few seconds (100 adapters on a base, 4 kept on each
instance) evicts an adapter loaded ahead long before its request comes: on the 200-adapter cut of
docs/benchmarks/scaling.md, 1,631 loads ahead without this test saved 22 of 3,158 requests a
load. One whose gaps are too spread to be worth it is
neither: a load ahead evicts the least recently used adapter of an instance, and an instance keeps
a few (4 by default) of the many adapters a base may serve, so only a forecast sure enough to hold
a base for earns one.

Worked example (`tests/warm_pool/policies/test_adapter_forecast.py`): a job calls adapter `qa`
every 600 s ± 20 s, three requests in 2 s each time. Its gaps, from a burst's last request to the
next one's first, are 576-616 s, in bins 57-61: head 570 s × 0.98 = 558.6 s, tail 620 s × 1.02 =
632.4 s (2 % margins here: 10 % of a ten-minute gap would be a minute of READY for nothing), and
READY over that window costs 39 s per hit, within the 60 s budget. So the base is asked to be READY
from 558.6 s after the last burst less its lead, with `qa` loaded, until 632.4 s. Called every
3000 s ± 10 s instead, the window (2920, 3070) s costs 77 s per hit: neither.

Bounded: at most `max_tracked` adapters per base (the one heard from longest ago is forgotten
first), each a fixed number of bins; windows and costs are computed when a gap is added, not at
every call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from warm_pool.errors import InvalidConfig
from warm_pool.policies.idle_histogram import HistogramConfig, IdleHistogram


def _histogram() -> HistogramConfig:
    return HistogramConfig(bin_s=10.0, range_s=3600.0, tail_pct=90.0, margin=0.02)


@dataclass(frozen=True)
class AdapterForecastConfig:
    histogram: HistogramConfig = field(default_factory=_histogram)
    burst_s: float = 10.0  # gaps shorter than this are inside a burst: not counted
    margin_s: float = 2.0  # loaded this long before the window opens, beyond the load itself
    max_tracked: int = 256  # adapters per base
    churn_loads: int = 1  # loads per READY instance in the last minute beyond which none is made ahead

    def __post_init__(self) -> None:
        for name in ("burst_s", "margin_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise InvalidConfig(name, f"{name} must be a finite number ≥ 0, got {value!r}")
        churn = self.churn_loads
        if isinstance(churn, bool) or not isinstance(churn, int) or churn < 0:
            raise InvalidConfig("churn_loads", f"churn_loads must be an integer ≥ 0, got {churn!r}")
        n = self.max_tracked
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 4096:
            raise InvalidConfig("max_tracked", f"max_tracked must be an integer in 1..4096, got {n!r}")


@dataclass(frozen=True)
class AdapterTrack:
    """One adapter as the policy knows it: `last` arrival (the pool's clock), its gaps, and what
    follows from them (None and inf until they are representative)."""

    last: float
    gaps: IdleHistogram = field(default_factory=IdleHistogram)
    window: tuple[float, float] | None = None  # (head, tail) seconds after `last`
    per_hit: float = math.inf  # READY seconds per gap that ends inside the window
    named: bool = False  # named in a decision to be loaded ahead since `last`: once a gap

    @classmethod
    def of(cls, last: float, gaps: IdleHistogram, config: HistogramConfig) -> AdapterTrack:
        window = gaps.windows(config)
        return cls(last, gaps, window, _per_hit(gaps, window, config))


# Every tracked adapter by name, the one heard from longest ago first.
Tracks = tuple[tuple[str, AdapterTrack], ...]


def add_arrivals(
    tracks: Tracks, arrivals: tuple[tuple[str, float, float], ...], config: AdapterForecastConfig
) -> Tracks:
    """`tracks` with `arrivals` ((adapter, first, last), oldest first) counted: a gap from an
    adapter's last arrival to its next first one, if it is not inside a burst."""
    if not arrivals:
        return tracks
    by_name = dict(tracks)
    for name, first, last in arrivals:
        track = by_name.pop(name, None)  # put back at the end: the newest
        if track is None:
            track = AdapterTrack(last)
        elif (gap := first - track.last) >= config.burst_s:
            track = AdapterTrack.of(
                max(last, track.last), track.gaps.add((gap,), config.histogram), config.histogram
            )
        else:
            track = replace(track, last=max(last, track.last), named=False)
        by_name[name] = track
    return tuple(by_name.items())[-config.max_tracked :]


def due(tracks: Tracks, now: float, lead_s: float) -> Tracks:
    """The adapters whose next request is expected within `lead_s` of now, or now (their window
    open), in the order tracked."""
    out = []
    for name, track in tracks:
        if track.window is None:
            continue
        head, tail = track.window
        since = now - track.last
        if head - lead_s <= since < tail:
            out.append((name, track))
    return tuple(out)


def _per_hit(gaps: IdleHistogram, window: tuple[float, float] | None, c: HistogramConfig) -> float:
    if window is None:
        return math.inf
    start, end = window
    if end <= start:
        return math.inf
    hits = cost = 0.0
    for index, n in enumerate(gaps.counts):
        if not n:
            continue
        gap = (index + 0.5) * c.bin_s
        hits += n if start <= gap < end else 0.0
        cost += n * min(max(gap - start, 0.0), end - start)
    cost += gaps.out_of_range * (end - start)
    return cost / hits if hits else math.inf
