"""`stoker simulate` as a user runs it: the real CLI in a subprocess."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import STOKER
from tests.deadlines import deadline

KEYS = {
    "policy",
    "requests",
    "rejected",
    "cold_start_share",
    "p50_wait_s",
    "p99_wait_s",
    "p99_ttft_s",
    "gpu_seconds",
    "starting_seconds",
    "sleep_seconds",
    "cost_per_1k_requests",
}


@pytest.fixture
def trace(tmp_path):
    rows = "".join(f"{t * 7.5},{200 + t},{10 + t % 5}\n" for t in range(40))
    path = tmp_path / "trace.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + rows)
    return path


def stoker(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([STOKER, "simulate", *args], capture_output=True, text=True, timeout=deadline(120))


def test_json_prints_one_object_per_policy_and_a_plot_is_drawn(trace, tmp_path):
    png = tmp_path / "run.png"
    out = stoker(
        "--trace", str(trace), "--policy", "kpa", "--policy", "predictive", "--json", "--plot", str(png)
    )
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["policy"] for r in rows] == ["kpa", "predictive"]
    for r in rows:
        assert KEYS <= set(r)
        assert r["requests"] == 40 and r["thin"] == 1 and r["seed"] == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_table_thin_time_scale_and_model_flags(trace):
    out = stoker(
        "--trace", str(trace), "--thin", "4", "--time-scale", "2", "--profile", "cpu", "--disk-s", "3"
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:3] == ["policy", "requests", "rejected"]
    assert [line.split()[0] for line in lines[1:]] == ["kpa", "keepalive", "histogram", "predictive"]
    assert {line.split()[1] for line in lines[1:]} == {"10"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policy", "hpa"], "stoker: error: unknown policy 'hpa'; choose one of: predictive, kpa, "),
        (["--thin", "0"], "stoker: error: --thin must be a whole number ≥ 1, got 0"),
        (["--concurrency", "0"], "stoker: error: need concurrency ≥ 1 and max_queue ≥ 0"),
        (["--plot", "out.jpg"], "stoker: error: --plot writes a PNG file; got out.jpg"),
    ],
)
def test_bad_options_are_one_line_errors(trace, args, message):
    out = stoker("--trace", str(trace), *args)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.startswith(message) and out.stderr.count("\n") == 1


def test_a_bad_trace_file_is_a_one_line_error(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("time,prompt,output\n1,2,3\n")
    for path, message in ((bad, "missing column TIMESTAMP"), (tmp_path / "none.csv", "no such file")):
        out = stoker("--trace", str(path))
        assert out.returncode == 1 and message in out.stderr and out.stderr.count("\n") == 1


def test_idle_timeout_binds_the_policies_as_a_deployment_with_it(trace):
    """Requests every 7.5 s: keepalive with the policies' own 600 s keeps the first instance
    throughout (only the 4 requests of its 28 s disk start wait); bound as a deployment with
    --idle-timeout 5, it lets the instance go in every gap, and most requests wait for a start."""

    def cold_share(*flags: str) -> float:
        out = stoker("--trace", str(trace), "--policy", "keepalive", "--json", *flags)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["cold_start_share"]

    assert cold_share() == pytest.approx(4 / 40)
    assert cold_share("--idle-timeout", "5", "--stable-window", "2") > 0.5
