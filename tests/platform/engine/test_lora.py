"""LoRA adapters on the CPU engine: vLLM's load and unload routes, per-request adapters mixed in one
batch, the LRU under `--max-adapters`, and the refusals (wrong base, corrupt file, pickle, rank).

The adapters are built with peft for the tiny model, their lora_B set to seeded random values (peft
starts them at zero, which would change nothing); the proof of the arithmetic is peft's own merged
model (`merge_and_unload`) generating the same greedy tokens, with the same log-probabilities.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stoker.engine.adapters import UNSUPPORTED, check_config, choose_victim
from stoker.errors import APIError
from tests.conftest import build_tiny_adapter, build_tiny_model
from tests.deadlines import HTTP_READ

PROMPT = "the quick brown fox"
TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]


def build_adapter(base: Path, out: Path, seed: int, rank: int = 8):
    return build_tiny_adapter(base, out, seed=seed, rank=rank, targets=tuple(TARGETS))


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for name, seed in (("a1", 1), ("a2", 2)):
        build_adapter(tiny_model_dir, root / name, seed)
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def merged_a1(tiny_model_dir: Path, tmp_path_factory):
    """peft's merged model for a1 (the same seed: the same weights)."""
    return (
        build_adapter(tiny_model_dir, tmp_path_factory.mktemp("merged") / "a1", 1).merge_and_unload().eval()
    )


@pytest.fixture(scope="module")
def lora_engine(tiny_snapshot: Path, tmp_path_factory, stoker_env):
    from tests.platform.engine.conftest import launch_engine

    e = launch_engine(
        tiny_snapshot, tmp_path_factory.mktemp("lora-logs"), "--max-adapters", "3", env=stoker_env
    )
    try:
        e.wait_ready()
        yield e
    finally:
        e.stop()


def load(url: str, name: str, path: Path | str, **extra) -> httpx.Response:
    body = {"lora_name": name, "lora_path": str(path), **extra}
    return httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=HTTP_READ)


def unload(url: str, name: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=HTTP_READ)


def complete(url: str, model: str, logprobs: bool = False) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "temperature": 0, "max_tokens": 12, "ignore_eos": True}
    if logprobs:
        body["logprobs"] = 1
    return httpx.post(f"{url}/v1/completions", json=body, timeout=HTTP_READ)


def text(url: str, model: str) -> str:
    r = complete(url, model)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def ensure_loaded(url: str, adapters: dict[str, Path], *names: str) -> None:
    for name in names:
        r = load(url, name, adapters[name])
        assert r.status_code == 200 or "already been loaded" in r.text, r.text


def test_an_adapter_changes_the_output_deterministically_and_as_peft_merges_it(
    lora_engine, adapters, merged_a1, tiny_model_dir
):
    import torch
    from transformers import AutoTokenizer

    url = lora_engine.url
    r = load(url, "a1", adapters["a1"])
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a1' added successfully."
    base, tuned = text(url, "tiny"), text(url, "a1")
    assert tuned != base
    assert text(url, "a1") == tuned

    answer = complete(url, "a1", logprobs=True).json()["choices"][0]["logprobs"]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok.encode(PROMPT, add_special_tokens=True)
    with torch.no_grad():
        out = merged_a1.generate(
            torch.tensor([ids]),
            max_new_tokens=12,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    new = out.sequences[0][len(ids) :].tolist()
    assert answer["tokens"] == [tok.decode([t]) for t in new]
    expected = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, new, strict=True)]
    assert all(
        math.isclose(a, b, abs_tol=1e-3) for a, b in zip(answer["token_logprobs"], expected, strict=True)
    )


