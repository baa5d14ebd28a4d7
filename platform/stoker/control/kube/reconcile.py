"""The controller's reconcile loop on a cluster: each StokerDeployment's spec made true, and what
the platform does written back into its status.

    StokerDeployment changed ──queue (one name at a time)──▶ reconcile(name)
      gone, or being deleted (finalizer held) ──▶ Platform.remove: drained, let go (the resource goes)
      its spec                                ──▶ Platform.apply: a new revision unless the newest
                                                  already is that spec (warmed before the switch,
                                                  as `stoker deploy` does); refused: Ready=False
                                                  with the refusal's code and message
    status loop (every `status_interval_s`, and at once on a new split):
      observedGeneration, revision, traffic, ready, asleep, lastReason, conditions Ready, RolledOut

A `stoker deploy` through the admin API writes the resource itself (`ResourceRegistry`); its event
comes back here and finds the newest revision already is its spec: nothing more is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from stoker.control.kube.registry import ResourceRegistry, terminating
from stoker.errors import APIError
from stoker.spec.resources import from_resource

log = logging.getLogger("stoker.kube")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that turns `old` into `new`: a key gone is null."""
    patch: dict[str, Any] = {}
    for key in old.keys() - new.keys():
        patch[key] = None
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, dict) and isinstance(before, dict):
            inner = merge_patch(before, value)
            if inner:
                patch[key] = inner
        elif value != before:
            patch[key] = value
    return patch


