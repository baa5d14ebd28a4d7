"""`stoker bench` against a real platform with the tiny model, then `stoker plan` on its output;
and every bad input to either as one line. Figures that depend on timing are checked only
against each other (the plan against its own inputs), never against a number."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess

import pytest

from stoker.cli.loadgen import poisson_arrivals
from stoker.cli.main import build_parser
from tests.conftest import STOKER
from tests.deadlines import CLI
from tests.snapshots.support import assert_one_line_error

SMALL = ("--prompt-tokens", "8", "--output-tokens", "4")
BENCH_FIELDS = {
    "requests", "answered", "errors", "error_kinds", "cold_starts", "throughput_rps", "output_tokens_per_s",
    "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "e2e_p50_s", "e2e_p99_s", "levels", "samples",
}  # fmt: skip
PLAN_FIELDS = {
    "instances",
    "target_concurrency",
    "min_warm",
    "max",
    "devices",
    "concurrency",
    "service_time_s",
}


def bench(platform, *args: str) -> dict:
    return json.loads(platform.cli("bench", "tiny", *SMALL, "--json", *args).stdout)


def test_bench_then_plan(shared_platform, tmp_path):
    # At zero: the first request waits for a start, and says so.
    first = bench(shared_platform, "--rate", "4", "--duration", "2")
    # Whether every request of a burst at zero is answered depends on how fast the engine starts
    # and sends its first stream headers (the activator's 10 s stream_headers_timeout_s), which a
    # loaded CI machine does not promise: the warm run below must answer every one.
    assert first["cold_starts"] >= 1 and first["answered"] >= 1, first["error_kinds"]

    run = bench(shared_platform, "--rate", "5", "--duration", "3")
    assert BENCH_FIELDS <= run.keys() and run["kind"] == "stoker-bench"
    assert (
        run["requests"] == len(poisson_arrivals(5, 3, prompt_tokens=8, max_tokens=4)) == len(run["samples"])
    )
    # Every request answered. The random tiny model can sample 4 tokens that decode to no text: the
    # bench counts such an answer as "no output" (no first content token to time), with its usage.
    silent = [s for s in run["samples"] if s["error"] == "no output" and s["tokens"] == 4]
    assert run["errors"] == len(silent) and run["answered"] + len(silent) == run["requests"], run[
        "error_kinds"
    ]
    # ignore_eos: every answer is the 4 tokens asked for, counted from the usage chunk.
    assert {s["tokens"] for s in run["samples"]} == {4}
    answered = [s for s in run["samples"] if s["error"] is None]
    assert answered and all(0 < s["ttft"] <= s["e2e"] for s in answered)
    assert run["ttft_p50_s"] <= run["ttft_p99_s"] and run["tpot_p50_s"] is not None
    assert run["engine"] == "cpu" and run["instances_seen"] >= 1
    assert sum(lv["requests"] for lv in run["levels"]) == run["answered"] - sum(s["cold"] for s in answered)

    saved = tmp_path / "bench.json"
    saved.write_text(json.dumps(run))
    # A target every level meets: C is the highest level the bench drove.
    args = ("plan", "--from", str(saved), "--qps", "10", "--p99-ttft", "1h", "--redundancy", "N+1")
    p = json.loads(shared_platform.cli(*args, "--min-samples", "1", "--json").stdout)
    assert PLAN_FIELDS <= p.keys()
    assert p["concurrency"] == max(lv["in_flight"] for lv in run["levels"]) == p["target_concurrency"]
    assert p["instances"] == max(1, math.ceil(10 * p["service_time_s"] / p["concurrency"] - 1e-9)) + 1
    assert p["min_warm"] == p["instances"] <= p["max"] and p["devices"] == p["instances"]
    deploy = shlex.split(p["deploy_command"])
    parsed = build_parser().parse_args(deploy[1:])  # the command it prints is one the CLI takes
    assert (parsed.name, parsed.model, parsed.target_concurrency, parsed.min_warm, parsed.max) == (
        "tiny", run["model"], p["concurrency"], p["instances"], p["max"]
    )  # fmt: skip

    text = shared_platform.cli(*args, "--min-samples", "1").stdout
    assert (
        "instances = ceil(Q × W / C) = ceil(10 × " in text and f"deploy with: {p['deploy_command']}" in text
    )

    # No such deployment: one line, at once.
    gone = shared_platform.cli("bench", "nosuch", "--rate", "5", "--duration", "1", check=False)
    assert_one_line_error(gone, "HTTP 404", "nosuch")


def stoker(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "STOKER_URL": "http://127.0.0.1:1"}
    return subprocess.run([STOKER, *args], capture_output=True, text=True, timeout=CLI, env=env)


@pytest.fixture
def files(tmp_path):
    samples = [
        {
            "start": 0.0,
            "ttft": None,
            "e2e": None,
            "tokens": 0,
            "instance": None,
            "cold": False,
            "error": "timeout",
        }
    ]
    made = {
        "notjson": "{",
        "other": json.dumps({"kind": "something-else", "samples": []}),
        "unanswered": json.dumps({"kind": "stoker-bench", "samples": samples}),
        "malformed": json.dumps({"kind": "stoker-bench", "samples": [{"ttft": 1}]}),
        "trace.csv": "TIMESTAMP,ContextTokens\n1,2\n",
    }
    for name, text in made.items():
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["bench", "x"], ["one of the arguments --trace --rate is required"]),
        (["bench", "x", "--rate", "5", "--trace", "t.csv"], ["not allowed with argument"]),
        (["bench", "x", "--rate", "0"], ["--rate must be a number of requests per second > 0, got 0.0"]),
        (["bench", "x", "--rate", "fast"], ["argument --rate: invalid float value: 'fast'"]),
        (["bench", "x", "--rate", "5", "--duration", "5x"], ["argument --duration: '5x' is not a duration"]),
        (["bench", "x", "--rate", "5", "--duration", "0"], ["--duration must be more than 0 s"]),
        (["bench", "x", "--rate", "5", "--concurrency-limit", "0"], ["--concurrency-limit must be 1 or more, got 0"]),
        (["bench", "x", "--rate", "5", "--max-tokens", "0"], ["--max-tokens must be 1 or more"]),
        (["bench", "x", "--rate", "0.001", "--duration", "1"], ["no requests to send"]),
        (["bench", "x", "--trace", "{d}/missing.csv"], ["missing.csv: no such file"]),
        (["bench", "x", "--trace", "{d}/trace.csv"], ["missing column GeneratedTokens"]),
        (["bench", "x", "--trace", "{d}/trace.csv", "--thin", "0"], ["--thin must be 1 or more"]),
        (["bench", "x", "--rate", "5", "--duration", "1"], ["cannot reach the platform at http://127.0.0.1:1"]),
        (["bench", "x", "--rate", "5", "--url", "localhost:1"], ["--url: 'localhost:1' is not an http://"]),
        (["plan", "--qps", "1", "--p99-ttft", "1"], ["the following arguments are required: --from"]),
        (["plan", "--from", "{d}/missing", "--qps", "1", "--p99-ttft", "1"], ["missing: no such file"]),
        (["plan", "--from", "{d}", "--qps", "1", "--p99-ttft", "1"], ["is a directory, not a bench file"]),
        (["plan", "--from", "{d}/notjson", "--qps", "1", "--p99-ttft", "1"], ["not JSON"]),
        (["plan", "--from", "{d}/other", "--qps", "1", "--p99-ttft", "1"], ["not a bench result"]),
        (["plan", "--from", "{d}/malformed", "--qps", "1", "--p99-ttft", "1"], ["a sample in it is malformed"]),
        (["plan", "--from", "{d}/unanswered", "--qps", "1", "--p99-ttft", "1"], ["no request in it was answered (1 sent)"]),
        (["plan", "--from", "{d}/other", "--qps", "1", "--p99-ttft", "1", "--redundancy", "N-1"], ["--redundancy: 'N-1' is not a redundancy"]),
        (["plan", "--from", "{d}/other", "--qps", "1", "--p99-ttft", "soon"], ["argument --p99-ttft: 'soon' is not a duration"]),
        (["plan", "--from", "{d}/other", "--qps", "1", "--p99-ttft", "1", "--redundncy", "N+1"], ["did you mean '--redundancy'?"]),
    ],
)  # fmt: skip
def test_bad_input_is_one_line(files, args, fragments):
    assert_one_line_error(stoker(*(a.format(d=files) for a in args)), *fragments)
