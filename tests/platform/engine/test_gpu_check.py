"""bench/gpu_check.py: the GPU check's own steps, run end to end on the CPU with `--tiny`.

The 8B run needs a GPU; what can go wrong before it (a snapshot whose names miss the engine's
fast path, a figure left out, an import that a bare GPU machine lacks) shows here in seconds.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stoker.engine import weights
from tests.deadlines import deadline

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "bench" / "gpu_check.py"
# What the GPU machine does not have: the check must not import any of it.
NOT_THERE = {
    "starlette",
    "uvicorn",
    "aiohttp",
    "prometheus_client",
    "vllm",
    "snapshots",
    "activator",
    "warm_pool",
}
PHASES = ("interpreter_s", "imports_s", "device_init_s", "load_s", "first_token_s")


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # as `python bench/gpu_check.py` has it
    return importlib.import_module("gpu_check")


def test_the_8b_snapshot_has_every_tensor_of_llama_3_8b_by_its_name(gpu_check, tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps(gpu_check.llama_config(gpu_check.LLAMA3_8B, "bfloat16")))
    model = weights.empty_model(tmp_path, torch.bfloat16)  # the engine's own model, on the meta device
    written = dict(gpu_check.llama_tensors(gpu_check.LLAMA3_8B))
    assert written == {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert sum(t.numel() for t in model.parameters()) == 8_030_261_248  # Llama-3-8B's count


@pytest.mark.slow  # 9-10 s alone here (three fresh interpreters import torch and transformers)
def test_tiny_check_runs_end_to_end_and_reports_every_figure(tmp_path: Path, stoker_env):
    out = tmp_path / "check.json"
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", "--dir", str(tmp_path / "snapshot")]
    r = subprocess.run(
        [*cmd, "--out", str(out)], env=stoker_env, capture_output=True, text=True, timeout=deadline(600)
    )
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout)  # one JSON object on stdout, progress on stderr
    assert json.loads(out.read_text()) == result
    assert result["errors"] == []
    assert result["device"] == "cpu" and result["shape"] == "tiny" and result["shards"] == 4

    assert set(result["ceilings"]) == {
        "disk_read_s",
        "disk_read_gbps",
        "page_cache_read_gbps",
        "h2d_pinned_s",
        "h2d_pinned_gbps",
    }
    assert result["cache_drop"]["method"] == "posix_fadvise_dontneed"  # never the machine's whole cache
    for name in ("start_from_disk", "start_from_page_cache"):
        start = result[name]
        assert start["weights_source"] == weights.MMAP  # the engine's own load path, not the fallback
        assert start["to_first_token_s"] == pytest.approx(sum(start[p] for p in PHASES), abs=2e-3)

    sleep_wake = result["sleep_wake"]
    assert sleep_wake["same_token"] is True  # the weights came back bit for bit
    assert sleep_wake["weights_to_pinned_host"] is False  # the CPU drops them at level 1
    assert {"sleep_s", "wake_s", "wake_to_first_token_s", "release_pinned_s"} <= set(sleep_wake)
    # The pinned copy, its ratio and the targets are GPU figures: present, and empty on the CPU.
    assert result["wake_over_h2d"] is None and result["meets"] is None
    assert result["load_from_page_cache"] is None
    assert result["targets"] == {"start_to_first_token_s": 3.0, "wake_over_h2d": 1.2}

    modules = set(result["modules"])
    assert {m for m in modules if m.startswith("stoker")} == {
        "stoker",
        "stoker.engine",
        "stoker.engine.weights",
    }
    assert not modules & NOT_THERE
