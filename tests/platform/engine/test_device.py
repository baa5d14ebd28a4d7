"""The engine's device: chosen once at start, and what each sleep level does with the weights on it.

Tables for the two decisions (`weights.choose_device`, `weights.sleep_plan`). The moves behind
them in-process on the tiny model: a GPU's level 1 (host buffers, each copied back in one
transfer) runs on the CPU too, where its bookkeeping — packing, tied weights kept tied, every byte
back — is the same. Real `stoker engine` processes for the flag. The tests marked `cuda` run only where
torch sees a GPU.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest
import torch

from stoker.engine import weights
from stoker.engine.core import EngineConfig
from tests.conftest import STOKER
from tests.deadlines import HTTP_READ

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no GPU")
IDS = [[1, 5, 7, 9, 11]]
GREEDY = {"model": "tiny", "prompt": "The capital of France", "max_tokens": 12, "temperature": 0}


@pytest.mark.parametrize(
    ("requested", "cuda_available", "device"),
    [
        ("auto", True, "cuda"),
        ("auto", False, "cpu"),
        ("cpu", True, "cpu"),
        ("cpu", False, "cpu"),
        ("cuda", True, "cuda"),
    ],
)
def test_the_device_is_chosen_from_the_flag_and_what_torch_sees(requested, cuda_available, device):
    assert weights.choose_device(requested, cuda_available) == device


@pytest.mark.parametrize(
    ("requested", "cuda_available", "message"),
    [
        ("cuda", False, r"--device cuda, but torch sees no CUDA GPU"),
        ("tpu", True, r"device must be one of auto, cpu, cuda; got 'tpu'"),
    ],
)
def test_a_device_that_cannot_be_had_is_refused(requested, cuda_available, message):
    with pytest.raises(ValueError, match=message):
        weights.choose_device(requested, cuda_available)


@pytest.mark.parametrize(
    ("level", "device", "to_host", "drop_page_cache"),
    [
        (1, "cpu", False, False),  # the weights are page-cache pages: unmapped, mapped again on wake
        (2, "cpu", False, True),
        (1, "cuda", True, False),  # device memory: a pinned host copy, one transfer back
        (1, "cuda:1", True, False),
        (2, "cuda", False, True),
    ],
)
def test_what_each_sleep_level_does_on_each_device(level, device, to_host, drop_page_cache):
    assert weights.sleep_plan(level, device) == weights.SleepPlan(to_host, drop_page_cache)


@pytest.mark.parametrize("level", [0, 3])
def test_only_levels_1_and_2_exist(level):
    with pytest.raises(ValueError, match=f"sleep level must be 1 or 2, got {level}"):
        weights.sleep_plan(level, "cpu")


@pytest.mark.parametrize(
    ("sizes", "places", "buffers"),
    [
        ([], [], []),
        ([5000, 100, 9000], [(0, 0), (0, 8192), (1, 0)], [8292, 9000]),  # the docstring's example
        ([16384, 1], [(0, 0), (1, 0)], [16384, 1]),  # a full buffer
        ([20000, 10, 10], [(0, 0), (1, 0), (1, 4096)], [20000, 4106]),  # larger than a buffer: its own
        ([10, 20000], [(0, 0), (1, 0)], [10, 20000]),
        ([0, 0], [(0, 0), (0, 0)], [1]),  # empty tensors take no room (a buffer has at least a byte)
    ],
)
def test_sleeping_weights_are_packed_into_aligned_host_buffers(sizes, places, buffers):
    assert weights.pack(sizes, chunk_bytes=16384) == (places, buffers)


def test_engine_config_refuses_an_unknown_device(tmp_path: Path):
    with pytest.raises(ValueError, match=r"device must be one of \['cpu', 'cuda'\], got 'tpu'"):
        EngineConfig(snapshot_dir=tmp_path, served_model_name="tiny", device="tpu")


def logits(model) -> torch.Tensor:
    device = next(model.parameters()).device
    with torch.no_grad():
        return model(torch.tensor(IDS, device=device)).logits.cpu()


@pytest.mark.parametrize(
    "plan",
    [
        weights.sleep_plan(1, "cpu"),
        weights.sleep_plan(2, "cpu"),
        weights.SleepPlan(to_host=True, drop_page_cache=False),  # a GPU's level 1, on the CPU
    ],
    ids=["cpu-level-1", "cpu-level-2", "host-copy"],
)
def test_the_weights_leave_and_come_back_bit_for_bit(tiny_model_dir: Path, plan: weights.SleepPlan):
    model, _ = weights.load_model(tiny_model_dir, torch.float32)
    before = logits(model)
    weights.put_to_sleep(model, plan)
    params = list(model.parameters())  # each tied parameter once
    if plan.to_host:
        assert len({p.untyped_storage().data_ptr() for p in params}) == 1  # well under 1 GiB: one host buffer
        assert all(p.storage_offset() * p.element_size() % weights.ALIGN == 0 for p in params)
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        assert all(p.is_meta for p in params)  # nothing held; the wake ties them again

    assert weights.wake(model, plan, tiny_model_dir, "cpu") is None
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not any(p.is_meta for p in model.parameters())
    assert torch.equal(logits(model), before)


def test_weights_spread_over_several_host_buffers_come_back_bit_for_bit(tiny_model_dir: Path):
    model, _ = weights.load_model(tiny_model_dir, torch.float32)
    before = logits(model)
    weights.offload(model, chunk_bytes=50_000)  # the tiny model's 0.4 MB in 50 kB buffers
    assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) > 1
    assert model.lm_head.weight is model.model.embed_tokens.weight
    weights.onload(model, "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(logits(model), before)


def test_the_engine_runs_on_the_cpu_where_torch_sees_no_gpu(engine):
    if torch.cuda.is_available():
        pytest.skip("torch sees a GPU here: --device auto picks it")
    assert " on cpu at http://" in engine.log.read_text()


@no_gpu
def test_device_cuda_without_a_gpu_is_a_one_line_error(tiny_snapshot: Path, stoker_env):
    r = subprocess.run(
        [STOKER, "engine", "--snapshot", str(tiny_snapshot), "--port", "1", "--device", "cuda"],
        capture_output=True,
        text=True,
        env=stoker_env,
    )
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "stoker: error: --device cuda, but torch sees no CUDA GPU (torch.cuda.is_available() is false)"
    ]


# ---- where there is a GPU ------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("level", [1, 2])
def test_on_a_gpu_sleep_frees_the_device_and_wake_brings_back_the_same_weights(
    tiny_model_dir: Path, level: int
):
    model, source = weights.load_model(tiny_model_dir, torch.float32, "cuda")
    assert source == weights.MMAP
    assert all(p.is_cuda for p in model.parameters()) and all(b.is_cuda for b in model.buffers())
    before = logits(model)
    allocated, nbytes = torch.cuda.memory_allocated(), sum(p.nbytes for p in model.parameters())
    plan = weights.sleep_plan(level, "cuda")
    weights.put_to_sleep(model, plan)
    if level == 1:
        assert all(p.device.type == "cpu" and p.is_pinned() for p in model.parameters())
    else:
        assert all(p.is_meta for p in model.parameters())
    assert torch.cuda.memory_allocated() <= allocated - nbytes

    assert weights.wake(model, plan, tiny_model_dir, "cuda") is None
    weights.release_pinned()
    assert all(p.is_cuda for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(logits(model), before)


@cuda
def test_on_a_gpu_the_engine_serves_sleeps_and_wakes_with_the_same_answers(fresh_engine):
    e = fresh_engine("--device", "cuda")
    assert " on cuda at http://" in e.log.read_text()
    before = httpx.post(f"{e.url}/v1/completions", json=GREEDY).json()["choices"][0]["text"]
    for level in (1, 2):
        assert httpx.post(f"{e.url}/sleep?level={level}").status_code == 200
        assert httpx.post(f"{e.url}/wake_up", timeout=HTTP_READ).status_code == 200
        assert httpx.post(f"{e.url}/v1/completions", json=GREEDY).json()["choices"][0]["text"] == before
