"""Failures kept for the operator, and failed starts in a row that make a deployment unavailable.

Tables for the pure parts (`warm_pool.failures`); the real `Pool` on a fake clock with the
in-memory backend of `test_pool_sleep`, told to fail its starts, for the wiring; and the local
backend on real processes for the phase a start failed in.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from snapshots import SnapshotStore, import_hf_dir
from tests.activator.conftest import eventually
from tests.deadlines import deadline
from tests.warm_pool.rig import Load, at
from tests.warm_pool.support import python
from warm_pool.backends.local import LocalBackend, free_port
from warm_pool.backends.memory import MemoryBackend
from warm_pool.errors import StartFailed
from warm_pool.failures import REDACTED, FailureRecord, StartFailures, record_of, redact
from warm_pool.launch import LaunchSpec
from warm_pool.metrics import PoolMetrics
from warm_pool.policies.base import ScalingConfig
from warm_pool.pool import Pool, PoolSpec
from warm_pool.snapshot import SnapshotSource


def failure(n: int = 1, **kw) -> FailureRecord:
    return FailureRecord(f"d-{n:08x}", "model_load", "engine pid 1 exited", float(n), 1, ("boom",), **kw)


@pytest.mark.parametrize(
    ("threshold", "events", "told"),
    [
        # each event: "f" a failed start, "r" a start that reached READY, "l" lifted (nobody calls);
        # told: what the activator is told after each event (a reason, "clear", or nothing: "-")
        (3, "fff", ["-", "-", "reason 3"]),
        (3, "ffff", ["-", "-", "reason 3", "reason 4"]),
        (3, "fffr", ["-", "-", "reason 3", "clear"]),
        (3, "ffrff", ["-", "-", "-", "-", "-"]),  # a success resets the count
        (2, "fflf", ["-", "reason 2", "clear", "reason 3"]),  # lifted, the count kept: at once again
        (1, "f", ["reason 1"]),
        (0, "ffffff", ["-"] * 6),  # 0: never unavailable
        (3, "lr", ["-", "-"]),  # nothing to lift or clear
    ],
)
def test_failed_starts_in_a_row_make_a_deployment_unavailable_until_one_succeeds(threshold, events, told):
    failures, seen = StartFailures(threshold), []
    for n, event in enumerate(events):
        if event == "f":
            reason = failures.start_failed(failure(n))
            seen.append(f"reason {failures.in_a_row}" if reason else "-")
            assert reason is None or reason.startswith(
                f"instance failed to start ({failures.in_a_row} in a row): "
            )
        else:
            was = failures.started() if event == "r" else failures.lift()
            seen.append("clear" if was else "-")
    assert seen == told
    assert failures.unavailable is None or told[-1].startswith("reason")


def test_a_running_instance_failure_is_the_last_failure_but_no_failed_start():
    failures = StartFailures(1)
    failures.failed(record_of("d-1", "serving", "process 7 died", 10.0))
    assert failures.in_a_row == 0 and failures.unavailable is None
    failures.exit_code_known("d-2", -9)  # another instance's: ignored
    assert failures.last.exit_code is None
    failures.exit_code_known("d-1", -9)
    assert (failures.last.phase, failures.last.exit_code) == ("serving", -9)
    assert failures.last.headline == "serving, exit code -9: process 7 died"


@pytest.mark.parametrize(
    ("line", "kept"),
    [
        ("key sk-stoker-abcdefghijklmnop used", "key [redacted] used"),
        ("Authorization: Bearer abc.def-ghi_123", "Authorization: Bearer [redacted]"),
        ("sent bearer abcdefghijkl", "sent bearer [redacted]"),
        (
            "non-default args: {'api_key': 'xyz12345', 'port': 1}",
            "non-default args: {'api_key': '[redacted]', 'port': 1}",
        ),
        ("HF_TOKEN=hf_abcdefghijklmnopqrstuvwx", "HF_TOKEN=[redacted]"),
        ("AWS key AKIAABCDEFGHIJKLMNOP here", "AWS key [redacted] here"),
        ("password=hunter22 user=x", "password=[redacted] user=x"),
        ("Loading weights: 100% tokens=12", "Loading weights: 100% tokens=12"),  # a count, no secret
        ("nothing secret in RuntimeError: size mismatch", "nothing secret in RuntimeError: size mismatch"),
    ],
)
def test_what_looks_like_a_credential_is_redacted(line, kept):
    assert redact(line) == kept


def test_the_instance_key_is_redacted_wherever_it_shows():
    key = "Zx9-longinstancekey_ABC"
    assert redact(f"started with {key}, ok", [key]) == f"started with {REDACTED}, ok"
    assert redact("a short one: abc", ["abc"]) == "a short one: abc"  # too short to search for


def test_a_start_failure_record_is_bounded_one_line_and_keeps_what_the_engine_said():
    key = "instance-secret-0123456789"
    lines = (*(f"line {i}" for i in range(40)), f"RuntimeError: bad shape (key {key})", "x" * 1000)
    tail = " | ".join(lines[-5:])
    exc = StartFailed(
        f"engine pid 5 exited with status 1 before it was ready (/logs/d-1.log)\nmore; log: {tail}",
        exit_code=1,
        log_tail=tail,
        phase="model_load",
        log_lines=lines,
    )
    record = record_of("d-1", "wait_ready", exc, 100.0, key)
    assert record.phase == "model_load"  # the backend knew better than the pool's step
    assert record.message == "engine pid 5 exited with status 1 before it was ready (/logs/d-1.log) more"
    assert len(record.log_tail) == 20 and all(len(line) <= 300 for line in record.log_tail)
    assert key not in repr(record) and f"(key {REDACTED})" in record.log_tail[-2]
    assert record.headline == f"model_load, exit code 1: RuntimeError: bad shape (key {REDACTED})"
    assert record.to_dict()["log_tail"] == list(record.log_tail)

    plain = record_of("d-2", "snapshot", OSError("no space left on device"), 1.0)
    assert plain.headline == "snapshot: no space left on device"
    long = record_of("d-3", "process_start", RuntimeError("y" * 5000), 1.0)
    assert len(long.message) == 500


# ---- the pool ----------------------------------------------------------------------------------------


@dataclass
class FailingBackend(MemoryBackend):
    """Engines whose first `failing` starts exit while loading, as a snapshot transformers refuses."""

    failing: int = 0

    async def wait_ready(self, handle, timeout_s, *, health_path) -> str:
        if self.failing > 0:
            self.failing -= 1
            self.alive.discard(handle)
            lines = ("loading", "stoker: error: cannot load /s: size mismatch")
            raise StartFailed(
                f"engine pid {handle.pid} exited with status 1",
                exit_code=1,
                phase="model_load",
                log_lines=lines,
            )
        return await super().wait_ready(handle, timeout_s, health_path=health_path)


@dataclass
class Demand:
    now: Load = field(default_factory=lambda: Load(queued=1))
    told: list[str | None] = field(default_factory=list)

    def load(self) -> Load:
        return self.now

    def capacity_changed(self) -> None:
        pass

    def set_unavailable(self, reason: str | None) -> None:
        self.told.append(reason)


@pytest.fixture
async def failing_pool(tmp_path: Path, tiny_model_dir: Path):
    store = SnapshotStore(tmp_path / "store")
    source = SnapshotSource(store, import_hf_dir(tiny_model_dir, store).id)
    registry, clock = CollectorRegistry(), [0.0]
    backend, demand = FailingBackend(failing=3), Demand()
    pool = Pool(
        PoolSpec(
            "d",
            source,
            scaling=ScalingConfig(max=1, idle_timeout_s=600, stable_window_s=1),
            unavailable_after=2,
        ),
        backend,
        PoolMetrics(registry),
        engines=backend,
        clock=lambda: clock[0],
        tick_s=3600,
    )
    pool.attach(demand)
    loop = asyncio.create_task(pool.run())

    def starts(outcome: str) -> float:
        return (
            registry.get_sample_value("stoker_instance_starts_total", {"deployment": "d", "outcome": outcome})
            or 0
        )

    async def tick(at: float) -> None:
        clock[0] = at
        before = pool.last_decision
        pool.poke()
        await eventually(lambda: pool.last_decision is not before)

    yield pool, demand, starts, tick
    await pool.close(drain=False)
    await loop


async def test_failed_starts_refuse_held_requests_with_the_reason_until_a_start_succeeds(failing_pool):
    pool, demand, starts, tick = failing_pool
    pool.request_arrived()
    await tick(0.0)
    await eventually(lambda: starts("failed") == 1 and not any(pool.counts().values()))
    assert demand.told == [] and pool.failed_starts == 1 and pool.unavailable is None
    assert (
        pool.last_failure.headline == "model_load, exit code 1: stoker: error: cannot load /s: size mismatch"
    )

    await tick(1.0)  # the backoff after one failure is 1 s: the second start fails too
    await eventually(lambda: starts("failed") == 2)
    [reason] = demand.told
    assert reason.startswith("instance failed to start (2 in a row): model_load, exit code 1: stoker: error:")
    assert pool.unavailable == reason

    await tick(1.5)  # within the 2 s backoff: nothing started
    assert starts("failed") == 2 and not any(pool.counts().values())
    await tick(3.0)  # still trying, and failing: a newer reason
    await eventually(lambda: starts("failed") == 3)
    assert demand.told[-1].startswith("instance failed to start (3 in a row)")

    await tick(7.0)  # the fourth start succeeds: available again; the last failure is kept
    await eventually(lambda: starts("ready") == 1)
    assert demand.told[-1] is None and pool.unavailable is None and pool.failed_starts == 0
    assert pool.last_failure.phase == "model_load"
    [inst] = pool.instances()
    assert inst["state"] == "READY" and inst["url"].startswith("http://127.0.0.1:") and inst["since"] > 0


async def test_nobody_calling_lifts_unavailability_and_the_next_failure_sets_it_at_once(failing_pool):
    pool, demand, starts, tick = failing_pool
    pool.request_arrived()
    await tick(0.0)
    await eventually(lambda: starts("failed") == 1)
    await tick(1.0)
    await eventually(lambda: starts("failed") == 2 and len(demand.told) == 1)

    demand.now.queued = 0  # the held request was refused; nothing arrives for a long while
    await tick(5000.0)
    assert pool.last_decision.ready == 0
    assert demand.told[-1] is None and pool.unavailable is None and pool.failed_starts == 2

    demand.now.queued = 1  # a new request is held, and its start fails: unavailable again at once
    pool.request_arrived()
    await tick(5001.0)
    await eventually(lambda: starts("failed") == 3)
    assert demand.told[-1].startswith("instance failed to start (3 in a row)")


# ---- the local backend: the phase a start failed in ------------------------------------------------

# Answers /health 503 ("loading") once, then exits 4: it got as far as loading.
ANSWERS_THEN_DIES = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(503); self.end_headers(); self.wfile.write(b"loading")
        print("RuntimeError: the weights do not fit", flush=True)
        self.server.answered = True
    def log_message(self, *a): pass
s = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
s.answered = False
while not s.answered:
    s.handle_request()
sys.exit(4)
"""


async def test_the_local_backend_says_how_far_a_failed_start_got(tmp_path):
    backend = LocalBackend(tmp_path)
    handle = await backend.start(
        at("early-1"), LaunchSpec(python("import sys; print('ImportError: no torch'); sys.exit(3)"))
    )
    with pytest.raises(StartFailed) as err:
        await backend.wait_ready(handle, timeout_s=deadline(30), interval_s=0.05)
    assert (err.value.phase, err.value.exit_code, err.value.log_lines) == (
        "process_start",
        3,
        ("ImportError: no torch",),
    )

    port = free_port()
    handle = await backend.start(at("late-1", port), LaunchSpec((*python(ANSWERS_THEN_DIES), str(port))))
    with pytest.raises(StartFailed) as err:
        await backend.wait_ready(handle, timeout_s=deadline(30), interval_s=0.05)
    assert (err.value.phase, err.value.exit_code) == ("model_load", 4)
    assert err.value.log_lines[-1] == "RuntimeError: the weights do not fit"
    await backend.stop(handle, 1)
