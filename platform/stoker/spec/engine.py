"""A deployment's engine settings (`warm_pool.engine_settings.EngineSettings`): each one's schema,
default, the engines it applies to and its help, written once. The deploy body validates with it
(`validate_engine`), the OpenAPI schema and the reference page are generated from it, and
`stoker deploy`'s flags are named by it (vLLM's own names: `--dtype`, `--max-model-len` …).

A setting left out or null is the default. A setting that does not apply to the deployment's
engine is refused, naming the engines it applies to: Stoker's engine takes `gpus` 0 or 1 (1: it
runs on CUDA), `dtype`, `max_model_len`, `task`, `max_adapters` and `max_adapter_rank`; vLLM takes every one. The pod settings (`cpu`,
`memory`, `node_selector`, `tolerations`) are the Kubernetes backend's, for either engine; a local
backend runs processes and does not use them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

from stoker.errors import invalid
from warm_pool.engine_settings import (
    ADAPTER_RANKS,
    SCHEDULING_POLICIES,
    TOOL_CALL_PARSERS,
    EngineSettings,
    arg_collision,
)

ENGINES = ("cpu", "vllm")
# vLLM's --dtype choices; Stoker's engine takes the three it computes in.
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
CPU_ENGINE_DTYPES = ("auto", "float32", "bfloat16", "float16")
# Kubernetes label keys ([prefix/]name) and values, and resource quantities.
_LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL_KEY = rf"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?{_LABEL_NAME}$"
_LABEL_VALUE = rf"^({_LABEL_NAME})?$"
_CPU = r"^([0-9]{1,6}m|[0-9]{1,4}(\.[0-9]{1,3})?)$"
_MEMORY = r"^[0-9]{1,12}(\.[0-9]{1,3})?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$"
# An argument: printable, no whitespace but spaces inside a value, bounded.
_ARG = r"^[^\x00-\x1f\x7f]{1,512}$"


@dataclass(frozen=True)
class Setting:
    schema: dict[str, Any]  # JSON Schema of a value (null always means the default)
    describe: str  # what a value must be, as an error says it: "an integer in 0..64"
    help: str
    engines: tuple[str, ...] = ENGINES


SETTINGS: dict[str, Setting] = {
    "gpus": Setting(
        {"type": "integer", "minimum": 0, "maximum": 64},
        "an integer in 0..64",
        "devices per instance, acquired and released together on one node: vLLM's tensor-parallel "
        "size; Stoker's engine takes 0 or 1 (1: on CUDA) (default: vLLM 1, its CPU build 0; Stoker's engine 0)",
    ),
    "dtype": Setting(
        {"enum": list(DTYPES)},
        f"one of {', '.join(DTYPES)}",
        "the weights' dtype (default auto: the snapshot's)",
    ),
    "quantization": Setting(
        {"type": "string", "pattern": r"^[a-z0-9][a-z0-9_-]{0,39}$"},
        "a vLLM quantization method's name, such as fp8, awq or gptq",
        "vLLM's --quantization (default: none, or what the checkpoint says)",
        ("vllm",),
    ),
    "max_model_len": Setting(
        {"type": "integer", "minimum": 16, "maximum": 16_777_216},
        "an integer in 16..16777216",
        "the context window in tokens (default: the model's)",
    ),
    "gpu_memory_utilization": Setting(
        {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "a number above 0 and at most 1",
        "the share of each device's memory vLLM takes (default: vLLM's, 0.9)",
        ("vllm",),
    ),
    "max_num_seqs": Setting(
        {"type": "integer", "minimum": 1, "maximum": 65_536},
        "an integer in 1..65536",
        "sequences vLLM batches at once (default: vLLM's)",
        ("vllm",),
    ),
    "max_adapters": Setting(
        {"type": "integer", "minimum": 1, "maximum": 1024},
        "an integer in 1..1024",
        "LoRA adapters each instance keeps loaded, the least recently used evicted; vLLM's --enable-lora "
        "--max-loras N, without which it serves none (default: Stoker's engine 4, vLLM none)",
    ),
    "task": Setting(
        {"enum": ["generate", "embed"]},
        "generate or embed",
        "what an instance serves: generate (chat and completions) or embed (/v1/embeddings only; "
        "vLLM's --runner pooling) (default: generate)",
    ),
    "max_adapter_rank": Setting(
        {"enum": list(ADAPTER_RANKS)},
        f"one of {', '.join(map(str, ADAPTER_RANKS))}",
        "the largest LoRA rank an instance loads: the CPU engine's and vLLM's --max-lora-rank; on a GPU "
        "each adapter slot reserves room for it (default: 64)",
    ),
    "enable_prefix_caching": Setting(
        {"type": "boolean"}, "true or false", "vLLM's prefix caching (default: vLLM's)", ("vllm",)
    ),
    "enforce_eager": Setting(
        {"type": "boolean"},
        "true or false",
        "no CUDA graphs: a shorter start, a slower decode (default: false)",
        ("vllm",),
    ),
    "tool_call_parser": Setting(
        {"enum": list(TOOL_CALL_PARSERS)},
        "one of vLLM's tool-call parsers (hermes, llama3_json, mistral, pythonic, ...)",
        "how vLLM reads tool calls out of the model's text: --enable-auto-tool-choice --tool-call-parser "
        "NAME, without which vLLM refuses tool_choice auto (default: none)",
        ("vllm",),
    ),
    "scheduling_policy": Setting(
        {"enum": list(SCHEDULING_POLICIES)},
        "fcfs or priority",
        "vLLM's --scheduling-policy: fcfs (arrival order) or priority (by a request's `priority`, lower "
        "first); under fcfs no nonzero priority is forwarded to vLLM and only the hold queue orders by "
        "it; Stoker's engine always orders by it (default: fcfs)",
        ("vllm",),
    ),
    "engine_args": Setting(
        {"type": "array", "maxItems": 64, "items": {"type": "string", "pattern": _ARG}},
        "a list of at most 64 vLLM arguments of at most 512 printable characters each",
        "further vLLM arguments, passed through; those Stoker manages (port, host, model, served name, "
        "API key, sleep mode, tensor parallel) and those named above are refused",
        ("vllm",),
    ),
    "cpu": Setting(
        {"type": "string", "pattern": _CPU},
        "a Kubernetes CPU quantity such as 4, 1.5 or 500m",
        "a pod's CPU request (default: none)",
    ),
    "memory": Setting(
        {"type": "string", "pattern": _MEMORY},
        "a Kubernetes memory quantity such as 16Gi or 512Mi",
        "a pod's memory request (default: none)",
    ),
    "node_selector": Setting(
        {
            "type": "object",
            "maxProperties": 32,
            "propertyNames": {"pattern": _LABEL_KEY, "maxLength": 317},
            "additionalProperties": {"type": "string", "pattern": _LABEL_VALUE},
        },
        "an object of at most 32 Kubernetes labels (key: value)",
        "the node labels a pod's node must have (default: any node)",
    ),
    "tolerations": Setting(
        {
            "type": "array",
            "maxItems": 32,
            "items": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "key": {"type": "string", "pattern": _LABEL_KEY},
                    "operator": {"enum": ["Exists", "Equal"]},
                    "value": {"type": "string", "pattern": _LABEL_VALUE},
                    "effect": {"enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"]},
                    "tolerationSeconds": {"type": "integer", "minimum": 0, "maximum": 31_536_000},
                },
            },
        },
        "a list of at most 32 Kubernetes tolerations (key, operator, value, effect, tolerationSeconds)",
        "the taints a pod tolerates, beyond the GPU taint a GPU pod always tolerates (default: none)",
    ),
}
assert set(SETTINGS) == {f.name for f in fields(EngineSettings)}, "a setting without its table entry"
_DEFAULTS = {f.name: f.default for f in fields(EngineSettings) if not callable(f.default_factory)}
_VALIDATORS = {name: Draft202012Validator(s.schema) for name, s in SETTINGS.items()}


def default(name: str) -> Any:
    """A setting's default, as the deploy body writes it."""
    return {"node_selector": {}, "tolerations": [], "engine_args": []}.get(name, _DEFAULTS.get(name))


