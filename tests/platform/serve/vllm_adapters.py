"""LoRA adapters on a vLLM base, with vLLM's CPU build: checked inside the vLLM live test of
test_vllm_engine.py (a vLLM start is the suite's slowest step: this shares that test's), on its
base deployed with `--max-adapters 1` (vLLM started with --enable-lora --max-loras 1
--max-lora-rank 64 and its run-time LoRA API).

Each adapter answers with its own weights: greedy, its tokens are the ones peft's model gives, and
differ from the base's. Both adapters are served by the one instance, though vLLM runs one adapter
at a time (--max-loras 1): vLLM keeps every adapter it loaded registered and reads one it evicted
from its directory again itself, so the platform loads each adapter once. What vLLM cannot serve
is refused at deploy: an adapter on a vLLM base deployed without `max_adapters`, naming the
setting, and an adapter of a rank above 64."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai

from tests.conftest import build_tiny_adapter
from tests.deadlines import HTTP_READ, VLLM_START
from tests.platform.conftest import PlatformProcess

PROMPT = "the quick brown fox"


def peft_greedy(base: Path, adapter: Path | None, tokens: int) -> list[int]:
    """The tokens greedy decoding gives on the base, or on the base with `adapter` applied (peft's).
    Tokens, not text: this random model's answers hold partial UTF-8 characters, which vLLM's
    detokenizer holds back at the end and transformers' decode writes as U+FFFD."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False, eos_token_id=None)
    return out[0, ids.shape[1] :].tolist()


def deploy_adapter(p: PlatformProcess, name: str, path: Path, base: str) -> httpx.Response:
    return httpx.post(
        f"{p.url}/admin/v1/deployments",
        json={"name": name, "adapter": str(path), "base": base},
        timeout=HTTP_READ,
    )


def check_adapters_on(p: PlatformProcess, base: str, model_dir: Path, tmp_path: Path) -> None:
    """Adapters on `base`, a READY vLLM deployment of `model_dir` with `--max-adapters 1`; they are
    removed again at the end, so the caller can remove its base."""
    adapters = {}
    for name, seed in (("a1", 1), ("a2", 2)):
        build_tiny_adapter(model_dir, tmp_path / name, seed=seed)
        adapters[name] = tmp_path / name
    build_tiny_adapter(model_dir, tmp_path / "wide", seed=3, rank=128)
    tokens = 8
    expected = {name: peft_greedy(model_dir, path, tokens) for name, path in adapters.items()}
    expected[base] = peft_greedy(model_dir, None, tokens)
    assert len({tuple(t) for t in expected.values()}) == 3, expected  # each adapter changes the greedy answer

    # Refused at deploy, before any engine starts: a vLLM base without adapters, naming the setting.
    p.deploy("plain", model_dir, "--engine", "vllm")
    r = deploy_adapter(p, "a0", adapters["a1"], "plain")
    assert r.status_code == 400 and r.json()["error"]["code"] == "adapter_engine", r.text
    assert "--max-adapters" in r.json()["error"]["message"]
    for name, path in adapters.items():
        assert deploy_adapter(p, name, path, base).status_code == 201
    r = deploy_adapter(p, "a3", tmp_path / "wide", base)
    assert r.status_code == 400 and r.json()["error"]["code"] == "adapter_rank", r.text
    assert "rank 128" in r.json()["error"]["message"]

    client = openai.OpenAI(base_url=f"{p.url}/v1", api_key="-", timeout=VLLM_START + HTTP_READ, max_retries=0)

    def greedy(model: str) -> list[int]:
        answer = client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=tokens,
            temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        assert answer.system_fingerprint.startswith("vllm-") and answer.model == model
        return answer.choices[0].model_extra["token_ids"]

    assert greedy("a1") == expected["a1"]
    assert greedy(base) == expected[base]
    assert greedy("a2") == expected["a2"]
    assert greedy("a1") == expected["a1"]  # a2 took vLLM's one slot: vLLM read a1 back itself
    for name in adapters:
        assert p.metric("stoker_adapter_loads_total", deployment=name, base=base) == 1
    for name in (*adapters, "plain"):
        p.cli("rm", name)
