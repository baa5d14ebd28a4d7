"""Benchmark what request bodies offered at once cost the gateway's memory: `--max-body-memory 64MiB`
against a budget too big to bind (4 GiB: the gateway as it was before the bound), side by side.

    python bench/bodies_bench.py [--counts 100,200,400] [--body-mib 1] [--budget 64MiB]
                                 [--out bench/results/bodies.json]

Per variant, one `stoker up --max-queued 16` (its own `STOKER_HOME`, a temporary one), one `--max 1`
deployment of the tests' tiny model, warm. Then, for each count N in turn, N clients each send one
plain completion at the same instant, its body carrying `--body-mib` MiB in `user` (a field the
engine accepts and ignores; the prompt is short, `max_tokens` 1), while this process samples the
`stoker up` process's RSS every 20 ms. Reported per variant and count: what came back (200s, 503s
by code) and the peak RSS; the RSS before the first count. Python's allocator keeps what it was
given, so a peak stays; the counts run from the smallest up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx
from common import REPO, Processes, _interrupt, machine_info, say, write_results
from overload_bench import MIB, Up, rss

VARIANTS = (("unbounded", "4GiB"), ("bounded", None))  # None: --budget; 4 GiB binds at no count here


async def offer(up: Up, n: int, body_mib: float) -> dict:
    """`n` requests with `body_mib` MiB bodies at once; their answers and the peak RSS meanwhile."""
    body = {"model": "bench", "prompt": "hi", "max_tokens": 1, "user": "u" * int(body_mib * MIB)}
    payload = json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    peak, done = 0, asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss(up.proc.pid))
            await asyncio.sleep(0.02)

    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(httpx.AsyncClient(base_url=up.base, timeout=120))
            for _ in range(n)
        ]
        sampler = asyncio.ensure_future(sample())
        answers = await asyncio.gather(
            *(c.post("/v1/completions", content=payload, headers=headers) for c in clients),
            return_exceptions=True,
        )
        done.set()
        await sampler
    codes: dict[str, int] = {}
    for a in answers:
        if isinstance(a, BaseException):
            key = type(a).__name__
        elif a.status_code == 200:
            key = "200"
        else:
            key = f"{a.status_code} {a.json().get('error', {}).get('code')}"
        codes[key] = codes.get(key, 0) + 1
    return {"n": n, "codes": codes, "peak_rss_mib": peak / MIB}


def table(res: dict) -> str:
    head = (
        "| bodies at once ("
        + f"{res['body_mib']:g} MiB each) | "
        + " | ".join(v["name"] for v in res["variants"])
        + " |"
    )
    lines = [head, "|---" * (len(res["variants"]) + 1) + "|"]
    lines.append(
        "| `stoker up` RSS before | "
        + " | ".join(f"{v['rss_before_mib']:.0f} MiB" for v in res["variants"])
        + " |"
    )
    for i, n in enumerate(res["counts"]):
        cells = []
        for v in res["variants"]:
            shot = v["shots"][i]
            answered = ", ".join(f"{k}: {c}" for k, c in sorted(shot["codes"].items()))
            cells.append(f"peak {shot['peak_rss_mib']:.0f} MiB ({answered})")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        f"`stoker up --max-queued 16`, one `--max 1` deployment of the tiny model; bounded: "
        f"`--max-body-memory {res['budget']}`; load average at start {res['machine']['loadavg_start'][0]:.2f}."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--counts", default="100,200,400", help="bodies offered at once, in turn")
    ap.add_argument("--body-mib", type=float, default=1.0, help="each body's size (at most 4)")
    ap.add_argument("--budget", default="64MiB", help="the bounded variant's --max-body-memory")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "bodies.json")
    args = ap.parse_args(argv)
    counts = [int(x) for x in args.counts.split(",")]
    if not 0 < args.body_mib < 4:
        ap.error(f"--body-mib must be above 0 and below 4 (the body limit), got {args.body_mib:g}")
    signal.signal(signal.SIGTERM, _interrupt)
    procs = Processes(stop_all_timeout=60.0)
    t0 = time.perf_counter()
    results: dict = {
        "machine": machine_info(),
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv),
        "counts": counts,
        "body_mib": args.body_mib,
        "budget": args.budget,
        "variants": [],
    }
    try:
        with tempfile.TemporaryDirectory(prefix="stoker-bodies-bench-") as tmp:
            sys.path.insert(0, str(REPO))
            from tests.conftest import build_tiny_model

            model = str(build_tiny_model(Path(tmp) / "tiny"))
            for i, (name, budget) in enumerate(VARIANTS):
                budget = budget or args.budget
                env = {**os.environ, "STOKER_HOME": f"{tmp}/home{i}"}
                flags = ["--max-queued", "16", "--warm-runtimes", "0", "--max-body-memory", budget]
                up = Up(procs, env, Path(tmp) / f"up{i}.log", flags)
                up.cli("deploy", "bench", "--model", model, "--max", "1", "--idle-timeout", "600")
                with httpx.Client(base_url=up.base, timeout=120) as c:  # warm: the instance READY
                    c.post("/v1/completions", json={"model": "bench", "prompt": "hi", "max_tokens": 1})
                variant = {
                    "name": f"{name}: `--max-body-memory {budget}`",
                    "rss_before_mib": rss(up.proc.pid) / MIB,
                }
                variant["shots"] = []
                for n in counts:
                    say(f"{name}: {n} bodies of {args.body_mib:g} MiB at once")
                    variant["shots"].append(asyncio.run(offer(up, n, args.body_mib)))
                    say(json.dumps(variant["shots"][-1]))
                results["variants"].append(variant)
                procs.stop(up.proc)
    finally:
        procs.stop_all()
    results["elapsed_s"] = time.perf_counter() - t0
    write_results(args.out, results, table(results))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    print(json.dumps({"interrupted": True}), file=sys.stderr)
