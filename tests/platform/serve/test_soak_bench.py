"""bench/soak.py and bench/soak_probe.py: their own helpers, with no platform: the trace thinned and
looped, the fitted line, the zero periods, and the process probe on real processes started here
(a tree, then a child its parent left behind)."""

from __future__ import annotations

import importlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.deadlines import deadline

REPO = Path(__file__).resolve().parents[3]
BENCH = REPO / "bench"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # as `python bench/soak.py` has it
    return importlib.import_module("soak"), importlib.import_module("soak_probe")


def test_the_trace_is_thinned_to_every_kth_row_and_looped(bench, tmp_path: Path):
    soak, _ = bench
    trace = tmp_path / "trace.csv"
    rows = [f"2023-11-16 18:17:{s:02d}.0000000,{100 * s},{s + 1}" for s in range(6)]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    plan = soak.schedule(trace, 2, soak.LOOP_S + 3)
    assert plan == [
        (0.0, 0, 1),
        (2.0, 200, 3),
        (4.0, 400, 5),
        (soak.LOOP_S, 0, 1),
        (soak.LOOP_S + 2.0, 200, 3),
    ]


def test_bodies_cap_the_answer_and_the_prompt_and_alternate_plain_and_streamed(bench):
    soak, _ = bench
    shapes = [soak.body_for(i, 100_000, 5000) for i in range(4)]
    assert [stream for _, _, stream in shapes] == [False, True, False, True]
    assert {path for path, _, _ in shapes} == {"/v1/completions", "/v1/chat/completions"}
    for _, body, _ in shapes:
        assert body["max_tokens"] == soak.MAX_TOKENS_CAP and body["model"] == soak.NAME
        text = body.get("prompt") or body["messages"][0]["content"]
        assert text == soak.PHRASE * soak.PROMPT_REPEAT_CAP
    _, small, _ = soak.body_for(0, 10, 0)
    assert small["max_tokens"] == 1 and small["prompt"] == soak.PHRASE


def test_a_straight_line_is_fitted_exactly_and_a_short_series_gets_no_slope(bench):
    _, probe = bench
    hours = [0.0, 0.5, 1.0, 1.5]
    line = probe.fit(hours, [10 + 4 * h for h in hours])
    assert line["slope_per_h"] == pytest.approx(4.0)
    assert line["slope_se_per_h"] == pytest.approx(0.0, abs=1e-9)
    assert (line["first"], line["last"], line["min"], line["max"], line["n"]) == (10, 16, 10, 16, 4)
    noisy = probe.fit(hours, [10, 12, 9, 11])
    assert noisy["slope_se_per_h"] > 0
    assert "slope_per_h" not in probe.fit([0.0, 1.0], [1, 2])
    assert probe.fit([], []) == {"n": 0}


def test_zero_periods_count_each_fall_to_no_instance(bench):
    soak, _ = bench
    polls = [(0, 0), (2, 1), (4, 2), (6, 0), (8, 0), (10, 1), (12, 0)]
    assert soak.zero_periods(polls) == 2


def test_the_probe_reads_a_tree_and_finds_a_child_left_behind(bench):
    _, probe = bench
    # A parent that starts a child and prints its pid; the child outlives the parent's SIGKILL.
    code = "import subprocess, sys, time; c = subprocess.Popen(['sleep', '120']); print(c.pid, flush=True); time.sleep(120)"
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        seen: set[tuple[int, int]] = set()
        s = probe.sample(parent.pid, seen)
        assert s["procs"] == 2 and s["escaped"] == []
        assert s["fds_up"] > 0 and s["fds_tree"] >= s["fds_up"]
        assert s["rss_tree_mib"] > s["rss_up_mib"] > 0 and s["pss_up_mib"] > 0
        assert {pid for pid, _ in seen} == {parent.pid, child}
        members = probe.members(parent.pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(deadline(30))
        until = time.monotonic() + deadline(30)
        while probe.tree(parent.pid, probe.processes()) and time.monotonic() < until:
            time.sleep(0.05)  # the killed parent is reaped (wait above): its pid leaves /proc
        after = probe.sample(parent.pid, seen)
        assert after["procs"] == 0 and after["escaped"] == [child]
        assert probe.alive(members) == [child]
    finally:
        subprocess.run(["kill", "-9", str(child)], check=False)
        parent.kill()
        parent.wait()
        parent.stdout.close()
