"""The draw step's arithmetic on small rows of logits, checked against vLLM's definitions (pure: no
model, no manager): bias, penalties, min_tokens, top-k, the grammar mask, raw logprobs, seeded
draws, and one request's failure leaving the others' rows alone."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingTemperatureLogitsWarper,
    ContinuousBatchingTopPLogitsWarper,
)
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from stoker.engine.draw import Draw, Draws, RequestDraw, Shape, needs_shape, sample, top_p_
from stoker.engine.protocol import SamplingParams

V = 8
EOS = 7
NEG_INF = float("-inf")


def params(**kw) -> SamplingParams:
    base = {"max_tokens": 16, "temperature": 0.0, "top_p": 1.0, "stop": (), "seed": None}
    return SamplingParams(**{**base, **kw})


class FakeGrammar:
    """A grammar that allows a fixed set of tokens, and records what it was given."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed_set, self.taken, self.error = allowed, [], None

    def allowed(self) -> torch.Tensor:
        mask = torch.zeros(V, dtype=torch.bool)
        mask[list(self.allowed_set)] = True
        return mask

    def advance(self, token: int) -> None:
        self.taken.append(token)


def request(prompt=(0,), grammar=None, **kw) -> RequestDraw:
    return RequestDraw(params(**kw), list(prompt), vocab_size=V, eos={EOS}, device="cpu", grammar=grammar)


def take(d: RequestDraw, *tokens: int) -> None:
    """Draw `tokens` as if the model had put all its mass on each in turn."""
    for t in tokens:
        row = torch.full((V,), NEG_INF)
        row[t] = 0.0
        assert d.draw(row) == t


def shaped(d: RequestDraw, row=None) -> torch.Tensor:
    row = torch.zeros(V) if row is None else torch.tensor(row, dtype=torch.float32)
    d.shape(row)
    return row


@pytest.mark.parametrize(("presence", "frequency"), [(0.5, 0.25), (-2.0, 0.0), (0.0, -1.5), (2.0, 2.0)])
def test_presence_and_frequency_penalties_count_output_tokens_as_openai_defines(presence, frequency):
    d = request(prompt=(3,), presence_penalty=presence, frequency_penalty=frequency)
    take(d, 2, 2, 5)
    row = shaped(d)
    assert row[2].item() == pytest.approx(-presence - 2 * frequency)
    assert row[5].item() == pytest.approx(-presence - 1 * frequency)
    assert row[[0, 1, 3, 4, 6, 7]].tolist() == [0.0] * 6  # the prompt's token 3 is not penalised


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    d = request(prompt=(1,), repetition_penalty=2.0)
    take(d, 2)
    row = shaped(d, [1.0, 1.0, -1.0, 1.0, -1.0, 1.0, 1.0, 1.0])
    # token 1 is in the prompt, token 2 in the output; token 4 is negative but unseen
    assert row.tolist() == [1.0, 0.5, -2.0, 1.0, -1.0, 1.0, 1.0, 1.0]


def test_logit_bias_adds_and_a_big_one_forces_the_token():
    d = request(logit_bias=((3, 100.0), (4, -2.0)))
    row = shaped(d, [1.0] * V)
    assert row[3].item() == 101.0 and row[4].item() == -1.0
    assert d.draw(row) == 3


def test_min_tokens_holds_eos_back_until_reached():
    d = request(min_tokens=2)
    assert shaped(d)[EOS].item() == NEG_INF
    take(d, 1)
    assert shaped(d)[EOS].item() == NEG_INF
    take(d, 1)
    assert shaped(d)[EOS].item() == 0.0


def test_a_complete_grammar_wins_over_min_tokens():
    # The JSON is complete: only EOS may follow. min_tokens would leave no token at all.
    d = request(min_tokens=5, grammar=FakeGrammar({EOS}))
    row = shaped(d)
    assert torch.isfinite(row).tolist() == [False] * EOS + [True]
    assert d.draw(row) == EOS


def test_top_k_keeps_the_k_best():
    d = request(top_k=3)
    row = shaped(d, [0.0, 5.0, 1.0, 4.0, 2.0, 3.0, -1.0, 0.5])
    assert torch.isfinite(row).nonzero().view(-1).tolist() == [1, 3, 5]


def test_grammar_masks_the_row_and_takes_each_drawn_token():
    grammar = FakeGrammar({2, 4})
    d = request(grammar=grammar, temperature=1.0, seed=1)
    for _ in range(20):
        row = shaped(d)
        assert torch.isfinite(row).nonzero().view(-1).tolist() == [2, 4]
        d.draw(row)
    assert set(grammar.taken) <= {2, 4} and len(grammar.taken) == 20


def test_logprobs_are_raw_after_the_grammar_and_before_bias_and_temperature():
    d = request(logprobs=2, logit_bias=((3, 100.0),), grammar=FakeGrammar({1, 2, 3, 4}))
    row = shaped(d)
    assert d.draw(row) == 3
    (record,) = d.records
    assert record.token == 3
    assert record.logprob == pytest.approx(math.log(1 / 4))  # what the model (masked) gave it
    assert len(record.top) == 2 and all(lp == pytest.approx(math.log(1 / 4)) for _, lp in record.top)


