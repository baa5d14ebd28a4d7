"""A Kubernetes cluster for the tests: the fake API server on loopback, two nodes, and a fake
kubelet running their pods as local processes (`stoker` is the repository's own script)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from lightkube import AsyncClient, KubeConfig
from lightkube.config.models import Cluster, User

from snapshots import SnapshotStore, import_hf_dir
from tests.conftest import STOKER
from tests.kube.fake.apiserver import FakeApiServer
from tests.kube.fake.kubelet import FakeKubelet
from warm_pool.backends.kube import KubeBackend

TOKEN = "test-token-0123456789"
NAMESPACE = "stoker"
NODES = ("node-a", "node-b")


@dataclass
class Cluster_:
    api: FakeApiServer
    config: KubeConfig
    client: AsyncClient
    kubelet: FakeKubelet

    def backend(self, store: Path, owner: str = "ctl-1", **kwargs) -> KubeBackend:
        """A backend with its own client, as a controller process would have."""
        return KubeBackend(
            self.config, NAMESPACE, image="stoker:test", store_path=store, owner=owner, **kwargs
        )


def kube_config(url: str, token: str = TOKEN) -> KubeConfig:
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


@pytest.fixture
async def cluster(tmp_path: Path, stoker_env: dict[str, str]) -> AsyncIterator[Cluster_]:
    logs = tmp_path / "pod-logs"
    logs.mkdir()
    api = FakeApiServer(TOKEN, logs)
    for node in NODES:
        api.add_node(node)
    async with api.serve() as url:
        config = kube_config(url)
        client = AsyncClient(config=config, namespace=NAMESPACE)
        kubelet_client = AsyncClient(config=config, namespace=NAMESPACE)
        programs = {"stoker": STOKER, "python": sys.executable}
        kubelet = FakeKubelet(
            kubelet_client, NAMESPACE, set(NODES), programs=programs, base_env=stoker_env, log_dir=logs
        )
        task = asyncio.create_task(kubelet.run())
        try:
            yield Cluster_(api, config, client, kubelet)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await client.close()
            await kubelet_client.close()
        assert not kubelet.errors, kubelet.errors
