"""What the pool believes about an instance's sleep, checked against what its engine says.

The pool's states are its own bookkeeping: an instance is READY because the pool saw it start or
wake, SLEEPING because the pool's own `POST /sleep` answered 200. An engine can be slept or woken
by someone else (an operator holding its key; a wake call that timed out after the engine did
wake), and then the bookkeeping lies: a READY instance that is asleep stays in routing and its
requests fail, a SLEEPING one that is awake holds its memory unseen. So every `interval_s` the pool
asks each settled instance (READY or SLEEPING, no sleep, wake, start or drain of its own in flight)
`GET /is_sleeping`, and corrects what it believes:

| believed | the engine says | correction | why |
|---|---|---|---|
| READY | asleep | `TO_SLEEPING`: out of routing, SLEEPING | it cannot serve; the policy then wakes it (a wake, not a start) or stops it, through the usual paths |
| SLEEPING | awake | `TO_READY`: READY, into routing | its memory is spent either way, and it serves: the policy sees one more READY instance and puts it back to sleep (after the grace period, as any scale-down) if it is not wanted. Putting it straight back to sleep instead would undo a wake someone wanted, and flap with them |
| READY or SLEEPING | 401 | `REPLACE`: failed, stopped, replaced | it holds another key than ours: neither the pool nor the proxy can call it |
| any | no answer in time, refused, another status, not `{"is_sleeping": bool}` | none | liveness is the activator's (`/health` probes, ejection) and the pool's check stage's (`Lifecycle.check`), not this |
| PENDING, STARTING, DRAINING, FAILED, STOPPED | anything | none | not settled: what it does is in flight |

`correction` is that table, pure; `read_answer` turns one HTTP answer into what the engine says.
`SleepStates` is the I/O around them, as `EngineScraper` is for `/metrics`: one shared aiohttp
session, a per-request timeout, a bound on requests in flight, at most one round at a time, started
by the pool's tick and read by a later tick, so the tick never waits on an engine. It is not a
`Backend` call: it runs every few seconds for every instance and wants one connection pool, not a
session per call, and the answer is the engine's own, wherever the engine runs. Only engines with
sleep mode are asked (vLLM without it serves no `/is_sleeping`).

A round of n instances takes at most ceil(n / concurrency) × timeout_s: 20 instances, 8 at a
time, 2 s each → 6 s in the worst case. An answer is applied only if the instance took no edge
since it was asked (`Instance.transitions`) and nothing of the pool's own is in flight for it: an
answer that crossed the pool's own sleep or wake says nothing about the state that followed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

import aiohttp

from warm_pool.engine_tls import EngineTls, connector
from warm_pool.errors import InvalidConfig
from warm_pool.states import Instance, InstanceState

log = logging.getLogger("stoker.pool.reconcile")

PATH = "/is_sleeping"
MAX_BODY_BYTES = 4096  # `{"is_sleeping": false}` is 22 bytes
S = InstanceState


class Observed(StrEnum):
    """What an engine said when asked whether it sleeps."""

    AWAKE = "awake"
    ASLEEP = "asleep"
    UNAUTHORIZED = "unauthorized"  # 401: it wants another key than the one we hold for it
    UNKNOWN = "unknown"  # no usable answer: not a mismatch, only no news


class Correction(StrEnum):
    NONE = "none"
    TO_SLEEPING = "to_sleeping"  # out of routing and SLEEPING; the policy wakes or stops it
    TO_READY = "to_ready"  # READY and in routing; the policy sleeps it again if unwanted
    REPLACE = "replace"  # failed: stopped and replaced


def correction(believed: InstanceState, observed: Observed) -> Correction:
    """How the pool corrects an instance it believes `believed` whose engine said `observed`."""
    if believed not in (S.READY, S.SLEEPING) or observed is Observed.UNKNOWN:
        return Correction.NONE
    if observed is Observed.UNAUTHORIZED:
        return Correction.REPLACE
    if believed is S.READY and observed is Observed.ASLEEP:
        return Correction.TO_SLEEPING
    if believed is S.SLEEPING and observed is Observed.AWAKE:
        return Correction.TO_READY
    return Correction.NONE


def read_answer(status: int, body: bytes) -> Observed:
    """One answer to `GET /is_sleeping`: `{"is_sleeping": true|false}` with 200 (the CPU engine and
    vLLM both answer so), 401 for a key the engine does not hold, anything else no news."""
    if status == 401:
        return Observed.UNAUTHORIZED
    if status != 200 or len(body) > MAX_BODY_BYTES:
        return Observed.UNKNOWN
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return Observed.UNKNOWN
    value = doc.get("is_sleeping") if isinstance(doc, dict) else None
    if not isinstance(value, bool):
        return Observed.UNKNOWN
    return Observed.ASLEEP if value else Observed.AWAKE


@dataclass(frozen=True)
class Seen:
    """One engine's answer, with the instance's `transitions` when it was asked."""

    instance_id: str
    transitions: int
    observed: Observed


class SleepStates:
    """Asks engines `GET /is_sleeping` in the background, one round at a time, every `interval_s` of
    the injected clock. `start(instances)` begins a round if none is in flight and one is due;
    `collect()` hands back the answers of a finished round once, else nothing."""

    def __init__(
        self,
        clock: Callable[[], float],
        *,
        interval_s: float = 5.0,
        timeout_s: float = 2.0,
        concurrency: int = 8,
        name: str = "",
        tls: EngineTls | None = None,  # engines on HTTPS (`warm_pool.engine_tls`)
    ) -> None:
        # 5 s: as often as the activator probes /health; a mismatch costs requests (READY but
        # asleep) or memory (SLEEPING but awake) for at most an interval and a round. 2 s: an
        # engine that cannot answer a flag in 2 s has a stalled event loop; the activator's probes
        # deal with that.
        for field, value in (("reconcile_interval_s", interval_s), ("timeout_s", timeout_s)):
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise InvalidConfig(field, f"{field} must be a finite number > 0, got {value!r}")
        if not (isinstance(concurrency, int) and concurrency >= 1):
            raise InvalidConfig("concurrency", f"concurrency must be ≥ 1, got {concurrency!r}")
        self._clock = clock
        self.interval_s, self.timeout_s, self.concurrency = float(interval_s), float(timeout_s), concurrency
        self._name = name
        self._last_round = -math.inf
        self._round: asyncio.Task[list[Seen]] | None = None
        self._tls = tls
        self._session: aiohttp.ClientSession | None = None  # made in the loop, at the first round
        self._closed = False

    @property
    def in_flight(self) -> bool:
        return self._round is not None and not self._round.done()

    def collect(self) -> list[Seen]:
        """The answers of the round that finished since the last call; [] if none did."""
        task = self._round
        if task is None or not task.done():
            return []
        self._round = None
        if task.cancelled():
            return []
        if (exc := task.exception()) is not None:  # an engine's fault is UNKNOWN, never raised: a bug
            log.error("pool %s: sleep-state round failed: %r", self._name, exc)
            return []
        return task.result()

    def start(self, instances: Iterable[Instance]) -> None:
        """Ask these instances' engines, in the background, if no round is in flight and one is due."""
        now = self._clock()
        if self._closed or self._round is not None or now - self._last_round < self.interval_s:
            return
        asked = [(inst.id, inst.transitions, inst.url, inst.auth_headers) for inst in instances]
        if not asked:
            return
        self._last_round = now
        self._round = asyncio.create_task(self._ask_all(asked), name=f"reconcile-{self._name}")

    async def aclose(self) -> None:
        self._closed = True
        if self._round is not None:
            self._round.cancel()
            await asyncio.gather(self._round, return_exceptions=True)
            self._round = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _ask_all(self, asked: Sequence[tuple[str, int, str, Mapping[str, str]]]) -> list[Seen]:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=connector(self._tls, limit=self.concurrency),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            )
        gate = asyncio.Semaphore(self.concurrency)
        answers = await asyncio.gather(*(self._ask(self._session, gate, url, h) for _, _, url, h in asked))
        return [Seen(i, t, observed) for (i, t, _, _), observed in zip(asked, answers, strict=True)]

    async def _ask(
        self, session: aiohttp.ClientSession, gate: asyncio.Semaphore, url: str, headers: Mapping[str, str]
    ) -> Observed:
        async with gate:
            try:
                async with asyncio.timeout(self.timeout_s), session.get(url + PATH, headers=headers) as r:
                    body = bytearray()
                    async for chunk in r.content.iter_chunked(1024):
                        body += chunk
                        if len(body) > MAX_BODY_BYTES:  # read_answer refuses it; read no further
                            break
                    return read_answer(r.status, bytes(body))
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                log.debug("GET %s%s: no answer: %s: %s", url, PATH, type(exc).__name__, exc)
                return Observed.UNKNOWN
