"""`predictive` (the default): forecast the arrivals, size for them ahead of time, and use the
sleeping tier for the instances that are not needed now but will be soon.

Each call:

1. Forecast. The damped Holt trend (and, after a day, the time-of-day profile: `forecast.py`)
   gives the arrival rate at now + h, where h is the measured start-up time of the tier a new
   instance would come from now: a wake (~1 s) when one sleeps, else a page-cache, disk or
   object-storage start. Capacity asked for now is READY by then.
2. Little's law, for the instances alone. Expected concurrency = rate × service time S, the
   seconds a request spends on an instance, measured over the last `stable_window_s` (60 s, kpa's
   window) as S = L_s / λ: the window's mean concurrency in service over its arrivals per second.
   L_s is the tracker's time-weighted concurrency (requests in flight or held) less the time held:
   the requests held at each call (`Observation.queued`) until the next, per second, kept here.
   Not the time held (W = L / λ): a request held for a start waits for capacity already coming,
   and counting that wait asks for more (8 requests at zero, target 8, max 2, an 8 s CPU start:
   8.00/s × 0.39 s → 1 instance, then 3.50/s × 1.39 s = 4.9 concurrent, rising with each second
   held until a second start was asked for: issue 13). Held requests are the reactive floor's
   (rules.py, rule 1), which counts them at once; the forecast sizes for the arrivals once served.
   Not the tracker's learned latency (mean service time of finished requests) either, except for
   a window without arrivals: while a backlog drains it is biased low, because short requests
   finish first (conv trace, t = 37 s: 2.7 s learned against ~6 s in the system; the forecast then
   cancelled two starts that the next minute needed, and 19 requests waited ~4 s for a page-cache
   start); L_s counts a long request for every second it is served, finished or not. With nothing
   held, S = W, as before. Instances =
   ceil(concurrency / (target × utilization)), the same per-instance target as `kpa`. The rate
   is already smoothed (α: about a 60 s window). Against flapping, besides
   the shared rules' delays, a step down is taken only if it still holds with the estimate `band`
   (8 %) higher: about one standard deviation of the estimate at 5 requests/s (level ±6 %, learned
   latency ±5 %). On a steady Poisson load at an instance boundary this cuts the reversals
   (17 against kpa's 25 in 20 minutes: tests/warm_pool/test_noisy_load.py) for ~4 % more
   GPU-seconds. Below `sparse_concurrency` (0.5 requests in flight on average: idle more than
   60 % of the time) the forecast does not keep an instance by itself, and step 3 decides. The
   shared rules add the reactive floor on top: the forecast is a floor, never a ceiling.
3. The last instance, while nothing is in flight or held, from the idle-gap histogram
   (`idle_histogram.py`; prewarm = head × 0.9, keep_until = tail × 1.1, both seconds into the gap;
   head the 5th percentile as in the paper, tail the 90th where the paper has the 99th: a miss
   there costs a wake (~1 s) instead of a cold start (~28 s), so missing 10 % of gaps instead of
   1 % still adds less expected wait per gap: 0.10 × 1 s against 0.01 × 28 s):
   - asleep from the start of the gap until prewarm − lead, if that is at least `min_sleep_s`
     (10 s; shorter sleeps save less than a wake risks), where lead = the wake time plus
     `wake_margin_s` (2 s: one loop tick and a margin) when an instance is there to sleep, else the
     start-up time of the tier a new one would come from;
   - READY from then until keep_until: the pre-warm lands before the expected arrival;
   - asleep after keep_until: the expected arrival did not come. Asleep, an instance holds host
     RAM and no GPU, and a request that finds it waits a wake, not a cold start;
   - not worth it: if READY over that window costs more than `stable_window_s` (60 s) of READY
     time per gap that ends inside it (from the histogram), asleep for the whole gap. kpa pays one
     stable window of idle READY for each chance to avoid a cold start; on irregular sparse gaps
     (code trace thinned by 500: gaps 22–289 s, near memoryless, so a window costs about the mean
     gap, ~150 s, per hit) a 1 s wake on each arrival is the cheaper answer;
   - not representative yet (fewer than 5 gaps, say): READY for `fallback_ready_s` (30 s: the
     shared rules' down delay, one disk start, the ski-rental break-even against the start a stop
     would cost), then asleep. Not the longest gap seen × 1.1: early gaps of 4–5 minutes held a
     GPU idle that long to spare a 1 s wake;
   - stopped once idle for `sleep_keepalive_s` (30 min; a deployment's idle timeout);
   - READY only within the first `ready_share` (half) of `sleep_keepalive_s`, whatever the
     fallback or the histogram say: both READY windows end at min(their end, T × 0.5), T the idle
     timeout, so every idle timeout leaves the instance asleep for at least its second half
     before the stop. Without the cap a short idle timeout turned the sleeping tier off: bound
     from a deployment (`settings.bind_policy`) the fallback is the stable window, which the
     platform caps at T, so with `--idle-timeout 20` READY ended at 20 s, the very second the
     instance was stopped. Worked example, T = 20 s, window 60 s (capped to 20): READY 0–10 s,
     asleep 10–20 s, stopped at 20 s; T = 300 s, window 60 s: READY 0–60 s, asleep 60–300 s
     (unchanged: 60 < 150); T = 300 s, gaps of ~200 s (keep_until 1.1 × tail ≈ 230 s): the
     pre-warm at ~177 s lies past 150 s, so the instance sleeps through, a wake (~1 s) away. Why
     a half: the idle timeout keeps its meaning (the last instance goes at T), and neither tier
     is squeezed to nothing by the other, however short T is (the platform's floor is 2 s, two
     loop ticks: `settings.MIN_SLEEPING_IDLE_S`).
4. The sleeping tier for the rest: instances the load needed in the last `sleep_keepalive_s` and
   that are not READY now are put to sleep instead of stopped (the highest READY count of that
   window, minus READY now), so the next burst wakes them in a second instead of starting them.
5. Page cache: while the deployment is active and has no sleeping instance, ask for its snapshot
   to be warmed into the page cache when a new instance would otherwise read disk or object storage.
6. Without sleep mode (`Observation.can_sleep` False: vLLM's CPU build) every "asleep" above is
   "stopped", and the way back is a fresh start from the tier the snapshot is in now (page cache,
   disk, object storage), whose measured start-up time is the lead, never a wake:
   - the last instance is stopped at the start of a gap and started again at prewarm − start
     only if that stop lasts at least one start-up time (and `min_sleep_s`): an instance let go
     for less than a start takes is a flap (the shared rules' down delay, and the ski-rental
     break-even). Gaps of ~100 s, disk start 28 s: prewarm 90 s, stopped 0–62 s, READY from 90 s
     until keep_until. Gaps of ~40 s: prewarm 36 s, a stop of 8 s < 28 s: READY throughout;
   - READY over the window is weighed against stopping for the whole gap at the same rate of one
     stable window per hit: kpa's rate, whose alternative is also a cold start;
   - not representative: READY for `fallback_ready_s`, then stopped; idle for
     `sleep_keepalive_s`: stopped, as with sleep;
   - stopped between arrivals the policy still asks for the page cache to be warmed: the fastest
     tier an engine without sleep has.

7. LoRA adapters served on this deployment (`adapter_forecast.py`): each adapter's own gaps, from
   one of its requests to its next, in a histogram of its own, since the base's sees them only in
   the sum. An adapter whose next request is due (its window, less the lead: the adapter load, the
   adapter tier `TierTimes.adapter`, plus `margin_s`, and the base's start or wake from its tier
   when nothing is READY), and where holding the base up over its window costs no more than
   `stable_window_s` of READY per hit (as in step 3), keeps a base that would otherwise be asleep
   or stopped READY for it, and is named in the decision's `adapters` (soonest expected first), to
   be loaded onto a READY instance before its request arrives: once a gap, at the first call
   with an instance READY.

State is bounded: Holt's two numbers, the 1440-slot profile, the histogram's bins, a running
peak of at most max + 1 entries, the stable window's per-second samples and held seconds (61
each at most), and at most `adapters.max_tracked` (256) adapters of 360 bins each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from warm_pool.errors import InvalidConfig
from warm_pool.policies.adapter_forecast import AdapterForecastConfig, Tracks, add_arrivals, due
from warm_pool.policies.base import TARGET_CONCURRENCY, Decision, Observation, SecondSample, Tier
from warm_pool.policies.forecast import Forecast, ForecastConfig
from warm_pool.policies.idle_histogram import HistogramConfig, IdleHistogram
from warm_pool.policies.windows import Peak, instances_for, peak, push_peak, push_seconds

READY_SHARE = 0.5  # an idle instance is READY at most this share of the idle timeout (step 3)


@dataclass(frozen=True)
class PredictiveConfig:
    target_concurrency: int = TARGET_CONCURRENCY
    max: int = 1
    target_utilization: float = 0.7
    latency_prior_s: float = 2.0
    sparse_concurrency: float = 0.5
    band: float = 0.08
    fallback_ready_s: float = 30.0
    min_sleep_s: float = 10.0
    wake_margin_s: float = 2.0
    sleep_keepalive_s: float = 1800.0
    stable_window_s: float = 60.0  # kpa's: the window for W = L / λ and the READY budget per hit
    ready_share: float = READY_SHARE  # of sleep_keepalive_s, the most an idle instance stays READY
    forecast: ForecastConfig = field(default_factory=ForecastConfig)
    histogram: HistogramConfig = field(default_factory=lambda: HistogramConfig(tail_pct=90.0))
    adapters: AdapterForecastConfig = field(default_factory=AdapterForecastConfig)  # step 7

    def __post_init__(self) -> None:
        if not 0 < self.target_utilization <= 1:
            raise InvalidConfig(
                "target_utilization", f"target_utilization must be in (0, 1], got {self.target_utilization}"
            )
        for name in ("latency_prior_s", "fallback_ready_s", "sleep_keepalive_s", "stable_window_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise InvalidConfig(name, f"{name} must be a finite number > 0, got {value}")
        if not 0 < self.ready_share < 1:
            raise InvalidConfig("ready_share", f"ready_share must be in (0, 1), got {self.ready_share}")
        for name in ("sparse_concurrency", "band", "min_sleep_s", "wake_margin_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise InvalidConfig(name, f"{name} must be a finite number ≥ 0, got {value}")


@dataclass(frozen=True)
class PredictiveState:
    forecast: Forecast = field(default_factory=Forecast)
    histogram: IdleHistogram = field(default_factory=IdleHistogram)
    readies: Peak = ()  # instances READY or coming up in the last sleep_keepalive_s
    samples: tuple[SecondSample, ...] = ()  # the stable window's seconds
    held: tuple[tuple[float, float], ...] = ()  # (second's start, request-seconds held in it), the same
    queued: tuple[float, int] | None = None  # (when, requests held) at the previous call
    adapters: Tracks = ()  # each LoRA adapter's own arrivals on this base (step 7)


def predictive(
    observation: Observation, state: PredictiveState, now: float, config: PredictiveConfig
) -> tuple[Decision, PredictiveState]:
    o, c = observation, config
    fc = state.forecast.update(tuple((s.start, s.arrivals) for s in o.seconds), c.forecast)
    hist = state.histogram.add(o.idle_gaps, c.histogram)
    adapters = add_arrivals(state.adapters, o.adapter_arrivals, c.adapters)

    horizon = o.startup.of(o.start_tier)
    rate = fc.rate(now, horizon, c.forecast)
    samples = push_seconds(state.samples, o.seconds, now, c.stable_window_s)
    held = _push_held(state.held, state.queued, now, c.stable_window_s)
    arrived = sum(s.arrivals for s in samples)
    if arrived:
        in_held = dict(held)  # L_s = L − time held, second by second (step 2)
        latency = sum(max(0.0, s.concurrency - in_held.get(s.start, 0.0)) for s in samples) / arrived
    else:
        latency = o.latency_s if o.latency_s is not None else c.latency_prior_s
    concurrency = rate * latency
    per_instance = c.target_concurrency * c.target_utilization
    need = 0 if concurrency < c.sparse_concurrency else min(instances_for(concurrency, per_instance), c.max)
    present = o.ready + o.starting + o.waking
    if 0 < need < present and instances_for(concurrency * (1 + c.band), per_instance) >= present:
        need = present  # within the band of what is there: not worth a step down
    reason = (
        f"forecast {rate:.2f}/s at +{horizon:.0f}s × {latency:.2f}s = {concurrency:.1f} concurrent → {need}"
    )

    demand = o.in_flight + o.queued
    parked = False  # the last instance is asleep (or, without sleep mode, stopped) between arrivals
    if need > 0 or demand > 0:
        ready = max(need, 1)
    elif o.idle_since is None and o.last_arrival is None:
        ready, reason = 0, "no traffic yet"
    else:
        since = o.idle_since if o.idle_since is not None else o.last_arrival
        idle_for = max(0.0, now - since)
        if o.can_sleep:
            ready, parked, reason = _last_instance(o, hist, idle_for, c)
        else:
            ready, parked, reason = _last_instance_without_sleep(o, hist, idle_for, c)

    # Step 7: the adapters whose next request is due: loaded ahead, and the base READY for them.
    lead = o.startup.adapter + c.adapters.margin_s + (0.0 if o.ready else o.startup.of(o.start_tier))
    # Those worth it (the READY budget per hit), soonest expected first: a stable order, so that the
    # same few are loaded ahead at each call, and none evicts another from an instance's LRU.
    coming = sorted(
        ((n, t) for n, t in due(adapters, now, lead) if t.per_hit <= c.stable_window_s),
        key=lambda item: (item[1].last + item[1].window[0], item[0]),  # type: ignore[index]
    )
    if ready == 0 and coming:
        name, track = coming[0]
        ready, parked = 1, False
        expected = track.last + track.window[0] - now  # type: ignore[index]
        reason = (
            f"adapter {name}: its next request expected from {expected:+.0f}s "
            f"({track.per_hit:.0f}s READY per hit): pre-warmed"
        )

    readies = push_peak(state.readies, now, min(max(ready, present), c.max), c.sleep_keepalive_s)
    recent = peak(readies, now, c.sleep_keepalive_s)
    stopping = ready == 0 and not parked
    sleeping = 0 if stopping or not o.can_sleep else max(recent - ready, 1 if parked else 0)

    warm: tuple[str, ...] = ()
    slow_start = o.start_tier in (Tier.DISK, Tier.OBJECT_STORAGE)
    if o.snapshot_id and not stopping and o.sleeping == 0 and slow_start:
        warm = (o.snapshot_id,)
    # Named once a gap, when an instance is READY to load them on and their LRUs turn over slowly
    # enough for a load ahead to last until its request (`adapter_forecast.py`).
    churn = o.adapter_loads > o.ready * c.adapters.churn_loads
    ahead = tuple(n for n, t in coming if not t.named) if o.ready and not churn else ()
    if ahead:
        adapters = tuple((n, replace(t, named=True) if n in ahead else t) for n, t in adapters)
    decision = Decision(ready, sleeping, warm, reason, forecast=rate, adapters=ahead)
    queued = (now, o.queued) if state.queued is None or now >= state.queued[0] else state.queued
    return decision, PredictiveState(fc, hist, readies, samples, held, queued, adapters)


def _push_held(
    held: tuple[tuple[float, float], ...], queued: tuple[float, int] | None, now: float, window_s: float
) -> tuple[tuple[float, float], ...]:
    """`held` with the requests held at the previous call counted until `now`, split at whole
    seconds as the tracker splits its samples, and only the seconds of the last `window_s` kept.

    The count is what the activator held at that call, so where it changes between calls (a held
    request gets a slot, a new one is held) this is off by at most the time between calls: a second,
    and less where the loop is poked, as it is by every request held at zero."""
    buckets = dict(held)
    if queued is not None and queued[1] > 0:
        t = max(queued[0], now - window_s - 1.0)  # after a long silence, only the window counts
        while t < now:
            start = float(math.floor(t))
            end = min(now, start + 1.0)
            buckets[start] = buckets.get(start, 0.0) + queued[1] * (end - t)
            t = end
    return tuple((s, a) for s, a in sorted(buckets.items()) if s + 1.0 > now - window_s)


def _last_instance(
    o: Observation, hist: IdleHistogram, idle_for: float, c: PredictiveConfig
) -> tuple[int, bool, str]:
    """(READY, put the last one to sleep?, reason) for a deployment idle for `idle_for` seconds."""
    if idle_for >= c.sleep_keepalive_s:
        return 0, False, f"idle {idle_for:.0f}s ≥ {c.sleep_keepalive_s:g}s: stop"
    limit = c.sleep_keepalive_s * c.ready_share  # READY only this far into the idle timeout
    windows = hist.windows(c.histogram)
    if windows is None:
        keep = min(c.fallback_ready_s, limit)
        if idle_for < keep:
            return 1, False, f"histogram not representative ({hist.total:.0f} gaps): ready {keep:g}s"
        return 0, True, f"histogram not representative: asleep after {keep:g}s idle"
    prewarm, keep_until = windows
    keep_until = min(keep_until, limit)
    has_instance = o.ready + o.starting + o.waking + o.sleeping > 0
    lead = o.startup.wake + c.wake_margin_s if has_instance else o.startup.of(o.start_tier)
    wake_at = prewarm - lead
    if idle_for < wake_at and (wake_at >= c.min_sleep_s or not has_instance):
        return (
            0,
            True,
            f"idle {idle_for:.0f}s: asleep until {wake_at:.0f}s (next arrival from {prewarm:.0f}s)",
        )
    from_s = max(wake_at, 0.0) if has_instance and wake_at >= c.min_sleep_s else 0.0
    per_hit = _ready_per_hit(hist, from_s, keep_until, c)
    if has_instance and per_hit > c.stable_window_s:
        return (
            0,
            True,
            f"idle {idle_for:.0f}s: asleep (ready until {keep_until:.0f}s: {per_hit:.0f}s per hit)",
        )
    if idle_for < keep_until:
        return (
            1,
            False,
            f"idle {idle_for:.0f}s: ready until {keep_until:.0f}s (pre-warmed at {max(wake_at, 0):.0f}s)",
        )
    return 0, True, f"idle {idle_for:.0f}s > {keep_until:.0f}s: asleep"


def _last_instance_without_sleep(
    o: Observation, hist: IdleHistogram, idle_for: float, c: PredictiveConfig
) -> tuple[int, bool, str]:
    """(READY, stopped between arrivals?, reason) for an idle deployment whose engine cannot sleep:
    every way back is a start from `o.start_tier` (step 6 of the module docstring)."""
    if idle_for >= c.sleep_keepalive_s:
        return 0, False, f"idle {idle_for:.0f}s ≥ {c.sleep_keepalive_s:g}s: stop"
    windows = hist.windows(c.histogram)
    if windows is None:
        keep = c.fallback_ready_s
        if idle_for < keep:
            return 1, False, f"histogram not representative ({hist.total:.0f} gaps): ready {keep:.0f}s"
        return 0, True, f"histogram not representative: stopped after {keep:.0f}s idle (no sleep mode)"
    prewarm, keep_until = windows
    lead = o.startup.of(o.start_tier)
    start_at = prewarm - lead
    # Stopped first only if the stop outlasts a start; the same test whether or not an instance is
    # up now, so that stopping one never turns the next call's answer into starting one.
    stop_first = start_at >= max(c.min_sleep_s, lead)
    has_instance = o.ready + o.starting + o.waking + o.sleeping > 0
    if idle_for < start_at and (stop_first or not has_instance):
        return (
            0,
            True,
            f"idle {idle_for:.0f}s: stopped, started at {start_at:.0f}s ({o.start_tier} {lead:.0f}s)",
        )
    per_hit = _ready_per_hit(hist, start_at if stop_first else 0.0, keep_until, c)
    if per_hit > c.stable_window_s:
        return (
            0,
            True,
            f"idle {idle_for:.0f}s: stopped (ready until {keep_until:.0f}s: {per_hit:.0f}s per hit)",
        )
    if idle_for < keep_until:
        return (
            1,
            False,
            f"idle {idle_for:.0f}s: ready until {keep_until:.0f}s (started at {max(start_at, 0):.0f}s)",
        )
    return 0, True, f"idle {idle_for:.0f}s > {keep_until:.0f}s: stopped"


def _ready_per_hit(hist: IdleHistogram, start: float, end: float, c: PredictiveConfig) -> float:
    """Expected READY seconds per gap ending inside [start, end), if the last instance is READY
    from `start` to `end` seconds into every gap; inf when no gap seen ended there."""
    total = hist.total
    if total <= 0 or end <= start:
        return math.inf
    hits = cost = 0.0
    for index, n in enumerate(hist.counts):
        if not n:
            continue
        gap = (index + 0.5) * c.histogram.bin_s
        hits += n if start <= gap < end else 0.0
        cost += n * min(max(gap - start, 0.0), end - start)
    cost += hist.out_of_range * (end - start)
    return cost / hits if hits else math.inf
