"""Per-key rate limits: requests per second and tokens per minute (token buckets), and a cap on a
key's requests held + in flight. Checked by the gateway before a request reaches an activator.

    admit ─▶ concurrency cap ─▶ request bucket ─▶ token bucket ─▶ Ticket (serve, then settle, close)
               │ over              │ empty            │ short
               └──────────────────┴──────────────────┴──▶ 429, Retry-After, x-ratelimit-* headers

Tokens are charged before the answer exists, so admission charges an estimate (the body's bytes
over four for the prompt, plus `max_tokens`, or `DEFAULT_MAX_TOKENS` when the request names none)
and the answer settles it: the `usage` it reports, or for a stream without usage the prompt estimate
plus one token per event. A request is admitted when the bucket holds its estimate, or, for one
larger than the whole bucket, when the bucket is full: a big request waits for a full minute's
budget and then takes it, instead of being refused for ever. The bucket may go below zero then,
and later requests wait for it to refill.

The headers are OpenAI's (`x-ratelimit-limit-requests`, `-remaining-`, `-reset-`, and the same for
tokens), on every answer to a limited key and on its 429s. Our request limit is per second, so
`x-ratelimit-limit-requests` is the bucket's size: the requests one second allows.

A small token bucket is written here rather than taken from `limits` (flask-limiter's library):
that one counts fixed and moving windows, cannot give back tokens charged in advance, and costs a
lock and a list per hit; this is a few float operations per request.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from stoker.engine.protocol import MAX_N
from stoker.errors import APIError
from stoker.spec.keys import NO_LIMITS, Limits, is_integer

DEFAULT_MAX_TOKENS = 256  # charged for a request that names no max_tokens, until its usage settles it
RATE_LIMITED = 429


class TokenBucket:
    """`capacity` tokens, refilled at `rate` per second; `level` may go below zero (see the module)."""

    __slots__ = ("capacity", "level", "rate", "stamp")

    def __init__(self, capacity: float, rate: float, now: float) -> None:
        self.capacity = capacity
        self.rate = rate
        self.level = capacity
        self.stamp = now

    def refill(self, now: float) -> None:
        if now > self.stamp:
            self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
            self.stamp = now

    def wait_s(self, amount: float) -> float:
        """Seconds until `amount` (at most the capacity) is in the bucket; 0: now."""
        need = min(amount, self.capacity) - self.level
        return need / self.rate if need > 0 else 0.0

    def reset_s(self) -> float:
        """Seconds until the bucket is full again."""
        return max(0.0, self.capacity - self.level) / self.rate


class _KeyState:
    __slots__ = ("busy", "limits", "requests", "tokens")

    def __init__(self, limits: Limits, now: float) -> None:
        self.limits = limits
        self.busy = 0  # requests held or in flight
        self.requests = None if limits.rps is None else TokenBucket(max(1.0, limits.rps), limits.rps, now)
        self.tokens = None if limits.tpm is None else TokenBucket(limits.tpm, limits.tpm / 60.0, now)


class Ticket:
    """An admitted request of a limited key: its headers for the answer, its token charge to
    settle, and its place under the concurrency cap to give back (`close`, exactly once)."""

    __slots__ = ("_charged", "_state", "headers", "prompt_estimate")

    def __init__(
        self, state: _KeyState, charged: int, prompt_estimate: int, headers: list[tuple[bytes, bytes]]
    ):
        self._state = state
        self._charged = charged
        self.prompt_estimate = prompt_estimate
        self.headers = headers

    @property
    def counts_tokens(self) -> bool:
        return self._state.tokens is not None

    def settle(self, tokens: int) -> None:
        """The answer used `tokens` in all: charge or give back the difference from the estimate."""
        if (bucket := self._state.tokens) is not None:
            bucket.level = min(bucket.capacity, bucket.level + self._charged - tokens)
            self._charged = tokens

    def close(self) -> None:
        self._state.busy -= 1


class Limiter:
    """The limits of every key that has any, in memory (one gateway process). A key's state is
    made at its first request and dropped when the key is revoked (`forget`)."""

    def __init__(
        self,
        defaults: Limits = NO_LIMITS,
        *,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.defaults = defaults
        self._clock = clock
        self._keys: dict[str, _KeyState] = {}
        self._refused = Counter(
            "stoker_rate_limited",
            "Requests refused 429 for a key's limit, by tenant and limit (requests, tokens, concurrency)",
            ["tenant", "limit"],
            registry=registry,
        )

    def limits_for(self, own: Limits) -> Limits:
        return own.over(self.defaults)

    def forget(self, key_id: str) -> None:
        self._keys.pop(key_id, None)

    def admit(self, key_id: str, own: Limits, estimate: tuple[int, int], tenant: str = "") -> Ticket | None:
        """Admit one request of `key_id` (of `tenant`) whose limits are `own` (over the defaults),
        charging `estimate` = (prompt tokens, completion tokens at most). None: the key has no
        limit. Raises a 429 `APIError` (with Retry-After and x-ratelimit-* headers) when over one."""
        try:
            return self._admit(key_id, own, estimate)
        except APIError as exc:
            self._refused.labels(
                tenant, "concurrency" if exc.code == "concurrency_limit_exceeded" else exc.type
            ).inc()
            raise

    def _admit(self, key_id: str, own: Limits, estimate: tuple[int, int]) -> Ticket | None:
        state = self._keys.get(key_id)
        if state is None:
            limits = own.over(self.defaults)
            if not limits.any:
                return None
            state = self._keys[key_id] = _KeyState(limits, self._clock())
        limits = state.limits
        now = self._clock()
        requests, tokens = state.requests, state.tokens
        charge = estimate[0] + estimate[1]
        if requests is not None:
            requests.refill(now)
        if tokens is not None:
            tokens.refill(now)
        if limits.max_concurrent is not None and state.busy >= limits.max_concurrent:
            raise _limited(
                f"Too many requests at once for this key: {limits.max_concurrent} are already waiting or "
                "running; retry when one finishes.",
                "requests",
                "concurrency_limit_exceeded",
                1.0,
                requests,
                tokens,
            )
        if requests is not None and (wait := requests.wait_s(1)) > 0:
            raise _limited(
                f"Rate limit reached for requests: {limits.rps:g} per second; retry in {wait:.2f} s.",
                "requests",
                "rate_limit_exceeded",
                wait,
                requests,
                tokens,
            )
        if tokens is not None and (wait := tokens.wait_s(charge)) > 0:
            raise _limited(
                f"Rate limit reached for tokens: {limits.tpm} per minute; this request may use {charge} "
                f"and {max(0, int(tokens.level))} are left; retry in {wait:.2f} s.",
                "tokens",
                "rate_limit_exceeded",
                wait,
                requests,
                tokens,
            )
        if requests is not None:
            requests.level -= 1
        if tokens is not None:
            tokens.level -= charge
        state.busy += 1
        return Ticket(state, charge, estimate[0], _headers(requests, tokens))


def _limited(
    message: str,
    kind: str,
    code: str,
    wait_s: float,
    requests: TokenBucket | None,
    tokens: TokenBucket | None,
) -> APIError:
    headers = {name.decode(): value.decode() for name, value in _headers(requests, tokens)}
    headers["retry-after"] = str(max(1, math.ceil(wait_s)))
    return APIError(RATE_LIMITED, message, type=kind, code=code, headers=headers)


def _headers(requests: TokenBucket | None, tokens: TokenBucket | None) -> list[tuple[bytes, bytes]]:
    out = []
    for name, bucket in ((b"requests", requests), (b"tokens", tokens)):
        if bucket is not None:
            out += [
                (b"x-ratelimit-limit-" + name, b"%d" % int(bucket.capacity)),
                (b"x-ratelimit-remaining-" + name, b"%d" % max(0, int(bucket.level))),
                (b"x-ratelimit-reset-" + name, duration(bucket.reset_s()).encode()),
            ]
    return out


def duration(seconds: float) -> str:
    """OpenAI's reset format: `20ms`, `1.5s`, `6m0s`."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{rest:.0f}s"


