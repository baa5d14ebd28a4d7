"""A deployment's engine settings: validated once (a 400 naming the field, the value and what it
must be), carried by each revision (a change needs new instances), round-tripped through JSON."""

from __future__ import annotations

import json

import pytest

from stoker.errors import APIError
from stoker.spec.deployment import DeploymentSpec, validate
from stoker.spec.engine import SETTINGS, validate_engine
from warm_pool.engine_settings import EngineSettings, arg_collision


def body(**settings) -> dict:
    return {"name": "big", "model": "m", "engine": "vllm", **settings}


def refused(b: dict) -> APIError:
    with pytest.raises(APIError) as caught:
        validate(b)
    assert caught.value.status == 400
    return caught.value


def test_left_out_or_null_every_setting_is_the_engines_default():
    out = validate(body())
    assert DeploymentSpec.from_dict({**out, "snapshot_id": "s"}).engine_settings == EngineSettings()
    nulls = validate(body(**dict.fromkeys(SETTINGS)))
    assert {k: nulls[k] for k in SETTINGS} == {k: out[k] for k in SETTINGS}


def test_the_done_when_deploy_is_accepted_and_carried():
    out = validate(body(gpus=2, max_model_len=8192, dtype="bfloat16", engine_args=["--swap-space=4"]))
    spec = DeploymentSpec.from_dict({**out, "snapshot_id": "s"})
    s = spec.engine_settings
    assert (s.gpus, s.max_model_len, s.dtype, s.engine_args) == (2, 8192, "bfloat16", ("--swap-space=4",))
    assert s.devices("vllm") == 2 and EngineSettings().devices("vllm") == 1
    assert EngineSettings().devices("vllm", cpu_build=True) == 0 and EngineSettings().devices("cpu") == 0


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("gpus", 65, "'gpus' must be an integer in 0..64, got 65."),
        ("gpus", True, "'gpus' must be an integer in 0..64, got True."),
        ("gpus", "2", "'gpus' must be an integer in 0..64, got '2'."),
        ("dtype", "fp4", "'dtype' must be one of auto, half, float16, bfloat16, float, float32, got 'fp4'."),
        ("max_model_len", 8, "'max_model_len' must be an integer in 16..16777216, got 8."),
        (
            "gpu_memory_utilization",
            0,
            "'gpu_memory_utilization' must be a number above 0 and at most 1, got 0.",
        ),
        ("gpu_memory_utilization", 1.5, "got 1.5"),
        ("max_num_seqs", 0, "'max_num_seqs' must be an integer in 1..65536, got 0."),
        ("enforce_eager", "yes", "'enforce_eager' must be true or false, got 'yes'."),
        ("quantization", "FP8; rm -rf", "'quantization' must be a vLLM quantization method's name"),
        ("cpu", "four", "'cpu' must be a Kubernetes CPU quantity such as 4, 1.5 or 500m, got 'four'."),
        ("memory", "16 GB", "'memory' must be a Kubernetes memory quantity"),
        (
            "node_selector",
            {"bad key!": "x"},
            "'node_selector' must be an object of at most 32 Kubernetes labels",
        ),
        (
            "tolerations",
            [{"key": "gpu", "operator": "Maybe"}],
            "(tolerations[0].operator: 'Maybe' is not one of",
        ),
        ("tolerations", [{"key": "gpu", "colour": "red"}], "tolerations[0]"),
        ("engine_args", ["--x"] * 65, "'engine_args' must be a list of at most 64 vLLM arguments"),
        ("engine_args", ["--x\n--port=1"], "'engine_args' must be a list"),
    ],
)
def test_a_bad_value_is_a_400_naming_the_field_the_value_and_what_it_must_be(field, value, says):
    error = refused(body(**{field: value}))
    assert error.param == field and says in error.message, error.message


