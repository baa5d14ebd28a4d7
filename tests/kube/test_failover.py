"""Two controllers on the fake cluster, one leading by the Lease, the other standing by with its
watches warm; a Service sends to whichever listens (only the leader does). Under steady load
through two gateways the leader is SIGKILLed: no request is lost (the gateways route on to the
READY pod, and hold a request for a deployment at zero until the new leader starts it), and the
new leader adopts the running pod: the same pod, no start.

How long the takeover took is printed (the Lease is `LEASE`; a standby takes over once it has seen
no renewal for that long): figures, not asserts. Everything blocking runs in threads: the fake API
server, the kubelet and the Service share this event loop."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import httpx

from tests.deadlines import ENGINE_START, deadline
from tests.kube.conftest import NAMESPACE, TinyStore
from tests.kube.test_controller_e2e import ENV, LEASE, H, kubeconfig, until
from tests.kube.traffic import service
from tests.platform.conftest import PlatformProcess
from tests.platform.engine.conftest import free_port
from tests.platform.reliability_support import COMPLETE, Load, describe, lost


def chat(url: str, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=H, timeout=deadline(180))


def listening(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


async def test_the_leader_killed_under_load_loses_no_request(
    cluster, tiny_store: TinyStore, tmp_path: Path
) -> None:
    api = cluster.api
    config = kubeconfig(tmp_path / "kubeconfig", cluster.config.get().cluster.server)
    flags = (
        "--backend", "kubernetes", "--kubeconfig", str(config), "--engine-image", "stoker:test",
        "--store-path", str(tiny_store.root), "--store", str(tiny_store.root), "--owner", "ha",
        "--lease-duration", LEASE, "--stable-window", "1",
    )  # fmt: skip
    ports = [free_port(), free_port()]
    leader, standby = (
        PlatformProcess(tmp_path / f"c{i}", port, flags, extra_env=ENV, command="controller")
        for i, port in enumerate(ports)
    )
    started = [leader, standby]
    try:
        async with service(ports) as controller_url:
            await asyncio.to_thread(leader.start)
            standby.launch()
            await until(
                lambda: "watching 0 deployment resource(s)" in standby.log_tail(20000), "the standby watching"
            )
            assert not await asyncio.to_thread(listening, standby.url)  # not ready: the Service skips it
            gateways = []
            for i in range(2):
                args = ("--controller", controller_url, "--report-interval", "0.2s", "--gateway-id", f"g{i}")
                g = PlatformProcess(tmp_path / f"g{i}", free_port(), args, extra_env=ENV, command="gateway")
                await asyncio.to_thread(g.start)
                started.append(g)
                gateways.append(g)
            a, b = gateways
            common = ("--policy", "reactive", "--max", "1", "--idle-timeout", "600")
            await asyncio.to_thread(a.deploy, "chat", tiny_store.snapshot_id, "--min-warm", "1", *common)
            await asyncio.to_thread(a.deploy, "cold", tiny_store.snapshot_id, *common)  # at zero

            def warm() -> bool:
                return leader.deployments()["chat"]["instances"].get("READY") == 1

            await until(warm, "chat's min_warm instance READY")
            pods = {o["metadata"]["uid"] for (p, _, _), o in list(api.store.objects.items()) if p == "pods"}
            assert len(pods) == 1

            async with Load(
                [a.url, b.url], concurrency=1, max_tokens=2, bound_s=deadline(180), model="chat", headers=H
            ) as load:
                await load.wait_finished(5)
                killed = load.mark("leader killed")
                leader.stop(signal.SIGKILL)
                # While no controller answers: the gateways route on, and a request for the
                # deployment at zero is held until the new leader starts an instance for it.
                held = asyncio.create_task(asyncio.to_thread(chat, b.url, "cold"))
                await until(lambda: listening(standby.url), "the standby leading", within_s=ENGINE_START)
                took_over = time.monotonic() - killed
                await load.wait_finished(5, since=load.mark("standby leading"))
                cold = await held
            print(f"takeover {took_over:.2f} s after SIGKILL (lease {LEASE}); {len(load.outcomes)} answers")
            assert not lost(load.outcomes), (load.by_phase(), describe(load.outcomes))
            assert all(o.kind == COMPLETE for o in load.outcomes), load.by_phase()
            assert cold.status_code == 200, cold.text

            # The new leader adopted the READY pod: same pod, no start for it.
            def adopted() -> bool:
                return standby.deployments()["chat"]["instances"].get("READY") == 1

            await until(adopted, "chat's pod adopted")
            now = {
                o["metadata"]["uid"]
                for (p, _, _), o in list(api.store.objects.items())
                if p == "pods" and o["metadata"]["labels"].get("stoker.dev/deployment") != "cold"
            }
            assert pods <= now
            starts = await asyncio.to_thread(
                standby.metric, "stoker_instance_starts_total", deployment="chat", outcome="ready"
            )
            assert starts == 0
            lease = api.get("leases.coordination.k8s.io", NAMESPACE, "stoker-controller")
            assert lease["spec"]["leaseTransitions"] >= 1
    finally:
        for p in started:
            await asyncio.to_thread(p.stop)
