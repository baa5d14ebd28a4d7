"""What a batch does to interactive traffic: interactive TTFT under a steady load, with and without
a 500-request batch submitted at once, side by side in one run.

    python bench/batch_bench.py [--quick] [--out bench/results/batch.json]

One `stoker up` (open mode, loopback), SmolLM2-135M (the embedded model, imported once into
`--home`, default ~/.cache/stoker-bench) deployed at `--min-warm 1 --max 1`: one instance, so
the batch can only take what that instance has to spare (its window, 24 h, never makes it urgent).
Interactive load is open-loop: a streamed chat request every `1 / --rate` seconds, each on its own
connection, its TTFT the time to its first content event. Three phases, one after the other:

    A   interactive load alone, `--seconds`
    B   a batch of `--lines` chat requests submitted at once (the openai client's files.create and
        batches.create); the same interactive load for `--seconds` while it runs; then the batch
        polled to its end
    A'  interactive load alone again (the baseline is the better p99 of A and A': a drift or a
        noisy spell of the shared machine shows as their difference, and never flatters the batch)

The figure is the change in interactive p99 TTFT (B against the baseline), which the batch API
bounds (docs/guide/batches.md: the bound, and why it holds), and the batch's own time to complete
against its window. Writes JSON and a markdown table (`.md`) next to it.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common
import httpx
import openai
from common import (
    HOST,
    Processes,
    fmt_s,
    fmt_x,
    free_port,
    import_builtin_snapshot,
    machine_info,
    ratio,
    say,
    stoker_command,
    write_results,
)

MODEL = "smollm2"
PROMPT = [{"role": "user", "content": "Tell me one short fact about the sea, in a single sentence please."}]
BOUND = 1.5  # interactive p99 TTFT with the batch, at most this times the baseline's (docs/guide/batches.md)


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


async def interactive(base: str, rate: float, seconds: float, max_tokens: int) -> dict:
    """Open-loop streamed chat requests at `rate` per second for `seconds`: each one's TTFT."""
    ttft: list[float] = []
    statuses: dict[str, int] = {}
    body = {"model": MODEL, "messages": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}

    samples: list[list[float]] = []  # [sent at (s into the phase), TTFT]
    origin = time.perf_counter()

    async def one(client: httpx.AsyncClient) -> None:
        t0 = time.perf_counter()
        first = None
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if first is None and line.startswith("data: {") and '"content"' in line:
                    first = time.perf_counter() - t0
        statuses[str(r.status_code)] = statuses.get(str(r.status_code), 0) + 1
        if r.status_code == 200 and first is not None:
            ttft.append(first)
            samples.append([t0 - origin, first])

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as client:
        tasks, start = [], time.monotonic()
        for i in range(int(seconds * rate)):
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            tasks.append(asyncio.create_task(one(client)))
        await asyncio.gather(*tasks)
    return {"ttft": ttft, "statuses": statuses, "samples": sorted(samples)}


