"""A deployment's engine settings, as each revision carries them (`stoker deploy --gpus 2 --dtype
bfloat16 …`): how many devices an instance takes, vLLM's own settings by vLLM's names, further vLLM
arguments passed through, and where a pod may run. Plain data: `stoker.spec.engine` validates them
(one table of types, ranges and defaults), the launch turns them into arguments
(`warm_pool.launch`, `warm_pool.vllm_starts`), the Kubernetes backend into a pod's resources and
placement (`warm_pool.backends.kube_pod`).

    gpus                     devices per instance: vLLM's tensor-parallel size (acquired and
                             released together, on one node); None: the engine's default (vLLM 1
                             on a GPU build, 0 on its CPU build; Stoker's engine 0, the CPU)
    dtype, quantization,     vLLM's --dtype (auto: from the snapshot), --quantization,
    max_model_len,           --max-model-len (None: the model's context length), ...
    gpu_memory_utilization,
    max_num_seqs,
    enable_prefix_caching,
    enforce_eager
    scheduling_policy        vLLM's --scheduling-policy: "fcfs" (None: vLLM's default) or "priority"
                             (its scheduler orders by a request's `priority`; `takes_priority`)
    max_adapters             LoRA adapters an instance holds: the CPU engine's LRU (--max-adapters);
                             vLLM's --enable-lora --max-loras N (None: vLLM serves no adapters)
    task                     what an instance serves: "generate" (text) or "embed" (/v1/embeddings
                             only: the CPU engine's --task embed, vLLM's --runner pooling)
    max_adapter_rank         the largest LoRA rank an instance loads: the CPU engine's and vLLM's
                             --max-lora-rank (None: 64); on a GPU each of vLLM's slots reserves
                             room for this rank on every layer it adapts
    tool_call_parser         vLLM's --enable-auto-tool-choice --tool-call-parser NAME: how it reads
                             tool calls out of its model's text (None: only required and named
                             tool_choice, which vLLM serves by structured output)
    engine_args              further vLLM arguments, refused where they collide with what Stoker
                             manages (`MANAGED_ARGS`) or with a named setting (`NAMED_ARGS`)
    cpu, memory              a pod's requests (Kubernetes quantities: "4", "500m", "16Gi")
    node_selector,           where a pod may be scheduled
    tolerations

A change to any of them needs new instances: it is a new revision, warmed before the switch
(`stoker.spec.deployment.DeploymentSpec.serves_like`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# The largest LoRA rank an instance that hosts adapters loads, on either engine, unless the
# deployment's `max_adapter_rank` says otherwise: the CPU engine's --max-lora-rank default, and vLLM's
# --max-lora-rank where `max_adapters` is set (vLLM's own default, 16, would refuse many published
# adapters; on a GPU each of the --max-loras slots reserves room for this rank on every layer it
# adapts, so a larger one costs KV cache). An adapter of a higher rank is refused at deploy.
MAX_LORA_RANK = 64
# The ranks `max_adapter_rank` takes: vLLM's --max-lora-rank choices up to snapshots.adapter.MAX_RANK.
ADAPTER_RANKS = (8, 16, 32, 64, 128, 256)
# LoRA adapters an instance keeps loaded where `max_adapters` is not set: the CPU engine's own
# --max-adapters default (`stoker.engine.core.EngineConfig`); vLLM then serves none.
DEFAULT_MAX_ADAPTERS = 4
# vLLM's --scheduling-policy choices.
SCHEDULING_POLICIES = ("fcfs", "priority")
# vLLM arguments Stoker sets on every vLLM it starts, from the snapshot, the instance or the pool:
# neither `stoker up --vllm-args` nor a deployment's engine_args may set them.
MANAGED_ARGS: dict[str, str] = {
    "--host": "the address is the instance's",
    "--port": "the port is the instance's",
    "--model": "the model is the deployment's snapshot",
    "--served-model-name": "the served name is the deployment's",
    "--api-key": "the key is the instance's own",
    "--enable-sleep-mode": "sleep mode is on wherever the build supports it",
    "--middleware": "the engine's guard is Stoker's",
    "--config": "a config file could set any of these",
    "--uds": "the engine listens on the instance's port",
    "--tensor-parallel-size": "use 'gpus'",
    "-tp": "use 'gpus'",
}
# vLLM arguments a deployment names as settings of their own.
NAMED_ARGS: dict[str, str] = {
    "--dtype": "dtype",
    "--quantization": "quantization",
    "-q": "quantization",
    "--max-model-len": "max_model_len",
    "--gpu-memory-utilization": "gpu_memory_utilization",
    "--max-num-seqs": "max_num_seqs",
    "--enable-prefix-caching": "enable_prefix_caching",
    "--no-enable-prefix-caching": "enable_prefix_caching",
    "--enforce-eager": "enforce_eager",
    "--scheduling-policy": "scheduling_policy",
    "--enable-lora": "max_adapters",
    "--no-enable-lora": "max_adapters",
    "--max-loras": "max_adapters",
    "--max-lora-rank": "max_adapter_rank",
    "--runner": "task",
    "--task": "task",
    "--tool-call-parser": "tool_call_parser",
    "--enable-auto-tool-choice": "tool_call_parser",
}
# vLLM 0.32's tool-call parsers (`vllm serve --tool-call-parser`), as its ToolParserManager lists
# them; tests/infra pins this against the installed vLLM. A name it does not know would only fail
# at the instance's start, after the deploy was taken.
TOOL_CALL_PARSERS = (
    "apertus",
    "cohere_command3",
    "cohere_command4",
    "deepseek_v3",
    "deepseek_v31",
    "deepseek_v32",
    "deepseek_v4",
    "deepseek_v41",
    "dots",
    "ernie45",
    "functiongemma",
    "gemma4",
    "gigachat3",
    "glm45",
    "glm47",
    "granite",
    "granite-20b-fc",
    "granite4",
    "hermes",
    "hf",
    "hunyuan_a13b",
    "hy_v3",
    "hy_v4",
    "inkling",
    "internlm",
    "jamba",
    "k2_horizon",
    "kimi_k2",
    "kimi_k3",
    "lfm2",
    "ling3",
    "llama3_json",
    "llama4_json",
    "llama4_pythonic",
    "longcat",
    "mimo",
    "minicpm5",
    "minimax_m2",
    "minimax_m3",
    "mistral",
    "muse_glimmer",
    "olmo3",
    "openai",
    "phi4_mini_json",
    "plamo3",
    "poolside_v1",
    "pythonic",
    "qwen3_coder",
    "qwen3_json",
    "qwen3_xml",
    "seed_oss",
    "step3",
    "step3p5",
    "xlam",
)


def arg_collision(args: Sequence[str]) -> tuple[str, str] | None:
    """(the argument, why it may not be passed) for the first of `args` that sets what Stoker
    manages or what a named setting sets, or None. `--flag=value` and `--flag value` alike; a
    leading word that is no flag is refused too (vLLM would take it for the model)."""
    for i, arg in enumerate(args):
        name = arg.split("=", 1)[0]
        if name in MANAGED_ARGS:
            return name, f"Stoker sets it ({MANAGED_ARGS[name]})"
        if name in NAMED_ARGS:
            return name, f"use the '{NAMED_ARGS[name]}' setting"
        if i == 0 and not arg.startswith("-"):
            return arg, "a positional argument would be taken for the model"
    return None


@dataclass(frozen=True)
class EngineSettings:
    gpus: int | None = None
    dtype: str = "auto"
    quantization: str | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = None
    max_adapters: int | None = None  # LoRA adapters at once: the CPU engine's LRU, vLLM's --max-loras
    max_adapter_rank: int | None = None  # the largest LoRA rank loaded (None: MAX_LORA_RANK)
    task: str = "generate"  # or "embed": embeddings only
    enable_prefix_caching: bool | None = None
    enforce_eager: bool = False
    tool_call_parser: str | None = None  # vLLM's --tool-call-parser (with --enable-auto-tool-choice)
    scheduling_policy: str | None = None  # vLLM's --scheduling-policy (None: vLLM's, fcfs)
    engine_args: tuple[str, ...] = ()
    cpu: str | None = None
    memory: str | None = None
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()

    def __post_init__(self) -> None:
        # As read back from JSON: lists and dicts, made the same values as those built here.
        object.__setattr__(self, "engine_args", tuple(self.engine_args))
        object.__setattr__(self, "node_selector", dict(self.node_selector))
        object.__setattr__(self, "tolerations", tuple(dict(t) for t in self.tolerations))

    def devices(self, engine: str, cpu_build: bool = False) -> int:
        """The devices an instance of `engine` takes: `gpus`, else the engine's default."""
        if self.gpus is not None:
            return self.gpus
        return 1 if engine == "vllm" and not cpu_build else 0

    def vllm_args(self) -> tuple[str, ...]:
        """The named settings as vLLM arguments (dtype and context length are the launch's: they
        default from the snapshot), then `engine_args`."""
        args: list[str] = []
        if self.task == "embed":
            args += ["--runner", "pooling"]  # vLLM's pooling runner: /v1/embeddings
        if self.quantization is not None:
            args += ["--quantization", self.quantization]
        if self.gpu_memory_utilization is not None:
            args += ["--gpu-memory-utilization", f"{self.gpu_memory_utilization:g}"]
        if self.max_num_seqs is not None:
            args += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.enable_prefix_caching is not None:
            args.append(
                "--enable-prefix-caching" if self.enable_prefix_caching else "--no-enable-prefix-caching"
            )
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.tool_call_parser is not None:
            args += ["--enable-auto-tool-choice", "--tool-call-parser", self.tool_call_parser]
        if self.scheduling_policy is not None:
            args += ["--scheduling-policy", self.scheduling_policy]
        if self.max_adapters is not None:
            # Adapters loaded at run time (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`, which `vllm_spec` sets
            # with --enable-lora): --max-loras of them in one batch, and as many kept in host memory
            # (vLLM's --max-cpu-loras default); one more is read from its directory again when asked.
            args += ["--enable-lora", "--max-loras", str(self.max_adapters)]
            args += ["--max-lora-rank", str(self.adapter_rank)]
        return (*args, *self.engine_args)

    def takes_priority(self, engine: str) -> bool:
        """Whether an instance of `engine` orders its own queue by a body's `priority`: Stoker's
        engine always does; vLLM with --scheduling-policy priority (it refuses a nonzero one else)."""
        return engine == "cpu" or self.scheduling_policy == "priority"

    @property
    def adapter_rank(self) -> int:
        """The largest LoRA rank an instance loads."""
        return MAX_LORA_RANK if self.max_adapter_rank is None else self.max_adapter_rank

    def pod_resources(self) -> dict[str, str]:
        """A pod's requests of CPU and memory (limits are the cluster's policy)."""
        return {k: v for k, v in (("cpu", self.cpu), ("memory", self.memory)) if v is not None}
