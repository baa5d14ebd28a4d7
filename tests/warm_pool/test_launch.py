"""The commands that start engines, byte for byte, and the GPU inventory that places vLLM ones."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from warm_pool.errors import InvalidConfig, NoGpuAvailable
from warm_pool.launch import (
    VLLM_GUARD,
    VLLM_GUARD_DIR,
    GpuInventory,
    LaunchSpec,
    cpu_engine_spec,
    vllm_spec,
    with_python_path,
)

SNAP = Path("/data/snapshots/abc123")


def test_cpu_engine_command():
    spec = cpu_engine_spec(SNAP, 41234, "smollm2", threads=2, stoker_executable="/opt/bin/stoker")
    assert spec.argv == (
        "/opt/bin/stoker", "engine", "--snapshot", "/data/snapshots/abc123", "--port", "41234",
        "--host", "127.0.0.1", "--served-model-name", "smollm2", "--device", "cpu", "--threads", "2",
    )  # fmt: skip
    assert dict(spec.env) == {"PYTHONUNBUFFERED": "1"}
    assert spec.health_path == "/health"


def test_cpu_engine_defaults_to_the_stoker_script_beside_this_python():
    spec = cpu_engine_spec(SNAP, 8001, "m", host="::1", extra_args=("--grace-period", "5"))
    assert spec.argv[0] == str(Path(sys.executable).with_name("stoker"))
    assert spec.argv[1:] == (
        "engine", "--snapshot", str(SNAP), "--port", "8001", "--host", "::1", "--served-model-name", "m",
        "--device", "cpu", "--grace-period", "5",
    )  # fmt: skip


def test_vllm_on_one_gpu_with_sleep_mode_behind_the_guard():
    spec = vllm_spec(
        SNAP, 8000, "llama", [3], dtype="bfloat16", max_model_len=8192, cache_root=Path("/c/w"), api_key="k"
    )
    assert spec.argv == (
        "vllm", "serve", "abc123", "--host", "127.0.0.1", "--port", "8000",
        "--served-model-name", "llama", "--dtype", "bfloat16", "--max-model-len", "8192",
        "--enable-sleep-mode", "--middleware", "stoker_vllm_guard.EngineGuard",
    )  # fmt: skip
    assert spec.cwd == Path("/data/snapshots")  # the model is named relative to the store
    assert dict(spec.env) == {
        "PYTHONUNBUFFERED": "1",
        "VLLM_NO_USAGE_STATS": "1",  # nothing about what runs is sent to vLLM's usage server
        "VLLM_DO_NOT_TRACK": "1",
        "CUDA_VISIBLE_DEVICES": "3",
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_API_KEY": "k",  # also the guard's
        "VLLM_CACHE_ROOT": "/c/w",
        "TORCHINDUCTOR_CACHE_DIR": "/c/w/inductor",
    }
    assert spec.secret_env == {"VLLM_API_KEY"}
    assert spec.python_path == (str(VLLM_GUARD_DIR),)  # where vLLM's Python finds the guard


def test_vllm_dev_mode_is_never_started_without_the_guard():
    with pytest.raises(ValueError, match="sleep mode needs an api_key"):
        vllm_spec(SNAP, 8000, "llama", [3])
    bare = vllm_spec(SNAP, 8000, "m", [], sleep_mode=False)
    assert "--middleware" not in bare.argv and "VLLM_SERVER_DEV_MODE" not in bare.env
    assert bare.python_path == ()
    keyed = vllm_spec(SNAP, 8000, "m", [], sleep_mode=False, api_key="k", extra_args=("--enforce-eager",))
    assert keyed.argv[-3:] == ("--middleware", VLLM_GUARD, "--enforce-eager")


def test_the_guards_directory_goes_ahead_on_the_programs_python_path():
    spec = LaunchSpec(("vllm",), {"A": "1"}, python_path=("/guard",))
    assert spec.environ({"PYTHONPATH": "/src", "B": "2"}) == {"PYTHONPATH": "/guard:/src", "A": "1", "B": "2"}
    assert spec.environ({})["PYTHONPATH"] == "/guard"
    assert LaunchSpec(("x",)).environ({"B": "2"}) == {"B": "2"}  # nothing to add: unchanged
    parent = {"PYTHONPATH": "/src"}
    assert with_python_path(parent, ["/a", "/b"])["PYTHONPATH"] == "/a:/b:/src"
    assert parent == {"PYTHONPATH": "/src"}


def test_vllm_cpu_build_has_no_sleep_mode_and_a_host_kv_cache():
    spec = vllm_spec(
        SNAP, 8000, "m", [], dtype="float32", sleep_mode=False, cpu_kv_cache_gib=2,
        vllm_command=("/v/bin/vllm",), extra_args=("--enforce-eager",),
    )  # fmt: skip
    assert spec.argv == (
        "/v/bin/vllm", "serve", "abc123", "--host", "127.0.0.1", "--port", "8000",
        "--served-model-name", "m", "--dtype", "float32", "--distributed-executor-backend", "uni",
        "--enforce-eager",
    )  # fmt: skip
    assert dict(spec.env) == {
        "PYTHONUNBUFFERED": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # else vLLM's CPU platform turns `uni` back into `mp`
    }
    with pytest.raises(ValueError, match="sleep mode needs a GPU"):
        vllm_spec(SNAP, 8000, "m", [], sleep_mode=True)


def test_vllm_with_lora_enabled_serves_its_run_time_lora_api():
    spec = vllm_spec(SNAP, 8000, "m", [], sleep_mode=False, extra_args=("--enable-lora", "--max-loras", "2"))
    assert spec.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in vllm_spec(SNAP, 8000, "m", [], sleep_mode=False).env


def test_vllm_tensor_parallel_over_the_gpus_it_was_given():
    spec = vllm_spec(SNAP, 8000, "big", [4, 5, 6, 7], extra_args=("--max-num-seqs", "64"), api_key="k")
    assert spec.argv[-7:-4] == ("--tensor-parallel-size", "4", "--enable-sleep-mode")
    assert spec.argv[-2:] == ("--max-num-seqs", "64")
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"


def test_a_spec_cannot_be_changed_after_it_is_built():
    env = {"A": "1"}
    spec = LaunchSpec(["x", "y"], env)  # type: ignore[arg-type]
    env["A"] = "2"
    assert spec.argv == ("x", "y") and spec.env["A"] == "1"
    with pytest.raises(TypeError):
        spec.env["B"] = "3"  # type: ignore[index]
    assert spec == LaunchSpec(("x", "y"), {"A": "1"})


def test_inventory_hands_out_the_lowest_free_gpus_and_takes_them_back():
    inv = GpuInventory([0, 1, 2, 3])
    assert inv.acquire(2, "a-1") == [0, 1]
    assert inv.acquire(1, "b-1") == [2]
    with pytest.raises(NoGpuAvailable) as err:
        inv.acquire(2, "c-1")
    assert str(err.value) == "c-1 needs 2 GPUs, 1 free of 4 (held: a-1: [0, 1], b-1: [2])"
    assert inv.release("a-1") == [0, 1]
    assert inv.release("a-1") == []  # twice is fine
    assert inv.acquire(2, "c-1") == [0, 1]
    assert inv.free() == [3] and inv.held_by("b-1") == [2]


def test_inventory_refuses_misuse():
    inv = GpuInventory([0, 1])
    inv.acquire(1, "a")
    with pytest.raises(ValueError, match="a already holds GPUs"):
        inv.acquire(1, "a")
    with pytest.raises(ValueError, match="n >= 1, got 0"):
        inv.acquire(0, "b")
    with pytest.raises(NoGpuAvailable, match="b needs 1 GPU, 0 free of 0"):
        GpuInventory([]).acquire(1, "b")
    with pytest.raises(InvalidConfig, match="distinct"):
        GpuInventory([0, 0])


@pytest.mark.parametrize(
    ("environ", "gpus"),
    [
        ({}, []),
        ({"CUDA_VISIBLE_DEVICES": "0,1,3"}, [0, 1, 3]),
        ({"STOKER_GPUS": "2", "CUDA_VISIBLE_DEVICES": "0,1"}, [2]),
        ({"STOKER_GPUS": ""}, []),
        ({"CUDA_VISIBLE_DEVICES": " 1, 2 ,"}, [1, 2]),
        ({"CUDA_VISIBLE_DEVICES": "-1"}, []),
        ({"CUDA_VISIBLE_DEVICES": "0,1,-1,2"}, [0, 1]),  # CUDA stops at the first invalid index
    ],
)
def test_inventory_from_env(environ, gpus):
    assert list(GpuInventory.from_env(environ).gpus) == gpus


def test_inventory_from_env_refuses_what_it_cannot_read():
    with pytest.raises(InvalidConfig) as err:
        GpuInventory.from_env({"CUDA_VISIBLE_DEVICES": "GPU-8f2c"})
    assert err.value.field == "CUDA_VISIBLE_DEVICES"
    assert str(err.value) == "CUDA_VISIBLE_DEVICES must list GPU indices like 0,1,3, got 'GPU-8f2c'"


def test_an_instances_key_travels_in_its_environment_never_its_command_line():
    cpu = cpu_engine_spec(SNAP, 8001, "m", api_key="k1")
    vllm = vllm_spec(SNAP, 8000, "m", [], sleep_mode=False, api_key="k2")
    assert cpu.env["STOKER_ENGINE_API_KEY"] == "k1" and "k1" not in cpu.argv
    assert vllm.env["VLLM_API_KEY"] == "k2" and "k2" not in vllm.argv
    assert "STOKER_ENGINE_API_KEY" not in cpu_engine_spec(SNAP, 8001, "m").env


def test_vllm_serves_https_with_the_files_it_is_given():
    spec = vllm_spec(Path("/s/snap"), 8001, "m", [], sleep_mode=False, ssl_files=("/t/tls.crt", "/t/tls.key"))
    args = list(spec.args)
    assert args[args.index("--ssl-certfile") + 1] == "/t/tls.crt"
    assert args[args.index("--ssl-keyfile") + 1] == "/t/tls.key"
    assert "--ssl-certfile" not in vllm_spec(Path("/s/snap"), 8001, "m", [], sleep_mode=False).args
