"""Load for the reliability suite (`test_reliability.py`), with every request's outcome classified.

Each request is one of three outcomes, judged from what the client received and nothing else:

    complete   a plain 200 whose body is a whole answer (choices, a finish_reason), or a stream of
               200 that carried tokens and ended with `data: [DONE]` and no error event
    refused    a clean refusal the client can act on: a 503 (or 429) with Retry-After and OpenAI's
               error object, or a stream that ended with an SSE error event in OpenAI's shape
               followed by `data: [DONE]`
    lost       everything else: a reset or refused connection, a stream ending without [DONE] or
               an error event, a 5xx other than a clean 503, a malformed body, no answer within
               the per-request bound (a hang)

`Load` keeps `concurrency` requests in flight (plain and streaming, completions and chat, in turn)
until it is told to stop, so a fault lands on requests in every phase: held, waiting for headers,
mid-stream. Raw HTTP (httpx) rather than the `openai` client, so nothing is retried or reparsed
behind the count's back. Both shapes use it: one `stoker up` (one URL), or the split planes (the
gateways' URLs, taken in turn as a load balancer would). With several URLs:

    unreached  a connection refused before anything was sent (a gateway stopped or killed): the
               request never reached a gateway, so it is not an outcome; it goes to the next URL,
               as a load balancer sends it. (Every URL refusing is a LOST outcome.)
    retried    with `retry_elsewhere`, a request that failed on the wire after it reached a gateway
               (that gateway was killed under it) is recorded as it failed, LOST with
               `transport_error`, and sent once more to the next URL, as a client retries; the
               retry is an outcome of its own (`retry_of` names the first).

`mark(phase)` starts a named phase: each outcome belongs to the phase it started in, so a test
asserts per phase (`phase(name)`, `by_phase()`) what the fault allowed there.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from tests.deadlines import deadline

COMPLETE, REFUSED, LOST = "complete", "refused", "lost"
ERROR_FIELDS = {"message", "type", "param", "code"}


@dataclass
class Outcome:
    kind: str  # COMPLETE, REFUSED or LOST
    stream: bool
    started: float  # monotonic seconds
    ended: float
    status: int = 0
    instance: str | None = None  # x-stoker-instance: which instance answered
    revision: str | None = None  # x-stoker-revision: which revision of the deployment
    reason: str = ""  # for a refusal or a loss: what the client saw
    transport_error: bool = False  # the connection failed (reset, refused, cut mid-body)
    url: str = ""  # where it was sent (a gateway, with several)
    phase: str = ""  # the load's phase when it started (`Load.mark`)
    retry_of: Outcome | None = None  # the attempt it retries (`Load.retry_elsewhere`)

    @property
    def seconds(self) -> float:
        return self.ended - self.started


def request_body(i: int, model: str, max_tokens: int) -> tuple[str, dict, bool]:
    """The i-th request of a load: (path, body, stream), cycling plain/stream × completions/chat.
    `ignore_eos` makes every answer `max_tokens` long, so a stream lasts long enough to be cut."""
    stream = i % 2 == 1
    common = {"model": model, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    if i % 4 < 2:
        return "/v1/completions", {**common, "prompt": f"request {i}"}, stream
    return (
        "/v1/chat/completions",
        {**common, "messages": [{"role": "user", "content": f"request {i}"}]},
        stream,
    )


class Unreached(Exception):
    """The connection was refused before anything was sent: no server took the request."""


async def send(
    client: httpx.AsyncClient,
    url: str,
    path: str,
    body: dict,
    stream: bool,
    bound_s: float,
    headers: dict | None = None,
    *,
    raise_unreached: bool = False,
) -> Outcome:
    """One request, classified. Never raises (but `Unreached` where asked): a hang past `bound_s`
    is a LOST outcome."""
    began = time.monotonic()
    out = Outcome(LOST, stream, began, began, url=url)
    try:
        async with asyncio.timeout(bound_s):
            async with client.stream("POST", url + path, json=body, headers=headers) as r:
                out.status, out.instance = r.status_code, r.headers.get("x-stoker-instance")
                out.revision = r.headers.get("x-stoker-revision")
                if r.status_code == 200 and stream:
                    _judge_stream(out, [line async for line in r.aiter_lines()])
                else:
                    _judge_whole(out, r, await r.aread())
    except TimeoutError:
        out.kind, out.reason = LOST, f"hang: no end within {bound_s:g} s"
    except httpx.ConnectError as exc:
        if raise_unreached:  # no connection: nothing was sent
            raise Unreached(str(exc)) from exc
        out.kind, out.reason, out.transport_error = LOST, f"{type(exc).__name__}: {exc}", True
    except httpx.TransportError as exc:
        out.kind, out.reason, out.transport_error = LOST, f"{type(exc).__name__}: {exc}", True
    out.ended = time.monotonic()
    return out


def _judge_whole(out: Outcome, r: httpx.Response, raw: bytes) -> None:
    try:
        data = json.loads(raw)
    except ValueError:
        out.kind, out.reason = LOST, f"{r.status_code} with a body that is not JSON: {raw[:200]!r}"
        return
    if r.status_code == 200:
        choices = data.get("choices") if isinstance(data, dict) else None
        if choices and choices[0].get("finish_reason") in ("stop", "length"):
            out.kind = COMPLETE
        else:
            out.kind, out.reason = LOST, f"200 without a whole answer: {raw[:200]!r}"
        return
    error = data.get("error") if isinstance(data, dict) else None
    clean = (
        r.status_code in (429, 503)
        and r.headers.get("retry-after", "").isdigit()
        and isinstance(error, dict)
        and set(error) == ERROR_FIELDS
    )
    code = error.get("code") if isinstance(error, dict) else None
    out.kind = REFUSED if clean else LOST
    out.reason = f"{r.status_code} {code}" if clean else f"{r.status_code}: {raw[:200]!r}"


def _judge_stream(out: Outcome, lines: list[str]) -> None:
    data = [line[5:].strip() for line in lines if line.startswith("data:")]
    if not data or data[-1] != "[DONE]":
        out.kind, out.reason = LOST, f"stream cut: {len(data)} events, the last {data[-1:]!r}"
        return
    events = []
    for payload in data[:-1]:
        try:
            events.append(json.loads(payload))
        except ValueError:
            out.kind, out.reason = LOST, f"stream event that is not JSON: {payload[:200]!r}"
            return
    errors = [e["error"] for e in events if isinstance(e.get("error"), dict)]
    if errors:
        clean = len(errors) == 1 and "error" in events[-1] and set(errors[0]) == ERROR_FIELDS
        out.kind = REFUSED if clean else LOST
        out.reason = f"error event {errors[0].get('code')}" if clean else f"malformed error events {errors}"
        return
    tokens = [e for e in events if e.get("choices")]
    finished = any(c.get("finish_reason") in ("stop", "length") for e in tokens for c in e["choices"])
    out.kind = COMPLETE if tokens and finished else LOST
    out.reason = "" if out.kind == COMPLETE else f"stream of {len(tokens)} token events, no finish_reason"


@dataclass
class Load:
    """`concurrency` requests in flight at a time until `stop()`, each bounded by `bound_s`, sent
    to `url` (one platform) or to each of `url` in turn (the gateways)."""

    url: str | list[str]
    concurrency: int
    max_tokens: int = 16
    bound_s: float = 60.0
    model: str = "tiny"
    headers: dict = field(default_factory=dict)  # the caller's key, with the planes' admin key set
    retry_elsewhere: bool = False  # a request cut on the wire is sent once more to the next URL
    outcomes: list[Outcome] = field(default_factory=list)
    marks: list[tuple[str, float]] = field(default_factory=list)  # (phase, monotonic start)
    unreached: int = 0  # connections refused, each sent on to the next URL (not outcomes)
    _stopping: asyncio.Event = field(default_factory=asyncio.Event)
    _next: int = 0
    _done: asyncio.Condition = field(default_factory=asyncio.Condition)

    @property
    def urls(self) -> list[str]:
        return [self.url] if isinstance(self.url, str) else list(self.url)

    def mark(self, phase: str) -> float:
        """From now on, requests that start belong to `phase`; its start (monotonic) is returned."""
        at = time.monotonic()
        self.marks.append((phase, at))
        return at

    def phase(self, name: str) -> list[Outcome]:
        return [o for o in self.outcomes if o.phase == name]

    def by_phase(self) -> dict[str, Counter]:
        """Each phase's outcomes by kind, in the order the phases began (for a failure's message)."""
        return {name: tally(self.phase(name)) for name, _ in self.marks}

    async def __aenter__(self) -> Load:
        # One connection per request at most, none reused across a fault: a pooled connection to
        # a killed server would fail for reasons of the client's own pool, not the platform's.
        limits = httpx.Limits(max_connections=2 * self.concurrency, max_keepalive_connections=0)
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.bound_s), limits=limits)
        if not self.marks:
            self.mark("start")
        self._workers = [asyncio.create_task(self._worker()) for _ in range(self.concurrency)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop()
        await asyncio.gather(*self._workers, return_exceptions=True)
        await self._client.aclose()

    def stop(self) -> None:
        """No new request from now on; those in flight run to their end (or their bound)."""
        self._stopping.set()

    async def wait_finished(self, n: int, since: float = 0.0, within_s: float = deadline(120)) -> None:
        """Until `n` requests that began at or after `since` have an outcome."""

        def finished() -> int:
            return sum(o.started >= since for o in self.outcomes)

        try:
            async with asyncio.timeout(within_s):
                async with self._done:
                    await self._done.wait_for(lambda: finished() >= n)
        except TimeoutError:
            raise TimeoutError(
                f"{n} requests finished not within {within_s:g} s: {finished()} did "
                f"({len(self.outcomes)} in all); the last: {[(o.kind, o.status) for o in self.outcomes[-5:]]}"
            ) from None

    async def _worker(self) -> None:
        while not self._stopping.is_set():
            i, self._next = self._next, self._next + 1
            path, body, stream = request_body(i, self.model, self.max_tokens)
            phase = self.marks[-1][0]
            outcome = await self._send(i, path, body, stream)
            outcome.phase = phase
            await self._record(outcome)
            if self.retry_elsewhere and outcome.transport_error and len(self.urls) > 1:
                retry = await self._send(i + 1, path, body, stream)
                retry.phase, retry.retry_of = phase, outcome
                await self._record(retry)

    async def _send(self, i: int, path: str, body: dict, stream: bool) -> Outcome:
        """To the i-th URL (in turn), or the next that takes the connection."""
        urls = self.urls
        several = len(urls) > 1
        for k in range(len(urls)):
            url = urls[(i + k) % len(urls)]
            try:
                return await send(
                    self._client, url, path, body, stream, self.bound_s, self.headers, raise_unreached=several
                )
            except Unreached:
                self.unreached += 1
        now = time.monotonic()
        return Outcome(
            LOST, stream, now, now, reason="every URL refused the connection", transport_error=True
        )

    async def _record(self, outcome: Outcome) -> None:
        async with self._done:
            self.outcomes.append(outcome)
            self._done.notify_all()


async def burst(
    url: str, n: int, *, max_tokens: int = 8, bound_s: float = 60.0, first: int = 0
) -> list[Outcome]:
    """`n` requests sent at once, each on its own connection; their outcomes in request order."""
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(bound_s), limits=limits) as client:
        jobs = []
        for i in range(first, first + n):
            path, body, stream = request_body(i, "tiny", max_tokens)
            jobs.append(send(client, url, path, body, stream, bound_s))
        return list(await asyncio.gather(*jobs))


def tally(outcomes: list[Outcome]) -> Counter:
    return Counter(o.kind for o in outcomes)


def lost(outcomes: list[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if o.kind == LOST]


@dataclass
class ScenarioResult:
    """One row of the README's table."""

    scenario: str
    fault: str
    requests: int
    complete: int
    refused: int
    lost: int
    failed_at_fault: int = 0  # requests the fault itself ended on the client side (a killed gateway)
    seconds: float = 0.0
    notes: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def describe(outcomes: list[Outcome], limit: int = 10) -> str:
    """The losses, for an assertion message."""
    return "\n".join(
        f"{'stream' if o.stream else 'plain'} status {o.status} after {o.seconds:.2f}s on {o.instance}: {o.reason}"
        for o in lost(outcomes)[:limit]
    )


# A stopped instance: probes every 0.5 s eject it after two failures; out for longer than a scenario
# (SIGCONT comes at its end); a stream's headers within 2 s or it is retried elsewhere.
SICK_FLAGS = (
    "--stream-headers-timeout", "2",
    "--eject-after", "2",
    "--eject-time", "120",
    "--health-interval", "0.5",
    "--health-timeout", "0.5",
)  # fmt: skip


def write_results(label: str, results: list[ScenarioResult], env: str) -> None:
    """A module's rows, printed, and written as JSON to $`env` when set (the docs' tables)."""
    table = [r.as_dict() for r in results]
    print(f"\n{label}:", json.dumps(table, indent=1))
    if out := os.environ.get(env):
        Path(out).write_text(json.dumps(table, indent=1) + "\n")
