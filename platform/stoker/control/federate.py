"""Every instance's engine metrics on one scrape target: the gateway's `GET /metrics/engines`.

Federated at scrape time, as Prometheus's own `/federate` and production-stack's router serve what
they front: each scrape of the gateway reads every serving instance's `/metrics` (READY, SLEEPING
or DRAINING; with that instance's key: engines demand one), adds `deployment`, `revision` and
`instance` labels to each sample, merges the families of all instances under one HELP and TYPE, and answers one Prometheus
text exposition. Nothing is cached between scrapes: what Prometheus stores is what the engines said
when it asked.

    engine A /metrics ─┐  parsed (prometheus_client's parser), relabelled,
    engine B /metrics ─┼─ merged by family name ──────────────────────────▶ GET /metrics/engines
    engine C (slow) ───┘  skipped at the deadline, counted; `stoker_engine_scrape_up` 0

Why a path of its own, beside the gateway's `/metrics`: the gateway's own series never wait on an
engine, and gateways are replicated: were every replica's `/metrics` to carry every engine, a
Prometheus scraping them all would store each engine's series once per replica. Scrape
`/metrics/engines` from one of them, with `honor_labels: true` (the `instance` label here names
the engine instance; without it Prometheus renames ours to `exported_instance`, as for any target).

`revision` is the number of the deployment's revision the instance serves (`stoker revisions`),
so a canary's engines and the stable ones are told apart. A label an engine already sets under one of these three names is kept as `exported_<name>`.

Bounded in time and size: every instance is read at once (at most `concurrency` connections), all
within one `timeout_s` of the scrape's start, each body within `max_instance_bytes`, all of them
within `max_total_bytes` (in target order). A slow, dead, oversized or unparsable instance is left
out and counted in the gateway's own `stoker_engine_scrapes_skipped_total{deployment,reason}`; it
never holds the scrape past `timeout_s` plus the parse. Parsing runs in a thread: ~8 ms for one
vLLM exposition (52 kB) on this 2-core machine, which the event loop that relays tokens must not pay.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from warm_pool.engine_tls import EngineTls, connector

TARGET_LABELS = ("deployment", "revision", "instance")
REVISION_DIGITS = 12
METRICS_PATH = "/metrics"
REASONS = ("timeout", "unreachable", "status", "too_big", "unparsable", "over_budget")


@dataclass(frozen=True)
class Target:
    """One instance to read: who it serves, where it is, and the key it demands."""

    deployment: str
    revision: str
    instance: str
    url: str  # base URL, e.g. http://127.0.0.1:41234
    headers: Mapping[str, str] = field(default_factory=dict, hash=False, compare=False, repr=False)

    @property
    def labels(self) -> dict[str, str]:
        return {"deployment": self.deployment, "revision": self.revision, "instance": self.instance}


def revision_of(snapshot_id: str) -> str:
    """The `revision` label of a deployment serving `snapshot_id` (see the module doc)."""
    return snapshot_id[:REVISION_DIGITS]


@dataclass(frozen=True)
class FederationLimits:
    # 2 s: an engine that cannot answer a read of its counters in 2 s has a stalled event loop, and
    # Prometheus's default scrape_timeout (10 s) leaves room for the parse after it.
    timeout_s: float = 2.0
    # One vLLM exposition is ~50 kB (a few dozen histograms of ~20 buckets); 4 MiB is 80 times that.
    max_instance_bytes: int = 4 << 20
    max_total_bytes: int = 64 << 20  # the most one answer holds: 16 instances at the cap, ~1300 typical
    concurrency: int = 32

    def __post_init__(self) -> None:
        if not (
            isinstance(self.timeout_s, int | float) and math.isfinite(self.timeout_s) and self.timeout_s > 0
        ):
            raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {self.timeout_s!r}")
        for name in ("max_instance_bytes", "max_total_bytes", "concurrency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


class Skipped(Exception):
    """An instance left out of this scrape; `reason` is one of `REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def federate(
    pages: Sequence[tuple[Target, str]], down: Iterable[Target] = ()
) -> tuple[bytes, dict[Target, str]]:
    """The merged exposition of `pages` (each instance's /metrics text), and the instances whose
    text could not be parsed (target → why). Pure: no I/O, no clock.

    Families merge by name: the first instance's HELP and TYPE stand for all; a family another
    instance types otherwise (two engine versions that disagree) is left out for that instance, not
    mislabelled. `stoker_engine_scrape_up` says, per instance, 1 if its metrics are in the answer,
    0 if not (`down`, and the unparsable).
    """
    merged: dict[str, Metric] = {}
    unparsable: dict[Target, str] = {}
    included: list[Target] = []
    for target, text in pages:
        try:
            families = list(text_string_to_metric_families(text))  # whole or nothing
        except ValueError as exc:  # the parser's only error
            unparsable[target] = str(exc).splitlines()[0] if str(exc) else "not Prometheus text"
            continue
        included.append(target)
        extra = target.labels
        for family in families:
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            elif into.type != family.type:
                continue
            for sample in family.samples:
                into.samples.append(sample._replace(labels=_relabel(sample.labels, extra)))
    up = Metric(
        "stoker_engine_scrape_up", "1 if the instance's engine metrics are in this answer, else 0.", "gauge"
    )
    for target in included:
        up.add_sample("stoker_engine_scrape_up", target.labels, 1.0)
    for target in [*down, *unparsable]:
        up.add_sample("stoker_engine_scrape_up", target.labels, 0.0)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([*merged.values(), up]))
    return generate_latest(registry), unparsable


def _relabel(labels: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    out = {(f"exported_{k}" if k in extra else k): v for k, v in labels.items()}
    out.update(extra)
    return out


class _Families:
    """A collector of metric families already built: how `generate_latest` writes them."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


class EngineFederation:
    """Reads the instances' /metrics for one scrape and federates them (`federate`)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        limits: FederationLimits | None = None,
        engine_tls: EngineTls | None = None,
    ) -> None:
        self.limits = limits or FederationLimits()
        self._tls = engine_tls  # a `warm_pool.engine_tls.EngineTls`: engines that serve HTTPS
        self._skipped = Counter(
            "stoker_engine_scrapes_skipped",
            "Instances left out of a GET /metrics/engines answer, by deployment and reason "
            "(timeout, unreachable, status, too_big, unparsable, over_budget).",
            ["deployment", "reason"],
            registry=registry,
        )
        self._session: aiohttp.ClientSession | None = None  # made in the loop, at the first scrape

    async def scrape(self, targets: Sequence[Target]) -> bytes:
        """One exposition of every target's engine metrics, within `limits` (module doc)."""
        limits = self.limits
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=connector(self._tls, limit=limits.concurrency),
                timeout=aiohttp.ClientTimeout(total=limits.timeout_s),
                auto_decompress=True,
            )
        reads = [asyncio.ensure_future(self._read(self._session, t)) for t in targets]
        if reads:
            _, late = await asyncio.wait(reads, timeout=limits.timeout_s)
            for read in late:
                read.cancel()
            await asyncio.wait(reads)
        pages: list[tuple[Target, str]] = []
        down: list[Target] = []
        budget = limits.max_total_bytes
        for target, read in zip(targets, reads, strict=True):
            try:
                if read.cancelled():
                    raise Skipped("timeout", f"no answer within {limits.timeout_s:g} s")
                text = read.result()
                if len(text) > budget:
                    raise Skipped("over_budget", f"the answer's {limits.max_total_bytes} bytes are used up")
            except Skipped as exc:
                self._skipped.labels(target.deployment, exc.reason).inc()
                down.append(target)
                continue
            budget -= len(text)
            pages.append((target, text))
        body, unparsable = await asyncio.to_thread(federate, pages, down)
        for target in unparsable:
            self._skipped.labels(target.deployment, "unparsable").inc()
        return body

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _read(self, session: aiohttp.ClientSession, target: Target) -> str:
        """The target's /metrics text; `Skipped` (with why) for anything but a 200 within the caps."""
        cap = self.limits.max_instance_bytes
        try:
            async with session.get(target.url + METRICS_PATH, headers=dict(target.headers)) as response:
                if response.status != 200:
                    raise Skipped("status", f"answered {response.status}")
                if response.content_length is not None and response.content_length > cap:
                    raise Skipped("too_big", f"{response.content_length} bytes, over {cap}")
                body = bytearray()
                async for chunk in response.content.iter_chunked(64 * 1024):
                    body += chunk
                    if len(body) > cap:
                        raise Skipped("too_big", f"over {cap} bytes")
        except TimeoutError:  # before OSError, of which it is a subclass
            raise Skipped("timeout", f"no answer within {self.limits.timeout_s:g} s") from None
        except (aiohttp.ClientError, OSError, ValueError) as exc:  # ValueError: a malformed answer
            raise Skipped("unreachable", f"{type(exc).__name__}: {exc}") from None
        return body.decode("utf-8", "replace")
