"""`n` > 1: one request's n choices, each a `Generation` of its own in the one batch.

    request (n = 3) ─▶ admitted one after another, under the engine's `choices_admission` lock
                       ─▶ Generation 0 (seed s), 1 (s + 1), 2 (s + 2): one slot each
                    ◀─ their deltas merged as they come, each with its choice's index

Why the lock: a request of n choices holds the slots it has while it waits for the rest, so two
such requests admitted side by side could each hold half the slots and wait for the other's
forever (until the queue timeout). Under the lock one of them has all its slots before the next
asks; a request of one choice never waits on the lock and needs one slot only, so nothing it does
can hold an n-choice request back for ever. `n` is at most the engine's `--max-num-seqs` (the batch
could never hold them all) and `protocol.MAX_N`.

The prompt is one prompt: its tokens are counted once in the usage, the choices' completion
tokens together, as OpenAI and vLLM count them. Each choice draws with its own generator: a
request's `seed` s gives choice i the seed s + i (s − i past the top of the seed's range), so
choices differ and the whole answer is reproducible; greedy choices are all the same, as vLLM's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import TYPE_CHECKING

from stoker.engine.generation import Delta, Generation
from stoker.engine.protocol import SamplingParams
from stoker.errors import invalid

if TYPE_CHECKING:
    from stoker.engine.adapters import Adapter
    from stoker.engine.core import Engine

SEED_END = 2**64  # `protocol._seed`'s range ends below this


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s sampling: the request's, with its own seed when the request has one."""
    if index == 0 or params.seed is None:
        return params
    seed = params.seed + index
    return replace(params, seed=seed if seed < SEED_END else params.seed - index)


async def start_choices(
    engine: Engine, n: int, ids: list[int], params: SamplingParams, max_new: int, adapter: Adapter | None
) -> list[Generation]:
    """The request's `n` generations, admitted together (the module docstring says why); a refusal
    of any closes those already started and is raised."""
    if n == 1:
        return [await engine.start(ids, params, max_new, adapter)]
    if n > engine.config.max_num_seqs:
        raise invalid(
            f"'n' must be at most {engine.config.max_num_seqs} on this engine (its batch holds that many), got {n}.",
            param="n",
        )
    started: list[Generation] = []
    try:
        async with engine.choices_admission:
            for index in range(n):
                started.append(await engine.start(ids, choice_params(params, index), max_new, adapter))
    except BaseException:
        for generation in started:
            await generation.close()
        raise
    for index, generation in enumerate(started):
        generation.n_param = n if index == 0 else 0
    return started


async def merged(generations: list[Generation]) -> AsyncIterator[tuple[int, Delta]]:
    """Each generation's deltas as they come, with its index; in order within a choice. The first
    error of any choice is raised (the others are cancelled by the caller's close)."""
    if len(generations) == 1:
        async for delta in generations[0]:
            yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, generation: Generation) -> None:
        try:
            async for delta in generation:
                queue.put_nowait((index, delta, None))
        except Exception as exc:
            queue.put_nowait((index, None, exc))
            return
        queue.put_nowait((index, None, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(generations)]
    try:
        left = len(tasks)
        while left:
            index, delta, exc = await queue.get()
            if exc is not None:
                raise exc
            if delta is None:
                left -= 1
                continue
            yield index, delta
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
