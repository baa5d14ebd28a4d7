"""GitOps on the fake cluster, with no Stoker CLI: the StokerDeployment of docs/guide/gitops.md is
applied (the HTTP calls `kubectl apply` makes), applied again with another model under load
through two gateways (every answer 200: the new revision warms before traffic moves), and deleted
(its finalizer holds the delete until the controller has drained it).

A real `stoker controller --backend kubernetes` and two real `stoker gateway`s; the fake API server
and kubelet share this test's event loop, so everything blocking runs in threads."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from pathlib import Path

import httpx
import yaml

from snapshots import SnapshotStore, import_hf_dir
from tests.conftest import REPO
from tests.deadlines import deadline
from tests.kube.conftest import NAMESPACE
from tests.kube.test_controller_e2e import ENV, LEASE, H, kubeconfig, until
from tests.platform.conftest import PlatformProcess
from tests.platform.engine.conftest import free_port
from tests.platform.reliability_support import COMPLETE, Load, describe, lost

PAGE = REPO / "docs" / "guide" / "gitops.md"
DEPLOYMENTS = f"/apis/stoker.dev/v1alpha1/namespaces/{NAMESPACE}/stokerdeployments"
MERGE = {"Content-Type": "application/merge-patch+json"}


def documented() -> dict:
    """The page's first YAML block: what the user applies."""
    [block, *_] = re.findall(r"```yaml\n(.*?)```", PAGE.read_text(), re.S)
    return yaml.safe_load(block)


def two_models(tiny_model_dir: Path, root: Path) -> SnapshotStore:
    """The node's store with the page's two models: the tiny one, and it again with other bytes."""
    store = SnapshotStore(root)
    import_hf_dir(tiny_model_dir, store, name="tiny-chat")
    other = root.parent / "tiny-v2"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "stoker_test_revision": 2}))
    import_hf_dir(other, store, name="tiny-chat-v2")
    return store


