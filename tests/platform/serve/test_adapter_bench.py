"""bench/adapter_bench.py: its own helpers, with no platform: the adapter and the merged model it
builds (here on the tests' tiny model), and its summary and table from samples made up here."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "bench" / "adapter_bench.py"


@pytest.fixture
def adapter_bench(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # as `python bench/adapter_bench.py` has it
    return importlib.import_module("adapter_bench")


def test_the_merged_model_is_the_base_with_only_the_adapters_targets_changed(
    adapter_bench, tiny_model_dir: Path, tmp_path: Path
):
    import torch
    from safetensors.torch import load_file

    adapter_bench.build_lora(tiny_model_dir, tmp_path / "lora", tmp_path / "merged")
    config = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    assert config["r"] == 8 and sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    assert (tmp_path / "lora" / "adapter_model.safetensors").is_file()
    base = load_file(tiny_model_dir / "model.safetensors")
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    assert merged.keys() == base.keys()
    changed = sorted(k for k in base if not torch.equal(base[k], merged[k]))
    assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in changed), changed
    assert (tmp_path / "merged" / "tokenizer.json").is_file()  # a model dir the platform can import


def test_summary_and_table_give_the_ratios_of_the_medians(adapter_bench):
    samples = {
        "base": [{"ttft_s": t, "text": "Paris."} for t in (0.10, 0.30, 0.20)],
        "adapter": [
            {"ttft_s": t, "text": "942.", "loaded_ttft_s": 0.2, "adapter_load_s": 0.05}
            for t in (0.30, 0.40, 0.90)
        ],
        "merged": [{"ttft_s": t, "text": "942.", "total_to_ready_s": t - 0.2} for t in (2.0, 4.0, 3.0)],
    }
    summary = adapter_bench.summarize(samples)
    assert summary["ttft_s"]["adapter"] == {"median": 0.4, "min": 0.3, "max": 0.9, "n": 3}
    assert summary["ratios"]["adapter_over_base"] == pytest.approx(2.0)
    assert summary["ratios"]["merged_over_adapter"] == pytest.approx(7.5)
    assert summary["ratios"]["merged_ready_over_adapter_load"] == pytest.approx(2.8 / 0.05)
    res = {
        "summary": summary,
        "rounds": 3,
        "tiny": False,
        "machine": {"loadavg_start": (1.0,), "loadavg_end": (2.0,)},
    }
    text = adapter_bench.table(res)
    assert (
        "| (b) adapter at zero on the READY base (its load + first token) | 400 ms | 300 ms – 900 ms | 3 |"
        in text
    )
    assert "Answers: base 'Paris.'; adapter '942.'; merged '942.'." in text
    assert "(b) ÷ (a) 2.00× (bar ≤ 2×: met)" in text and "(c) ÷ (b) 7.50× (bar ≥ 3×: met)" in text
