"""The engine's OpenAI surface, driven by the official `openai` client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.deadlines import HTTP_READ

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{engine.url}/v1", api_key="unused", max_retries=0)


def test_chat_whole_reports_usage_and_length(client, tiny_snapshot):
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=7, temperature=0)
    tok = AutoTokenizer.from_pretrained(tiny_snapshot)
    prompt = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str)
    assert r.usage.prompt_tokens == len(prompt)
    # A random model rarely emits its EOS token: either it ran to the limit or it stopped on EOS.
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 7
    else:
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_greedy_stream_matches_greedy_whole(client):
    whole = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == whole.choices[0].message.content
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_completions_whole_and_stream(client):
    whole = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=9, temperature=0)
    assert whole.object == "text_completion"
    assert whole.usage.completion_tokens <= 9
    chunks = list(
        client.completions.create(
            model="tiny", prompt="The quick brown fox", max_tokens=9, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].usage is None  # only with stream_options.include_usage


def test_ignore_eos_generates_exactly_max_tokens(client):
    r = client.completions.create(model="tiny", prompt="x", max_tokens=60, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 60
    assert r.choices[0].finish_reason == "length"


def test_completion_from_token_ids(client):
    r = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=3, temperature=0)
    assert r.usage.prompt_tokens == 4


def test_same_seed_same_sample(client):
    def sample(seed):
        return (
            client.completions.create(
                model="tiny", prompt="Hello", max_tokens=16, temperature=1.0, top_p=0.95, seed=seed
            )
            .choices[0]
            .text
        )

    assert sample(1234) == sample(1234)


def test_stop_sequence_cuts_the_text(client):
    free = (
        client.completions.create(model="tiny", prompt="One two", max_tokens=24, temperature=0)
        .choices[0]
        .text
    )
    if len(free) < 6:
        pytest.skip(f"the random model's greedy text is too short to cut: {free!r}")
    stop = free[3:5]
    expected = free[: free.find(stop)]
    r = client.completions.create(model="tiny", prompt="One two", max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"


async def test_ten_concurrent_streams_all_complete(engine):
    client = openai.AsyncOpenAI(base_url=f"{engine.url}/v1", api_key="unused", max_retries=0)

    async def one(i: int) -> tuple[str, str]:
        stream = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": f"Count to {i}"}],
            max_tokens=20,
            temperature=0.8,
            stream=True,
        )
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    results = await asyncio.gather(*(one(i) for i in range(10)))
    assert all(reason in ("stop", "length") for _, reason in results)
    await client.close()


def test_models_health_and_metrics(engine, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{engine.url}/health").status_code == 200
    client.completions.create(model="tiny", prompt="Hi", max_tokens=3)
    text = httpx.get(f"{engine.url}/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
    ):
        assert re.search(rf'^{name}{{.*model_name="tiny"', text, re.M), name
    ttft_count = next(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("vllm:time_to_first_token_seconds_count")
    )
    assert ttft_count >= 1


BAD = [
    ("chat", b"{not json", 400, None),
    ("chat", b"[1, 2]", 400, None),
    ("chat", {"model": "tiny"}, 400, "messages"),
    ("chat", {"model": "tiny", "messages": "hello"}, 400, "messages"),
    ("chat", {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("chat", {"model": "tiny", "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("chat", {"messages": [{"role": "user", "content": "x"}]}, 400, "model"),
    ("completion", {"model": "tiny"}, 400, "prompt"),
    ("completion", {"model": "tiny", "prompt": 42}, 400, "prompt"),
    ("completion", {"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("completion", {"model": "tiny", "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("completion", {"model": "tiny", "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("completion", {"model": "tiny", "prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    ("completion", {"model": "tiny", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("completion", {"model": "tiny", "prompt": "x", "temperature": 3}, 400, "temperature"),
    ("completion", {"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("completion", {"model": "tiny", "prompt": "x", "stop": 7}, 400, "stop"),
    ("completion", {"model": "tiny", "prompt": "x", "seed": 1.5}, 400, "seed"),
    ("completion", {"model": "tiny", "prompt": "x", "n": 0}, 400, "n"),
    ("completion", {"model": "tiny", "prompt": "x", "n": 17}, 400, "n"),
    ("completion", {"model": "tiny", "prompt": "x", "n": "2"}, 400, "n"),
    ("completion", {"model": "tiny", "prompt": "x", "n": 9}, 400, "n"),  # more than its 8 slots
    ("completion", {"model": "tiny", "prompt": "x", "best_of": 2}, 400, "best_of"),
    ("completion", {"model": "tiny", "prompt": "x", "stream": "yes"}, 400, "stream"),
    ("completion", {"model": "tiny", "prompt": [1, 10**9]}, 400, "prompt"),
    ("completion", {"model": "other", "prompt": "x"}, 404, "model"),
]


@pytest.mark.parametrize(("kind", "body", "status", "param"), BAD)
def test_bad_input_gets_openai_error_and_engine_keeps_serving(engine, kind, body, status, param):
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(engine.url + path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["param"] == param
    ok = httpx.post(engine.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200


def test_body_over_the_limit_is_refused(engine):
    big = json.dumps({"model": "tiny", "prompt": "x" * (5 << 20)}).encode()
    r = httpx.post(engine.url + "/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


def test_unknown_route_and_method_are_openai_errors(engine):
    r = httpx.get(engine.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(engine.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def ttft_count(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return next(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("vllm:time_to_first_token_seconds_count")
    )


def test_the_role_chunk_comes_with_the_first_token(engine):
    """A chat stream announces its role only once the first token exists (as vLLM does), so a client
    that times its first chunk reads the real TTFT: here a ~1500-token prompt's prefill."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 150
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 2,
        "stream": True,
    }
    before = ttft_count(engine.url)
    with httpx.stream("POST", f"{engine.url}/v1/chat/completions", json=body, timeout=HTTP_READ) as r:
        events = (line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: "))
        first = json.loads(next(events))
        counted_at_first_chunk = ttft_count(engine.url)  # before reading any further
        rest = [json.loads(e) for e in events if e != "[DONE]"]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    # The engine observes its TTFT at the first token; the role chunk left after that, never before.
    assert counted_at_first_chunk == before + 1
    assert all("role" not in c["choices"][0]["delta"] for c in rest)
    assert rest[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_retrieve_a_model_by_id(client):
    model = client.models.retrieve("tiny")
    assert (model.id, model.object, model.owned_by) == ("tiny", "model", "stoker")
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4o")
    assert info.value.body["code"] == "model_not_found"
