"""A LoRA adapter on the fake cluster: a base deployment's engine pod serves it, the adapter's files
read from the node's store at the path every engine pod mounts it (`--store-path`), loaded when
its first request reaches the pod through a gateway of its own.

Real processes: `stoker controller --backend kubernetes` and a `stoker gateway`; the fake API
server and kubelet share this test's event loop, so everything blocking runs in threads."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai

from snapshots import SnapshotStore, import_hf_dir
from snapshots.importer import import_adapter_dir
from tests.conftest import build_tiny_adapter
from tests.deadlines import COLD_ANSWER
from tests.kube.test_controller_e2e import ADMIN, ENV, LEASE, kubeconfig, until
from tests.platform.conftest import PlatformProcess
from tests.platform.engine.conftest import free_port


def greedy(client: openai.OpenAI, model: str) -> str:
    answer = client.completions.create(model=model, prompt="the quick brown fox", max_tokens=8, temperature=0)
    return answer.choices[0].text


async def test_an_adapter_served_by_its_bases_pod(cluster, tiny_model_dir: Path, tmp_path: Path) -> None:
    # The node's store (every fake node shares this machine's disk) holds the base and the adapter.
    store = SnapshotStore(tmp_path / "node-store")
    base_id = import_hf_dir(tiny_model_dir, store).id
    build_tiny_adapter(tiny_model_dir, tmp_path / "a1", seed=1)
    adapter_id = import_adapter_dir(tmp_path / "a1", store).id
    config = kubeconfig(tmp_path / "kubeconfig", cluster.config.get().cluster.server)
    flags = (
        "--backend", "kubernetes", "--kubeconfig", str(config), "--engine-image", "stoker:test",
        "--store-path", str(store.root), "--store", str(store.root), "--owner", "lora",
        "--lease-duration", LEASE, "--stable-window", "1",
    )  # fmt: skip
    controller = PlatformProcess(tmp_path / "ctl", free_port(), flags, extra_env=ENV, command="controller")
    started = [controller]
    try:
        await asyncio.to_thread(controller.start)
        args = ("--controller", controller.url, "--report-interval", "0.2s", "--gateway-id", "g0")
        gateway = PlatformProcess(tmp_path / "g0", free_port(), args, extra_env=ENV, command="gateway")
        await asyncio.to_thread(gateway.start)
        started.append(gateway)
        await asyncio.to_thread(gateway.deploy, "base", base_id, "--max", "1", "--idle-timeout", "600")
        made = await asyncio.to_thread(
            gateway.cli, "deploy", "a1", "--adapter", adapter_id, "--base", "base", "--json"
        )
        assert json.loads(made.stdout)["kind"] == "adapter"
        client = openai.OpenAI(
            base_url=f"{gateway.url}/v1", api_key=ADMIN, timeout=COLD_ANSWER, max_retries=0
        )
        await until(lambda: "a1" in {m.id for m in client.models.list().data}, "a1 in the gateway's table")

        # The base is at zero: a1's request is held while its pod starts, then a1 loads there.
        adapted = await asyncio.to_thread(greedy, client, "a1")
        base = await asyncio.to_thread(greedy, client, "base")
        assert adapted != base
        [pod] = [o for (p, _, _), o in list(cluster.api.store.objects.items()) if p == "pods"]
        assert pod["metadata"]["labels"]["stoker.dev/deployment"] == "base"
        loads = await asyncio.to_thread(
            gateway.metric, "stoker_adapter_loads_total", deployment="a1", base="base"
        )
        assert loads == 1
    finally:
        for p in started:
            await asyncio.to_thread(p.stop)