def test_two_adapters_and_the_base_share_a_batch(lora_engine, adapters):
    url = lora_engine.url
    ensure_loaded(url, adapters, "a1", "a2")
    alone = {model: text(url, model) for model in ("tiny", "a1", "a2")}
    assert len(set(alone.values())) == 3
    order = ["a1", "tiny", "a2", "a1", "tiny", "a2", "a2", "a1"]
    with ThreadPoolExecutor(len(order)) as pool:
        together = list(pool.map(lambda m: text(url, m), order))
    assert together == [alone[m] for m in order]


def test_models_lists_each_adapter_with_its_parent_and_path(lora_engine, adapters):
    url = lora_engine.url
    ensure_loaded(url, adapters, "a1")
    cards = {c["id"]: c for c in httpx.get(f"{url}/v1/models", timeout=HTTP_READ).json()["data"]}
    assert cards["a1"]["parent"] == "tiny" and cards["a1"]["root"] == str(adapters["a1"])
    assert cards["tiny"].get("parent") is None
    one = httpx.get(f"{url}/v1/models/a1", timeout=HTTP_READ)
    assert one.status_code == 200 and one.json()["parent"] == "tiny"


def test_load_and_unload_answer_as_vllm(lora_engine, adapters):
    url = lora_engine.url
    ensure_loaded(url, adapters, "a2")
    again = load(url, "a2", adapters["a2"])
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    assert load(url, "a2", adapters["a2"], load_inplace=True).status_code == 200
    r = unload(url, "a2")
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a2' removed successfully."
    assert complete(url, "a2").status_code == 404
    missing = unload(url, "a2")
    assert missing.status_code == 404 and "cannot be found" in missing.json()["error"]["message"]
    assert load(url, "", adapters["a2"]).status_code == 400
    assert load(url, "x", "/no/such/dir").status_code == 404
    assert complete(url, "nobody").status_code == 404


def test_a_wrong_base_is_refused_naming_the_shapes(lora_engine, tmp_path):
    other = build_tiny_model(tmp_path / "wide", head_dim=32)  # q_proj gives 128, not 64
    build_adapter(other, tmp_path / "wrong", seed=3)
    r = load(lora_engine.url, "wrong", tmp_path / "wrong")
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "adapter's lora_" in message and "the base's layer" in message, message
    assert "x8" in message or "8x" in message


def test_a_corrupt_or_pickled_adapter_fails_its_load_and_nothing_else(lora_engine, adapters, tmp_path):
    url = lora_engine.url
    ensure_loaded(url, adapters, "a1")
    before = text(url, "a1")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_bytes((adapters["a1"] / "adapter_config.json").read_bytes())
    good = (adapters["a1"] / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(good[:8] + b"{not json" + good[17:200])
    r = load(url, "corrupt", corrupt)
    assert r.status_code == 400 and "not a valid safetensors file" in r.json()["error"]["message"]

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_bytes((adapters["a1"] / "adapter_config.json").read_bytes())
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04 never unpickled")
    r = load(url, "pickled", pickled)
    assert r.status_code == 400 and "adapter_model.bin" in r.json()["error"]["message"]

    linked = tmp_path / "linked"
    linked.symlink_to(adapters["a1"])
    assert load(url, "linked", linked).status_code == 400

    assert text(url, "tiny") and text(url, "a1") == before
    names = {c["id"] for c in httpx.get(f"{url}/v1/models", timeout=HTTP_READ).json()["data"]}
    assert not names & {"corrupt", "pickled", "linked"}


def test_eviction_under_max_adapters_1(fresh_engine, adapters):
    e = fresh_engine("--max-adapters", "1", "--max-lora-rank", "8")
    url = e.url
    assert load(url, "a1", adapters["a1"]).status_code == 200
    tuned = text(url, "a1")
    assert load(url, "a2", adapters["a2"]).status_code == 200
    assert complete(url, "a1").status_code == 404
    assert text(url, "a2")
    assert load(url, "a1", adapters["a1"]).status_code == 200
    assert text(url, "a1") == tuned
    samples = {
        (s.name, s.labels.get("result")): s.value
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=HTTP_READ).text)
        for s in family.samples
    }
    assert samples["stoker_engine_lora_adapter_evictions_total", None] == 2
    assert samples["stoker_engine_lora_adapters_loaded", None] == 1
    assert samples["stoker_engine_lora_adapter_loads_total", "ok"] == 3
    assert samples["stoker_engine_lora_adapter_load_seconds_count", None] == 3


