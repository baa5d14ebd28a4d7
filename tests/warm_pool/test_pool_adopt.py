"""A restarted controller's pool takes over the engines the previous one left (`Pool.adopt`): each
joins as its engine says (READY in routing, or SLEEPING), counted as no start; one that does not
answer as ours is stopped; and the loop goes on deciding afterwards."""

from __future__ import annotations

from pathlib import Path

from tests.activator.conftest import eventually
from tests.warm_pool.rig import pool_rig
from warm_pool.backends.base import Running
from warm_pool.backends.memory import MemoryBackend
from warm_pool.backends.procs import ProcessHandle
from warm_pool.policies.base import ScalingConfig
from warm_pool.reconcile import Observed


def left_running(backend: MemoryBackend, ident: str, port: int, observed: Observed) -> Running:
    handle = ProcessHandle(port, port, 1, ident)
    backend.alive.add(handle)
    url = f"http://127.0.0.1:{port}"
    backend.observed[url] = observed
    return Running(ident, "d", "snap", handle, url, f"key-{ident}", 1.7e9)


async def test_adopted_engines_join_as_they_are_and_the_loop_goes_on(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    backend = MemoryBackend()
    awake = left_running(backend, "d-aaaaaaaa", 30001, Observed.AWAKE)
    asleep = left_running(backend, "d-bbbbbbbb", 30002, Observed.ASLEEP)
    stranger = left_running(backend, "d-cccccccc", 30003, Observed.UNAUTHORIZED)
    scaling = ScalingConfig(min_warm=1, max=3, idle_timeout_s=600, stable_window_s=1)
    async with pool_rig(tmp_path, tiny_model_dir, backend, scaling=scaling) as rig:
        adopted = await rig.pool.adopt([awake, asleep, stranger])
        assert adopted == ["d-aaaaaaaa", "d-bbbbbbbb"]
        [endpoint] = rig.pool.endpoints()
        assert (endpoint.id, endpoint.url) == ("d-aaaaaaaa", awake.url)
        assert endpoint.auth_headers == {"authorization": "Bearer key-d-aaaaaaaa"}  # the recorded key
        states = {i["id"]: i["state"] for i in rig.pool.instances()}
        # The asleep one joined SLEEPING: never woken, and out of routing; the loop, poked by the
        # adoption, may already stop it as more sleepers than the policy asks for.
        assert states["d-aaaaaaaa"] == "READY" and states["d-bbbbbbbb"] in ("SLEEPING", "DRAINING")
        assert ("wake", asleep.url) not in backend.calls
        assert stranger.handle not in backend.alive  # refused our key: stopped, not adopted
        assert backend.specs == []  # nothing started
        assert rig.sample("stoker_instance_starts_total", outcome="ready") == 0
        await rig.tick(1.0)  # the loop decides on the adopted census: min_warm 1 is met
        assert rig.pool.last_decision.ready == 1
        await eventually(lambda: rig.pool.counts()["READY"] == 1)
        assert backend.specs == []
