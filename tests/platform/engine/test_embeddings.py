"""`/v1/embeddings` on the CPU engine (`stoker engine --task embed`, `stoker.engine.embed`), with
real processes and the official `openai` client: a tiny BERT encoder (CLS pooling from its
sentence-transformers config, Matryoshka dimensions) and the tiny Llama decoder (no pooling config:
mean pooling), each answer checked against a direct forward pass of the same weights; the input
forms, base64 and float, `dimensions`, usage, and every bad input refused naming the field."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import build_tiny_encoder
from tests.deadlines import deadline
from tests.platform.engine.conftest import launch_engine


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory) -> Path:
    return build_tiny_encoder(tmp_path_factory.mktemp("enc") / "tiny-bert", matryoshka=True)


def embedding_engine(snapshot: Path, logs: Path, env: dict):
    e = launch_engine(snapshot, logs, "--task", "embed", env=env)
    try:
        e.wait_ready()
        yield e
    finally:
        e.stop()


@pytest.fixture(scope="module")
def encoder(encoder_dir: Path, tmp_path_factory, stoker_env):
    yield from embedding_engine(encoder_dir, tmp_path_factory.mktemp("enc-logs"), stoker_env)


@pytest.fixture(scope="module")
def decoder(tiny_snapshot: Path, tmp_path_factory, stoker_env):
    yield from embedding_engine(tiny_snapshot, tmp_path_factory.mktemp("dec-logs"), stoker_env)


def direct(model_dir: Path, texts: list[str], pooling: str) -> np.ndarray:
    """What the embeddings must be: the base model's last hidden states, pooled, L2-normalised."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    with torch.inference_mode():
        for text in texts:
            ids = torch.tensor([tok.encode(text, add_special_tokens=True)])
            hidden = model(input_ids=ids).last_hidden_state[0]
            v = hidden[0] if pooling == "cls" else hidden.mean(dim=0)
            rows.append((v / v.norm()).numpy())
    return np.stack(rows)


def ids_of(model_dir: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).encode(text, add_special_tokens=True)


def client_of(e) -> openai.OpenAI:
    return openai.OpenAI(base_url=e.url + "/v1", api_key="unused", max_retries=0, timeout=deadline(60))


TEXTS = ["the quick brown fox", "hello there, how are you"]


def test_an_encoder_s_embeddings_are_its_cls_vectors_normalised(encoder, encoder_dir):
    got = client_of(encoder).embeddings.create(model="tiny", input=TEXTS)  # the SDK asks for base64
    assert [d.index for d in got.data] == [0, 1] and got.model == "tiny"
    vectors = np.array([d.embedding for d in got.data])
    np.testing.assert_allclose(vectors, direct(encoder_dir, TEXTS, "cls"), atol=1e-5)
    tokens = sum(len(ids_of(encoder_dir, t)) for t in TEXTS)  # [CLS] … [SEP], each
    assert got.usage.prompt_tokens == got.usage.total_tokens == tokens
    floats = httpx.post(
        encoder.url + "/v1/embeddings", json={"model": "tiny", "input": TEXTS[0], "encoding_format": "float"}
    )
    assert floats.status_code == 200 and floats.json()["object"] == "list"
    np.testing.assert_allclose(floats.json()["data"][0]["embedding"], vectors[0], atol=1e-6)
    b64 = httpx.post(
        encoder.url + "/v1/embeddings", json={"model": "tiny", "input": TEXTS[0], "encoding_format": "base64"}
    )
    decoded = np.frombuffer(base64.b64decode(b64.json()["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(decoded, np.array(floats.json()["data"][0]["embedding"], dtype=np.float32))


def test_token_ids_and_lists_of_them_are_inputs_too(encoder, encoder_dir):
    c = client_of(encoder)
    by_text = np.array(c.embeddings.create(model="tiny", input="the quick brown fox").data[0].embedding)
    ids = ids_of(encoder_dir, "the quick brown fox")  # [CLS] and [SEP] included
    one = np.array(c.embeddings.create(model="tiny", input=ids).data[0].embedding)
    two = c.embeddings.create(model="tiny", input=[ids, ids[:3]])
    np.testing.assert_allclose(one, by_text, atol=1e-6)
    assert len(two.data) == 2 and two.usage.prompt_tokens == len(ids) + 3


def test_matryoshka_dimensions_are_cut_and_normalised_again_and_refused_elsewhere(encoder, decoder):
    got = client_of(encoder).embeddings.create(
        model="tiny", input="hello", dimensions=16, encoding_format="float"
    )
    v = np.array(got.data[0].embedding)
    assert v.shape == (16,) and np.linalg.norm(v) == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(openai.BadRequestError) as caught:
        client_of(decoder).embeddings.create(model="tiny", input="hello", dimensions=16)
    assert caught.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError):
        client_of(encoder).embeddings.create(model="tiny", input="hello", dimensions=64)  # over its 32


def test_a_decoder_without_a_pooling_config_is_mean_pooled(decoder, tiny_snapshot):
    got = client_of(decoder).embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    np.testing.assert_allclose(
        np.array([d.embedding for d in got.data]), direct(tiny_snapshot, TEXTS, "mean"), atol=1e-5
    )


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"model": "tiny"}, "input", None),
        ({"model": "tiny", "input": ""}, "input", None),
        ({"model": "tiny", "input": []}, "input", None),
        ({"model": "tiny", "input": [[]]}, "input", None),
        ({"model": "tiny", "input": ["ok", 5]}, "input", None),
        ({"model": "tiny", "input": [-1]}, "input", None),
        ({"model": "tiny", "input": [10**6]}, "input", None),  # beyond the vocabulary
        ({"model": "tiny", "input": ["x"] * 2049}, "input", None),
        ({"model": "tiny", "input": "word " * 200}, "input", "context_length_exceeded"),  # over 128
        ({"model": "tiny", "input": "x", "encoding_format": "hex"}, "encoding_format", None),
        ({"model": "tiny", "input": "x", "dimensions": 0}, "dimensions", None),
        ({"input": "x"}, "model", None),
    ],
)
def test_bad_input_is_refused_naming_the_field(encoder, body, param, code):
    r = httpx.post(encoder.url + "/v1/embeddings", json=body, timeout=deadline(30))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert code is None or error["code"] == code


def test_each_engine_serves_only_its_task_and_an_embedding_engine_never_sleeps(encoder, engine):
    r = httpx.post(
        encoder.url + "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_generative"
    r = httpx.post(encoder.url + "/v1/responses", json={"model": "tiny", "input": "hi"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_generative"
    r = httpx.post(engine.url + "/v1/embeddings", json={"model": "tiny", "input": "hi"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_embedding"
    assert (
        httpx.post(encoder.url + "/v1/embeddings", json={"model": "other", "input": "hi"}).status_code == 404
    )
    info = httpx.get(encoder.url + "/server_info").json()
    assert info["sleep_levels"] == [] and info["task"] == "embed"
    assert httpx.post(encoder.url + "/sleep?level=1").status_code == 400
    assert httpx.get(encoder.url + "/health").status_code == 200
