"""The batch API's parts, made when the app starts (the data dir is the platform's) and stopped
with it: the tenants' files (their bytes in a bucket where `files_store` names one), the batches'
store, the runner. `stoker.serve.up.build_gateway` wires
the routes to them before they exist; a request can only arrive once they do.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from snapshots.s3 import RemoteConfig
from stoker.batch.config import BatchConfig
from stoker.batch.files import FileStore
from stoker.batch.objects import FileObjects
from stoker.batch.records import BatchStore
from stoker.batch.runner import BatchRunner
from stoker.spec.keys import Principal

FILES_DIR, BATCHES_DIR = "files", "batches"


class Batches:
    def __init__(self, config: BatchConfig) -> None:
        self.config = config
        self._files: FileStore | None = None
        self._runner: BatchRunner | None = None

    def files(self) -> FileStore:
        return self._files

    def runner(self) -> BatchRunner:
        return self._runner

    async def start(
        self,
        data_dir: Path,
        endpoint: Callable,
        platform: Any,
        principal_for: Callable[[str], Principal | None],
        registry: CollectorRegistry,
    ) -> None:
        objects = None
        if self.config.files_store is not None:
            objects = FileObjects(self.config.files_store, RemoteConfig.from_env())
        self._files = FileStore(data_dir / FILES_DIR, self.config.max_files, objects=objects)
        store = BatchStore(data_dir / BATCHES_DIR)
        cost = getattr(platform, "cost", None)  # the platform's cost meter (`stoker.control.cost`)
        self._runner = BatchRunner(
            self._files,
            store,
            endpoint,
            platform,
            principal_for,
            self.config,
            registry,
            cost_rows=cost.report if cost is not None else list,
        )
        await self._runner.start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.stop()
        if self._files is not None and self._files.objects is not None:
            await self._files.objects.close()
