"""One admitted request of the engine: its tokens from transformers' manager, as `Delta`s.

A `Generation` registers its request with the manager (`submit`), turns each output into text
(stop strings, held back until `min_tokens`), logprobs and a finish reason, counts tokens and KV
blocks into the engine's metrics, fails instead of hanging when the generation thread dies or
stalls (`stall_timeout_s`), and on `close` cancels what is unfinished and gives its slot back. The
engine (`core.Engine`) owns admission, the model and the manager; this owns one request's life.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transformers.generation.continuous_batching.requests import RequestStatus

from stoker.engine import draw as draw_mod
from stoker.engine.logprobs import TokenLogprob
from stoker.engine.metrics import blocks
from stoker.engine.protocol import SamplingParams
from stoker.engine.structured import Matcher
from stoker.engine.text import TextTracker
from stoker.errors import SERVER_ERROR, APIError

if TYPE_CHECKING:
    from stoker.engine.adapters import Adapter
    from stoker.engine.core import Engine

PAGE_SIZE = 32  # tokens per KV block: small pages waste little memory on short CPU requests


@dataclass(frozen=True)
class Delta:
    text: str
    completion_tokens: int
    finish_reason: str | None = None  # set on the last delta: "stop" or "length"
    logprobs: tuple[TokenLogprob, ...] = ()  # of the tokens since the previous delta, when asked


class Generation:
    """One admitted request: an async iterator of `Delta`s, the last one carrying the finish reason."""

    def __init__(
        self,
        engine: Engine,
        manager,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival: float,
        grammar: Matcher | None = None,
        admitted: float | None = None,  # when it got its slot; default: arrival
        adapter: Adapter | None = None,  # pinned by the engine; unpinned here on close
    ):
        self._engine = engine
        self._manager = manager
        self._prompt_ids = prompt_ids
        self._params = params
        self._arrival = arrival
        self._adapter = adapter
        self._admitted = arrival if admitted is None else admitted
        self._first_token_at: float | None = None
        self._max_new = 0
        self._kv_blocks = 0  # KV blocks this request's tokens fill, while it runs
        self._failed = False  # ended by an error, not by the client or a stop: "error", not "abort"
        self._outputs: asyncio.Queue = asyncio.Queue()  # at most one item per generated token
        self._tracker = TextTracker(engine._decode, params.stop)
        self.request_id = uuid.uuid4().hex
        self.prompt_tokens = len(prompt_ids)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self._last_token_at: float | None = None
        self._manager_done = False  # the manager finished the request itself (EOS or token budget)
        self._closed = False
        self.n_param = 1  # the request's `n`, for vLLM's histogram of it; 0 on its later choices
        # Every request is drawn by the engine's own draw step (`draw.py` says why), temperature and top-p included.
        self._draw = draw_mod.RequestDraw(
            params,
            prompt_ids,
            vocab_size=engine.vocab_size,
            eos=set() if params.ignore_eos else engine._eos,
            device=engine.config.device,
            grammar=grammar,
        )

    def submit(self, max_new: int) -> None:
        engine, params, rid = self._engine, self._params, self.request_id
        engine._draws.register(rid, self._draw)
        if self._adapter is not None:  # before the manager can schedule it: its first step uses it
            engine.adapters.bind(rid, self._adapter)
        self._manager.register_result_handler(rid, self._outputs.put_nowait)
        accepted = self._manager.add_request(
            self._prompt_ids,
            request_id=rid,
            max_new_tokens=max_new,
            streaming=True,
            eos_token_id=-1 if params.ignore_eos else None,  # -1: no EOS for this request
        )
        if accepted is None:
            engine.check_loop()
            raise APIError(500, "The engine's generation loop is not running.", type=SERVER_ERROR)
        engine.metrics.prompt_tokens.inc(self.prompt_tokens)
        self._max_new = max_new
        self._fill_kv(self.prompt_tokens)

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._deltas()

    async def _deltas(self) -> AsyncIterator[Delta]:
        """One delta per output that brings text, logprobs or the end, and one for the first token
        even without text (a stream announces its role then)."""
        engine, tracker, params, draw = self._engine, self._tracker, self._params, self._draw
        while self.finish_reason is None:
            out = await self._next_output()
            if out.status == RequestStatus.FAILED:
                self._failed = True
                raise APIError(500, f"Generation failed: {out.error}", type=SERVER_ERROR)
            if draw.error is not None:
                self._failed = True
                raise APIError(500, f"Generation failed: {draw.error}", type=SERVER_ERROR)
            tokens = out.generated_tokens
            before = self.completion_tokens
            self._manager_done = out.is_finished()
            self._count(len(tokens))
            records = tuple(draw.records[before : len(tokens)]) if params.logprobs is not None else ()
            # As vLLM: stop strings count only once more than min_tokens tokens exist.
            text = tracker.update(
                [t for t in tokens if t not in engine._eos], check_stop=len(tokens) > params.min_tokens
            )
            if tracker.stopped:
                self._finish("stop")
            elif out.is_finished():
                eos = tokens and tokens[-1] in engine._eos and not params.ignore_eos
                self._finish("stop" if eos else "length")
                text += tracker.flush()
            if text or records or self.finish_reason or (before == 0 and tokens):
                yield Delta(text, self.completion_tokens, self.finish_reason, records)

    def _count(self, n: int) -> None:
        new = n - self.completion_tokens
        if new <= 0:
            return
        metrics, now = self._engine.metrics, self._engine.clock()
        if self._last_token_at is None:
            metrics.ttft.observe(now - self._arrival)
            self._first_token_at = now
        else:
            metrics.itl.observe((now - self._last_token_at) / new)
        metrics.generation_tokens.inc(new)
        self._last_token_at, self.completion_tokens = now, n
        self._fill_kv(self.prompt_tokens + n)

    def _fill_kv(self, tokens: int) -> None:
        now_filled = blocks(tokens, PAGE_SIZE)
        if now_filled != self._kv_blocks:
            self._engine._kv(now_filled - self._kv_blocks)
            self._kv_blocks = now_filled

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        self._observe(reason)

    def _observe(self, reason: str) -> None:
        """The request's end, in vLLM's per-request metrics (`EngineMetrics.request_done`)."""
        self._engine.metrics.request_done(
            reason,
            arrival=self._arrival,
            admitted=self._admitted,
            first_token=self._first_token_at,
            last_token=self._last_token_at,
            now=self._engine.clock(),
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.completion_tokens,
            max_tokens=self._params.max_tokens,
            max_new_tokens=self._max_new,
            n=self.n_param,
        )

    async def _next_output(self):
        """The next output; fails instead of hanging if the generation thread died or stalled."""
        stall_s = self._engine.config.stall_timeout_s
        deadline = self._engine.clock() + stall_s
        while True:
            try:
                async with asyncio.timeout(1.0):
                    return await self._outputs.get()
            except TimeoutError:
                if not self._manager.is_running():
                    raise APIError(500, "The engine's generation loop stopped.", type=SERVER_ERROR) from None
                if self._engine.clock() >= deadline:
                    raise APIError(
                        500,
                        f"No token for {stall_s:g} s: the engine's generation loop is stalled.",
                        type=SERVER_ERROR,
                    ) from None

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        engine = self._engine
        if not self._manager_done:  # a stop string, a client that left, or an error
            self._manager.cancel_request(self.request_id)
            _forget_handler(self._manager, self.request_id)
            if self.finish_reason is None:
                self._observe("error" if self._failed else "abort")
        self._fill_kv(0)
        engine._draws.forget(self.request_id)
        if self._adapter is not None:
            engine.adapters.unbind(self.request_id)
            engine.adapters.unpin(self._adapter)
        engine._release()


def _forget_handler(manager, request_id: str) -> None:
    # A cancelled request may never deliver a final output, so its handler would stay registered.
    router = getattr(manager, "output_router", None)
    if router is not None:
        with router._lock:
            router.result_handlers.pop(request_id, None)
