"""Load against a deployment: arrivals from a trace or a Poisson rate, sent as streaming chats.

Each arrival becomes one `POST /v1/chat/completions` with `stream: true` at its time after the
start (open loop: a slow answer does not delay the next send, unless `concurrency_limit` caps the
requests in flight). From the stream come the figures `stoker.cli.plan` works on: TTFT to the first
content token, end-to-end to the last byte, output tokens (the final usage chunk's
`completion_tokens`, asked for with `stream_options.include_usage`, else the content chunks),
and from the headers the instance that answered (`x-stoker-instance`) and whether the request was
a cold start (`x-stoker-cold-start: true`). `ignore_eos` makes each answer as long as asked, so a
trace's output lengths are what the instances generate.

Prompts are synthesized: common English words, about one token each with the usual tokenizers,
led by the request's index so no two share a long prefix. A trace's ContextTokens and
GeneratedTokens are capped (`max_prompt_tokens`, `max_tokens`) to what the model takes.

Errors: an answer that is not 200, an SSE error event, a broken stream or a timeout is a failed
`Sample` with a short kind ("HTTP 503 queue_full"). One the run cannot go on from (the platform
unreachable, the key refused, no such deployment) ends it at once as a `LoadError`.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import aiohttp

from stoker.cli.admin_client import tls_context
from stoker.cli.plan import Sample
from stoker.errors import CLIError

FATAL_STATUSES = {401: "the key was refused", 403: "the key was refused", 404: "not found"}
_WORDS = (
    "the time people way year work day thing man world life hand part child eye woman place week "
    "case point number group problem fact water room mother area money story month lot right study "
    "book word business issue side kind head house service friend father power hour game line end "
    "member law car city name team minute idea body information back parent face others level office"
).split()


class LoadError(CLIError):
    """The load cannot go on: the platform or the deployment cannot be reached at all."""


@dataclass(frozen=True)
class Arrival:
    t: float  # seconds after the start
    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class Run:
    samples: list[Sample]
    wall_s: float  # from the first send to the last answer


def poisson_arrivals(
    rate: float, duration: float, *, prompt_tokens: int, max_tokens: int, seed: int = 0
) -> list[Arrival]:
    """Arrivals of a Poisson process of `rate` per second over `duration` seconds: exponential gaps
    with mean 1 / rate, seeded so a run is the same run again."""
    rng = random.Random(seed)
    out, t = [], rng.expovariate(rate)
    while t < duration:
        out.append(Arrival(t, prompt_tokens, max_tokens))
        t += rng.expovariate(rate)
    return out


def trace_arrivals(
    requests: Iterable, *, duration: float | None, max_prompt_tokens: int, max_tokens: int
) -> list[Arrival]:
    """A trace's requests (`warm_pool.trace.TraceRequest`) within `duration`, sizes capped (≥ 1)."""
    return [
        Arrival(
            r.t, max(1, min(r.context_tokens, max_prompt_tokens)), max(1, min(r.generated_tokens, max_tokens))
        )
        for r in requests
        if duration is None or r.t < duration
    ]


def prompt_text(tokens: int, index: int) -> str:
    """About `tokens` tokens of text, different for every `index`."""
    words = [f"{index}:"] + [_WORDS[(index + k) % len(_WORDS)] for k in range(max(0, tokens - 1))]
    return " ".join(words)


async def replay(
    base_url: str,
    model: str,
    arrivals: list[Arrival],
    *,
    api_key: str | None = None,
    concurrency_limit: int | None = None,
    timeout_s: float = 300.0,
    ignore_eos: bool = True,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable] = asyncio.sleep,
) -> Run:
    """Send every arrival at its time; every request's `Sample`, in the order they were sent."""
    url = base_url.rstrip("/") + "/v1/chat/completions"
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    gate = asyncio.Semaphore(concurrency_limit) if concurrency_limit else None
    samples: list[Sample] = []
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=10)
    t0 = clock()

    async def send(index: int, arrival: Arrival) -> None:
        try:
            sample = await _one(session, url, headers, model, index, arrival, t0, clock, ignore_eos)
            samples.append(sample)
        finally:
            if gate is not None:
                gate.release()

    connector = aiohttp.TCPConnector(limit=0, ssl=tls_context() or True)  # an https:// one: $STOKER_CA
    try:
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            async with asyncio.TaskGroup() as group:
                for index, arrival in enumerate(arrivals):
                    if (delay := t0 + arrival.t - clock()) > 0:
                        await sleep(delay)
                    if gate is not None:
                        await gate.acquire()
                    group.create_task(send(index, arrival))
    except* LoadError as failed:
        raise failed.exceptions[0] from None
    samples.sort(key=lambda s: s.start)
    return Run(samples, clock() - t0)


async def _one(session, url, headers, model, index, arrival, t0, clock, ignore_eos) -> Sample:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt_text(arrival.prompt_tokens, index)}],
        "max_tokens": arrival.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
    }
    sent = clock()
    start, ttft, chunks, usage, instance, cold = sent - t0, None, 0, None, None, False

    def failed(kind: str) -> Sample:
        return Sample(start, ttft, None, usage or chunks, instance, cold, kind)

    try:
        async with session.post(url, json=body, headers=headers) as resp:
            instance = resp.headers.get("x-stoker-instance")
            cold = resp.headers.get("x-stoker-cold-start", "").lower() == "true"
            if resp.status != 200:
                code, message = await _error_of(resp)
                if resp.status in FATAL_STATUSES:
                    raise LoadError(f"{url}: HTTP {resp.status}, {FATAL_STATUSES[resp.status]}: {message}")
                return failed(f"HTTP {resp.status} {code}".rstrip())
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue  # keep-alives (blank lines) and anything that is not an event
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if isinstance(event, dict) and event.get("error"):
                    error = event["error"]
                    return failed(f"stream error {error.get('code') or error.get('type') or ''}".rstrip())
                for choice in event.get("choices") or ():
                    if (choice.get("delta") or {}).get("content"):
                        ttft = clock() - sent if ttft is None else ttft
                        chunks += 1
                if event.get("usage"):
                    usage = event["usage"].get("completion_tokens")
    except LoadError:
        raise
    except aiohttp.ClientConnectorError as exc:
        raise LoadError(
            f"cannot reach the platform at {url} ({exc.os_error}); is `stoker up` running?"
        ) from None
    except TimeoutError:
        return failed("timeout")
    except aiohttp.ClientError as exc:
        return failed(f"broken stream {type(exc).__name__}")
    except (ValueError, AttributeError):
        return failed("bad event")
    if ttft is None:
        return failed("no output")
    return Sample(start, ttft, clock() - sent, usage or chunks, instance, cold)


async def _error_of(resp: aiohttp.ClientResponse) -> tuple[str, str]:
    """An error answer's OpenAI `code` (or `type`) and message."""
    text = await resp.text(errors="replace")
    try:
        error = json.loads(text)["error"]
        return str(error.get("code") or error.get("type") or ""), str(error.get("message") or text)
    except (ValueError, KeyError, TypeError, AttributeError):
        return "", text.strip()[:200] or resp.reason or ""