# ---- the pure parts ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("order", "busy", "loaded", "limit", "victim"),
    [
        (["a", "b"], set(), 2, 4, None),  # room left
        (["a", "b"], set(), 2, 2, "a"),  # the least recently used
        (["a", "b"], {"a"}, 2, 2, "b"),  # … that nothing holds
    ],
)
def test_choose_victim(order, busy, loaded, limit, victim):
    assert choose_victim(order, busy.__contains__, loaded, limit) == victim


def test_choose_victim_when_every_adapter_is_held():
    with pytest.raises(APIError) as caught:
        choose_victim(["a", "b"], lambda _: True, 2, 2)
    assert caught.value.status == 503 and caught.value.code == "adapters_busy"


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        ({"peft_type": "IA3", "r": 8}, "only LoRA"),
        ({"peft_type": "LORA", "r": 128}, "--max-lora-rank of 64"),
        ({"peft_type": "LORA", "r": 0}, "positive integer"),
        ({"peft_type": "LORA", "r": 8, "use_dora": True}, "use_dora"),
        ({"peft_type": "LORA", "r": 8, "bias": "all"}, "bias"),
        ([], "JSON object"),
    ],
)
def test_check_config_refuses(config, fragment):
    with pytest.raises(APIError) as caught:
        check_config(config, max_rank=64)
    assert caught.value.status == 400 and fragment in caught.value.message


def test_check_config_takes_what_peft_writes(adapters):
    config = json.loads((adapters["a1"] / "adapter_config.json").read_text())
    assert check_config(config, max_rank=64) == 8
    assert not [k for k in UNSUPPORTED if config.get(k)]


def test_an_adapter_request_never_shares_prefix_blocks_with_the_base(lora_engine, fresh_engine, adapters):
    """transformers shares the KV blocks of equal prompt prefixes (32-token pages), and the base's
    blocks are wrong for an adapter, an adapter's for the base: one engine sees the long prompt for
    the base first, the other for the adapter first, and both answer alike."""
    prompt = "the quick brown fox jumps over the lazy dog " * 12
    body = {"prompt": prompt, "temperature": 0, "max_tokens": 8, "ignore_eos": True, "logprobs": 1}

    def answer(url: str, model: str) -> list:
        r = httpx.post(f"{url}/v1/completions", json={**body, "model": model}, timeout=HTTP_READ)
        assert r.status_code == 200, r.text
        logprobs = r.json()["choices"][0]["logprobs"]
        return [(t, round(p, 3)) for t, p in zip(logprobs["tokens"], logprobs["token_logprobs"], strict=True)]

    ensure_loaded(lora_engine.url, adapters, "a1")
    fresh = fresh_engine().url
    assert load(fresh, "a1", adapters["a1"]).status_code == 200
    adapter_first = [answer(lora_engine.url, "a1"), answer(lora_engine.url, "tiny")]
    base_first = [answer(fresh, "tiny"), answer(fresh, "a1")]
    assert adapter_first == base_first[::-1]


def test_an_adapter_answers_alike_after_sleep_and_wake(fresh_engine, adapters):
    e = fresh_engine()
    assert load(e.url, "a1", adapters["a1"]).status_code == 200
    before = (text(e.url, "a1"), text(e.url, "tiny"))
    for level in (1, 2):
        assert httpx.post(f"{e.url}/sleep?level={level}", timeout=HTTP_READ).status_code == 200
        assert httpx.post(f"{e.url}/wake_up", timeout=HTTP_READ).status_code == 200
        assert (text(e.url, "a1"), text(e.url, "tiny")) == before