@pytest.mark.parametrize(
    ("arg", "why"),
    [
        ("--port=9000", "Stoker sets it (the port is the instance's)"),
        ("--host", "Stoker sets it"),
        ("--api-key=x", "the key is the instance's own"),
        ("--enable-sleep-mode", "sleep mode"),
        ("--served-model-name", "served name"),
        ("--tensor-parallel-size=2", "use 'gpus'"),
        ("-tp", "use 'gpus'"),
        ("--middleware=evil.Mw", "the engine's guard is Stoker's"),
        ("--config=/etc/x.yaml", "a config file"),
        ("--dtype=half", "use the 'dtype' setting"),
        ("--max-model-len=4096", "use the 'max_model_len' setting"),
        ("--enable-lora", "use the 'max_adapters' setting"),
        ("--no-enable-lora", "use the 'max_adapters' setting"),
        ("--max-loras=8", "use the 'max_adapters' setting"),
        ("--max-lora-rank=128", "use the 'max_adapter_rank' setting"),
        ("--runner=pooling", "use the 'task' setting"),
        ("--task", "use the 'task' setting"),
        ("some/model", "a positional argument"),
    ],
)
def test_a_passthrough_argument_that_collides_is_refused_naming_it(arg, why):
    error = refused(body(engine_args=[arg]))
    name = arg.split("=", 1)[0]
    assert error.param == "engine_args" and f"may not pass {name}" in error.message and why in error.message
    assert arg_collision(["--swap-space", "4", "--seed=1"]) is None  # a flag's value is no positional


def test_settings_of_another_engine_are_refused_naming_the_engines_they_belong_to():
    error = refused({**body(quantization="fp8"), "engine": "cpu"})
    assert error.message == "'quantization' is a setting of the vllm engine, not of 'cpu'."
    error = refused({**body(gpus=2), "engine": "cpu"})
    assert "'gpus' must be 0 or 1 for Stoker's engine" in error.message
    error = refused({**body(dtype="half"), "engine": "cpu"})
    assert error.param == "dtype" and "for Stoker's engine" in error.message
    ok = validate(
        {**body(gpus=1, dtype="bfloat16", max_model_len=512, cpu="2", memory="4Gi"), "engine": "cpu"}
    )
    assert (ok["gpus"], ok["dtype"], ok["cpu"]) == (1, "bfloat16", "2")


def test_json_round_trip_and_a_changed_setting_needs_new_instances():
    out = validate(
        body(
            gpus=2,
            enable_prefix_caching=False,
            node_selector={"nvidia.com/gpu.product": "H200"},
            tolerations=[{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}],
            engine_args=["--seed", "7"],
        )
    )
    spec = DeploymentSpec.from_dict({**out, "snapshot_id": "s", "revision": 1})
    flat = json.loads(json.dumps(spec.to_dict()))
    assert "engine_settings" not in flat and flat["gpus"] == 2 and flat["engine_args"] == ["--seed", "7"]
    again = DeploymentSpec.from_dict(flat)
    assert again == spec and again.serves_like(spec)
    changed = DeploymentSpec.from_dict({**flat, "max_model_len": 4096})
    assert not changed.serves_like(spec)
    # A revision stored before engine settings existed reads back with the defaults.
    old = {k: v for k, v in flat.items() if k not in SETTINGS}
    assert DeploymentSpec.from_dict(old).engine_settings == EngineSettings()


def test_the_named_settings_become_vllms_arguments_then_the_passthrough_ones():
    s = EngineSettings(
        quantization="fp8",
        gpu_memory_utilization=0.85,
        max_num_seqs=64,
        enable_prefix_caching=False,
        enforce_eager=True,
        engine_args=("--seed=7",),
    )
    assert s.vllm_args() == (
        "--quantization", "fp8", "--gpu-memory-utilization", "0.85", "--max-num-seqs", "64",
        "--no-enable-prefix-caching", "--enforce-eager", "--seed=7",
    )  # fmt: skip


def test_validate_engine_keeps_every_settings_key():
    assert set(validate_engine({}, "cpu")) == set(SETTINGS)


