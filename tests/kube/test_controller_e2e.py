"""End to end on the fake cluster (`conftest.py`: the fake API server and kubelet in this process):
a real `stoker controller --backend kubernetes` process and two real `stoker gateway`s.

deploy → a request held at zero → a pod (labelled, its key in a Secret) → READY → served through
either gateway; the controller SIGKILLed → the gateways route on; a new controller waits out the
Lease, then adopts the running pod (same pod, no new one, no start); a gateway killed → the other
serves; scale to zero → the pod deleted, its Secret with it. On the way, a tenant key made with the
CLI is a Secret holding the key's hash (never the key) and answers through a gateway.

Everything blocking (process starts, the CLI, HTTP) runs in threads: the fake API server and the
kubelet share this event loop."""

from __future__ import annotations

import asyncio
import base64
import json
import signal
import time
from pathlib import Path

import httpx
import yaml

from tests.deadlines import ENGINE_START, deadline, flag
from tests.kube.conftest import NAMESPACE, TOKEN, TinyStore
from tests.platform.conftest import PlatformProcess
from tests.platform.engine.conftest import free_port

ADMIN = "admin-key-e2e"
# The controller's Lease, renewed every third of it. Short, so that a new controller takes over soon
# after the old one is killed; scaled, because a controller on a loaded machine (a vLLM start beside
# it, the fake API server sharing the test's event loop) that cannot renew in time steps down and
# exits, as it should, and then nothing answers the requests it held.
LEASE = flag(6)
ENV = {"STOKER_ADMIN_KEY": ADMIN}
H = {"authorization": f"Bearer {ADMIN}"}


def kubeconfig(path: Path, server: str) -> Path:
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": {"server": server}}],
        "users": [{"name": "ctl", "user": {"token": TOKEN}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "ctl", "namespace": NAMESPACE}}],
        "current-context": "fake",
    }
    path.write_text(yaml.safe_dump(doc))
    path.chmod(0o600)
    return path


def chat(url: str, key: str = ADMIN) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=deadline(180))


async def until(condition, what: str, within_s: float = ENGINE_START) -> None:
    end = time.monotonic() + within_s
    while not await asyncio.to_thread(condition):
        if time.monotonic() > end:
            raise TimeoutError(f"{what}: not within {within_s:g} s")
        await asyncio.sleep(0.2)


