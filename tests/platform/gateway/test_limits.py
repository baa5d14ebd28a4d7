"""Per-key limits on a logical clock: token buckets, the concurrency cap, settling, headers."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry

from stoker.errors import APIError
from stoker.gateway.limits import DEFAULT_MAX_TOKENS, Limiter, UsageTap, duration, estimate_tokens
from stoker.spec.keys import Limits


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def refused(limiter: Limiter, key: str, limits: Limits, estimate=(1, 1)) -> APIError:
    with pytest.raises(APIError) as exc:
        limiter.admit(key, limits, estimate)
    assert exc.value.status == 429
    return exc.value


def test_refusals_are_counted_by_tenant_and_limit():
    registry = CollectorRegistry()
    limiter = Limiter(registry=registry, clock=Clock())
    limiter.admit("k", Limits(rps=1, max_concurrent=1), (1, 1), "acme")
    refused_ = [refused(limiter, "k", Limits(rps=1, max_concurrent=1)) for _ in range(2)]
    assert {e.code for e in refused_} == {"concurrency_limit_exceeded"}
    value = registry.get_sample_value("stoker_rate_limited_total", {"tenant": "", "limit": "concurrency"})
    assert value == 2


def test_no_limit_anywhere_admits_without_a_ticket():
    assert Limiter().admit("k", Limits(), (10, 10)) is None


def test_requests_per_second_refill_and_retry_after():
    clock = Clock()
    limiter = Limiter(clock=clock)
    limits = Limits(rps=2)
    for _ in range(2):
        limiter.admit("k", limits, (1, 1)).close()
    exc = refused(limiter, "k", limits)
    assert exc.type == "requests" and exc.code == "rate_limit_exceeded"
    assert exc.headers["retry-after"] == "1"  # 0.5 s, rounded up to whole seconds
    assert exc.headers["x-ratelimit-limit-requests"] == "2"
    assert exc.headers["x-ratelimit-remaining-requests"] == "0"
    clock.t += 0.5
    ticket = limiter.admit("k", limits, (1, 1))
    assert dict(ticket.headers)[b"x-ratelimit-remaining-requests"] == b"0"
    # Another key has its own bucket.
    assert limiter.admit("other", limits, (1, 1)) is not None


def test_a_fractional_rate_still_allows_one_request():
    clock = Clock()
    limiter = Limiter(clock=clock)
    limits = Limits(rps=0.2)
    limiter.admit("k", limits, (1, 1)).close()
    assert refused(limiter, "k", limits).headers["retry-after"] == "5"
    clock.t += 5
    assert limiter.admit("k", limits, (1, 1)) is not None


def test_tokens_are_charged_by_estimate_and_settled_by_usage():
    clock = Clock()
    limiter = Limiter(clock=clock)
    limits = Limits(tpm=600)  # 10 tokens a second
    ticket = limiter.admit("k", limits, (100, 400))
    exc = refused(limiter, "k", limits, (50, 100))
    assert exc.type == "tokens" and exc.headers["retry-after"] == "5"  # 150 wanted, 100 left
    assert exc.headers["x-ratelimit-remaining-tokens"] == "100"
    ticket.settle(120)  # it used far less than it might have: 380 come back
    ticket.close()
    follow = limiter.admit("k", limits, (50, 100))
    assert dict(follow.headers)[b"x-ratelimit-remaining-tokens"] == b"330"


def test_a_request_larger_than_the_bucket_waits_for_a_full_bucket_then_goes():
    clock = Clock()
    limiter = Limiter(clock=clock)
    limits = Limits(tpm=60)
    limiter.admit("k", limits, (10, 10)).close()  # 40 left
    assert refused(limiter, "k", limits, (100, 100)).headers["retry-after"] == "20"
    clock.t += 20
    big = limiter.admit("k", limits, (100, 100))  # full: admitted, the bucket goes below zero
    big.settle(200)
    assert refused(limiter, "k", limits, (1, 1)).headers["retry-after"] == "142"


def test_held_and_in_flight_requests_are_capped_until_one_closes():
    limiter = Limiter(clock=Clock())
    limits = Limits(max_concurrent=2)
    first, _second = limiter.admit("k", limits, (1, 1)), limiter.admit("k", limits, (1, 1))
    exc = refused(limiter, "k", limits)
    assert exc.code == "concurrency_limit_exceeded" and exc.headers["retry-after"] == "1"
    first.close()
    assert limiter.admit("k", limits, (1, 1)) is not None


def test_platform_defaults_apply_where_a_key_sets_none_and_forget_resets():
    clock = Clock()
    limiter = Limiter(Limits(rps=1, max_concurrent=5), clock=clock)
    limiter.admit("k", Limits(), (1, 1))
    refused(limiter, "k", Limits())
    own = Limits(rps=10)
    assert limiter.limits_for(own) == Limits(rps=10, max_concurrent=5)
    limiter.forget("k")  # a revoked key's state goes; a key made later starts full
    assert limiter.admit("k", Limits(), (1, 1)) is not None


@pytest.mark.parametrize(
    "body, size, expected",
    [
        ({"max_tokens": 50}, 400, (101, 50)),
        ({"max_completion_tokens": 7, "max_tokens": 50}, 8, (3, 7)),
        ({}, 0, (1, DEFAULT_MAX_TOKENS)),
        ({"max_tokens": "lots"}, 4, (2, DEFAULT_MAX_TOKENS)),
        ({"max_tokens": -3}, 4, (2, DEFAULT_MAX_TOKENS)),
        ({"max_tokens": 50, "n": 3}, 400, (101, 150)),  # each choice may take max_tokens
        ({"max_tokens": 50, "n": 99}, 400, (101, 50)),  # out of range: the engine's 400 settles it
        ({"max_tokens": 50, "n": True}, 400, (101, 50)),
        ({"max_output_tokens": 9}, 400, (101, 9)),  # a Responses request's
    ],
)
def test_estimates(body, size, expected):
    assert estimate_tokens(body, size) == expected


def test_an_embeddings_request_is_estimated_to_complete_nothing():
    assert estimate_tokens({"input": "x" * 396, "max_tokens": 50}, 400, embeddings=True) == (101, 0)


@pytest.mark.parametrize(
    "seconds, text", [(0.0201, "21ms"), (0.999, "999ms"), (1.5, "1.5s"), (59, "59s"), (360, "6m0s")]
)
def test_reset_durations_read_as_openai_writes_them(seconds, text):
    assert duration(seconds) == text


async def _through(tap: UsageTap, status: int, chunks: list[bytes]) -> None:
    await tap({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"x")]})
    for chunk in chunks:
        await tap({"type": "http.response.body", "body": chunk, "more_body": True})
    await tap({"type": "http.response.body", "body": b"", "more_body": False})


async def test_the_tap_adds_headers_and_reads_usage_from_a_completion_and_a_stream():
    limiter = Limiter(clock=Clock())
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    ticket = limiter.admit("k", Limits(tpm=10_000), (10, 100))
    tap = UsageTap(send, ticket)
    body = json.dumps({"choices": [{"text": "x" * 20_000}], "usage": {"prompt_tokens": 3, "total_tokens": 9}})
    await _through(tap, 200, [body[:7000].encode(), body[7000:].encode()])
    assert tap.used() == 9
    assert (b"x-ratelimit-limit-tokens", b"10000") in sent[0]["headers"]
    assert len(sent) == 4 and b"".join(m.get("body", b"") for m in sent[1:]) == body.encode()

    stream = UsageTap(send, limiter.admit("k", Limits(tpm=10_000), (10, 100)))
    events = [
        b'data: {"choices":[{"text":"a"}]}\n\n',
        b": waiting\n\n",
        b'data: {"choices":[]}\n\ndata: [DONE]\n\n',
    ]
    await _through(stream, 200, events)
    assert stream.used() == 10 + 2  # no usage: the prompt's estimate and one token per event

    with_usage = UsageTap(send, limiter.admit("k", Limits(tpm=10_000), (10, 100)))
    last = b'data: {"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":2,"total_tokens":6}}\n\n'
    await _through(with_usage, 200, [events[0], last, b"data: [DONE]\n\n"])
    assert with_usage.used() == 6

    refused_tap = UsageTap(send, limiter.admit("k", Limits(tpm=10_000), (10, 100)))
    await _through(refused_tap, 503, [b'{"error": {}}'])
    assert refused_tap.used() == 0  # no answer: nothing charged


@pytest.mark.parametrize(
    "usage",
    [
        # Stoker's engine: the totals first; vLLM (the openai types' order): each total's details after it.
        {"input_tokens": 4, "output_tokens": 2, "total_tokens": 6, "input_tokens_details": {"cached_tokens": 0},
         "output_tokens_details": {"reasoning_tokens": 0}},
        {"input_tokens": 4, "input_tokens_details": {"cached_tokens": 1}, "output_tokens": 2,
         "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 6},
    ],
)  # fmt: skip
async def test_the_tap_reads_a_response_s_usage_whole_and_from_its_completed_event(usage):
    async def send(message):
        pass

    limiter = Limiter(clock=Clock())
    response = {"id": "resp_1", "object": "response", "output": [{"text": "x" * 20_000}], "usage": usage}
    whole = UsageTap(send, limiter.admit("k", Limits(tpm=10_000), (10, 100)))
    body = json.dumps(response).encode()
    await _through(whole, 200, [body[:9000], body[9000:]])
    assert whole.used() == 6 and whole.tokens() == (4, 2)

    stream = UsageTap(send, limiter.admit("k", Limits(tpm=10_000), (10, 100)))
    created = {"type": "response.created", "response": {**response, "output": [], "usage": None}}
    done = {"type": "response.completed", "sequence_number": 9, "response": response}
    events = [f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in (created, done)]
    await _through(stream, 200, events)
    assert stream.used() == 6 and stream.tokens() == (4, 2)