def test_max_adapters_on_vllm_is_its_run_time_lora():
    """vLLM serves adapters only where the deployment asks for them: --enable-lora, as many in a batch
    as `max_adapters` (--max-loras), of rank 64 at most (vLLM's default, 16, is too small for many)."""
    ok = validate(body(max_adapters=3))
    assert ok["max_adapters"] == 3
    assert validate({**body(max_adapters=2), "engine": "cpu"})["max_adapters"] == 2
    assert EngineSettings(max_adapters=3, enforce_eager=True, engine_args=("--seed=7",)).vllm_args() == (
        "--enforce-eager", "--enable-lora", "--max-loras", "3", "--max-lora-rank", "64", "--seed=7",
    )  # fmt: skip
    assert "--enable-lora" not in EngineSettings().vllm_args()


def test_max_adapter_rank_is_both_engines_largest_lora_rank():
    assert validate(body(max_adapters=2, max_adapter_rank=128))["max_adapter_rank"] == 128
    assert validate({**body(max_adapter_rank=16), "engine": "cpu"})["max_adapter_rank"] == 16
    args = EngineSettings(max_adapters=2, max_adapter_rank=256).vllm_args()
    assert args[args.index("--max-lora-rank") + 1] == "256"
    assert EngineSettings().adapter_rank == 64 and EngineSettings(max_adapter_rank=8).adapter_rank == 8
    for bad in (100, 512, 0, "64", True):  # vLLM's ranks up to what an adapter snapshot may hold
        error = refused(body(max_adapter_rank=bad))
        assert error.param == "max_adapter_rank" and "one of 8, 16, 32, 64, 128, 256" in error.message


def test_task_embed_is_vllms_pooling_runner_on_either_engine():
    assert validate(body(task="embed"))["task"] == "embed"
    assert validate({**body(task="embed"), "engine": "cpu"})["task"] == "embed"
    assert EngineSettings(task="embed").vllm_args()[:2] == ("--runner", "pooling")
    assert "--runner" not in EngineSettings().vllm_args()
    error = refused(body(task="classify"))
    assert error.param == "task" and "generate or embed" in error.message


def test_a_tool_call_parser_turns_on_vllms_auto_tool_choice():
    assert validate(body(tool_call_parser="hermes"))["tool_call_parser"] == "hermes"
    assert EngineSettings(tool_call_parser="llama3_json").vllm_args() == (
        "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json",
    )  # fmt: skip
    assert "--enable-auto-tool-choice" not in EngineSettings().vllm_args()
    error = refused(body(tool_call_parser="herm3s"))  # caught at deploy, not at the instance's start
    assert error.param == "tool_call_parser" and "tool-call parsers" in error.message
    error = refused({**body(tool_call_parser="hermes"), "engine": "cpu"})  # it reads its calls itself
    assert error.param == "tool_call_parser" and "vllm" in error.message
    for arg in ("--tool-call-parser=hermes", "--enable-auto-tool-choice"):
        assert arg_collision([arg]) == (arg.split("=")[0], "use the 'tool_call_parser' setting")


def test_scheduling_policy_is_vllms_and_says_which_engines_take_a_priority():
    assert validate(body(scheduling_policy="priority"))["scheduling_policy"] == "priority"
    assert EngineSettings(scheduling_policy="priority").vllm_args() == ("--scheduling-policy", "priority")
    assert "--scheduling-policy" not in EngineSettings().vllm_args()  # vLLM's own default: fcfs
    error = refused(body(scheduling_policy="lifo"))
    assert error.param == "scheduling_policy" and "fcfs or priority" in error.message
    error = refused({**body(scheduling_policy="priority"), "engine": "cpu"})
    assert error.param == "scheduling_policy" and "of the vllm engine" in error.message
    error = refused(body(engine_args=["--scheduling-policy=priority"]))
    assert "use the 'scheduling_policy' setting" in error.message
    # Stoker's engine always orders its queue by priority; vLLM only under the priority policy.
    assert EngineSettings().takes_priority("cpu")
    assert not EngineSettings().takes_priority("vllm")
    assert not EngineSettings(scheduling_policy="fcfs").takes_priority("vllm")
    assert EngineSettings(scheduling_policy="priority").takes_priority("vllm")