async def test_instances_as_pods_end_to_end(cluster, tiny_store: TinyStore, tmp_path: Path) -> None:
    api = cluster.api
    config = kubeconfig(tmp_path / "kubeconfig", cluster.config.get().cluster.server)
    flags = (
        "--backend", "kubernetes", "--kubeconfig", str(config), "--engine-image", "stoker:test",
        "--store-path", str(tiny_store.root), "--store", str(tiny_store.root), "--owner", "e2e",
        "--lease-duration", LEASE, "--stable-window", "1", "--stop-instances-on-exit",
    )  # fmt: skip
    home = tmp_path / "home"
    controller = PlatformProcess(home, free_port(), flags, extra_env=ENV, command="controller")
    started = [controller]
    try:
        await asyncio.to_thread(controller.start)
        gateways = []
        for i in range(2):
            args = ("--controller", controller.url, "--report-interval", "0.2s", "--gateway-id", f"g{i}")
            g = PlatformProcess(tmp_path / f"g{i}", free_port(), args, extra_env=ENV, command="gateway")
            await asyncio.to_thread(g.start)
            started.append(g)
            gateways.append(g)
        a, b = gateways

        def pods(*, deleting: bool = False) -> list[dict]:
            return [
                o
                for (plural, ns, _), o in list(api.store.objects.items())
                if (plural, ns) == ("pods", NAMESPACE)
                and (deleting or "deletionTimestamp" not in o["metadata"])
            ]

        # Deploy through a gateway; nothing runs until the first request, which is held.
        await asyncio.to_thread(
            a.deploy,
            "m",
            tiny_store.snapshot_id,
            "--policy",
            "reactive",
            "--max",
            "1",
            "--idle-timeout",
            "600",
        )
        assert pods() == []
        r = await asyncio.to_thread(chat, b.url)
        assert r.status_code == 200, r.text
        [pod] = pods()
        instance = r.headers["x-stoker-instance"]
        assert pod["metadata"]["name"] == instance
        assert pod["metadata"]["labels"]["stoker.dev/owner"] == "e2e"
        assert api.get("secrets", NAMESPACE, f"{instance}-key") is not None
        [key_env] = [e for e in pod["spec"]["containers"][0]["env"] if e["name"] == "STOKER_ENGINE_API_KEY"]
        assert "value" not in key_env and key_env["valueFrom"]["secretKeyRef"]["name"] == f"{instance}-key"
        assert (await asyncio.to_thread(chat, a.url)).headers["x-stoker-instance"] == instance

        # A tenant key made with the CLI is a Secret holding its hash, and answers through a gateway.
        made = await asyncio.to_thread(
            controller.cli, "keys", "create", "--tenant", "acme", "--deployment", "m", "--json"
        )
        tenant = json.loads(made.stdout)
        secret = api.get("secrets", NAMESPACE, "stoker-key-" + tenant["id"].removeprefix("key_"))
        assert secret is not None and secret["metadata"]["labels"]["stoker.dev/key"] == "true"
        stored = json.dumps(list(api.store.objects.values()))
        assert tenant["key"] not in stored and base64.b64encode(tenant["key"].encode()).decode() not in stored
        await until(lambda: chat(b.url, tenant["key"]).status_code == 200, "the tenant key served", 30)

        # The controller dies: the gateways route on to the pod.
        controller.stop(signal.SIGKILL)
        assert (await asyncio.to_thread(chat, a.url)).status_code == 200
        # A new controller waits out the Lease, then adopts the pod: no new pod, no start.
        again = PlatformProcess(home, controller.port, flags, extra_env=ENV, command="controller")
        await asyncio.to_thread(again.start)
        started.append(again)

        def adopted() -> bool:
            d = again.deployments()["m"]
            return d["instances"]["READY"] == 1

        await until(adopted, "the pod adopted")
        [listed] = (await asyncio.to_thread(again.deployments))["m"]["instance_list"]
        assert listed["id"] == instance and listed["runs_as"] == f"pod {NAMESPACE}/{instance}"
        [same] = pods()
        keys = await asyncio.to_thread(again.admin_get, "/admin/v1/keys")  # read from its Secret
        assert [k["id"] for k in keys["data"]] == [tenant["id"]]
        assert same["metadata"]["uid"] == pod["metadata"]["uid"]
        starts = await asyncio.to_thread(
            again.metric, "stoker_instance_starts_total", deployment="m", outcome="ready"
        )
        assert starts == 0
        # `stoker logs` reads the pod's log through the API; following it is kubectl's.
        logs = await asyncio.to_thread(again.cli, "logs", "m", "--instance", instance, "--tail", "50")
        assert "ready: serving 'm'" in logs.stdout, logs.stdout
        follow = await asyncio.to_thread(again.cli, "logs", "m", "--follow", check=False)
        assert follow.returncode == 1 and f"kubectl logs -f {instance} -c engine" in follow.stderr, (
            follow.stderr
        )
        lease = api.get("leases.coordination.k8s.io", NAMESPACE, "stoker-controller")
        assert lease["spec"]["leaseTransitions"] >= 1
        # Its checkpoints are the API server's, not a volume's: read from their ConfigMaps (none
        # yet: the first controller was killed before it wrote any), never from the data dir.
        read = {c.attrs.name for c in api.calls if (c.attrs.resource, c.attrs.verb) == ("configmaps", "get")}
        assert read >= {"stoker-checkpoint-cost", "stoker-checkpoint-history", "stoker-checkpoint-policies"}
        assert not (home / "checkpoints").exists()

        # A gateway killed: the other one serves.
        a.stop(signal.SIGKILL)
        assert (await asyncio.to_thread(chat, b.url)).status_code == 200

        # Scale to zero: the pod goes, and its Secret with it.
        await asyncio.to_thread(
            b.deploy, "m", tiny_store.snapshot_id, "--policy", "reactive", "--max", "1", "--idle-timeout", "1"
        )
        await until(lambda: pods(deleting=True) == [], "the pod deleted")
        await until(lambda: api.get("secrets", NAMESPACE, f"{instance}-key") is None, "its Secret deleted")
    finally:
        for p in started:
            await asyncio.to_thread(p.stop)
