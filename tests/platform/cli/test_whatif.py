"""Shadow what-if: the arrival log (`stoker.control.arrival_log`) and `stoker simulate --from-log`
(`stoker.cli.whatif`), run as the real `stoker` command on logs written by the real `ArrivalLog`."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from stoker.control.arrival_log import LOG_FILE, ArrivalLog, load_arrivals
from tests.conftest import STOKER
from tests.deadlines import deadline
from tests.snapshots.support import assert_one_line_error
from warm_pool.trace import TraceError

# A burst at zero, a lone request 400 s later, two more 30 s after that.
ARRIVALS = [(0.0, 100, 20), (0.5, 120, 30), (1.0, 80, 10), (400.0, 90, 40), (430.0, 50, 5), (431.0, 60, 6)]


def _log(tmp_path, rows=ARRIVALS, deployment="chat"):
    log = ArrivalLog(tmp_path / "arrivals")
    for t, tokens_in, tokens_out in rows:
        log.write(1_764_000_000 + t, deployment, 1, tokens_in, tokens_out, 200)
    log.write(1_764_000_000 + 2.0, "other", 3, 1, 1, 200)
    log.close()
    return tmp_path / "arrivals" / LOG_FILE


def stoker(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [STOKER, *args], capture_output=True, text=True, timeout=deadline(120), env=dict(os.environ)
    )


def test_the_log_reads_back_as_a_trace_of_one_deployment(tmp_path):
    path = _log(tmp_path)
    trace = load_arrivals(path, "chat")
    assert [(r.t, r.context_tokens, r.generated_tokens) for r in trace] == ARRIVALS
    assert len(load_arrivals(path)) == len(ARRIVALS) + 1
    with pytest.raises(TraceError, match=r"no requests of 'nope' \(it has chat, other\)"):
        load_arrivals(path, "nope")


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        (b"{", "line 2: not JSON"),
        (b"[1]", "line 2: not a JSON object"),
        (b'{"t": "x", "deployment": "a", "in": 1, "out": 1}', "line 2: bad t 'x'"),
        (b'{"t": 1, "deployment": "", "in": 1, "out": 1}', "line 2: bad deployment ''"),
        (b'{"t": 1, "deployment": "a", "in": -1, "out": 1}', "line 2: bad in -1"),
        (b'{"t": 1, "deployment": "a", "in": 1, "out": 1.5}', "line 2: bad out 1.5"),
    ],
)
def test_a_bad_line_is_named(tmp_path, line, fragment):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b'{"t": 1, "deployment": "a", "in": 1, "out": 1}\n' + line + b"\n")
    with pytest.raises(TraceError, match=fragment):
        load_arrivals(path)


def test_the_log_rotates_by_size_and_follows_no_link(tmp_path):
    log = ArrivalLog(tmp_path / "a", max_bytes=1000)
    for i in range(100):  # ~75 bytes a line: rotated every 13 lines or so, one old file kept
        log.write(1_764_000_000 + i, "chat", 1, i, i, 200)
    log.close()
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == [LOG_FILE, f"{LOG_FILE}.1"]
    assert all((tmp_path / "a" / f).stat().st_size <= 1000 for f in files)
    assert (tmp_path / "a" / LOG_FILE).stat().st_mode & 0o777 == 0o600
    newest = [json.loads(x) for x in (tmp_path / "a" / LOG_FILE).read_text().splitlines()]
    assert newest[-1] == {
        "t": 1_764_000_099,
        "deployment": "chat",
        "revision": 1,
        "in": 99,
        "out": 99,
        "status": 200,
    }
    # A link where the log goes is not written through (the failure is logged, not raised).
    (tmp_path / "b").mkdir()
    target = tmp_path / "elsewhere.txt"
    target.write_text("")
    (tmp_path / "b" / LOG_FILE).symlink_to(target)
    ArrivalLog(tmp_path / "b").write(1.0, "chat", 1, 1, 1, 200)
    assert target.read_text() == ""
    with pytest.raises(TraceError, match="not a regular file"):
        load_arrivals(tmp_path / "b" / LOG_FILE)


def test_simulate_from_log_prices_each_policy_and_counts_slow_starts(tmp_path):
    path = _log(tmp_path)
    prices = tmp_path / "prices.yaml"
    prices.write_text("ready_hour: {cpu: 0.36, vllm: 3.6}\nstarting_hour: 0.72\nsleeping_hour: 0.036\n")
    proc = stoker(
        "simulate", "--from-log", str(path), "--deployment", "chat", "--policy", "keepalive",
        "--policy", "kpa", "--prices", str(prices), "--profile", "cpu", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = {r["policy"]: r for r in map(json.loads, proc.stdout.splitlines())}
    assert set(rows) == {"keepalive", "kpa"}
    tokens = sum(a + b for _, a, b in ARRIVALS)
    for r in rows.values():
        assert r["requests"] == len(ARRIVALS) and r["engine"] == "cpu"
        cost = (
            r["gpu_seconds"] * 0.36 / 3600
            + r["starting_seconds"] * 0.72 / 3600
            + r["sleep_seconds"] * 0.036 / 3600
        )
        assert r["cost_usd"] == pytest.approx(cost, rel=1e-6)
        assert r["cost_per_1k_requests"] == pytest.approx(r["cost_usd"] / len(ARRIVALS) * 1000, rel=1e-6)
        assert r["cost_per_1k_tokens"] == pytest.approx(r["cost_usd"] / tokens * 1000, rel=1e-6)
        assert r["slow_starts"] == r["cold_starts"] >= 1  # the burst arrives at zero instances
    # keepalive keeps its instance through the 400 s gap (600 s); kpa goes to zero within a minute
    # of the burst and starts again for the lone request: one slow start more, and fewer READY seconds.
    assert rows["kpa"]["slow_starts"] > rows["keepalive"]["slow_starts"]
    assert rows["kpa"]["gpu_seconds"] < rows["keepalive"]["gpu_seconds"]
    table = stoker("simulate", "--from-log", str(path), "--policy", "kpa", "--profile", "cpu")
    assert table.returncode == 0 and "slow starts" in table.stdout and "kpa" in table.stdout
    # Instances on 4 devices each: the same seconds; awake ones cost four times, asleep ones once.
    wide = stoker(
        "simulate", "--from-log", str(path), "--deployment", "chat", "--policy", "keepalive",
        "--prices", str(prices), "--profile", "cpu", "--json", "--gpus", "4",
    )  # fmt: skip
    [r] = map(json.loads, wide.stdout.splitlines())
    one = rows["keepalive"]
    awake = one["gpu_seconds"] * 0.36 / 3600 + one["starting_seconds"] * 0.72 / 3600
    assert r["gpu_seconds"] == one["gpu_seconds"]
    assert r["cost_usd"] == pytest.approx(4 * awake + one["sleep_seconds"] * 0.036 / 3600, rel=1e-6)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--from-log", "/nonexistent.jsonl"], "arrival log /nonexistent.jsonl: no such file"),
        (["--from-log", "LOG", "--trace", "x.csv"], "give it instead of --trace or --fleet"),
        (["--from-log", "LOG", "--deployment", "nope"], "no requests of 'nope'"),
        (["--from-log", "LOG", "--prices", "PRICES"], "ready_hour.tpu: unknown engine"),
        (["--from-log", "LOG", "--policy", "kpq"], "kpq"),
        (["--from-log", "LOG", "--thin", "0"], "--thin must be a whole number"),
        (["--from-log", "LOG", "--gpus", "0"], "--gpus: an instance holds at least 1 device"),
        (["--from-log", "LOG", "--measured-starts"], "--measured-starts reads one deployment's starts"),
    ],
)
def test_bad_what_if_input_is_one_line(tmp_path, args, fragment):
    path = _log(tmp_path)
    prices = tmp_path / "bad.yaml"
    prices.write_text("ready_hour: {tpu: 1}\n")
    args = [str(path) if a == "LOG" else str(prices) if a == "PRICES" else a for a in args]
    proc = stoker("simulate", *args)
    assert_one_line_error(proc, fragment)