def validate_engine(body: dict[str, Any], engine: str) -> dict[str, Any]:
    """The engine settings of a deploy body, checked (400 naming the field, the value and what it
    must be) and with their defaults; the keys are `EngineSettings`' fields."""
    out: dict[str, Any] = {}
    for name, setting in SETTINGS.items():
        value = body.get(name)
        if value is None or value == default(name):
            out[name] = _DEFAULTS.get(name, default(name))
            continue
        # JSON booleans are not integers here, though Python's bool is an int.
        if isinstance(value, bool) and setting.schema.get("type") in ("integer", "number"):
            raise invalid(f"'{name}' must be {setting.describe}, got {value!r}.", name)
        error = best_match(_VALIDATORS[name].iter_errors(value))
        if error is not None:
            where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
            detail = f" ({name}{where}: {error.message})" if where else ""
            raise invalid(f"'{name}' must be {setting.describe}, got {_shown(value)}{detail}.", name)
        if engine not in setting.engines:
            raise invalid(
                f"'{name}' is a setting of the {' and '.join(setting.engines)} engine, not of {engine!r}.",
                name,
            )
        out[name] = value
    if engine == "cpu":
        if out["gpus"] is not None and out["gpus"] > 1:
            raise invalid(
                f"'gpus' must be 0 or 1 for Stoker's engine (it runs on one device), got {out['gpus']}.",
                "gpus",
            )
        if out["dtype"] not in CPU_ENGINE_DTYPES:
            raise invalid(
                f"'dtype' must be one of {', '.join(CPU_ENGINE_DTYPES)} for Stoker's engine, got {out['dtype']!r}.",
                "dtype",
            )
    if (clash := arg_collision(out["engine_args"])) is not None:
        raise invalid(f"'engine_args' may not pass {clash[0]}: {clash[1]}.", "engine_args")
    return out


def settings_of(values: dict[str, Any]) -> EngineSettings:
    return EngineSettings(**{k: values[k] for k in SETTINGS if k in values})


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
