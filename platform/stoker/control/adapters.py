"""LoRA adapters as deployments of their own, served on a base deployment's instances.

    stoker deploy a1 --adapter ./my-lora --base smollm2
      a1 ─── revisions, split, keys, metrics, request log: its own ──▶ requests for `a1`
      └─ served by smollm2's instances: the base's activator picks one holding a1 (its affinity
         key, within the load bound) or the least loaded, loads a1 there first
         (`activator.adapters`), and the base's scaler sees a1's requests as its own demand

An adapter deployment has no pool: nothing of its own starts, sleeps or scales. At zero it is its
base at zero: a request is held like any request while the base starts, then the adapter loads.
Its arrivals are named to its base's pool, whose predictive policy forecasts each adapter on its
own (`warm_pool.policies.adapter_forecast`): the adapters it expects a request for soon are loaded
ahead onto the instance that request would go to (`prefetch`), and the base is kept READY for one
where that is worth it. Each load the base's instances make times the pool's adapter tier.
The engine knows the primary revision by the deployment's name (so answers say `"model": "a1"`)
and another revision as `a1@N`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from activator.adapters import AdapterRef, Adapters, Prefetcher
from activator.affinity import Balance
from stoker.control.models import resolve_model
from stoker.errors import APIError, invalid
from stoker.gateway.adapters import AdapterMetrics, adapter_ref, serve_on_base
from stoker.gateway.revisions import RevisionStats, pick_revision
from stoker.spec.deployment import DeploymentSpec
from stoker.spec.traffic import parse_traffic
from warm_pool.engine_settings import ADAPTER_RANKS, DEFAULT_MAX_ADAPTERS, MAX_LORA_RANK


def engine_name(spec: DeploymentSpec, primary: int) -> str:
    """What the engine calls a revision of the adapter: the primary by the deployment's name."""
    return spec.name if spec.revision == primary else f"{spec.name}@{spec.revision}"


@dataclass
class AdapterDeployment:
    """One adapter deployment as it runs: its revisions that have traffic, and the split."""

    name: str
    latest: DeploymentSpec
    revisions: dict[int, DeploymentSpec]  # those the split names
    traffic: dict[int, int]
    stats: RevisionStats
    path_of: Callable[[str], str]  # a snapshot's directory on the instances' machine
    base_of: Callable[[str], Any]  # a model deployment by name (the platform's)
    clock: Callable[[], float] = time.monotonic
    notes: dict[int, str] = field(default_factory=dict)

    @property
    def primary(self) -> int:
        return max(self.traffic, key=lambda r: (self.traffic[r], r))

    @property
    def spec(self) -> DeploymentSpec:
        return self.revisions[self.primary]

    def ref(self, revision: int) -> AdapterRef:
        spec = self.revisions[revision]
        return adapter_ref(engine_name(spec, self.primary), self.path_of(spec.snapshot_id), spec.snapshot_id)

    async def serve(self, scope, receive, send, body: bytes, parsed: dict, stream: bool, owner: str) -> None:
        """One request: the adapter's revision by its split, on the base's revision by the base's."""
        revision = pick_revision(self.name, self.traffic, self.revisions, scope, parsed)
        base = self.base_of(self.revisions[revision].base)
        if base is None:
            raise APIError(503, f"The base of {self.name!r} is gone.", code="base_gone")
        request = (scope, receive, send, body, parsed, stream, owner)
        await serve_on_base(self.name, revision, self.ref(revision), base, self.stats, self.clock, request)

    def routed(self) -> dict[str, Any]:
        """What a gateway of its own serves it by (`stoker.gateway.adapters.RemoteAdapters`)."""
        revisions = {}
        for r, spec in self.revisions.items():
            ref = self.ref(r)
            revisions[str(r)] = {
                "snapshot_id": spec.snapshot_id,
                "base": spec.base,
                "path": ref.path,
                "engine_name": ref.name,
                "log_requests": spec.log_requests,
                "log_content": spec.log_content,
            }
        return {"traffic": {str(r): p for r, p in self.traffic.items()}, "revisions": revisions}

    def describe(self) -> dict[str, Any]:
        spec = self.spec
        return {
            **spec.to_dict(),
            "kind": "adapter",
            "latest_revision": self.latest.revision,
            "traffic": {str(r): p for r, p in sorted(self.traffic.items())},
            "instances": {},
            "instance_list": [],
            "decision": None,
            "unavailable": None,
            "failed_starts": 0,
            "last_failure": None,
        }