def summary(ttft: list[float]) -> dict:
    return {"requests": len(ttft), "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99)}


def batch_input(lines: int, max_tokens: int) -> bytes:
    rows = []
    for i in range(lines):
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Fact {i} about the sea?"}]}
        rows.append({"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
                     "body": {**body, "max_tokens": max_tokens, "temperature": 0}})  # fmt: skip
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--home", type=Path, default=Path.home() / ".cache" / "stoker-bench")
    parser.add_argument("--out", type=Path, default=common.REPO / "bench" / "results" / "batch.json")
    parser.add_argument("--rate", type=float, default=2.0, help="interactive requests per second")
    parser.add_argument("--seconds", type=float, default=60.0, help="each phase's interactive load")
    parser.add_argument("--lines", type=int, default=500, help="requests in the batch")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="20 s phases, 100 lines: a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.lines = 20.0, 100
    signal.signal(signal.SIGTERM, common._interrupt)
    started = time.monotonic()
    snapshot = import_builtin_snapshot(args.home, MODEL)
    procs = Processes()
    work = Path(tempfile.mkdtemp(prefix="stoker-batch-bench-"))
    try:
        port = free_port()
        base = f"http://{HOST}:{port}"
        env = {**os.environ, "STOKER_HOME": str(work / "home"), "STOKER_URL": base}
        env["STOKER_SNAPSHOT_STORE"] = str(args.home / "snapshots")
        env.pop("STOKER_ADMIN_KEY", None)
        log = work / "up.log"
        up = [*stoker_command(), "up", "--host", HOST, "--port", str(port), "--warm-runtimes", "0"]
        with log.open("ab") as out:
            procs.spawn(up, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        wait(lambda: httpx.get(base + "/healthz", timeout=2).status_code == 200, 120, "stoker up", log)
        deploy = [
            "deploy",
            MODEL,
            "--model",
            snapshot["path"],
            "--min-warm",
            "1",
            "--max",
            "1",
            "--idle-timeout",
            "1h",
        ]
        subprocess.run([*stoker_command(), *deploy], env=env, check=True, capture_output=True, timeout=300)
        wait(lambda: ready(base) == 1, 300, "a READY instance", log)
        asyncio.run(interactive(base, args.rate, 15, args.max_tokens))  # warm up: not counted

        say(f"A: interactive alone, {args.rate:g}/s for {args.seconds:g} s")
        a = asyncio.run(interactive(base, args.rate, args.seconds, args.max_tokens))
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
        say(f"B: a batch of {args.lines} submitted at once, and the same interactive load")
        file = client.files.create(
            file=("in.jsonl", io.BytesIO(batch_input(args.lines, args.max_tokens))), purpose="batch"
        )
        submitted = time.monotonic()
        batch = client.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        b = asyncio.run(interactive(base, args.rate, args.seconds, args.max_tokens))
        during = client.batches.retrieve(batch.id).request_counts.completed
        while (batch := client.batches.retrieve(batch.id)).status not in (
            "completed",
            "failed",
            "expired",
            "cancelled",
        ):
            time.sleep(0.5)
        took = time.monotonic() - submitted
        say(f"A': interactive alone again; the batch took {took:.0f} s")
        a2 = asyncio.run(interactive(base, args.rate, args.seconds, args.max_tokens))
        output = client.files.content(batch.output_file_id).text.splitlines() if batch.output_file_id else []
        ids = sorted(json.loads(x)["custom_id"] for x in output)
    finally:
        procs.stop_all()
    shutil.rmtree(work, ignore_errors=True)  # kept when the run fails: its log says why
    # The baseline is the better of the two phases without the batch: the machine is shared, and
    # a noisy phase must not make the batch look free.
    alone = min((summary(a["ttft"]), summary(a2["ttft"])), key=lambda s: s["ttft_p99_s"] or float("inf"))
    baseline = {**summary(a["ttft"] + a2["ttft"]), "ttft_p99_s": alone["ttft_p99_s"]}
    loaded = summary(b["ttft"])
    change = ratio(loaded["ttft_p99_s"], baseline["ttft_p99_s"])
    results = {
        "benchmark": "batch",
        "command": "python bench/batch_bench.py" + (" --quick" if args.quick else ""),
        "machine": machine_info(("torch", "transformers")),
        "settings": {
            "rate": args.rate,
            "seconds": args.seconds,
            "lines": args.lines,
            "max_tokens": args.max_tokens,
            "model": MODEL,
            "bound_p99_ratio": BOUND,
        },
        "baseline": {**baseline, "A": summary(a["ttft"]), "A_again": summary(a2["ttft"])},
        "with_batch": {**loaded, "batch_lines_answered_meanwhile": during},
        "statuses": {"A": a["statuses"], "B": b["statuses"], "A_again": a2["statuses"]},
        "samples": {"A": a["samples"], "B": b["samples"], "A_again": a2["samples"]},
        "p99_ratio": change,
        "p99_delta_s": (loaded["ttft_p99_s"] or 0) - (baseline["ttft_p99_s"] or 0),
        "within_bound": change is not None and change <= BOUND,
        "batch": {
            "status": batch.status,
            "seconds": took,
            "window_s": 86_400,
            "completed": batch.request_counts.completed,
            "failed": batch.request_counts.failed,
            "each_line_once": ids == sorted(f"b{i}" for i in range(args.lines)),
        },
        "elapsed_s": time.monotonic() - started,
    }
    md = "\n".join([
        f"Interactive TTFT at {args.rate:g} req/s (streamed, {args.max_tokens} tokens), one SmolLM2 instance; "
        f"a {args.lines}-request batch submitted at once in phase B.",
        "",
        "| phase | requests | TTFT p50 | TTFT p99 |",
        "|---|---:|---:|---:|",
        *(f"| {name} | {s['requests']} | {fmt_s(s['ttft_p50_s'])} | {fmt_s(s['ttft_p99_s'])} |"
          for name, s in (("A: alone", results["baseline"]["A"]), ("B: with the batch", loaded),
                          ("A': alone again", results["baseline"]["A_again"]))),
        "",
        f"p99 with the batch / the better p99 of A and A': {fmt_x(change)} (bound {BOUND:g}x: "
        f"{'within' if results['within_bound'] else 'OVER'}); the batch: {batch.status} in {took:.0f} s of its "
        f"24 h window, {batch.request_counts.completed} answered, each line once: {results['batch']['each_line_once']}.",
    ])  # fmt: skip
    write_results(args.out, results, md)
    return 0 if results["within_bound"] and batch.status == "completed" else 1


def ready(base: str) -> int:
    data = httpx.get(base + "/admin/v1/deployments", timeout=10).json()["data"]
    return next((d["instances"]["READY"] for d in data if d["name"] == MODEL), 0)


def wait(condition, seconds: float, what: str, log: Path) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            if condition():
                return
        except (httpx.TransportError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{what} not reached in {seconds:g} s:\n{log.read_text(errors='replace')[-3000:]}")


if __name__ == "__main__":
    sys.exit(main())
