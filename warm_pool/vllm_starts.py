"""The vLLM side of a pool's starts: the launch spec from what the snapshot says, and each
instance's copy of the snapshot's compile cache (snapshots.compile_cache) from checkout to discard.

    spec(inst, dir, gpus)  dtype and context length from the snapshot; the cache of this vLLM and
                           these arguments checked out as the instance's VLLM_CACHE_ROOT
    keep(inst)             at READY: its cache committed if none was kept, and for an s3://
                           snapshot pushed beside it in the background, for the next node
    discard(inst)          when it stops: its copy removed

A failure to keep or push a cache costs a later start time, nothing else: it is logged, not raised.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from snapshots import SnapshotError, compile_remote
from snapshots.compile_cache import CompileCaches, CompileKey
from snapshots.errors import StoreWriteError
from snapshots.s3 import RemoteConfig
from warm_pool.engine_settings import EngineSettings
from warm_pool.errors import StartFailed
from warm_pool.launch import LaunchSpec, vllm_pod_spec, vllm_spec
from warm_pool.snapshot import SnapshotSource
from warm_pool.states import Instance
from warm_pool.vllm import VllmLaunch, snapshot_shape

log = logging.getLogger("stoker.pool")


@dataclass(frozen=True)
class _CacheCopy:
    """One vLLM instance's working copy of its snapshot's compile cache (its VLLM_CACHE_ROOT)."""

    key: CompileKey
    work: Path
    hit: bool  # seeded from a kept cache


def _read_json(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise StartFailed(f"cannot read {path.name} of the snapshot: {exc}") from None
    return doc if isinstance(doc, dict) else {}


def compile_key(
    snapshot_id: str, version: str, dtype: str, max_model_len: int | None, gpus: int, args: tuple[str, ...]
) -> CompileKey:
    """The compile cache a vLLM start uses: this snapshot, this vLLM, and the arguments that shape
    what it compiles. The same here and in an engine pod (`stoker vllm-serve`)."""
    settings = {
        "dtype": dtype,
        "max_model_len": str(max_model_len),
        "gpus": str(gpus),
        "args": " ".join(args),
    }
    return CompileKey.of(snapshot_id, "vllm", version, settings)


class VllmStarts:
    def __init__(self, deployment: str, snapshot: SnapshotSource, launch: VllmLaunch | None) -> None:
        self.deployment = deployment
        self.snapshot = snapshot
        self.launch = launch
        self.caches = CompileCaches(snapshot.store.root)
        self._copies: dict[str, _CacheCopy] = {}
        self._uploads: set[asyncio.Task] = set()

    @property
    def cpu_build(self) -> bool:
        return self.launch is not None and self.launch.runtime.cpu_build

    async def spec(
        self,
        inst: Instance,
        snapshot_dir: Path,
        gpus: list[int],
        host: str,
        settings: EngineSettings | None = None,
        extra: tuple[str, ...] = (),
        ssl_files: tuple[str, str] | None = None,  # the certificate and key it serves HTTPS with
    ) -> LaunchSpec:
        """vLLM on the snapshot, with the deployment's settings (`settings`; dtype and context length
        default from what the snapshot says) and a copy of the snapshot's compile cache for this vLLM
        and these arguments, if one was kept."""
        vllm = self.launch
        if vllm is None:
            raise StartFailed(f"deployment {self.deployment}: no vLLM on this machine")
        settings = settings or EngineSettings()
        if vllm.runtime.in_image:  # a pod, which asks its own vLLM its build (`vllm_pod_spec`)
            return await self._pod_spec(inst, snapshot_dir, len(gpus), host, settings, extra, ssl_files)
        manifest = self.snapshot.store.manifest(self.snapshot.snapshot_id)
        config = await asyncio.to_thread(_read_json, snapshot_dir / "config.json")
        shape = snapshot_shape(manifest.dtype, config)
        dtype = shape.dtype if settings.dtype == "auto" else settings.dtype
        max_len = settings.max_model_len or (None if vllm.sets("--max-model-len") else shape.max_model_len)
        # The deployment's arguments, then the operator's --vllm-args, which come last and win. The
        # compile cache is keyed by them, not by `extra` (a shared GPU's memory share compiles alike).
        args = (*settings.vllm_args(), *vllm.args)
        key = compile_key(self.snapshot.snapshot_id, vllm.runtime.version, dtype, max_len, len(gpus), args)
        work, hit = await asyncio.to_thread(self.caches.checkout, key)
        self._copies[inst.id] = _CacheCopy(key, work, hit)
        return vllm_spec(
            snapshot_dir,
            inst.port,
            self.deployment,
            gpus,
            host=host,
            dtype=dtype,
            max_model_len=max_len,
            sleep_mode=not vllm.runtime.cpu_build,
            cache_root=work,
            cpu_kv_cache_gib=vllm.cpu_kv_cache_gib,
            extra_args=(*extra, *args),
            vllm_command=vllm.runtime.command,
            api_key=inst.secret,
            ssl_files=ssl_files,
        )

    async def _pod_spec(
        self,
        inst: Instance,
        snapshot_dir: Path,
        gpus: int,
        host: str,
        settings: EngineSettings,
        extra: tuple,
        ssl_files: tuple[str, str] | None = None,
    ) -> LaunchSpec:
        """An engine pod's: the deployment's settings; what they leave to the snapshot (dtype, context
        length) the pod reads from its node's copy, which this controller need not have. No compile
        cache is kept here: the pod's vLLM keeps its own, under its $HOME."""
        vllm = self.launch
        return vllm_pod_spec(
            snapshot_dir,
            inst.port,
            self.deployment,
            gpus,
            host=host,
            dtype=settings.dtype,
            max_model_len=settings.max_model_len,
            cpu_kv_cache_gib=vllm.cpu_kv_cache_gib,
            extra_args=(*extra, *settings.vllm_args(), *vllm.args),
            api_key=inst.secret,
            ssl_files=ssl_files,
        )

    async def keep(self, inst: Instance) -> None:
        """A READY vLLM has compiled (or loaded) what it needs: keep its cache for the next start,
        unless one is kept already."""
        copy = self._copies.get(inst.id)
        if copy is None or copy.hit:
            return
        try:
            if not await asyncio.to_thread(self.caches.commit, copy.key, copy.work):
                return
        except StoreWriteError as exc:
            log.warning("instance %s: compile cache not kept: %s", inst.id, exc)
            return
        log.info("instance %s: compile cache %s kept", inst.id, copy.key.digest[:12])
        if (remote := self.snapshot.remote) is not None:  # other nodes pull it with the snapshot
            task = asyncio.create_task(self._upload(remote), name=f"upload-{inst.id}")
            self._uploads.add(task)
            task.add_done_callback(self._uploads.discard)

    async def discard(self, instance_id: str) -> None:
        if (copy := self._copies.pop(instance_id, None)) is not None:
            await asyncio.to_thread(self.caches.discard, copy.work)

    async def close(self) -> None:
        for task in self._uploads:
            task.cancel()
        await asyncio.gather(*self._uploads, return_exceptions=True)

    async def _upload(self, remote: str) -> None:
        config = self.snapshot.remote_config or RemoteConfig.from_env()
        try:
            sent = await compile_remote.upload(self.caches, self.snapshot.snapshot_id, remote, config)
        except SnapshotError as exc:
            log.warning("pool %s: compile cache not pushed to %s: %s", self.deployment, remote, exc)
            return
        log.info("pool %s: %d compile cache(s) pushed to %s", self.deployment, sent.pushed, remote)
