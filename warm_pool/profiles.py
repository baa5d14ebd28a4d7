"""Instance profiles: how fast an instance of each engine class starts, serves and queues.

`InstanceModel` is one class of instance; `GPU` (vLLM on an H100-class GPU, the default), `CPU`
(the CPU engine on this machine) and `VLLM_CPU` (vLLM's CPU build) are the presets, `PROFILES` names
them. The simulator runs instances of a profile in virtual time; the live pool takes a profile's
`startup` as the start-up priors its measured averages begin from (`warm_pool.policies.settings`).
Nothing here imports the simulator, so the live path does not load it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from warm_pool.errors import InvalidConfig
from warm_pool.policies.base import Tier, TierTimes

# Loading a LoRA adapter onto a running instance. GPU: no figure measured here (MEASURED.md has
# none); vLLM's load of a rank-16 adapter on an 8B model is about 0.1-0.5 s (reading the safetensors
# and copying them into the GPU's LoRA slots), so 0.25 s is a planning figure from the middle of
# that range. CPU engine: 1-5 ms for a rank-8 adapter on the tiny test model (docs/guide/cpu-engine.md).
GPU_ADAPTER_LOAD_S = 0.25
CPU_ADAPTER_LOAD_S = 0.005


@dataclass(frozen=True)
class InstanceModel:
    startup: TierTimes = field(default_factory=TierTimes)
    initial_tier: Tier = Tier.DISK
    page_cache_ttl_s: float = 600.0
    prefill_tps: float = 10_000.0
    decode_tps: float = 40.0
    concurrency: int = 16
    jitter: float = 0.1
    max_queue: int = 100
    deadline_s: float = 120.0
    can_sleep: bool = True
    warm_runtimes: int = 0  # runtimes kept ahead of need (`warm_pool.runtimes`): starts of tier runtime
    runtime_refill_s: float | None = None  # a taken runtime's replacement is ready after; None: page_cache
    adapter_load_s: float = GPU_ADAPTER_LOAD_S  # loading a LoRA adapter onto an instance (`adapter_sim`)

    def __post_init__(self) -> None:
        for name in ("prefill_tps", "decode_tps", "deadline_s", "page_cache_ttl_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise InvalidConfig(name, f"{name} must be a finite number > 0, got {value}")
        for tier in Tier:
            if not (math.isfinite(self.startup.of(tier)) and self.startup.of(tier) >= 0):
                raise InvalidConfig(tier.value, f"start-up time of {tier.value} must be ≥ 0 s")
        if self.warm_runtimes < 0 or (self.runtime_refill_s is not None and not self.runtime_refill_s >= 0):
            raise InvalidConfig("warm_runtimes", "need warm_runtimes ≥ 0 and runtime_refill_s ≥ 0")
        if self.concurrency < 1 or self.max_queue < 0:
            raise InvalidConfig("concurrency", "need concurrency ≥ 1 and max_queue ≥ 0")
        if not (math.isfinite(self.startup.adapter) and self.startup.adapter >= 0):
            raise InvalidConfig("adapter", f"the adapter tier must be ≥ 0 s, got {self.startup.adapter}")
        if not (math.isfinite(self.adapter_load_s) and self.adapter_load_s >= 0):
            raise InvalidConfig("adapter_load_s", f"adapter_load_s must be ≥ 0 s, got {self.adapter_load_s}")
        if not 0 <= self.jitter <= 2:
            raise InvalidConfig("jitter", f"jitter must be in 0..2, got {self.jitter}")


# GPU class: an 8B model in bf16 under vLLM on one H100-class GPU (start-up: see TierTimes). Prefill
# ~10k tokens/s; decode ~40 tokens/s per stream with 16 sequences batched (memory-bound decode of
# 16 GB of weights at ~2.5 TB/s gives ~150 steps/s at batch 1, and batching 16 long contexts costs
# most of that back). These are round planning figures, not measurements.
GPU = InstanceModel()
# The CPU engine with SmolLM2-135M on this 2-core machine (README "Benchmarks", MEASURED.md): start
# through `stoker up` 7.7 s to READY with the files cached, +0.74 s of weights from a cold disk,
# +~3 s for a 540 MB fp32 snapshot from S3; a level-1 wake 0.06 s + ~0.28 s of page faults on the
# first request; prefill ~290 tokens/s (194 tokens in 0.67 s); decode 3.1 tokens/s per stream at
# 8 streams (the engine's --max-num-seqs).
# A start through a warm runtime (bench/runtime_bench.py, one loaded run): 3.1 s to READY against
# 26.4 s for a fresh process beside it, 0.12 of it: 0.9 s against the 7.7 s above.
CPU = InstanceModel(
    startup=TierTimes(
        wake=0.35, page_cache=7.7, disk=8.4, object_storage=11.5, runtime=0.9, adapter=CPU_ADAPTER_LOAD_S
    ),
    prefill_tps=290.0,
    decode_tps=3.1,
    concurrency=8,
    adapter_load_s=CPU_ADAPTER_LOAD_S,
)
# vLLM's CPU build (vllm-cpu 0.32) with the same SmolLM2 snapshot on the same machine (README "vLLM"
# and "Benchmarks"; bench/vllm_start_bench.py, bench/engines_bench.py): no sleep mode; a start with
# the snapshot's compile cache kept ~30 s (~90 s without: torch.compile), +~1 s of weights from a
# cold disk, +~3 s of S3; prefill ~200 tokens/s, decode ~9 tokens/s per stream with 8 batched.
# `wake` is never used (can_sleep False); it stays the page-cache figure so nothing is cheaper.
VLLM_CPU = InstanceModel(
    startup=TierTimes(wake=30.0, page_cache=30.0, disk=31.0, object_storage=34.0),
    prefill_tps=200.0,
    decode_tps=9.0,
    concurrency=8,
    can_sleep=False,
)
PROFILES = {"gpu": GPU, "cpu": CPU, "vllm-cpu": VLLM_CPU}
