"""TLS on the fake cluster, as the chart runs it: a real `stoker controller --backend kubernetes`
serving HTTPS, its engine pods started with a TLS Secret mounted (`--engine-tls-secret`) and
serving HTTPS on their pod address (which no certificate names: engines are verified by
`stoker-engine`), a real `stoker gateway` verifying both against the CA. A request held at zero
is served through the gateway by the pod, over TLS all the way."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import httpx
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Secret

from stoker.tls.certs import init
from tests.deadlines import deadline
from tests.kube.conftest import NAMESPACE, TinyStore
from tests.kube.test_controller_e2e import LEASE, kubeconfig
from tests.platform.engine.conftest import free_port
from tests.platform.serve.test_planes_tls import ADMIN, H, TlsProcess, tls_args


async def test_engine_pods_serve_tls_from_their_secret(
    cluster, tiny_store: TinyStore, tmp_path: Path
) -> None:
    ours = tmp_path / "tls"
    init(ours)
    engine_secret = Secret(
        metadata=ObjectMeta(name="e2e-engine-tls", namespace=NAMESPACE),
        type="kubernetes.io/tls",
        data={k: base64.b64encode((ours / k).read_bytes()).decode() for k in ("tls.crt", "tls.key")},
    )
    await cluster.client.create(engine_secret)
    config = kubeconfig(tmp_path / "kubeconfig", cluster.config.get().cluster.server)
    flags = (
        "--backend", "kubernetes", "--kubeconfig", str(config), "--engine-image", "stoker:test",
        "--store-path", str(tiny_store.root), "--store", str(tiny_store.root), "--owner", "e2e-tls",
        "--lease-duration", LEASE, "--stable-window", "1", "--stop-instances-on-exit",
        *tls_args(ours), "--engine-tls-secret", "e2e-engine-tls",
    )  # fmt: skip
    ca = ours / "ca.crt"
    env = {"STOKER_ADMIN_KEY": ADMIN, "STOKER_CA": str(ca)}  # the CLI verifies the controller with it
    controller = TlsProcess(tmp_path / "home", free_port(), flags, extra_env=env, command="controller", ca=ca)
    started = [controller]
    try:
        await asyncio.to_thread(controller.start)
        args = ("--controller", controller.url, "--report-interval", "0.2s", "--gateway-id", "g0")
        gateway = TlsProcess(
            tmp_path / "g0",
            free_port(),
            (*args, *tls_args(ours, serve=False)),
            extra_env=env,
            command="gateway",
        )
        await asyncio.to_thread(gateway.start)
        started.append(gateway)
        await asyncio.to_thread(
            controller.deploy,
            "m",
            tiny_store.snapshot_id,
            "--policy",
            "reactive",
            "--max",
            "1",
            "--idle-timeout",
            "600",
        )
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        r = await asyncio.to_thread(
            httpx.post, f"{gateway.url}/v1/chat/completions", json=body, headers=H, timeout=deadline(180)
        )
        assert r.status_code == 200, r.text
        [pod] = [
            o
            for (plural, ns, _), o in list(cluster.api.store.objects.items())
            if (plural, ns) == ("pods", NAMESPACE)
        ]
        container = pod["spec"]["containers"][0]
        assert container["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
        assert {"name": "engine-tls", "mountPath": "/etc/stoker/engine-tls", "readOnly": True} in container[
            "volumeMounts"
        ]
        table = (await asyncio.to_thread(controller.get, "/cluster/v1/routes", gateway="probe")).json()
        [unit] = table["deployments"]["m"]["units"].values()
        [endpoint] = unit["endpoints"]
        assert endpoint["url"] == f"https://{pod['status']['podIP']}:8000"
        assert pod["status"]["podIP"] != "127.0.0.1"  # an address the certificate does not name
    finally:
        for p in reversed(started):
            await asyncio.to_thread(p.stop)