async def test_apply_apply_again_delete(cluster, tiny_model_dir: Path, tmp_path: Path) -> None:
    api = cluster.api
    store = two_models(tiny_model_dir, tmp_path / "node-store")
    config = kubeconfig(tmp_path / "kubeconfig", cluster.config.get().cluster.server)
    flags = (
        "--backend", "kubernetes", "--kubeconfig", str(config), "--engine-image", "stoker:test",
        "--store-path", str(store.root), "--store", str(store.root), "--owner", "gitops",
        "--lease-duration", LEASE, "--stable-window", "1",
    )  # fmt: skip
    controller = PlatformProcess(tmp_path / "home", free_port(), flags, extra_env=ENV, command="controller")
    started = [controller]
    http = httpx.AsyncClient(base_url=api.url, headers={"Authorization": "Bearer admin-token-0123456789"})
    try:
        await asyncio.to_thread(controller.start)
        gateways = []
        for i in range(2):
            args = ("--controller", controller.url, "--report-interval", "0.2s", "--gateway-id", f"g{i}")
            g = PlatformProcess(tmp_path / f"g{i}", free_port(), args, extra_env=ENV, command="gateway")
            await asyncio.to_thread(g.start)
            started.append(g)
            gateways.append(g)

        async def resource() -> dict | None:
            r = await http.get(f"{DEPLOYMENTS}/chat")
            return r.json() if r.status_code == 200 else None

        def condition(obj: dict | None, kind: str) -> dict:
            found = [
                c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == kind
            ]
            return found[0] if found else {}

        async def settled(revision: int) -> bool:
            obj = await resource()
            status = (obj or {}).get("status") or {}
            return (
                status.get("observedGeneration") == obj["metadata"]["generation"]
                and status.get("revision") == revision
                and status.get("ready", 0) >= 1
                and condition(obj, "RolledOut").get("status") == "True"
            )

        async def wait(check, what: str) -> None:
            loop = asyncio.get_running_loop()
            await until(lambda: asyncio.run_coroutine_threadsafe(check(), loop).result(), what)

        # kubectl apply, the first time: a create. The controller deploys it and warms min_warm.
        doc = documented()
        doc["metadata"]["namespace"] = NAMESPACE
        r = await http.post(DEPLOYMENTS, json=doc)
        assert r.status_code == 201, r.text
        await wait(lambda: settled(1), "revision 1 READY and rolled out")
        obj = await resource()
        assert obj["metadata"]["finalizers"] == ["stoker.dev/drain"]
        assert obj["status"]["traffic"] == {"1": 100} and obj["status"]["trafficSummary"] == "1=100%"
        assert condition(obj, "Ready")["status"] == "True"
        [rev1] = [
            o for (plural, _, _), o in api.store.objects.items() if plural == "stokerrevisions.stoker.dev"
        ]
        assert rev1["spec"]["model"] == "tiny-chat" and rev1["metadata"]["name"] == "chat-r1"
        first_pods = {o["metadata"]["name"] for (p, _, _), o in api.store.objects.items() if p == "pods"}

        # kubectl apply, the second time: a merge patch of what changed. Under load through both
        # gateways, every answer is 200 while revision 2 warms and takes the traffic.
        async with Load(
            [g.url for g in gateways],
            concurrency=2,
            max_tokens=4,
            bound_s=deadline(180),
            model="chat",
            headers=H,
        ) as load:
            await load.wait_finished(3)
            load.mark("applied")
            r = await http.patch(
                f"{DEPLOYMENTS}/chat", json={"spec": {"model": "tiny-chat-v2"}}, headers=MERGE
            )
            assert r.status_code == 200, r.text
            assert r.json()["metadata"]["generation"] == 2
            await wait(lambda: settled(2), "revision 2 READY and rolled out")
            await until(lambda: any(o.revision == "2" for o in load.outcomes[-3:]), "answers from revision 2")
        assert not lost(load.outcomes), (load.by_phase(), describe(load.outcomes))
        assert load.outcomes and all(o.kind == COMPLETE for o in load.outcomes), load.by_phase()
        assert {o.revision for o in load.outcomes} == {"1", "2"}
        obj = await resource()
        assert obj["status"]["traffic"] == {"2": 100}
        assert api.get("stokerrevisions.stoker.dev", NAMESPACE, "chat-r2")["spec"]["model"] == "tiny-chat-v2"
        deployed = (await asyncio.to_thread(controller.deployments))["chat"]
        assert deployed["latest_revision"] == 2 and deployed["model"] == "tiny-chat-v2"

        # `stoker rollback` writes the same resource: the split in its status.
        await asyncio.to_thread(controller.cli, "rollback", "chat")
        await wait(lambda: settled(1), "rolled back to revision 1")
        assert (await resource())["status"]["traffic"] == {"1": 100}

        # What the schema cannot refuse (min warm above max) the controller does, in the status.
        bad = {
            **doc,
            "metadata": {"name": "bad", "namespace": NAMESPACE},
            "spec": {**doc["spec"], "minWarm": 3},
        }
        r = await http.post(DEPLOYMENTS, json=bad)
        assert r.status_code == 201, r.text

        async def refused() -> bool:
            r = await http.get(f"{DEPLOYMENTS}/bad")
            return condition(r.json(), "Ready").get("reason") == "InvalidSpec"

        await wait(refused, "the bad spec refused in its status")
        ready = condition((await http.get(f"{DEPLOYMENTS}/bad")).json(), "Ready")
        assert ready["status"] == "False" and "min_warm" in ready["message"], ready
        assert "bad" not in await asyncio.to_thread(controller.deployments)
        assert (await http.delete(f"{DEPLOYMENTS}/bad")).status_code == 200

        # kubectl delete: held by the finalizer until the controller has drained it, then gone.
        r = await http.delete(f"{DEPLOYMENTS}/chat")
        assert r.status_code == 200, r.text
        assert r.json()["metadata"].get("deletionTimestamp"), r.json()  # held: draining

        async def gone() -> bool:
            return await resource() is None

        await wait(gone, "the resource deleted once drained")
        await until(
            lambda: not [o for (p, _, _), o in list(api.store.objects.items()) if p == "pods"],
            "its pods stopped",
        )
        assert "chat" not in await asyncio.to_thread(controller.deployments)
        assert not [k for k in api.store.objects if k[0] == "stokerrevisions.stoker.dev"]
        assert first_pods  # the pods the first apply started were the ones that went
    finally:
        await http.aclose()
        for p in started:
            await asyncio.to_thread(p.stop)