def estimate_tokens(body: dict[str, Any], size: int, *, embeddings: bool = False) -> tuple[int, int]:
    """(prompt tokens, completion tokens at most) for a request body of `size` bytes: about four
    bytes a token for the prompt (the JSON around it counts too: an overestimate, settled later);
    an embeddings request completes none."""
    if embeddings:
        return size // 4 + 1, 0
    most = body.get("max_completion_tokens", body.get("max_tokens", body.get("max_output_tokens")))
    if not is_integer(most) or most < 0:
        most = DEFAULT_MAX_TOKENS  # a bad value is the engine's to refuse; its answer settles this
    n = body.get("n")
    choices = n if is_integer(n) and 1 <= n <= MAX_N else 1  # each of n choices may take as many
    return size // 4 + 1, most * choices


# `"usage": {...}` in a completion, in a stream's last event, or in a Response (whole, or in the
# stream's `response.completed`): numbers only in the fields read, beside objects of one level (a
# Response's `input_tokens_details`, written before its totals by vLLM, after them by Stoker's engine).
_USAGE_BODY = rb'"usage"\s*:\s*\{((?:[^{}]|\{[^{}]*\})*'
_USAGE = re.compile(_USAGE_BODY + rb'?)"total_tokens"\s*:\s*(\d+)')
# The fields of that `usage` object, each request's tokens in and out (`stoker.control.cost`):
# chat's and completions' names, or the Responses API's.
_USAGE_OBJECT = re.compile(_USAGE_BODY + rb")")
_USAGE_FIELD = re.compile(rb'"(prompt_tokens|completion_tokens|input_tokens|output_tokens)"\s*:\s*(\d+)')
TAIL = 8192  # bytes of each of the last two chunks searched for `usage`


