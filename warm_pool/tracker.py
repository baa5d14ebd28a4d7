"""The bookkeeping behind every `Observation`: one class that the live pool and the simulator share.

A policy only sees what this class measured, so the live loop and the simulator must measure the
same way; putting the counting here, and nowhere else, is what makes a simulated run comparable to a
live one. It is told about events as they happen and builds an `Observation` when the loop asks:

- `arrived(now)` / `finished(now, service_s)`: requests in and out (a rejected one finishes with
  `service_s=None`). From these come the per-second samples (arrivals, and the time-weighted mean
  of requests outstanding, held ones included: Knative's "averaged per-second concurrency"; the
  predictive policy takes the time held back out, from `queued` at each call), the idle gaps (from the
  moment nothing was outstanding to the next arrival) and the learned latency per request.
- `started(tier, seconds)`: an instance became READY after `seconds` from `tier`; the per-tier
  start-up times fed to the policy are a running average of these, seeded with priors.
- `adapter_arrived(now, name)`: the request that arrived is for LoRA adapter deployment `name`,
  served on this one; the observation names each adapter heard from since the previous one, with its first and last
  arrival (`Observation.adapter_arrivals`, for `policies.adapter_forecast`).
- `adapter_loaded(seconds)`: an adapter was loaded onto an instance in `seconds`: the adapter tier
  (`TierTimes.adapter`), a running average as the start-up tiers are.

Every buffer is bounded (seconds not yet observed, idle gaps not yet observed), and time is only
ever the `now` each call is handed: no clock reads.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import replace

from warm_pool.errors import InvalidConfig
from warm_pool.policies.base import Observation, SecondSample, Tier, TierTimes

# Latency: a running mean for the first 100 requests, then an exponential average over ~100 (alpha
# 0.01), so one slow request moves it by 1 %, and a lasting change of workload is learned within a few
# hundred requests. (predictive sizes from the last 60 s of concurrency and arrivals, less the time
# requests were held, S = L_s / λ, and falls back on this only when that window is empty.)
LATENCY_ALPHA = 0.01
# Start-up: starts are rare (a few an hour), so each new one counts for 30 % once three are in.
STARTUP_ALPHA = 0.3
# Adapter loads are counted over the last minute (`Observation.adapter_loads`): how fast the
# instances' adapter LRUs turn over, which says whether a load ahead would last until its request.
ADAPTER_LOAD_WINDOW_S = 60.0


class ObservationTracker:
    def __init__(
        self,
        priors: TierTimes | None = None,
        *,
        max_pending_seconds: int = 3600,
        max_pending_gaps: int = 256,
        max_pending_adapters: int = 1024,
    ) -> None:
        if max_pending_seconds < 1 or max_pending_gaps < 1 or max_pending_adapters < 1:
            raise InvalidConfig("tracker", "the tracker's buffers must hold at least one entry")
        self._startup = priors or TierTimes()
        self._starts: dict[Tier, int] = dict.fromkeys(Tier, 0)
        self._latency: float | None = None
        self._served = 0
        self._outstanding = 0
        self._last_arrival: float | None = None
        self._idle_since: float | None = None
        self._refused_at: float | None = None
        self._arrivals = 0  # since the previous observation
        self._gaps: deque[float] = deque(maxlen=max_pending_gaps)
        self._pending: deque[SecondSample] = deque(maxlen=max_pending_seconds)
        self._bucket: int | None = None  # the second being filled: [bucket, bucket + 1)
        self._mark = 0.0  # how far into it `_area` is integrated
        self._area = 0.0  # ∫ outstanding dt over [bucket, mark)
        self._bucket_arrivals = 0
        # Adapters heard from since the previous observation: name -> (first, last) arrival.
        self._adapters: dict[str, tuple[float, float]] = {}
        self._max_adapters = max_pending_adapters
        self._adapter_loads = 0
        self._load_times: deque[float] = deque(maxlen=4096)
        self.dropped_adapters = 0  # adapter arrivals not named, past `max_pending_adapters` in one call

    # ---- events --------------------------------------------------------------------------------------

    def arrived(self, now: float) -> None:
        self._advance(now)
        if self._outstanding == 0 and self._idle_since is not None:
            self._gaps.append(max(0.0, now - self._idle_since))
        self._idle_since = None
        self._outstanding += 1
        self._arrivals += 1
        self._bucket_arrivals += 1
        self._last_arrival = now

    def active(self, at: float) -> None:
        """Requests arrived as late as `at`, unseen here: heard from elsewhere (a gateway's own
        last arrival), or inferred (instances a previous controller left READY were in use). Only
        idleness learns of it; no arrival is counted."""
        if self._last_arrival is None or at > self._last_arrival:
            self._last_arrival = at

    def finished(self, now: float, service_s: float | None = None) -> None:
        """A request left: served after holding an instance `service_s` seconds, or rejected (None)."""
        self._advance(now)
        self._outstanding = max(0, self._outstanding - 1)
        if self._outstanding == 0:
            self._idle_since = now
        if service_s is None:
            self._refused_at = now
        if service_s is not None and service_s >= 0 and math.isfinite(service_s):
            self._served += 1
            alpha = max(1.0 / self._served, LATENCY_ALPHA)
            self._latency = (
                service_s if self._latency is None else self._latency + alpha * (service_s - self._latency)
            )

    def started(self, tier: Tier | str, seconds: float) -> None:
        """An instance became READY `seconds` after it was asked for, coming from `tier`."""
        if not (math.isfinite(seconds) and seconds >= 0):
            return
        tier = Tier(tier)
        self._starts[tier] += 1
        alpha = max(1.0 / self._starts[tier], STARTUP_ALPHA)
        old = self._startup.of(tier)
        self._startup = replace(self._startup, **{tier.value: old + alpha * (seconds - old)})

    def adapter_arrived(self, now: float, adapter: str) -> None:
        """The request that `arrived` at `now` is for LoRA adapter deployment `adapter` (counted
        there: this only names it)."""
        seen = self._adapters.get(adapter)
        if seen is not None:
            self._adapters[adapter] = (seen[0], max(seen[1], now))
        elif len(self._adapters) < self._max_adapters:
            self._adapters[adapter] = (now, now)
        else:
            self.dropped_adapters += 1

    def adapter_loaded(self, seconds: float, now: float | None = None) -> None:
        """A LoRA adapter was loaded onto an instance in `seconds` (the adapter tier), at `now`."""
        if now is not None:
            self._load_times.append(now)
        if not (math.isfinite(seconds) and seconds >= 0):
            return
        self._adapter_loads += 1
        alpha = max(1.0 / self._adapter_loads, STARTUP_ALPHA)
        old = self._startup.adapter
        self._startup = replace(self._startup, adapter=old + alpha * (seconds - old))

    # ---- reading ---------------------------------------------------------------------------------------

    @property
    def outstanding(self) -> int:
        return self._outstanding

    @property
    def startup(self) -> TierTimes:
        return self._startup

    @property
    def latency_s(self) -> float | None:
        return self._latency

    def observe(
        self,
        now: float,
        *,
        in_flight: int,
        queued: int,
        ready: int,
        starting: int,
        sleeping: int = 0,
        waking: int = 0,
        cached_tier: Tier | str = Tier.DISK,
        snapshot_id: str | None = None,
        can_sleep: bool = True,
        engine_waiting: int = 0,
        kv_cache_usage: float | None = None,
    ) -> Observation:
        """The observation at `now`; what it reports as new (arrivals, seconds, gaps) is then cleared.

        `cached_tier` is where a fresh process would load the snapshot from (page cache, disk or
        object storage); a sleeping instance, when there is one and the engine can sleep, is faster
        and wins. Without sleep mode there is nothing to wake, whatever `sleeping` says, so the
        start tier (the predictive policy's lead time) is always a fresh process's.
        `engine_waiting` and `kv_cache_usage` are the READY engines' own figures
        (`warm_pool.engine_signals.engine_totals`), passed through."""
        self._advance(now)
        seconds, gaps, arrivals = tuple(self._pending), tuple(self._gaps), self._arrivals
        adapters = tuple((name, first, last) for name, (first, last) in self._adapters.items())
        while self._load_times and self._load_times[0] < now - ADAPTER_LOAD_WINDOW_S:
            self._load_times.popleft()
        self._pending.clear()
        self._gaps.clear()
        self._adapters.clear()
        self._arrivals = 0
        return Observation(
            in_flight=in_flight,
            queued=queued,
            ready=ready,
            starting=starting,
            last_arrival=self._last_arrival,
            arrivals=arrivals,
            seconds=seconds,
            idle_since=self._idle_since if self._outstanding == 0 else None,
            refused_at=self._refused_at,
            idle_gaps=gaps,
            sleeping=sleeping,
            waking=waking,
            latency_s=self._latency,
            startup=self._startup,
            start_tier=Tier.WAKE if sleeping > 0 and can_sleep else Tier(cached_tier),
            snapshot_id=snapshot_id,
            can_sleep=can_sleep,
            engine_waiting=max(0, engine_waiting),
            kv_cache_usage=kv_cache_usage,
            adapter_arrivals=adapters,
            adapter_loads=len(self._load_times),
        )

    # ---- per-second samples --------------------------------------------------------------------------

    def _advance(self, now: float) -> None:
        """Close every whole second before `now`, integrating requests outstanding over time."""
        if self._bucket is None:
            self._bucket, self._mark = math.floor(now), now
            return
        if now < self._mark:  # a caller's clock stepped back: count nothing twice
            return
        while now >= self._bucket + 1:
            end = self._bucket + 1
            self._area += self._outstanding * (end - self._mark)
            self._pending.append(SecondSample(float(self._bucket), self._bucket_arrivals, self._area))
            self._bucket, self._mark, self._area, self._bucket_arrivals = end, float(end), 0.0, 0
            # A long silence: only the newest `maxlen` empty seconds could be kept anyway.
            skip_to = math.floor(now) - (self._pending.maxlen or 0)
            if skip_to > self._bucket:
                self._bucket, self._mark = skip_to, float(skip_to)
        self._area += self._outstanding * (now - self._mark)
        self._mark = now
