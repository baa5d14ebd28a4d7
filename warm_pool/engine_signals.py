"""What the engines themselves say about their load: read from each READY instance's `/metrics`.

The activator counts requests it holds and has sent; only the engine knows how many of those wait
inside it for a batch slot and how full its KV cache is. vLLM publishes both, and so does the CPU
engine, under the same names (its KV figure: the blocks its running requests' tokens fill), and the
pool hands them to the shared rules' saturation rule (`warm_pool.policies.rules`):

| vLLM metric | here | across one engine's label sets |
|---|---|---|
| `vllm:num_requests_waiting` | `EngineLoad.waiting` | summed |
| `vllm:num_requests_running` | `EngineLoad.running` | summed |
| `vllm:kv_cache_usage_perc` (v1; before it `vllm:gpu_cache_usage_perc`), a fraction 0..1 | `EngineLoad.kv_cache_usage` | mean |

One engine may publish several label sets of a gauge: one per served model name, one per
data-parallel rank (`engine="0"`, `"1"`, …). Request counts add up over them. A KV figure does not:
several model names of one engine report the same cache (a sum would count it twice, the mean is
that value), and vLLM balances its ranks itself, as the activator balances instances, so their
mean is how full the engine is.

`parse_engine_metrics` is pure. `EngineScraper` is the I/O around it: one shared aiohttp session,
each instance scraped at most once per `interval_s` (on the injected clock), a per-request
timeout, a cap on the body, a bound on scrapes in flight. An instance that cannot be read (refused,
slow, not 200, too big, not Prometheus text) contributes nothing until it can, and is logged at
debug: a dying engine is the pool's business (`Lifecycle.check`), not the scraper's.

    PoolError
    └── EngineMetricsError   an engine's /metrics could not be fetched or read (aiohttp's errors,
                             timeouts and the text parser's ValueError become this at the edge)
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from warm_pool.engine_tls import EngineTls, connector
from warm_pool.errors import InvalidConfig, PoolError

log = logging.getLogger("stoker.pool.engines")

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # the newer name first
METRICS_PATH = "/metrics"
# The lines that can hold our figures: samples (`name{labels} value`, `name value`) and their HELP and
# TYPE lines. Everything else (vLLM's histograms are most of its ~50 kB) is skipped before parsing:
# the parser costs ~0.2 ms a kB on this 2-core machine, 11 ms for a whole 58 kB vLLM exposition, on
# the event loop that also streams tokens; filtered first, the same read takes 0.4 ms.
_LINES = tuple(
    prefix
    for name in (WAITING, RUNNING, *KV_USAGE)
    for prefix in (f"{name}{{", f"{name} ", f"# HELP {name} ", f"# TYPE {name} ")
)


class EngineMetricsError(PoolError):
    """An engine's /metrics could not be fetched, or what it answered is not an engine's metrics."""


@dataclass(frozen=True)
class EngineLoad:
    waiting: int  # requests inside the engine waiting for a batch slot (or preempted for KV space)
    running: int  # requests being generated
    kv_cache_usage: float | None  # fraction of the KV cache in use, 0..1; None: not reported


@dataclass(frozen=True)
class EngineTotals:
    """The figures of a deployment's READY instances, as the observation carries them."""

    waiting: int = 0  # summed: every waiting request is one the fleet could not batch
    kv_cache_usage: float | None = None  # mean over the instances that report one; None if none do


def parse_engine_metrics(text: str) -> EngineLoad:
    """The load in a Prometheus text exposition; `EngineMetricsError` if its lines for these gauges
    are not Prometheus text, or it has neither request gauge (then it is not an engine's)."""
    sums: dict[str, float] = {}
    kv: dict[str, list[float]] = {}
    kept = "\n".join(line for line in text.splitlines() if line.startswith(_LINES))
    try:
        for family in text_string_to_metric_families(kept):
            for sample in family.samples:
                value = sample.value
                if not math.isfinite(value):
                    continue  # vLLM never publishes NaN here; a stray one must not poison a sum
                if sample.name in (WAITING, RUNNING):
                    sums[sample.name] = sums.get(sample.name, 0.0) + value
                elif sample.name in KV_USAGE:
                    kv.setdefault(sample.name, []).append(value)
    except ValueError as exc:  # the parser's only error (fuzzed: 100k mutated expositions)
        raise EngineMetricsError(f"not Prometheus text: {exc}") from None
    if not sums:
        raise EngineMetricsError(f"neither {WAITING} nor {RUNNING} in the exposition")
    usage = next((values for name in KV_USAGE if (values := kv.get(name))), None)
    return EngineLoad(
        waiting=max(0, round(sums.get(WAITING, 0.0))),
        running=max(0, round(sums.get(RUNNING, 0.0))),
        kv_cache_usage=None if usage is None else min(max(sum(usage) / len(usage), 0.0), 1.0),
    )


def engine_totals(loads: Iterable[EngineLoad]) -> EngineTotals:
    """Waiting summed, KV usage averaged, over the instances' latest loads.

    The mean, not the max: the activator balances by least outstanding, so another instance adds
    capacity the fleet lacks only when the fleet as a whole is full. Four instances at 100 %, 20 %,
    20 %, 20 % (mean 40 %) need the requests routed to the three, not a fifth instance; four at
    95 % (mean 95 %) need the fifth."""
    waiting, usages = 0, []
    for load in loads:
        waiting += load.waiting
        if load.kv_cache_usage is not None:
            usages.append(load.kv_cache_usage)
    return EngineTotals(waiting, sum(usages) / len(usages) if usages else None)