class AdapterDeployments:
    """The platform's adapter deployments: deployed, restored, split, rolled back and removed here;
    served through their bases' activators. `platform`: the `Platform` (its registry, store and
    base deployments)."""

    def __init__(self, platform: Any, registry: CollectorRegistry) -> None:
        self._p = platform
        self._by_name: dict[str, AdapterDeployment] = {}
        self.metrics = AdapterMetrics(registry)
        self._prefetching: dict[tuple[int, str], asyncio.Future] = {}  # (prefetcher, adapter): under way

    def get(self, name: str) -> AdapterDeployment | None:
        return self._by_name.get(name)

    def list(self) -> list[AdapterDeployment]:
        return list(self._by_name.values())

    def on(self, base: str) -> list[str]:
        """The adapters that run on deployment `base`."""
        return sorted(n for n, a in self._by_name.items() if a.latest.base == base)

    def _path(self, snapshot_id: str) -> str:
        """Where the base's instances read an adapter's files: this machine's store, or on the
        Kubernetes backend the node's, mounted in every engine pod at the same path."""
        store_path = getattr(getattr(self._p.backend, "settings", None), "store_path", None)
        if store_path is not None:
            return f"{store_path.rstrip('/')}/{snapshot_id}"
        return str(self._p.store.path_of(snapshot_id))

    def _make(
        self, latest: DeploymentSpec, revisions: dict[int, DeploymentSpec], traffic: dict[int, int]
    ) -> AdapterDeployment:
        a = AdapterDeployment(
            latest.name,
            latest,
            revisions,
            traffic,
            RevisionStats(latest.name, self._p.revision_metrics, self._p.clock),
            self._path,
            self._p.base,
            self._p.clock,
        )
        self._by_name[latest.name] = a
        self._p.cost.adapter(latest.name, latest.base)
        return a

    def listen(self, activator: Any, base: str, pool: Any) -> None:
        """Count and time the loads `base`'s activator makes, price them to their adapters, and
        let the revision's `pool` learn its adapter tier from them; the adapters its policy expects
        are loaded ahead by the activator's prefetcher."""

        def loaded(engine_name: str, seconds: float) -> None:
            self.loaded(engine_name, seconds)
            pool.adapter_loaded(seconds)

        self.metrics.listen(activator, base, also=loaded)
        self.attach(pool, base, activator.prefetcher)

    def listen_remote(
        self, pool: Any, base: str, load: Callable[[], Any], session: Callable[[], Any]
    ) -> None:
        """In a controller (gateways hold the activators, and report their loads: `loaded`): the
        adapters `pool`'s policy expects are loaded ahead by the controller itself, onto the pool's
        READY instances by the gateways' reported `load` (a `Load`); a gateway whose request then
        finds the adapter there sees it listed with its directory and does not load it again."""

        def loaded(engine_name: str, seconds: float) -> None:
            self.loaded(engine_name, seconds)
            pool.adapter_loaded(seconds)

        adapters = Adapters(session, self.metrics.counter(base, loaded))
        prefetcher = Prefetcher(adapters, pool.endpoints, lambda: load().outstanding, lambda: Balance.bound)
        self.attach(pool, base, prefetcher)

    def attach(self, pool: Any, base: str, prefetcher: Prefetcher) -> None:
        """The adapters `pool`'s policy expects a request for (`Decision.adapters`), loaded ahead
        by `prefetcher`: the activator's in one process, the controller's where gateways serve."""
        pool.on_adapters = lambda names: self.prefetch(base, prefetcher, names)

    def prefetch(self, base: str, prefetcher: Prefetcher, names: tuple[str, ...]) -> None:
        """Load each of `names` (adapter deployments on `base`; others are ignored) where its next
        request would go, in the background: at most one load under way per adapter and prefetcher,
        and no more adapters than an instance of the base keeps (`max_adapters`), so that a
        prefetch never evicts another one it made."""
        d = self._p.base(base)
        if d is None:
            return
        room = d.spec.engine_settings.max_adapters or DEFAULT_MAX_ADAPTERS
        for name in names[:room]:
            a = self._by_name.get(name)
            k = (id(prefetcher), name)
            if a is None or a.spec.base != base or k in self._prefetching:
                continue
            task = asyncio.ensure_future(prefetcher.prefetch(a.ref(a.primary)))
            self._prefetching[k] = task
            task.add_done_callback(lambda t, k=k: self._prefetched(k, t))

    def _prefetched(self, k: tuple[int, str], task: asyncio.Future) -> None:
        self._prefetching.pop(k, None)
        if not task.cancelled() and task.exception() is None and task.result() is not None:
            self.metrics.prefetches.labels(k[1]).inc()

    def loaded(self, engine_name: str, seconds: float) -> None:
        """One load of an adapter (by the engine's name for it: `a1`, the primary, or `a1@3`) on
        an instance of its base, here or on a gateway of its own: priced to the adapter. One of a
        revision it does not have (a gateway's stale or crafted report) is dropped."""
        name, _, revision = engine_name.partition("@")
        if (a := self._by_name.get(name)) is not None:
            rev = int(revision) if revision else a.primary
            if self.has_revision(name, rev):
                self._p.cost.adapter_loaded(name, rev, seconds)

    def has_revision(self, name: str, revision: int) -> bool:
        """Whether adapter deployment `name` has had `revision` (what its cost may be counted under)."""
        a = self._by_name.get(name)
        return a is not None and 1 <= revision <= a.latest.revision

    def restore(self, spec: DeploymentSpec, latest: DeploymentSpec) -> None:
        """One revision that served, brought back at start (its base restored before it)."""
        a = self._by_name.get(spec.name) or self._make(latest, {}, {})
        a.revisions[spec.revision] = spec
        a.traffic = {r: p for r, p in self._p.registry.traffic(spec.name).items() if p}

    def check_free(self, name: str) -> None:
        """A model's deploy under an adapter's name: 409."""
        if name in self._by_name:
            raise APIError(
                409,
                f"{name!r} is an adapter's deployment; deploy it with --adapter and --base.",
                param="name",
                code="name_taken",
            )

    def check_unused(self, base: str) -> None:
        """A base's removal while adapters run on it: 409 naming them."""
        if on := self.on(base):
            raise APIError(
                409,
                f"Adapter deployment(s) {', '.join(on)} run on {base!r}; remove them first.",
                param="name",
                code="base_in_use",
            )

    def check_serves(self, fields: dict[str, Any]) -> None:
        """A new revision of a base that could not serve the adapters running on it (vLLM without
        `max_adapters`, or a `max_adapter_rank` below one's rank): 409 naming them, before anything
        changes."""
        from snapshots.adapter import adapter_info

        serves = fields["engine"] != "vllm" or fields.get("max_adapters") is not None
        serves = serves and fields.get("task", "generate") == "generate"
        if not serves and (on := self.on(fields["name"])):
            raise APIError(
                409,
                f"Adapter deployment(s) {', '.join(on)} run on {fields['name']!r}, and this revision would "
                "serve none (an embedding one, or vLLM without --max-adapters N): remove them first, or "
                "deploy it with --task generate and --max-adapters N.",
                param="max_adapters",
                code="base_in_use",
            )
        rank = fields.get("max_adapter_rank") or MAX_LORA_RANK
        ranks = {
            n: adapter_info(self._p.store.path_of(self._by_name[n].spec.snapshot_id)).rank
            for n in self.on(fields["name"])
        }
        if over := sorted(n for n, r in ranks.items() if r > rank):
            raise APIError(
                409,
                f"Adapter deployment(s) {', '.join(f'{n} (rank {ranks[n]})' for n in over)} run on "
                f"{fields['name']!r}, whose new revision would load ranks up to {rank} only: deploy it with "
                f"--max-adapter-rank {next(r for r in ADAPTER_RANKS if r >= max(ranks[n] for n in over))}, or remove "
                "them first.",
                param="max_adapter_rank",
                code="base_in_use",
            )

    async def deploy(self, fields: dict[str, Any], canary: int | None) -> tuple[DeploymentSpec, bool]:
        """A new revision of the adapter deployment (creating it): all of the traffic at once, or the
        canary's share. Nothing warms: each instance loads it at its first request."""
        if self._p.base(fields["name"]) is not None:
            raise APIError(
                409,
                f"{fields['name']!r} is a model's deployment; an adapter needs a name of its own.",
                param="name",
                code="name_taken",
            )
        snapshot_id = await resolve_model(self._p.store, fields["model"], "adapter")
        base = self._p.get(fields["base"])
        if base is None:
            raise APIError(
                400,
                f"'base': no model deployment named {fields['base']!r} to serve the adapter on.",
                param="base",
            )
        self._check(fields, base, snapshot_id)
        spec = DeploymentSpec.from_dict({**fields, "snapshot_id": snapshot_id, "engine": base.spec.engine})
        current = self._by_name.get(spec.name)
        if current is None:
            spec = await self._p.registry.put(spec)
            self._make(spec, {spec.revision: spec}, {spec.revision: 100})
            self._p.routes.bump()
            return spec, True
        spec = await self._p.registry.create_revision(spec)
        current.latest = spec
        self._p.cost.adapter(spec.name, spec.base)
        current.revisions[spec.revision] = spec
        if canary is None or canary == 100:
            self.publish(current, {spec.revision: 100})
        else:
            rest = {current.primary: 100 - canary}
            self.publish(current, {**rest, spec.revision: canary})
        return spec, False

    def _check(self, fields: dict[str, Any], base: Any, snapshot_id: str) -> None:
        """Refuse what the base cannot serve: a vLLM base deployed without `max_adapters` (vLLM
        serves adapters only with --enable-lora), an adapter of a rank above the engines' limit, or
        an adapter made for another base model."""
        from snapshots.adapter import adapter_info, base_mismatch

        if base.spec.engine_settings.task != "generate":
            raise APIError(
                400,
                f"'base': {base.name!r} is an embedding deployment (task {base.spec.engine_settings.task}); "
                "LoRA adapters run on a base that generates.",
                param="base",
                code="adapter_engine",
            )
        if base.spec.engine == "vllm" and base.spec.engine_settings.max_adapters is None:
            raise APIError(
                400,
                f"'base': {base.name!r} runs on vLLM without adapters; deploy it again with "
                "--max-adapters N (the 'max_adapters' setting: vLLM's --enable-lora --max-loras N).",
                param="base",
                code="adapter_engine",
            )
        store = self._p.store
        try:
            info = adapter_info(store.path_of(snapshot_id))
        except Exception as exc:  # not an adapter snapshot at all
            raise APIError(
                400, f"'adapter': {fields['model']!r} is no LoRA adapter: {exc}", param="adapter"
            ) from None
        rank = base.spec.engine_settings.adapter_rank
        if info.rank > rank:
            larger = next((r for r in ADAPTER_RANKS if r >= info.rank), None)
            fix = f" (deploy {base.name!r} again with --max-adapter-rank {larger})" if larger else ""
            raise APIError(
                400,
                f"'adapter' {fields['model']!r} has rank {info.rank}; the instances of {base.name!r} load "
                f"LoRA adapters of rank {rank} at most{fix}.",
                param="adapter",
                code="adapter_rank",
            )
        config = json.loads((store.path_of(base.spec.snapshot_id) / "config.json").read_text())
        if (why := base_mismatch(info, config)) is not None:
            raise APIError(
                400,
                f"'adapter' {fields['model']!r} does not fit base {base.name!r} ({base.spec.model}): {why}",
                param="adapter",
                code="adapter_base_mismatch",
            )

    def publish(self, a: AdapterDeployment, traffic: dict[int, int]) -> None:
        a.traffic = dict(traffic)
        for r in traffic:
            if r not in a.revisions and (spec := self._p.registry.revision(a.name, r)) is not None:
                a.revisions[r] = spec
        self._p.registry.set_traffic(a.name, a.traffic)
        self._p.revision_metrics.set_traffic(a.name, a.traffic, sorted({*a.revisions, *a.traffic}))
        self._p.routes.bump()

    def split(self, a: AdapterDeployment, body: object) -> None:
        """`stoker traffic` for an adapter: at once (nothing to warm)."""
        self.publish(
            a, parse_traffic(body, {spec.revision for spec, _ in self._p.registry.revisions(a.name)})
        )

    def rollback(self, a: AdapterDeployment, to: int | None) -> DeploymentSpec:
        """Back to revision `to` (default: the newest before the primary), at once."""
        known = {spec.revision: spec for spec, _ in self._p.registry.revisions(a.name)}
        if to is not None:
            if isinstance(to, bool) or not isinstance(to, int) or to not in known:
                raise invalid(f"'to' must be one of the revisions {sorted(known)}, got {to!r}.", "to")
            target = known[to]
        else:
            earlier = [r for r in known if r < a.primary]
            if not earlier:
                raise APIError(
                    409,
                    f"Deployment {a.name!r} has no revision before {a.primary} to roll back to.",
                    param="to",
                    code="no_previous_revision",
                )
            target = known[max(earlier)]
        self.publish(a, {target.revision: 100})
        return target

    def revision_rows(self, a: AdapterDeployment) -> list[dict[str, Any]]:
        return [
            {
                "revision": spec.revision,
                "snapshot_id": spec.snapshot_id,
                "model": spec.model,
                "engine": spec.engine,
                "traffic_percent": a.traffic.get(spec.revision, 0),
                "state": "serving" if a.traffic.get(spec.revision) else "retired",
                "ready": 0,
                "created": created,
                "settings": {"base": spec.base},
            }
            for spec, created in self._p.registry.revisions(a.name)
        ]

    async def remove(self, name: str) -> DeploymentSpec:
        a = self._by_name.pop(name)
        await self._p.registry.delete(name)
        self._p.routes.bump()
        return a.spec