def test_greedy_draws_the_argmax_and_a_seed_repeats_its_draws():
    assert request().draw(torch.tensor([0.0, 3.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0])) == 1

    def draws(seed: int) -> list[int]:
        d = request(temperature=1.0, seed=seed)
        return [d.draw(torch.zeros(V)) for _ in range(30)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_a_failing_request_ends_alone_and_its_neighbours_rows_are_untouched():
    draws = Draws(eos=EOS)
    broken = request(grammar=FakeGrammar(set()))  # allows nothing: cannot continue
    healthy = request(logit_bias=((5, 10.0),))
    draws.register("a", broken)
    draws.register("b", healthy)
    shape, draw = Shape(draws), Draw(draws)
    batch = [SimpleNamespace(state=SimpleNamespace(request_id=r)) for r in ("a", "c", "b")]
    shape.prepare_tensor_args(batch)
    scores = torch.zeros(3, V)
    scores = draw(shape(scores, None), None)
    assert broken.error is not None and "no token is allowed" in broken.error
    assert torch.isfinite(scores[0]).nonzero().view(-1).tolist() == [EOS]  # ended with EOS
    assert scores[1].tolist() == [0.0] * V  # "c" is no request of ours: left to transformers' argmax
    assert torch.isfinite(scores[2]).nonzero().view(-1).tolist() == [5]  # drawn as asked


@pytest.mark.parametrize(
    ("kw", "needed"),
    [
        ({"temperature": 1.0}, False),
        ({"temperature": 0.7, "top_p": 0.9}, False),
        ({"temperature": 0.0}, False),
        ({"temperature": 1.0, "seed": 3}, False),
        ({"temperature": 1.0, "logprobs": 0}, True),
        ({"temperature": 1.0, "top_k": 5}, True),
        ({"temperature": 1.0, "min_tokens": 1}, True),
        ({"temperature": 1.0, "presence_penalty": -0.5}, True),
        ({"temperature": 1.0, "repetition_penalty": 1.1}, True),
    ],
)
def test_only_requests_that_ask_for_more_than_a_plain_draw_are_shaped(kw, needed):
    assert needs_shape(params(**kw)) is needed


def transformers_warped(scores: torch.Tensor, temperatures: list[float], top_ps: list[float]) -> torch.Tensor:
    """What transformers' per-request temperature and top-p warpers make of a batch of rows."""
    temp = ContinuousBatchingTemperatureLogitsWarper(TemperatureLogitsWarper(0.5))
    top_p = ContinuousBatchingTopPLogitsWarper(TopPLogitsWarper(0.5))
    rows = [SimpleNamespace(state=SimpleNamespace(logit_processor_kwargs={"temperature": t, "top_p": p}))
            for t, p in zip(temperatures, top_ps, strict=True)]  # fmt: skip
    scores = temp(scores, temp.prepare_tensor_args(rows))
    return top_p(scores, top_p.prepare_tensor_args(rows))


def test_temperature_and_top_p_are_transformers_warpers_bit_for_bit_and_a_seed_draws_what_it_drew():
    """The draw step took over transformers' warpers: the same rows, bit for bit (so a seed gives
    the answer it gave when they ran), top-p 1 cutting nothing and temperature 1 changing nothing."""
    gen = torch.Generator().manual_seed(0)
    vocab, cases = 4096, [(0.7, 0.9), (1.0, 0.95), (1.3, 1.0), (1.0, 1.0), (0.2, 0.5)]
    logits = torch.randn(len(cases), vocab, generator=gen) * 4
    theirs = transformers_warped(logits.clone(), [t for t, _ in cases], [p for _, p in cases])
    for i, (t, p) in enumerate(cases):
        mine = request(temperature=t, top_p=p, seed=11)
        twin = request(temperature=t, top_p=p, seed=11)
        row = logits[i].clone()
        token = mine.draw(row)  # warps, then narrows the row to `token`
        assert torch.isfinite(row).nonzero().view(-1).tolist() == [token]
        expected = theirs[i].clone()
        assert twin.generator is not None

        assert token == sample(torch.softmax(expected, dim=-1), twin.generator)  # the draw on their rows
        warped = logits[i].clone()
        if mine.temperature is not None:
            warped.div_(mine.temperature)
        if mine.top_p_floor is not None:
            top_p_(warped, mine.top_p_floor)
        assert torch.equal(warped, expected)
        assert (mine.temperature is None) == (t == 1.0) and (mine.top_p_floor is None) == (p == 1.0)
        assert torch.isfinite(warped).sum() == (vocab if p == 1.0 else torch.isfinite(expected).sum())


def test_greedy_rows_are_not_warped():
    d = request(temperature=0.0, top_p=0.5)
    assert d.temperature is None and d.top_p_floor is None
    row = torch.tensor([0.0, 3.0, 1.0, 2.9, 0.0, 0.0, 0.0, 0.0])
    assert d.draw(row) == 1