class EngineScraper:
    """Scrapes engines' /metrics and keeps the latest `EngineLoad` of each instance.

    `scrape(targets)` (instance id → base URL) reads every target due, at most `concurrency` at
    once, and forgets the instances not among the targets; `latest` is what was last read. A round
    of n targets takes at most ceil(n / concurrency) × `timeout_s`: 20 instances, 8 at a time, 2 s
    each → 6 s in the worst case, a round or so behind the 5 s interval, never unbounded.
    """

    def __init__(
        self,
        clock: Callable[[], float],
        *,
        interval_s: float = 5.0,
        timeout_s: float = 2.0,
        max_body_bytes: int = 2 * 1024 * 1024,
        concurrency: int = 8,
        tls: EngineTls | None = None,  # engines on HTTPS (`warm_pool.engine_tls`)
    ) -> None:
        # 5 s: the rules act on a signal only to add an instance, which takes seconds to tens of
        # seconds to start, so fresher figures would buy nothing; vLLM updates these gauges every
        # scheduler step, so any interval reads a current value. 2 s: an engine that cannot answer
        # a gauge read in 2 s has a stalled event loop, and its figures would be stale on arrival.
        # 2 MiB: vLLM's exposition for one model is ~50 kB (a few dozen histograms of ~20 buckets).
        for name, value in (("interval_s", interval_s), ("timeout_s", timeout_s)):
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise InvalidConfig(name, f"{name} must be a finite number > 0, got {value!r}")
        if not (isinstance(max_body_bytes, int) and max_body_bytes >= 1):
            raise InvalidConfig("max_body_bytes", f"max_body_bytes must be ≥ 1, got {max_body_bytes!r}")
        if not (isinstance(concurrency, int) and concurrency >= 1):
            raise InvalidConfig("concurrency", f"concurrency must be ≥ 1, got {concurrency!r}")
        self._clock = clock
        self.interval_s, self.timeout_s = float(interval_s), float(timeout_s)
        self.max_body_bytes, self.concurrency = max_body_bytes, concurrency
        self._tried: dict[str, float] = {}  # instance id → when its last scrape began
        self._loads: dict[str, EngineLoad] = {}
        self._tls = tls
        self._session: aiohttp.ClientSession | None = None  # made in the loop, on the first scrape
        self._closed = False

    @property
    def latest(self) -> Mapping[str, EngineLoad]:
        """The last load read from each instance still known (read-only)."""
        return MappingProxyType(self._loads)

    def retain(self, instance_ids: Iterable[str]) -> None:
        """Forget every instance not in `instance_ids`: gone, or no longer READY."""
        keep = set(instance_ids)
        for table in (self._tried, self._loads):
            for gone in [i for i in table if i not in keep]:
                del table[gone]

    def due(self, instance_ids: Iterable[str]) -> bool:
        """Whether `scrape` would read any of these now."""
        now = self._clock()
        return not self._closed and any(self._is_due(i, now) for i in instance_ids)

    async def scrape(
        self, targets: Mapping[str, str], headers: Mapping[str, Mapping[str, str]] | None = None
    ) -> Mapping[str, EngineLoad]:
        """Read each target due (instance id → base URL, with that instance's `headers`: its key);
        returns `latest`. Never raises for an engine's fault: that instance's load is dropped until
        a later read succeeds."""
        headers = headers or {}
        self.retain(targets)
        now = self._clock()
        due = [(i, url) for i, url in targets.items() if self._is_due(i, now)]
        if self._closed or not due:
            return self.latest
        for instance_id, _ in due:
            self._tried[instance_id] = now  # a failed read waits its interval too: no retry storm
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=connector(self._tls, limit=self.concurrency),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            )
        gate = asyncio.Semaphore(self.concurrency)
        await asyncio.gather(
            *(self._scrape_one(self._session, gate, i, url, headers.get(i, {})) for i, url in due)
        )
        return self.latest

    async def aclose(self) -> None:
        self._closed = True
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _is_due(self, instance_id: str, now: float) -> bool:
        tried = self._tried.get(instance_id)
        return tried is None or now - tried >= self.interval_s

    async def _scrape_one(
        self,
        session: aiohttp.ClientSession,
        gate: asyncio.Semaphore,
        instance_id: str,
        url: str,
        headers: Mapping[str, str],
    ) -> None:
        async with gate:
            try:
                load = parse_engine_metrics(await self._fetch(session, url, headers))
            except EngineMetricsError as exc:
                self._loads.pop(instance_id, None)
                log.debug("instance %s: no engine load: %s", instance_id, exc)
                return
        if instance_id in self._tried:  # not forgotten while the read was in flight
            self._loads[instance_id] = load

    async def _fetch(self, session: aiohttp.ClientSession, base_url: str, headers: Mapping[str, str]) -> str:
        url, cap = base_url + METRICS_PATH, self.max_body_bytes
        try:
            async with session.get(url, headers=headers) as response:
                if response.status != 200:
                    raise EngineMetricsError(f"GET {url} answered {response.status}")
                if response.content_length is not None and response.content_length > cap:
                    raise EngineMetricsError(f"GET {url}: {response.content_length} bytes, over {cap}")
                body = bytearray()
                async for chunk in response.content.iter_chunked(64 * 1024):
                    body += chunk
                    if len(body) > cap:  # no Content-Length (chunked, or decompressed): count
                        raise EngineMetricsError(f"GET {url}: over {cap} bytes")
        except TimeoutError:  # before OSError, of which it is a subclass
            raise EngineMetricsError(f"GET {url}: no answer within {self.timeout_s:g}s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise EngineMetricsError(f"GET {url} failed: {type(exc).__name__}: {exc}") from None
        return body.decode("utf-8", "replace")
