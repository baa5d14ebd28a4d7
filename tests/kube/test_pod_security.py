"""Pod Security on the fake cluster: a namespace that enforces `baseline` refuses every engine pod
(each mounts the node's snapshot store, a hostPath) with the API server's message; the backend
makes that the instance's failure reason, and `stoker controller` refuses to start there, saying
which label the namespace needs."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import STOKER
from tests.deadlines import CLI
from tests.kube.accounts import ADMIN_TOKEN
from tests.kube.conftest import NAMESPACE, TinyStore, running_cluster
from tests.kube.fake.rbac import Policy
from tests.kube.test_backend import placement, web_spec
from tests.kube.test_controller_e2e import kubeconfig
from tests.platform.engine.conftest import free_port
from warm_pool.backends.kube_pod import PodSettings, pod_manifest
from warm_pool.errors import InvalidConfig, StartFailed
from warm_pool.failures import record_of

BASELINE = {"pod-security.kubernetes.io/enforce": "baseline"}
REFUSAL = 'violates PodSecurity "baseline:latest": hostPath volumes (volume "snapshots")'


async def test_a_baseline_namespace_refuses_an_engine_pod_as_the_api_server_does(
    pod_logs: Path, stoker_env: dict[str, str], tiny_store: TinyStore
) -> None:
    settings = PodSettings(image="stoker:test", store_path=str(tiny_store.root), owner="ctl-1")
    pod = pod_manifest(settings, placement(tiny_store, "tiny-1f1f1f1f"), web_spec(), 1.0)
    async with running_cluster(pod_logs, stoker_env, namespace_labels=BASELINE) as cluster:
        async with httpx.AsyncClient(base_url=cluster.api.url) as http:
            answer = await http.post(
                f"/api/v1/namespaces/{NAMESPACE}/pods",
                json=pod,
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            )
        assert answer.status_code == 403
        assert answer.json()["reason"] == "Forbidden"
        assert answer.json()["message"] == f'pods "tiny-1f1f1f1f" is forbidden: {REFUSAL}'
        assert cluster.api.get("pods", NAMESPACE, "tiny-1f1f1f1f") is None


async def test_the_backend_makes_the_refusal_the_instances_failure_reason(
    pod_logs: Path, stoker_env: dict[str, str], tiny_store: TinyStore
) -> None:
    async with running_cluster(pod_logs, stoker_env, namespace_labels=BASELINE) as cluster:
        backend = cluster.backend(tiny_store.root)
        try:
            with pytest.raises(InvalidConfig, match=r"pod-security\.kubernetes\.io/enforce=privileged"):
                await backend.check_admission()
            with pytest.raises(StartFailed) as failed:
                await backend.start(placement(tiny_store, "tiny-2f2f2f2f"), web_spec())
        finally:
            await backend.aclose()
        record = record_of("tiny-2f2f2f2f", "process_start", failed.value, time.time())
        assert record.headline == (
            f'process_start: pod {NAMESPACE}/tiny-2f2f2f2f was not created: pods "tiny-2f2f2f2f" is forbidden: '
            f"{REFUSAL}"
        )
        assert cluster.api.get("secrets", NAMESPACE, "tiny-2f2f2f2f-key") is None  # its Secret went too
        # the check was a dry run: nothing was stored, nothing scheduled
        assert not [k for k in cluster.api.store.objects if k[0] == "pods"]


async def test_another_refusal_is_said_as_it_is(
    pod_logs: Path, stoker_env: dict[str, str], tiny_store: TinyStore
) -> None:
    """An account that may not create pods is refused too, by RBAC: no Pod Security advice then."""
    async with running_cluster(pod_logs, stoker_env, policy=Policy()) as cluster:
        cluster.probing = True
        backend = cluster.backend(tiny_store.root)
        try:
            with pytest.raises(InvalidConfig) as refused:
                await backend.check_admission()
        finally:
            await backend.aclose()
    assert 'cannot create resource "pods"' in str(refused.value) and "pod-security" not in str(refused.value)


async def test_the_controller_refuses_to_start_in_a_namespace_that_refuses_engine_pods(
    pod_logs: Path, stoker_env: dict[str, str], tiny_store: TinyStore, tmp_path: Path
) -> None:
    async with running_cluster(pod_logs, stoker_env, namespace_labels=BASELINE) as cluster:
        config = kubeconfig(tmp_path / "kubeconfig", cluster.api.url)
        command = [
            STOKER, "controller", "--port", str(free_port()), "--backend", "kubernetes",
            "--kubeconfig", str(config), "--engine-image", "stoker:test", "--store-path", str(tiny_store.root),
            "--store", str(tiny_store.root), "--owner", "e2e", "--data-dir", str(tmp_path / "home"),
        ]  # fmt: skip
        env = {**stoker_env, "STOKER_ADMIN_KEY": "admin-key-pod-security"}
        run = await asyncio.to_thread(
            subprocess.run, command, env=env, capture_output=True, text=True, timeout=CLI
        )
    assert run.returncode != 0
    assert f'pods "stoker-admission-check" is forbidden: {REFUSAL}' in run.stderr, run.stderr
    assert "label the namespace pod-security.kubernetes.io/enforce=privileged" in run.stderr
