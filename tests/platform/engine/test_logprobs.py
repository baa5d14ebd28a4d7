"""Logprobs on a real engine, in OpenAI's two shapes, whole and streamed, through the official client."""

from __future__ import annotations

import math

import openai
import pytest

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def client(engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{engine.url}/v1", api_key="unused", max_retries=0)


def test_chat_logprobs_one_entry_per_token_with_the_top_n_by_rank(client):
    r = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens  # the EOS token too, when it ends the answer
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert all(-9999.0 <= lp <= 0.0 for lp in [*tops, entry.logprob])
        assert entry.bytes == list(entry.token.encode("utf-8", "replace"))
        # Greedy and nothing else: the chosen token is the most likely of the raw distribution.
        assert entry.logprob == pytest.approx(tops[0]) and entry.token == entry.top_logprobs[0].token
    # The probabilities are a distribution's: the top 3 of a token cannot add up past 1.
    assert all(sum(math.exp(t.logprob) for t in e.top_logprobs) <= 1.0 + 1e-5 for e in content)
    if r.choices[0].finish_reason == "length":
        assert "".join(e.token for e in content) == r.choices[0].message.content


def test_chat_logprobs_without_top_logprobs_and_none_when_not_asked(client):
    r = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=4, temperature=0, logprobs=True
    )
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, temperature=0)
    assert r.choices[0].logprobs is None


def test_streamed_chat_logprobs_are_the_whole_answers(client):
    kw = {
        "model": "tiny",
        "messages": CHAT,
        "max_tokens": 10,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [
        (e.token, e.logprob) for e in whole.choices[0].logprobs.content
    ]
    assert chunks[0].choices[0].logprobs is None  # the role chunk carries no token


def test_completion_logprobs_in_the_legacy_shape_whole_and_streamed(client):
    kw = {"model": "tiny", "prompt": PROMPT, "max_tokens": 9, "temperature": 0, "logprobs": 2}
    whole = client.completions.create(**kw)
    lp = whole.choices[0].logprobs
    n = whole.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    offset = 0
    for token, logprob, top, at in zip(
        lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset, strict=True
    ):
        assert at == offset
        offset += len(token)
        assert top[token] == logprob  # the chosen token is always there...
        assert len(top) in (2, 3)  # ...beside the 2 most likely: 2 entries when it is one of them
        assert logprob == pytest.approx(max(top.values()))  # greedy
    chunks = list(client.completions.create(**kw, stream=True))
    blocks = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert [t for b in blocks for t in b.tokens] == lp.tokens
    assert [o for b in blocks for o in b.text_offset] == lp.text_offset
    assert [x for b in blocks for x in b.token_logprobs] == lp.token_logprobs


def test_completion_logprobs_zero_gives_the_chosen_token_only(client):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0)
    lp = r.choices[0].logprobs
    assert [list(top) for top in lp.top_logprobs] == [[t] for t in lp.tokens]


def test_a_forced_token_reports_the_probability_the_model_gave_it(client, tiny_snapshot):
    """vLLM's default logprobs are the raw model's: a token forced by logit_bias +100 is reported
    with the (low) probability the model itself gave it, not ~1."""
    from transformers import AutoTokenizer

    (fox,) = AutoTokenizer.from_pretrained(tiny_snapshot).encode(" fox")
    r = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=4, temperature=1.0, logit_bias={str(fox): 100}, logprobs=1
    )
    lp = r.choices[0].logprobs
    assert r.choices[0].text == " fox" * 4
    assert all(x < math.log(0.5) for x in lp.token_logprobs)  # a random model: nowhere near certain


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_out_of_range_logprobs_are_a_400_naming_the_parameter(client, kw, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, **kw)
    assert info.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, logprobs=6)
    assert info.value.body["param"] == "logprobs"
