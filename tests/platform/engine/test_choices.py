"""`n` > 1 on the CPU engine (`stoker.engine.choices`), through the official `openai` client and raw
SSE: n choices indexed 0..n-1, whole and streamed, the prompt's tokens counted once, a seed giving
each choice its own reproducible draw, greedy choices alike, and two requests that each want most of
the batch both answered (admitted one after the other, not deadlocked)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.deadlines import deadline


@pytest.fixture(scope="module")
def client(engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0, timeout=deadline(60))


def test_n_choices_whole_with_a_seed_are_distinct_reproducible_and_counted_once(client):
    def ask(n: int):
        return client.completions.create(
            model="tiny",
            prompt="Hello there",
            max_tokens=8,
            temperature=1.0,
            seed=7,
            n=n,
            extra_body={"ignore_eos": True},
        )

    three, again, one = ask(3), ask(3), ask(1)
    assert [c.index for c in three.choices] == [0, 1, 2]
    texts = [c.text for c in three.choices]
    assert texts == [c.text for c in again.choices]  # the same seed: the same three
    assert len(set(texts)) == 3, texts  # each choice its own draw
    assert texts[0] == one.choices[0].text  # choice 0 draws as a request of one does
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt once
    assert three.usage.completion_tokens == 3 * 8 and three.usage.total_tokens == one.usage.prompt_tokens + 24


def test_greedy_chat_choices_are_alike(client):
    answer = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, n=2
    )
    first, second = answer.choices
    assert (first.index, second.index) == (0, 1)
    assert first.message.content == second.message.content and first.message.role == "assistant"
    assert {first.finish_reason, second.finish_reason} <= {"stop", "length"}


def test_a_stream_of_n_choices_gives_each_its_role_then_its_tokens_then_its_end(engine):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "count"}],
        "max_tokens": 5,
        "temperature": 1.0,
        "seed": 3,
        "n": 3,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = []
    with httpx.stream("POST", engine.url + "/v1/chat/completions", json=body, timeout=deadline(60)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    by_index: dict[int, list[dict]] = {0: [], 1: [], 2: []}
    for event in events[:-1]:
        [choice] = event["choices"]
        by_index[choice["index"]].append(choice)
    for index, choices in by_index.items():
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}, index
        assert choices[-1]["finish_reason"] == "length" and choices[-1]["delta"] == {}
        assert all(c["finish_reason"] is None for c in choices[:-1])
    usage = events[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 15
    whole = httpx.post(
        engine.url + "/v1/chat/completions", json={**body, "stream": False, "stream_options": None}
    )
    texts = [c["message"]["content"] for c in whole.json()["choices"]]
    streamed = ["".join(c["delta"].get("content", "") for c in by_index[i]) for i in range(3)]
    assert streamed == texts  # the same seed: the same choices, streamed or whole


async def test_two_requests_that_each_want_most_of_the_batch_are_both_answered(engine):
    body = {"model": "tiny", "prompt": "a", "max_tokens": 4, "n": 6, "temperature": 1.0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=engine.url, timeout=deadline(60)) as c:
        answers = await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(2)))
    for r in answers:  # 12 choices on 8 slots: the second waited for the first's, not half of them
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 6 and r.json()["usage"]["completion_tokens"] == 24


def test_the_request_s_n_is_in_vllms_histogram_once(engine, client):
    def sampled() -> tuple[float, float]:
        text = httpx.get(engine.url + "/metrics").text
        value = {
            line.split("{")[0]: float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("vllm:request_params_n_")
        }
        return value["vllm:request_params_n_count"], value["vllm:request_params_n_sum"]

    before = sampled()
    client.completions.create(model="tiny", prompt="x", max_tokens=2, n=3, temperature=1.0)
    after = sampled()
    assert (after[0] - before[0], after[1] - before[1]) == (1, 3)
