"""Each sampling parameter beyond the basics changes a real engine's answer the way it should.

The tiny random model's greedy answer to this prompt repeats one token (" quick") to the end:
a clear baseline for penalties, and its near-uniform logits make a strong parameter decisive.
"""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

PROMPT = "The quick"


@pytest.fixture(scope="module")
def client(engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{engine.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tok(tiny_snapshot):
    return AutoTokenizer.from_pretrained(tiny_snapshot)


def tokens(client, **kw) -> list[str]:
    """The answer's tokens (from logprobs: their text, one per token)."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 0, **kw}
    extra = {k: body.pop(k) for k in ("top_k", "min_tokens", "repetition_penalty") if k in body}
    r = client.completions.create(**body, extra_body=extra)
    return r.choices[0].logprobs.tokens


def test_the_baseline_repeats_one_token(client):
    assert tokens(client) == [" quick"] * 12


@pytest.mark.parametrize("penalty", ["presence_penalty", "frequency_penalty"])
def test_a_big_presence_or_frequency_penalty_stops_repeats(client, penalty):
    out = tokens(client, **{penalty: 2.0})
    assert out.count(" quick") == 1 and out[0] == " quick"


def test_repetition_penalty_also_counts_the_prompts_tokens(client):
    # " quick" is in the prompt: penalised from the first token on, unlike the presence penalty.
    assert " quick" not in tokens(client, repetition_penalty=2.0)


def test_logit_bias_plus_100_forces_a_token_and_minus_100_bans_it(client, tok):
    (fox,) = tok.encode(" fox")
    (quick,) = tok.encode(" quick")
    assert tokens(client, temperature=1.0, logit_bias={str(fox): 100}) == [" fox"] * 12
    banned = tokens(client, logit_bias={str(quick): -100})
    assert " quick" not in banned


def test_min_tokens_holds_back_eos(client, tok):
    eos = str(tok.eos_token_id)
    r = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, logit_bias={eos: 100}
    )
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (1, "stop")
    r = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        logit_bias={eos: 100},
        extra_body={"min_tokens": 5},
    )
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (6, "stop")  # 5, then EOS


def test_min_tokens_ignores_stop_strings_until_reached(client):
    # The greedy answer is " quick quick ...": stop at " quick" would end it at once.
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=[" quick"])
    assert (r.choices[0].text, r.usage.completion_tokens) == ("", 1)
    r = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        stop=[" quick"],
        extra_body={"min_tokens": 3},
    )
    assert (r.choices[0].text, r.usage.completion_tokens) == (" quick" * 3, 4)


def test_top_k_one_is_greedy(client):
    greedy = tokens(client, max_tokens=16)
    for seed in (1, 2):
        assert tokens(client, temperature=1.5, seed=seed, top_k=1, max_tokens=16) == greedy
    assert tokens(client, temperature=1.5, seed=1, max_tokens=16) != greedy  # without it, sampled


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"presence_penalty": 9.0}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logit_bias": {"100000": 5}}, "logit_bias"),  # beyond the vocabulary: only the engine knows
        ({"logit_bias": {"5": 300}}, "logit_bias"),
        ({"extra_body": {"top_k": -5}}, "top_k"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"max_tokens": 3, "extra_body": {"min_tokens": 4}}, "min_tokens"),
        ({"extra_body": {"min_tokens": 5000}}, "min_tokens"),  # more than the context leaves
        ({"tool_choice": "auto"}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "tools[0]",
        ),
    ],
)
def test_out_of_range_or_unsupported_is_a_400_naming_the_parameter(client, kw, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], **kw)
    assert info.value.body["param"] == param
