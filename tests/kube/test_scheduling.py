"""GPU pods on the fake cluster's scheduler, through the backend: a pod that fits nowhere stays
Pending and the backend says why in the scheduler's words; it is bound as soon as room appears, a
node added or a GPU freed, as the real scheduler retries."""

from __future__ import annotations

import copy
import dataclasses

from tests.kube.conftest import NAMESPACE, Cluster_, TinyStore
from tests.kube.test_backend import READY_S, pending_because, placement, web_spec
from warm_pool.backends.kube import KubeBackend, PodHandle

DEDICATED = {"key": "dedicated", "value": "gpu", "effect": "NoSchedule"}


def gpu_node(cluster: Cluster_, name: str, gpus: int, taints: list[dict] | None = None) -> None:
    """Make node `name` (adding it if need be, on the kubelet too) advertise `gpus` GPUs."""
    node = cluster.api.get("nodes", "", name)
    if node is None:
        cluster.api.add_node(name, allocatable={"nvidia.com/gpu": str(gpus)}, taints=taints)
        cluster.kubelet.nodes.add(name)
        return
    node = copy.deepcopy(node)
    node["status"]["allocatable"]["nvidia.com/gpu"] = str(gpus)
    if taints:
        node["spec"] = {"taints": taints}
    cluster.api.put("nodes", node, "MODIFIED")


async def start_gpu_pod(
    backend: KubeBackend, tiny_store: TinyStore, instance_id: str, gpus: int
) -> PodHandle:
    return await backend.start(dataclasses.replace(placement(tiny_store, instance_id), gpus=gpus), web_spec())


async def test_a_pod_asking_for_more_gpus_than_any_node_has_stays_pending_saying_why(
    cluster: Cluster_, tiny_store: TinyStore
) -> None:
    gpu_node(cluster, "node-a", 2)
    gpu_node(cluster, "node-b", 8, [DEDICATED])
    backend = cluster.backend(tiny_store.root)
    try:
        handle = await start_gpu_pod(backend, tiny_store, "tiny-3a3a3a3a", 4)
        failed = await pending_because(backend, handle)
        assert failed.phase == "wait_ready"
        assert str(failed).endswith(
            "(Unschedulable: 0/2 nodes are available: 1 Insufficient nvidia.com/gpu, "
            "1 node(s) had untolerated taint {dedicated: gpu}.)"
        ), str(failed)
        pod = cluster.api.get("pods", NAMESPACE, "tiny-3a3a3a3a")
        assert pod["status"]["phase"] == "Pending" and "nodeName" not in pod["spec"]

        gpu_node(cluster, "node-c", 4)  # a node added: the pod is tried again, and fits
        assert (await backend.wait_ready(handle, READY_S, health_path="/")).startswith("http://")
        assert cluster.api.get("pods", NAMESPACE, "tiny-3a3a3a3a")["spec"]["nodeName"] == "node-c"
        await backend.stop(handle, term_timeout_s=5)
    finally:
        await backend.aclose()


async def test_a_pending_pod_is_bound_once_another_frees_the_gpus(
    cluster: Cluster_, tiny_store: TinyStore
) -> None:
    gpu_node(cluster, "node-a", 2)
    backend = cluster.backend(tiny_store.root)
    try:
        first = await start_gpu_pod(backend, tiny_store, "tiny-4a4a4a4a", 2)
        await backend.wait_ready(first, READY_S, health_path="/")
        second = await start_gpu_pod(backend, tiny_store, "tiny-4b4b4b4b", 2)
        failed = await pending_because(backend, second)
        assert "0/2 nodes are available: 2 Insufficient nvidia.com/gpu." in str(failed)

        await backend.stop(first, term_timeout_s=5)  # its GPUs are free once it is gone
        assert (await backend.wait_ready(second, READY_S, health_path="/")).startswith("http://")
        assert cluster.api.get("pods", NAMESPACE, "tiny-4b4b4b4b")["spec"]["nodeName"] == "node-a"
        await backend.stop(second, term_timeout_s=5)
    finally:
        await backend.aclose()
