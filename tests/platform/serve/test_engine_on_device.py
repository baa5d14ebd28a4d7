"""Stoker's engine given a device from the platform: `stoker deploy --gpus 1` on a machine whose GPU
inventory lists one (`STOKER_GPUS=0`) starts the instance with `--device auto` and
`CUDA_VISIBLE_DEVICES` naming the device it was given. On this machine torch sees no GPU, so the
engine runs on the CPU by its own choice (`weights.choose_device`) and serves as ever; on a GPU
machine the same launch runs it on CUDA (the GPU check, `bench/gpu_check.py`)."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.deadlines import deadline
from tests.platform.conftest import PlatformProcess
from tests.platform.engine.conftest import free_port


def proc_file(pid: int, name: str) -> list[str]:
    return Path(f"/proc/{pid}/{name}").read_bytes().decode().split("\0")


def test_deploy_gpus_1_starts_the_engine_on_the_device_it_was_given(tmp_path, tiny_model_dir):
    p = PlatformProcess(tmp_path / "home", free_port(), (), extra_env={"STOKER_GPUS": "0"}).start()
    try:
        p.deploy("ondevice", tiny_model_dir, "--gpus", "1", "--idle-timeout", "600")
        body = {"model": "ondevice", "prompt": "x", "max_tokens": 2}
        r = httpx.post(f"{p.url}/v1/completions", json=body, timeout=deadline(180))
        assert r.status_code == 200, r.text
        [inst] = p.admin_get("/admin/v1/deployments/ondevice")["instance_list"]
        pid = int(inst["runs_as"].removeprefix("pid "))
        argv = proc_file(pid, "cmdline")
        assert argv[argv.index("--device") + 1] == "auto", argv
        assert "CUDA_VISIBLE_DEVICES=0" in proc_file(pid, "environ")
        log = p.cli("logs", "ondevice", "--instance", inst["id"]).stdout
        assert " on cpu at http://" in log  # torch sees no GPU here: the engine chose the CPU itself
    finally:
        p.stop()
