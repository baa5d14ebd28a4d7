"""The vLLM a platform runs (`stoker up --vllm …`): its settings, found and asked its version at the
first vLLM deployment (then kept), its warm runtimes joining the keeper then, and the deploy-time
check that vLLM can load a snapshot. Split from `stoker.control.platform`, which composes it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from snapshots.remote import read_manifest
from snapshots.s3 import RemoteConfig
from stoker.errors import invalid
from warm_pool.errors import EngineUnavailable
from warm_pool.vllm import (
    IMAGE_VLLM,
    VllmLaunch,
    check_settings,
    loadable_reason,
    probe_vllm,
    read_config,
    runtime_kind,
    vllm_command,
)

log = logging.getLogger("stoker.platform")


@dataclass(frozen=True)
class VllmOptions:
    """`stoker up`'s vLLM settings: the command (None: $STOKER_VLLM, else `vllm` on PATH), extra
    arguments for every vLLM instance, a CPU build's KV cache in GiB, and the vLLM warm runtimes
    kept once a vLLM is found (`infra/vllm-cpu/runtime.py`; 0: every start fresh). `in_image`: vLLM
    runs in engine pods, each of which asks the image's own (`stoker vllm-serve`); this process runs
    none and looks for none."""

    command: str | None = None
    args: tuple[str, ...] = ()
    cpu_kv_cache_gib: float = 1.0
    warm_runtimes: int = 0
    in_image: bool = False

    def __post_init__(self) -> None:
        check_settings(self.args, self.cpu_kv_cache_gib)
        if self.warm_runtimes < 0:
            raise ValueError(f"--vllm-warm-runtimes must be 0 (off) or more, got {self.warm_runtimes}")


class VllmSetup:
    """`options` made real: `launch()` finds the vLLM once; `found` is it, or None before."""

    def __init__(self, options: VllmOptions, gpus: Any, keeper: Any = None) -> None:
        self.options = options
        self._gpus = gpus  # a `warm_pool.gpus.GpuInventory`: a GPU build needs a GPU
        self._keeper = keeper  # a `warm_pool.runtimes.RuntimeKeeper`, or None (no runtimes)
        self.found: VllmLaunch | None = None

    async def launch(self) -> VllmLaunch:
        """The vLLM this platform runs, found and asked its version at the first vLLM deployment;
        a 400 on `engine`, in one line, where it cannot run: no vLLM, or a GPU build and no GPU.
        Its warm runtimes (`options.warm_runtimes`) are kept from then on."""
        if self.found is not None:
            return self.found
        options = self.options
        if options.in_image:
            self.found = VllmLaunch(IMAGE_VLLM, options.args, options.cpu_kv_cache_gib)
            log.info("vLLM: the engine image's, which each engine pod asks for its build")
            return self.found
        try:
            command = vllm_command(options.command)
            if command is None:
                raise EngineUnavailable(
                    "no vLLM found: pass `stoker up --vllm CMD` or set STOKER_VLLM (`make vllm` builds "
                    ".venv-vllm/bin/vllm, vLLM's CPU build), or put `vllm` on PATH (pip install 'stoker[gpu]')"
                )
            runtime = await probe_vllm(command)
            if not runtime.cpu_build and not self._gpus.gpus:
                raise EngineUnavailable(
                    f"vLLM {runtime.version} is a GPU build and no GPU was found "
                    "(set STOKER_GPUS or CUDA_VISIBLE_DEVICES, or use vLLM's CPU build: `make vllm`)"
                )
            launch = VllmLaunch(runtime, options.args, options.cpu_kv_cache_gib)
        except EngineUnavailable as exc:
            raise invalid(f"The vllm engine cannot run here: {exc}.", "engine") from None
        log.info(
            "vLLM %s (%s build) at %s", runtime.version, "CPU" if runtime.cpu_build else "GPU", command[0]
        )
        self.found = launch
        if self._keeper is not None and options.warm_runtimes > 0:
            kind = runtime_kind(runtime, options.warm_runtimes)
            if kind is None:
                log.warning("no vLLM warm runtime: %s is not in a virtualenv of its own", command[0])
            else:
                self._keeper.add_kind(kind)
        return launch

    @staticmethod
    async def check_can_load(store: Any, snapshot_id: str, model: str) -> None:
        """Refuse at deploy a snapshot vLLM cannot load, with the reason."""
        if store.path_of(snapshot_id).is_dir():
            files = [f.path for f in store.manifest(snapshot_id).files]
            config = read_config(store.path_of(snapshot_id))
        else:  # in object storage only: the manifest says which files there are
            manifest = await read_manifest(model, RemoteConfig.from_env())
            files = [f.path for f in manifest.files]
            config = {"architectures": ["?"]} if "config.json" in files else None
        if (reason := loadable_reason(files, config)) is not None:
            raise invalid(f"vLLM cannot load snapshot {snapshot_id[:12]}: {reason}.", "model")
