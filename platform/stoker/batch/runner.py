"""The batch runner: one task per unfinished batch, in the gateway's process (`stoker up`).

Each line is sent through the gateway's own `InferenceEndpoint` as an ASGI request of its own
(`stoker.batch.inprocess`): the
caller is the batch's key (read again at each line, so a revoked key stops its batches), and the
request takes every step an interactive one does (the key's deployments and limits, the cost
meter, the request log, the split between revisions, the activator's hold queue, scale from zero).
Its body's `priority` is `BATCH_PRIORITY` (or the key's own class where that is lower still), so
a held interactive request always goes first (`activator.slots`). How many lines go at once is
`pacing.allowance`'s, looked at again whenever a line ends and every `tick_s` meanwhile.

A 429 or 503 answer (a key's limit, a full queue, a hold deadline) is tried again after
`retry_s`, doubled at each try, `max_attempts` tries in all; then it goes to the error file as it
was. Every other answer goes to the output file (200) or the error file, with its status and body.

A restart (or a crash) loses only the lines in flight: `results.ResultLog.recover` reads back
what is answered, and those lines are never sent again. Stopping the runner cancels its lines in
flight (their answers are not written: they are sent again after the restart).

Cost (`stoker.batch.cost`): the cost meter's figures of every deployment are the batch's base when
it first goes `in_progress`; its `cost_usd` is its tokens' share of what they spent since, live
while it runs and fixed when it is counted for the last time.

Metrics, labelled by deployment (a name no deployment has is `other`, so the label stays bounded):
`stoker_batch_requests_total{deployment,outcome}`, `stoker_batch_tokens_total{deployment,direction}`,
`stoker_batch_in_flight{deployment}`, `stoker_batch_cost_usd_total{deployment}` (each batch's cost
as it ends, under its first line's model); `stoker_batches{status}` counts batches by state, and
`stoker_batch_duration_seconds{status}` how long each took from its creation to its end. A batch's
own figures (counts, tokens, cost) are on its Batch object, never a label: ids are unbounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from snapshots.errors import RemoteError
from stoker.batch import pacing
from stoker.batch.config import BatchConfig
from stoker.batch.cost import batch_cost, figures
from stoker.batch.disk import DiskError
from stoker.batch.files import FileStore
from stoker.batch.inprocess import call, error
from stoker.batch.lines import BadLine, Entry, TooManyLines, request_body, scan
from stoker.batch.records import DONE, RUNNING, BatchRecord, BatchStore
from stoker.batch.results import ResultLog
from stoker.spec import priority as priorities
from stoker.spec.keys import Principal

log = logging.getLogger("stoker.batch")
BATCH_PRIORITY = 100  # behind the default class (0) and every interactive key's
RETRY = (429, 503)
MAX_BACKOFF_S = 60.0
INPUT_COPY = "input.jsonl"  # in the work dir: a copy of an input kept in object storage


@dataclass
class _Batch:
    """A batch the runner is running: its record, result files and lines in flight."""

    record: BatchRecord
    results: ResultLog
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # a line ended, or a cancel came
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    in_flight: set[asyncio.Task] = field(default_factory=set)
    task: asyncio.Task | None = None
    broken: BaseException | None = None  # a result that could not be written: the batch fails


class BatchMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "stoker_batch_requests", "Batch lines answered", ["deployment", "outcome"], registry=registry
        )
        self.tokens = Counter(
            "stoker_batch_tokens", "Tokens of batch answers", ["deployment", "direction"], registry=registry
        )
        self.in_flight = Gauge(
            "stoker_batch_in_flight", "Batch lines sent and not answered", ["deployment"], registry=registry
        )
        self.batches = Gauge("stoker_batches", "Batches by status", ["status"], registry=registry)
        self.cost = Counter(
            "stoker_batch_cost_usd",
            "Dollars of finished batches (each one's share of its deployments' spend while it ran)",
            ["deployment"],
            registry=registry,
        )
        self.duration = Histogram(
            "stoker_batch_duration_seconds",
            "Seconds from a batch's creation to its end, by how it ended",
            ["status"],
            buckets=(60, 300, 900, 3600, 4 * 3600, 12 * 3600, 24 * 3600, 3 * 86400, 7 * 86400),
            registry=registry,
        )


class BatchRunner:
    def __init__(
        self,
        files: FileStore,
        store: BatchStore,
        endpoint: Callable,  # the gateway's `InferenceEndpoint` (an ASGI app)
        platform: Any,  # a `Router`: what each deployment's activators see (`room`)
        principal_for: Callable[[str], Principal | None],  # a key's id -> its caller (None: revoked)
        config: BatchConfig,
        registry: CollectorRegistry,
        wall: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
        cost_rows: Callable[[], list[dict[str, Any]]] = list,  # the cost meter's rows (`CostMeter.report`)
    ) -> None:
        self.files, self.store, self.endpoint, self.platform = files, store, endpoint, platform
        self.principal_for = principal_for
        self.config = config
        self.metrics = BatchMetrics(registry)
        self._wall, self._clock = wall, clock
        self._running: dict[str, _Batch] = {}
        self._on_deployment: dict[str, int] = {}  # batch lines in flight per deployment, every batch's
        self._cost_rows = cost_rows
        self._figures: tuple[float, dict[str, list[float]]] | None = None  # (when, figures): 1 s fresh

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        damaged = self.store.load()
        for name in damaged:
            log.error("batch record %s is damaged; it is skipped", name)
        unfinished = [r for r in self.store.all() if r.running]
        keep = [i for r in unfinished for i in (r.output_id, r.error_id)]
        self.files.sweep(keep=keep)
        if finished := await self.files.sweep_objects(keep=keep):
            log.info(
                "finished %d uploads or deletes of files a crash left in %s", finished, self.files.objects
            )
        for record in unfinished:
            self._spawn(record)
        self._publish()

    async def stop(self) -> None:
        tasks = [b.task for b in self._running.values() if b.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def submit(self, record: BatchRecord) -> None:
        self.store.save(record)
        self._spawn(record)
        self._publish()

    def cancel(self, record: BatchRecord) -> None:
        if record.status in ("validating", "in_progress"):
            record.status, record.cancelling_at = "cancelling", int(self._wall())
            self.store.save(record)
            if (running := self._running.get(record.id)) is not None:
                running.wake.set()
                running.cancelled.set()
            self._publish()

    def view(self, record: BatchRecord) -> dict[str, Any]:
        """The Batch object, with the live counts of a batch that runs."""
        running = self._running.get(record.id)
        if running is not None and not record.counted:
            self._count_into(record, running.results)
        return record.to_dict()

    def _spawn(self, record: BatchRecord) -> None:
        batch = _Batch(record, ResultLog(self.store.work_dir(record), record.id))
        self._running[record.id] = batch
        batch.task = asyncio.create_task(self._run(batch), name=f"batch-{record.id}")

    def _publish(self) -> None:
        counts = dict.fromkeys((*RUNNING, *DONE), 0)
        for record in self.store.all():
            counts[record.status] = counts.get(record.status, 0) + 1
        for status, n in counts.items():
            self.metrics.batches.labels(status).set(n)

    def _set(self, record: BatchRecord, status: str) -> None:
        record.status = status
        setattr(record, f"{status}_at", int(self._wall()))
        if status == "in_progress" and record.cost_base is None:
            record.cost_base = self._cost_figures()
        self.store.save(record)
        self._publish()
        if status in DONE:
            self.metrics.duration.labels(status).observe(max(0.0, self._wall() - record.created_at))
            if record.cost_usd > 0:
                label = (
                    record.model if record.model and self.platform.get(record.model) is not None else "other"
                )
                self.metrics.cost.labels(label).inc(record.cost_usd)

    def _cost_figures(self) -> dict[str, list[float]]:
        """Every deployment's [instance $, tokens] from the cost meter, at most a second old."""
        now = self._clock()
        if self._figures is None or now - self._figures[0] >= 1.0:
            self._figures = (now, figures(self._cost_rows()))
        return self._figures[1]

    # -- one batch --------------------------------------------------------------------------------

    async def _run(self, batch: _Batch) -> None:
        record = batch.record
        try:
            tally = await asyncio.to_thread(batch.results.recover)
            entries = await self._validate(batch)
            if entries is None:
                return
            if record.status == "validating":
                self._set(record, "in_progress")
            while record.status == "in_progress":  # until every line is answered, or time is up
                left = deque(e for e in entries if e.line not in tally.done)
                if left and self._wall() >= record.expires_at:
                    record.ending = "expired"
                if not left or record.ending is not None:
                    self._set(record, "finalizing")
                    break
                await self._dispatch(batch, left)
            if record.status == "cancelling":
                record.ending = "cancelled"
            if not record.counted:  # once: after it, a result file may be moved out of the journal
                await self._refuse_rest(batch, entries)
                self._count_into(record, batch.results)
                record.counted = True
                self.store.save(record)
            await self._finalize_until_stored(batch)
        except asyncio.CancelledError:
            raise
        except (DiskError, OSError, RemoteError) as exc:
            log.error("batch %s failed: %s", record.id, exc)
            record.errors = [{"code": "storage_error", "message": str(exc), "param": None, "line": None}]
            self._set(record, "failed")
        finally:
            for task in batch.in_flight:
                task.cancel()
            await asyncio.gather(*batch.in_flight, return_exceptions=True)
            batch.results.close()
            self._running.pop(record.id, None)

    async def _validate(self, batch: _Batch) -> list[Entry] | None:
        """The input's valid lines; its bad ones written to the error file (once). None: failed."""
        record = batch.record
        fd = await self._input(record)
        if fd is None:
            return self._fail(record, "file_not_found", f"The input file {record.input_file_id} is gone.")
        try:
            with os.fdopen(fd, "rb") as f:
                lines = await asyncio.to_thread(lambda: list(scan(f, record.endpoint, self.config.max_lines)))
        except TooManyLines as exc:
            return self._fail(record, "too_many_requests", f"The batch input is refused: {exc}.")
        entries = [e for e in lines if isinstance(e, Entry)]
        record.total = len(lines)
        record.model = entries[0].model if entries else None
        for bad in lines:
            if isinstance(bad, BadLine) and bad.line not in batch.results.tally.done:
                await batch.results.refuse(bad.line, bad.custom_id, bad.code, bad.message)
        return entries

    def _fail(self, record: BatchRecord, code: str, message: str) -> None:
        record.errors = [{"code": code, "message": message, "param": "input_file_id", "line": None}]
        self._set(record, "failed")
        return None

    async def _dispatch(self, batch: _Batch, pending: deque[Entry]) -> None:
        """Send the pending lines as pacing allows, until all are answered, the batch is cancelled
        or its window ends (then the lines in flight finish, and the rest is left)."""
        record, config = batch.record, self.config
        started, answered = self._clock(), len(batch.results.tally.done)
        fd = await self._input(record)
        if fd is None:  # deletes are refused while it runs: the data dir was changed under it
            raise DiskError(f"the input file {record.input_file_id} is gone")
        try:
            while pending or batch.in_flight:
                if batch.broken is not None:
                    raise batch.broken
                stopping = record.status != "in_progress" or self._wall() >= record.expires_at
                if stopping:
                    pending.clear()
                elif pending:
                    done = len(batch.results.tally.done) - answered
                    elapsed = self._clock() - started
                    rate = done / elapsed if done and elapsed > 0 else None
                    hurry = pacing.urgent(
                        len(pending), rate, record.expires_at - self._wall(), record.window_s
                    )
                    room = self.room(pending[0].model)
                    n = pacing.allowance(room, len(batch.in_flight), config.share, config.concurrency, hurry)
                    for _ in range(min(n, len(pending))):
                        entry = pending.popleft()
                        raw = os.pread(fd, entry.length, entry.offset)
                        self._launch(batch, entry, raw)
                if not pending and not batch.in_flight:
                    break
                batch.wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(config.tick_s):
                        await batch.wake.wait()
        finally:
            os.close(fd)

    async def _input(self, record: BatchRecord) -> int | None:
        """The batch's input, open for reading (a file in the bucket: its copy in the work dir)."""
        cache = self.store.work_dir(record) / INPUT_COPY
        return await self.files.open(record.owner, record.input_file_id, cache)

    def room(self, model: str) -> pacing.Room | None:
        """What the deployment `model`'s activators see now; None if it has none here."""
        units = getattr(self.platform.get(model), "units", None)
        if not units:
            return None
        slots = busy = held = 0
        for unit in units.values():
            activator = getattr(unit, "activator", None)
            source = getattr(unit, "pool", None) or getattr(unit, "source", None)
            if activator is None or source is None:
                continue
            load = activator.load()
            busy, held = busy + load.in_flight, held + load.queued
            slots += sum(e.max_concurrency for e in source.endpoints())
        return pacing.Room(slots, busy, held, self._on_deployment.get(model, 0))

    def _launch(self, batch: _Batch, entry: Entry, raw: bytes) -> None:
        label = entry.model if self.platform.get(entry.model) is not None else "other"
        self._on_deployment[entry.model] = self._on_deployment.get(entry.model, 0) + 1
        self.metrics.in_flight.labels(label).inc()
        task = asyncio.create_task(self._line(batch, entry, raw, label))
        batch.in_flight.add(task)

        def done(t: asyncio.Task) -> None:
            batch.in_flight.discard(t)
            left = self._on_deployment.get(entry.model, 1) - 1
            if left > 0:
                self._on_deployment[entry.model] = left
            else:
                self._on_deployment.pop(entry.model, None)
            self.metrics.in_flight.labels(label).dec()
            batch.wake.set()

        task.add_done_callback(done)

    async def _line(self, batch: _Batch, entry: Entry, raw: bytes, label: str) -> None:
        """One line, answered; an unexpected error is its answer (a 500 in the error file), and
        one that cannot even be written stops the batch (`broken`)."""
        try:
            await self._try_line(batch, entry, raw, label)
        except (DiskError, OSError) as exc:
            batch.broken = exc
        except Exception as exc:
            log.exception("batch %s line %d", batch.record.id, entry.line)
            try:
                await batch.results.answer(
                    entry.line, entry.custom_id, 500, error(f"Internal error: {type(exc).__name__}.")
                )
            except (DiskError, OSError) as failed:
                batch.broken = failed

    async def _try_line(self, batch: _Batch, entry: Entry, raw: bytes, label: str) -> None:
        """One line, tried until it has an answer to keep; the answer written."""
        record, results = batch.record, batch.results
        wait = self.config.retry_s
        for attempt in range(1, self.config.max_attempts + 1):
            principal = self.principal_for(record.key_id)
            if principal is None:
                message = "The key that created this batch was revoked."
                await results.refuse(entry.line, entry.custom_id, "key_revoked", message)
                self.metrics.requests.labels(label, "failed").inc()
                return
            limits = principal.limits
            level = max(
                [BATCH_PRIORITY, *(p for p in (limits.priority, limits.priority_min) if p is not None)]
            )
            body, _ = request_body(raw, min(level, priorities.HIGHEST))
            status, headers, answer = await call(self.endpoint, record.endpoint, body, principal, record.id)
            last = attempt == self.config.max_attempts or record.status != "in_progress"
            if status in RETRY and not last:
                asked = headers.get("retry-after", "")
                pause = max(wait, float(asked) if asked.isdigit() else 0.0)
                wait = min(MAX_BACKOFF_S, wait * 2)
                with contextlib.suppress(TimeoutError):  # a cancel ends the wait
                    async with asyncio.timeout(min(pause, MAX_BACKOFF_S)):
                        await batch.cancelled.wait()
                continue
            await results.answer(entry.line, entry.custom_id, status, answer)
            outcome = "completed" if status == 200 else "failed"
            self.metrics.requests.labels(label, outcome).inc()
            usage = answer.get("usage") if status == 200 and isinstance(answer, dict) else None
            if isinstance(usage, dict):
                for direction, name in (("in", "prompt_tokens"), ("out", "completion_tokens")):
                    if isinstance(usage.get(name), int):
                        self.metrics.tokens.labels(label, direction).inc(usage[name])
            return

    async def _refuse_rest(self, batch: _Batch, entries: list[Entry]) -> None:
        """The lines a cancel or the window's end left unanswered, each in the error file."""
        record, results = batch.record, batch.results
        if record.ending is None:
            return
        expired = record.ending == "expired"
        code = "batch_expired" if expired else "batch_cancelled"
        message = "The batch's window ended first." if expired else "The batch was cancelled first."
        for entry in entries:
            if entry.line not in results.tally.done:
                await results.refuse(entry.line, entry.custom_id, code, message)

    async def _finalize_until_stored(self, batch: _Batch) -> None:
        """`_finalize`, tried again while object storage fails: the batch stays `finalizing`
        with its results on local disk, and no answer is lost to a store that is down a while."""
        wait = self.config.retry_s
        while True:
            try:
                return await self._finalize(batch)
            except RemoteError as exc:
                log.warning(
                    "batch %s: its result files are not stored yet (%s); again in %g s",
                    batch.record.id,
                    exc,
                    wait,
                )
                await asyncio.sleep(wait)
                wait = min(MAX_BACKOFF_S, wait * 2)

    async def _finalize(self, batch: _Batch) -> None:
        """The result files made the owner's File objects; then the batch's last state. Again
        after a crash, it only does what is left (`FileStore.adopt`)."""
        record, results = batch.record, batch.results
        out, err = results.sizes()
        results.close()
        owner = record.owner
        # A result file is adopted if it holds anything, or was (partly) adopted before: a crash,
        # or a store that failed the put.
        if out or self.files.holds(owner, record.output_id):
            name = f"{record.id}_output.jsonl"
            await self.files.adopt(owner, record.output_id, results.output_path, name, "batch_output")
            record.output_file_id = record.output_id
        if err or self.files.holds(owner, record.error_id):
            name = f"{record.id}_error.jsonl"
            await self.files.adopt(owner, record.error_id, results.errors_path, name, "batch_output")
            record.error_file_id = record.error_id
        with contextlib.suppress(FileNotFoundError):
            (self.store.work_dir(record) / INPUT_COPY).unlink()
        self._set(record, record.ending or "completed")

    def _count_into(self, record: BatchRecord, results: ResultLog) -> None:
        tally = results.tally
        record.completed, record.failed = tally.completed, tally.failed
        record.input_tokens, record.output_tokens = tally.input_tokens, tally.output_tokens
        if record.cost_base is not None:
            record.cost_usd = batch_cost(self._cost_figures(), record.cost_base, tally.by_model)
