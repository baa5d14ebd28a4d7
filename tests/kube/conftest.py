"""A Kubernetes cluster for the tests: the fake API server on loopback, holding every process to the
RBAC of the Helm chart rendered into namespace `stoker` (`tests.kube.accounts`), two nodes, and a
fake kubelet running their pods as local processes (`stoker` is the repository's own script).

Each process calls with its own service account's token (`Cluster_.config_for("controller")`); the
kubelet and the test itself call as `system:admin`. After each test, every call a process made
must be one its code declares (`API_CALLS`), and none refused, unless the test says it probes
refusals (`cluster.probing = True`)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from lightkube import AsyncClient, KubeConfig
from lightkube.config.models import Cluster, User

from snapshots import SnapshotStore, import_hf_dir
from stoker.spec.resources import crds
from tests.conftest import STOKER
from tests.kube.accounts import ADMIN_TOKEN, NAMESPACE, TOKENS, chart_access, tokens, unexplained
from tests.kube.fake.apiserver import FakeApiServer
from tests.kube.fake.kubelet import FakeKubelet
from tests.kube.fake.rbac import Policy
from warm_pool.backends.kube import KubeBackend

NODES = ("node-a", "node-b")

TOKEN = TOKENS["controller"]


@dataclass
class Cluster_:
    api: FakeApiServer
    config: KubeConfig  # system:admin's
    client: AsyncClient  # the test's own, as system:admin
    kubelet: FakeKubelet
    probing: bool = False  # the test calls as an account on purpose where it may not

    def config_for(self, component: str) -> KubeConfig:
        """The kubeconfig of a component's service account (controller, node, gateway)."""
        return kube_config(self.api.url, TOKENS[component])

    def backend(self, store: Path, owner: str = "ctl-1", **kwargs) -> KubeBackend:
        """A backend with its own client, as a controller process would have."""
        return KubeBackend(
            self.config_for("controller"),
            NAMESPACE,
            image="stoker:test",
            store_path=store,
            owner=owner,
            **kwargs,
        )


def kube_config(url: str, token: str = ADMIN_TOKEN) -> KubeConfig:
    return KubeConfig.from_one(cluster=Cluster(server=url), user=User(token=token), namespace=NAMESPACE)


@dataclass(frozen=True)
class TinyStore:
    root: Path
    snapshot_id: str

    @property
    def snapshot_dir(self) -> Path:
        return self.root / self.snapshot_id


@pytest.fixture(scope="session")
def tiny_store(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> TinyStore:
    """The node's store (the same directory on every fake node: they share this machine's disk)."""
    store = SnapshotStore(tmp_path_factory.mktemp("node-store"))
    return TinyStore(store.root, import_hf_dir(tiny_model_dir, store).id)


@contextlib.asynccontextmanager
async def running_cluster(
    logs: Path,
    stoker_env: Mapping[str, str],
    *,
    policy: Policy | None = None,
    namespace_labels: dict[str, str] | None = None,
    nodes: Mapping[str, dict] | None = None,
) -> AsyncIterator[Cluster_]:
    """The cluster, with the chart's RBAC unless given another `policy`; `logs` (a directory) holds
    the pods' logs; `nodes` by name, each with `FakeApiServer.add_node`'s keywords (default:
    `NODES`, plain)."""
    access = chart_access()
    api = FakeApiServer(logs, tokens=tokens(access), policy=policy or access.policy)
    api.add_namespace(NAMESPACE, namespace_labels)
    nodes = nodes if nodes is not None else {name: {} for name in NODES}
    for node, shape in nodes.items():
        api.add_node(node, **shape)
    async with api.serve() as url:
        config = kube_config(url)
        await install_crds(url)
        client = AsyncClient(config=config, namespace=NAMESPACE)
        kubelet_client = AsyncClient(config=config, namespace=NAMESPACE)
        programs = {"stoker": STOKER, "python": sys.executable}
        kubelet = FakeKubelet(
            kubelet_client, NAMESPACE, set(nodes), programs=programs, base_env=stoker_env, log_dir=logs
        )
        task = asyncio.create_task(kubelet.run())
        cluster = Cluster_(api, config, client, kubelet)
        try:
            yield cluster
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await client.close()
            await kubelet_client.close()
        assert not kubelet.errors, kubelet.errors
        if not cluster.probing:
            assert unexplained(api.calls, access) == []


async def install_crds(url: str) -> None:
    """The chart's CRDs, as `helm install` creates them before anything else (as system:admin)."""
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as http:
        for definition in crds():
            r = await http.post("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", json=definition)
            assert r.status_code == 201, r.text


@pytest.fixture
def pod_logs(tmp_path: Path) -> Path:
    (tmp_path / "pod-logs").mkdir()
    return tmp_path / "pod-logs"


@pytest.fixture
async def cluster(pod_logs: Path, stoker_env: dict[str, str]) -> AsyncIterator[Cluster_]:
    async with running_cluster(pod_logs, stoker_env) as running:
        yield running