class UsageTap:
    """An ASGI `send` wrapper for one limited request: adds the ticket's x-ratelimit-* headers to
    the response start, and reads the tokens used from the answer, to settle the ticket. Only the
    last two chunks are kept (a completion's `usage` is near its end; a stream's is its last event
    but for `[DONE]`), and a stream's events are counted, for a stream that reports no usage. Per
    chunk that is a reference kept and one `bytes.count`: this runs for every chunk of a stream."""

    __slots__ = ("_last", "_prev", "_send", "events", "prompt_estimate", "status", "ticket")

    def __init__(self, send: Callable, ticket: Ticket | None, prompt_estimate: int = 0) -> None:
        self._send = send
        self.ticket = ticket  # None: a tap that only reads (`stoker.control.cost`), adds no headers
        self.prompt_estimate = ticket.prompt_estimate if ticket is not None else prompt_estimate
        self._prev = self._last = b""
        self.events = 0
        self.status = 0

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            if self.ticket is not None:
                message = {**message, "headers": [*message.get("headers", ()), *self.ticket.headers]}
        elif chunk := message.get("body"):
            self.events += chunk.count(b"data: ")
            self._prev, self._last = self._last, chunk
        await self._send(message)

    def used(self) -> int | None:
        """Tokens the answer reports using; for a stream without usage, an estimate; 0 for no
        answer (refused, or an error); None when a 200 says nothing (the estimate stands)."""
        if self.status != 200:
            return 0
        reported = _USAGE.findall(self._prev[-TAIL:] + self._last[-TAIL:])
        if reported:
            return int(reported[-1][1])
        if self.events:  # minus the [DONE] marker; keep-alive comments are not events
            return self.prompt_estimate + self.events - 1
        return None

    def tokens(self) -> tuple[int, int] | None:
        """(prompt, completion) tokens of a 200 answer: what its `usage` reports; for a stream
        without usage, the prompt's estimate and one token per event, as `used` counts them. None:
        no answer (refused, an error), or a 200 that says nothing."""
        if self.status != 200:
            return None
        if found := _USAGE_OBJECT.findall(self._prev[-TAIL:] + self._last[-TAIL:]):
            fields = {k: int(v) for k, v in _USAGE_FIELD.findall(found[-1])}
            prompt = fields.get(b"prompt_tokens", fields.get(b"input_tokens", 0))
            return prompt, fields.get(b"completion_tokens", fields.get(b"output_tokens", 0))
        if self.events:
            return self.prompt_estimate, self.events - 1
        return None


class MeterTap(UsageTap):
    """`send` for one request to a deployment: the usage reading of `UsageTap`, no headers added."""

    __slots__ = ("arrival", "deployment", "wall")

    def __init__(self, send: Callable, deployment: str, prompt_estimate: int, arrival: float) -> None:
        super().__init__(send, None, prompt_estimate)
        self.deployment = deployment
        self.arrival = arrival
        self.wall = time.time()
