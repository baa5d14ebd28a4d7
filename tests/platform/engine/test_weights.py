"""Weight loading: memory-mapped into a model built without weights; transformers' path when names differ.

In-process for what only the model object can show (where each tensor's bytes live, equality with
`from_pretrained`), real engine processes for what serving shows.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from stoker.engine import weights
from tests.deadlines import HTTP_READ
from tests.platform.engine.conftest import launch_engine

GREEDY = {"model": "tiny", "prompt": "The capital of France", "max_tokens": 12, "temperature": 0}


def mapped_ranges(path: Path, pid: int | str = "self") -> list[tuple[int, int, int]]:
    """(start, end, resident bytes) of every mapping of `path` in a process, from /proc/PID/smaps."""
    real, out = os.path.realpath(path), []
    lines = Path(f"/proc/{pid}/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and "-" in fields[0] and fields[5] == real:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            rss = next(int(x.split()[1]) * 1024 for x in lines[i + 1 :] if x.startswith("Rss:"))
            out.append((start, end, rss))
    return out


def file_backed(tensor: torch.Tensor, ranges: list[tuple[int, int, int]]) -> bool:
    return any(start <= tensor.data_ptr() < end for start, end, _ in ranges)


def without_prefix(tiny_model_dir: Path, out: Path) -> Path:
    """The tiny model with its checkpoint saved under the base model's names ('model.' dropped):
    transformers maps those onto the causal-LM head; a 1:1 assignment cannot."""
    shutil.copytree(tiny_model_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
    state = load_file(tiny_model_dir / "model.safetensors")
    renamed = {k.removeprefix("model."): v for k, v in state.items()}
    save_file(renamed, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_the_tiny_model_is_memory_mapped_and_equals_from_pretrained(tiny_model_dir: Path):
    model, source = weights.load_model(tiny_model_dir, torch.float32)
    assert source == weights.MMAP
    ranges = mapped_ranges(tiny_model_dir / "model.safetensors")
    params = dict(model.named_parameters(remove_duplicate=False))
    assert all(file_backed(p, ranges) for p in params.values()), "a weight was copied out of the file"
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as the config says
    assert not model.training

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    ours, theirs = dict(model.named_buffers()), dict(reference.named_buffers())  # rotary inv_freq
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert model.generation_config.to_dict() == reference.generation_config.to_dict()


def test_another_dtype_is_converted_and_then_not_file_backed(tiny_model_dir: Path, caplog):
    with caplog.at_level(logging.INFO, logger="stoker.engine"):
        model, source = weights.load_model(tiny_model_dir, torch.bfloat16)
    assert source == weights.MMAP
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ranges = mapped_ranges(tiny_model_dir / "model.safetensors")
    assert not any(file_backed(p, ranges) for p in model.parameters())  # a conversion is a copy
    assert "converted to the model's dtype (a copy)" in caplog.text


def test_names_that_do_not_map_fall_back_to_from_pretrained(tiny_model_dir: Path, tmp_path: Path, caplog):
    snapshot = without_prefix(tiny_model_dir, tmp_path / "no-prefix")
    with caplog.at_level(logging.WARNING, logger="stoker.engine"):
        model, source = weights.load_model(snapshot, torch.float32)
    assert source == weights.FROM_PRETRAINED
    assert "not in the model (e.g. 'embed_tokens.weight')" in caplog.text
    reference, _ = weights.load_model(tiny_model_dir, torch.float32)
    ids = torch.tensor([[1, 5, 7, 9, 11]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_the_engine_serves_from_the_snapshot_file(engine, tiny_snapshot: Path):
    assert "weights: memory-mapped" in engine.log.read_text()
    assert httpx.post(f"{engine.url}/v1/completions", json=GREEDY).status_code == 200
    ranges = mapped_ranges(tiny_snapshot / "model.safetensors", engine.proc.pid)
    assert ranges and sum(rss for *_, rss in ranges) > 0  # the weights are those mapped pages


def test_the_fallback_engine_serves_the_same_model_and_wakes(
    engine, tiny_model_dir: Path, tmp_path: Path, stoker_env
):
    expected = httpx.post(f"{engine.url}/v1/completions", json=GREEDY).json()["choices"][0]["text"]
    snapshot = without_prefix(tiny_model_dir, tmp_path / "no-prefix")
    e = launch_engine(snapshot, tmp_path, env=stoker_env)
    try:
        e.wait_ready()
        assert "loading through transformers' from_pretrained instead" in e.log.read_text()
        assert httpx.post(f"{e.url}/v1/completions", json=GREEDY).json()["choices"][0]["text"] == expected
        assert httpx.post(f"{e.url}/sleep?level=1").status_code == 200
        assert httpx.post(f"{e.url}/wake_up", timeout=HTTP_READ).status_code == 200
        assert httpx.post(f"{e.url}/v1/completions", json=GREEDY).json()["choices"][0]["text"] == expected
    finally:
        assert e.stop() == 0
