"""Which of a deployment's instances take requests: the source's READY ones, less those ejected for
failing. One `HealthRouting` per `Activator`, which feeds it every request's outcome and runs its
probes; the rules (when a failure ejects, for how long, when a probe lets one back) are
`ejection.py`'s, pure.

- `outcome(key, ok)`: a request's end on an instance. `eject_after` failures in a row eject it for
  `eject_base_s`, doubling on each ejection in a row up to `eject_max_s`.
- `check()` (every `health_interval_s` under `watch()`): `GET /health` of every routable instance
  and of every ejected one whose time is up, within `health_timeout_s`; a 200 lets an ejected one
  back (`on_back`: the held requests get their chance), a 503 is reported to the source, which
  replaces the instance.
- An ejection ends the waits for headers of the requests already on that instance (`waits(key)`,
  the `asyncio.Timeout`s `proxy.forward` registers: moved to now by `proxy.expire`), so they are
  retried elsewhere, and bounds the silence of answers under way (`proxy.Silence`).
- One ejected `replace_after_ejections` times in a row is reported unhealthy (stopped or wedged:
  kept, a deployment whose every instance is ejected would hold its requests until their deadline).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import aiohttp

from activator import ejection, proxy
from activator.config import ActivatorConfig
from activator.ejection import HEALTHY, EjectionRules, Health
from activator.metrics import ActivatorMetrics
from activator.slots import Key, key
from activator.source import Endpoint, InstanceSource

log = logging.getLogger("activator")


class HealthRouting:
    def __init__(
        self,
        deployment: str,
        source: InstanceSource,
        config: ActivatorConfig,
        session: aiohttp.ClientSession,
        metrics: ActivatorMetrics,
        clock: Callable[[], float] = time.monotonic,
        on_back: Callable[[], None] = lambda: None,  # an ejected instance is routable again
    ) -> None:
        self._source, self._config, self._session, self._clock = source, config, session, clock
        self._on_back = on_back
        self._rules = EjectionRules(config.eject_after, config.eject_base_s, config.eject_max_s)
        self._health: dict[Key, Health] = {}  # instances that failed lately; absent: HEALTHY
        self._ejected: set[Key] = set()  # those out of routing now
        # Requests on each instance whose deadline an ejection shortens: waits for headers, and
        # answers under way (`proxy.forward`'s `waits`).
        self._waits: dict[Key, set[asyncio.Timeout]] = {}
        self._ejections = metrics.ejections.labels(deployment)
        self._ejected_now = metrics.ejected.labels(deployment)

    def routable(self) -> Sequence[Endpoint]:
        endpoints = self._source.endpoints()
        if not self._ejected:
            return endpoints
        return [e for e in endpoints if key(e) not in self._ejected]

    def ejected(self) -> list[str]:
        """The ids of the instances out of routing now for failing."""
        return sorted(k[0] for k in self._ejected)

    def waits(self, k: Key) -> set[asyncio.Timeout]:
        """The deadlines of the requests on instance `k`, for `proxy.forward` to add its own to."""
        return self._waits.setdefault(k, set())

    def done_waiting(self, k: Key) -> None:
        """A request on `k` has ended: its set goes once no deadline is left in it."""
        if not self._waits.get(k):
            self._waits.pop(k, None)

    async def watch(self) -> None:
        """Probe the instances every `health_interval_s`, for ever: the composition root runs this
        as a task per deployment and cancels it when the deployment goes."""
        while True:
            await asyncio.sleep(self._config.health_interval_s)
            await self.check()

    async def check(self) -> None:
        """One round: probe every routable instance, and every ejected one whose time is up."""
        endpoints = list(self._source.endpoints())
        present = {key(e) for e in endpoints}
        for gone in [k for k in self._health if k not in present]:  # left routing: forget it
            del self._health[gone]
            self._ejected.discard(gone)
        self._ejected_now.set(len(self._ejected))
        now = self._clock()
        due = [
            e
            for e in endpoints
            if not (h := self._health.get(key(e), HEALTHY)).ejected or ejection.probe_due(h, now)
        ]
        statuses = await asyncio.gather(*(self._probe(e) for e in due))
        now = self._clock()
        for endpoint, status in zip(due, statuses, strict=True):
            k = key(endpoint)
            if status == 503:
                self._source.report_unhealthy(endpoint.id, "its /health answered 503")
            self._set(k, ejection.probed(self._health.get(k, HEALTHY), status == 200, self._rules, now))

    async def _probe(self, endpoint: Endpoint) -> int:
        """GET /health within `health_timeout_s`: its status, or 0 when none came."""
        try:
            async with asyncio.timeout(self._config.health_timeout_s):
                async with self._session.get(endpoint.url + "/health") as resp:
                    await resp.read()
                    return resp.status
        except (aiohttp.ClientError, OSError, TimeoutError):
            return 0

    def outcome(self, k: Key, ok: bool) -> None:
        """A request on instance `k` ended: answered (`ok`) or failed."""
        health = self._health.get(k, HEALTHY)
        if ok:
            if health is not HEALTHY:
                self._set(k, ejection.succeeded(health))
        else:
            self._set(k, ejection.failed(health, self._rules, self._clock()))

    def _set(self, k: Key, health: Health) -> None:
        before = self._health.get(k, HEALTHY)
        if health == HEALTHY:
            self._health.pop(k, None)
        else:
            self._health[k] = health
        if health.ejected and health.ejections > before.ejections:  # ejected, or ejected again
            self._ejections.inc()
            if health.ejections >= self._config.replace_after_ejections:
                self._source.report_unhealthy(
                    k[0], f"ejected {health.ejections} times in a row (stopped or wedged)"
                )
        if health.ejected and k not in self._ejected:
            self._ejected.add(k)
            log.warning(
                "instance %s ejected from routing for %.3g s after failing",
                k[0],
                ejection.ejection_s(self._rules, health.ejections),
            )
            proxy.expire(self._waits.get(k, set()))  # its waiting requests go elsewhere
        elif not health.ejected and k in self._ejected:
            self._ejected.discard(k)
            log.warning("instance %s back in routing: its /health answered 200", k[0])
            self._on_back()
        self._ejected_now.set(len(self._ejected))
