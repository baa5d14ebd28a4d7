"""The observe stage of a pool's tick: one object gathers what the policy sees (as Ray Serve's
`autoscaling_state.py` gathers a deployment's reports into the policy's context), and the clock is
handed in, never read here.

`Observer.observe(now, ...)` reads, in this order: the activator's or the gateways' load
(`Demand.load()`: in flight, held, outstanding per instance; gateways of their own know arrivals
this pool never saw, which mark the deployment active in the tracker), the instances by group
(`warm_pool.census.census_of`), the READY engines' own queue and KV-cache figures (scraped in the
background, each engine at most every 5 s: the tick never waits for them, and reads what a scrape
found at a later tick), the census as the decision sees it (`warm_pool.recycler`: without an
instance being replaced), and the tracker's arrivals, idle gaps and start-up times
(`warm_pool.tracker`). The result is a `View`: the `Observation` for the policy, and the load and
the census the later stages of the tick read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from warm_pool.backends.base import Backend, runtime_ready, start_tier
from warm_pool.census import Census, Phase, census_of
from warm_pool.engine_signals import EngineScraper, EngineTotals, engine_totals
from warm_pool.page_tier import PageTier
from warm_pool.policies.base import Decision, Observation
from warm_pool.pool_spec import LoadView, PoolSpec
from warm_pool.recycler import Recycler
from warm_pool.states import Instance
from warm_pool.tracker import ObservationTracker

log = logging.getLogger("stoker.pool")


@dataclass(frozen=True)
class View:
    """What one tick sees."""

    load: LoadView
    full: Census  # every instance by group
    census: Census  # as the decision sees it: without an instance being replaced, if one is
    observation: Observation


class Observer:
    def __init__(
        self,
        tracker: ObservationTracker,
        engines: EngineScraper,
        page: PageTier,
        backend: Backend,
        recycler: Recycler,
    ) -> None:
        self._tracker, self._engines, self._page = tracker, engines, page
        self._backend, self._recycler = backend, recycler
        self._scrape: asyncio.Task | None = None

    def observe(
        self,
        now: float,
        load: LoadView,
        instances: Mapping[str, Instance],
        phases: Mapping[str, Phase],
        *,
        spec: PoolSpec,
        can_sleep: bool,
        last: Decision | None,
        leaving: Collection[str],
    ) -> View:
        """What the policy sees at `now`. `last`: the previous decision (a recycle waits for it);
        `leaving`: instances being stopped (never recycled)."""
        if load.last_arrival is not None:  # gateways of their own know arrivals this pool never saw
            self._tracker.active(load.last_arrival)
        full = census_of(instances.values(), phases)
        engines = self._engine_totals([instances[m.id] for m in full.routing], spec.deployment)
        census = self._recycler.begin(full, last, leaving, now, spec.max_instance_age_s)
        observation = self._tracker.observe(
            now,
            in_flight=load.in_flight,
            queued=load.queued,
            ready=len(census.routing),
            starting=len(census.coming),
            sleeping=census.sleeping,
            waking=len(census.waking),
            # A warm runtime ready for this engine makes the next start a runtime start.
            cached_tier=start_tier(self._page.tier(now), runtime_ready(self._backend, spec.engine)),
            snapshot_id=spec.snapshot.snapshot_id,
            can_sleep=can_sleep,
            engine_waiting=engines.waiting,
            kv_cache_usage=engines.kv_cache_usage,
        )
        return View(load, full, census, observation)

    def _engine_totals(self, routing: list[Instance], deployment: str) -> EngineTotals:
        """The READY engines' latest figures; starts a scrape of those due if none is in flight. The
        tick never waits for it: what it reads shows at the next tick, a second later."""
        targets = {inst.id: inst.url for inst in routing}
        self._engines.retain(targets)
        if (task := self._scrape) is not None and task.done():
            self._scrape = None
            # An engine's fault is never raised (that engine just has no figures): this is a bug.
            if not task.cancelled() and (exc := task.exception()) is not None:
                log.error("pool %s: engine scrape failed: %r", deployment, exc)
        if self._scrape is None and self._engines.due(targets):
            self._scrape = asyncio.create_task(
                self._engines.scrape(targets, {inst.id: inst.auth_headers for inst in routing}),
                name=f"scrape-{deployment}",
            )
        return engine_totals(self._engines.latest.values())

    def cancel(self) -> list[asyncio.Task]:
        """Cancel a scrape in flight; the task, for the pool to wait for as it closes."""
        task, self._scrape = self._scrape, None
        if task is None:
            return []
        task.cancel()
        return [task]

    async def aclose(self) -> None:
        await self._engines.aclose()