class Reconciler:
    def __init__(
        self,
        platform: Any,  # `stoker.control.platform.Platform`
        registry: ResourceRegistry,
        *,
        name_taken: Callable[[str], APIError | None] = lambda name: None,
        status_interval_s: float = 1.0,
        retry_s: float = 1.0,
    ) -> None:
        self._p, self._registry = platform, registry
        self._name_taken = name_taken
        self._interval, self._retry = status_interval_s, retry_s
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._queued: set[str] = set()
        self._observed: dict[str, tuple[int, APIError | None]] = {}  # generation handled, and its refusal
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def changed(self, name: str) -> None:
        """A StokerDeployment changed or went (the registry's mirror calls this)."""
        if name not in self._queued:
            self._queued.add(name)
            self._queue.put_nowait(name)
        self._wake.set()

    def traffic_changed(self, name: str) -> None:
        self._wake.set()

    def start(self) -> None:
        for name in [*self._registry.deployments.objects, *(d.name for d in self._p.list())]:
            self.changed(name)
        self._tasks = [
            asyncio.create_task(self._work(), name="reconcile"),
            asyncio.create_task(self._statuses(), name="reconcile-status"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    async def _work(self) -> None:
        while True:
            name = await self._queue.get()
            self._queued.discard(name)
            try:
                await self.reconcile(name)
            except Exception:  # the API server unreachable, a bug: try again, never stop the loop
                log.exception("reconciling deployment %s; again in %g s", name, self._retry)
                asyncio.get_running_loop().call_later(self._retry, self.changed, name)

    async def reconcile(self, name: str) -> None:
        obj = self._registry.deployments.get(name)
        running = self._p.get(name)
        if obj is None or terminating(obj):
            self._observed.pop(name, None)
            if running is not None:
                log.info("deployment %s deleted: draining its instances", name)
                await self._p.remove(name)  # the registry lets the resource go once drained
            elif obj is not None:
                await self._registry.delete(name)
            return
        await self._registry.hold(name)
        generation = obj["metadata"].get("generation", 0)
        if running is not None and self._observed.get(name, (None,))[0] == generation:
            return
        try:
            done = await self._p.apply(from_resource(name, obj.get("spec") or {}), self._name_taken)
        except APIError as exc:
            log.warning("deployment %s generation %d refused: %s", name, generation, exc.message)
            self._observed[name] = (generation, exc)
        else:
            if done is not None:
                log.info("deployment %s generation %d: revision %d", name, generation, done.revision)
            self._observed[name] = (generation, None)
        self._wake.set()

    # ---- the status ------------------------------------------------------------------------------

    async def _statuses(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._interval)
            self._wake.clear()
            for name, obj in list(self._registry.deployments.objects.items()):
                if terminating(obj):
                    continue
                old = obj.get("status") or {}
                new = self.status_of(name, old)
                patch = merge_patch(old, new)
                if not patch:
                    continue
                try:
                    await self._registry.write_status(name, patch)
                except Exception as exc:  # the next round tries again
                    log.warning("status of deployment %s not written: %s", name, exc)
                    continue
                obj["status"] = new  # until the watch brings the stored one
                self._registry.traffic_written(name, {int(k): v for k, v in new.get("traffic", {}).items()})

    def status_of(self, name: str, old: dict[str, Any]) -> dict[str, Any]:
        """The status as the platform has it now; a condition that did not change keeps its time."""
        d = self._p.get(name)
        generation, refusal = self._observed.get(name, (None, None))
        status: dict[str, Any] = {}
        if generation is not None:
            status["observedGeneration"] = generation
        conditions = []
        if d is None:
            reason = _refusal(refusal) if refusal is not None else "NotDeployed"
            message = refusal.message if refusal is not None else "not deployed yet"
            status |= {"ready": 0, "asleep": 0, "lastReason": message}
            conditions.append(("Ready", "False", _reason(reason), message))
        else:
            counts: dict[str, int] = {}
            for pool in d.pools():
                for state, n in pool.counts().items():
                    counts[state] = counts.get(state, 0) + n
            traffic = {str(r): p for r, p in sorted(d.traffic.items())}
            status |= {
                "revision": d.spec.revision,
                "traffic": traffic,
                "trafficSummary": ",".join(f"{r}={p}%" for r, p in traffic.items()),
                "ready": counts.get("READY", 0),
                "asleep": counts.get("SLEEPING", 0),
            }
            unavailable = d.pool.unavailable or (d.demand.unavailable if d.demand is not None else None)
            decision = d.pool.last_decision
            if refusal is not None:
                conditions.append(("Ready", "False", _reason(_refusal(refusal)), refusal.message))
                status["lastReason"] = refusal.message
            elif unavailable:
                conditions.append(("Ready", "False", "StartFailing", unavailable))
                status["lastReason"] = unavailable
            else:
                idle = status["ready"] == 0
                conditions.append(
                    (
                        "Ready",
                        "True",
                        "ScaledToZero" if idle else "Serving",
                        "no instance runs: the first request starts one"
                        if idle
                        else f"{status['ready']} READY",
                    )
                )
                status["lastReason"] = decision.reason if decision is not None else "deployed"
            latest = d.latest.revision
            warming = sorted(r for r, note in d.notes.items() if note == "warming")
            note = d.notes.get(latest)
            if warming:
                message = f"revision {warming[-1]} warming before the switch"
                conditions.append(("RolledOut", "False", "Warming", message))
            elif note is not None:
                conditions.append(
                    ("RolledOut", "False", _reason(note.split(":")[0]), f"revision {latest} {note}")
                )
            elif d.traffic.get(latest):
                conditions.append(
                    ("RolledOut", "True", "RolledOut", f"revision {latest} serves {d.traffic[latest]}%")
                )
            else:  # `stoker rollback` or `stoker traffic` put the split elsewhere
                split = ", ".join(f"revision {r} {p}%" for r, p in sorted(d.traffic.items()))
                conditions.append(("RolledOut", "True", "Pinned", f"{split}; the newest, {latest}, has none"))
        before = {c["type"]: c for c in old.get("conditions") or []}
        status["conditions"] = [
            {
                "type": kind,
                "status": value,
                "reason": reason,
                "message": message[:32768],
                "lastTransitionTime": (
                    before[kind]["lastTransitionTime"]
                    if kind in before
                    and before[kind].get("status") == value
                    and "lastTransitionTime" in before[kind]
                    else _now()
                ),
                **({"observedGeneration": generation} if generation is not None else {}),
            }
            for kind, value, reason, message in conditions
        ]
        if "lastReason" in status:
            status["lastReason"] = str(status["lastReason"])[:1024]
        return status


def _refusal(exc: APIError) -> str:
    """What a refused spec's Ready condition gives as its reason: the error's code, else its kind."""
    return exc.code or ("InvalidSpec" if exc.status == 400 else "Refused")


def _reason(text: str) -> str:
    """A condition's reason: CamelCase, as Kubernetes spells them (`rolled back` → `RolledBack`)."""
    words = "".join(c if c.isalnum() else " " for c in text).split()
    return "".join(w[:1].upper() + w[1:] for w in words) or "Unknown"
