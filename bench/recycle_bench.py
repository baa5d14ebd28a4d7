"""Benchmark what recycling costs a deployment under steady load: `--max-instance-age` against none,
side by side in one run.

    python bench/recycle_bench.py [--seconds 60] [--rounds 2] [--max-age 20s] [--clients 2]
                                  [--out bench/results/recycle.json] [--home DIR]

One `stoker up --stable-window 2` (its own `STOKER_HOME`, default `~/.cache/stoker-bench`, the
SmolLM2 snapshot imported there). Each round deploys, one after the other so that they never share
the CPU, `baseline` and then `recycled` (`--min-warm 2 --max 2 --idle-timeout 600`, the second with
`--max-instance-age`), waits for both instances READY, and runs `--clients` closed-loop clients for
`--seconds`, each sending a streamed chat request (a ~20-token message, `max_tokens` 8,
`temperature` 0) as soon as its last one ended, while a sampler reads the READY count from the
admin API every 50 ms. The deployment is then removed.

Reported per variant, over all rounds: requests, answers other than 200, TTFT and total latency
(p50, p99), recycles replaced (`stoker_instance_recycles_total{outcome="replaced"}`), instances
that served, and the lowest READY count sampled; and the ratios recycled / baseline. On a 2-core
machine a replacement's start competes with the serving engines for the CPU: that contention, not
the routing, is what the recycled p99 pays.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from common import (
    HOST,
    REPO,
    Processes,
    _interrupt,
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
BODY = {
    "messages": [
        {"role": "user", "content": "Tell me one short fact about the sea, in a single sentence please."}
    ],
    "max_tokens": 8,
    "temperature": 0,
    "stream": True,
}


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


class Up:
    def __init__(self, procs: Processes, env: dict[str, str], log: Path) -> None:
        self.port = free_port()
        self.base = f"http://{HOST}:{self.port}"
        self.env = {**env, "STOKER_URL": self.base}
        self.log = log
        cmd = [*stoker_command(), "up", "--host", HOST, "--port", str(self.port), "--stable-window", "2"]
        with log.open("ab") as out:
            self.proc = procs.spawn(cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"stoker up exited {self.proc.returncode}:\n{self.tail()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.base + "/healthz", timeout=2).status_code == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"stoker up not healthy within 120 s:\n{self.tail()}")

    def cli(self, *args: str) -> str:
        out = subprocess.run(
            [*stoker_command(), *args], env=self.env, capture_output=True, text=True, timeout=300
        )
        if out.returncode != 0:
            raise RuntimeError(f"stoker {shlex.join(args)} failed: {out.stderr.strip()}")
        return out.stdout

    def tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-3000:]
        return ""

    def metric(self, name: str, **labels: str) -> float:
        total = 0.0
        for line in httpx.get(self.base + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.split()[-1])
        return total


async def ready_count(client: httpx.AsyncClient, name: str) -> int:
    data = (await client.get("/admin/v1/deployments")).json()["data"]
    return next(d for d in data if d["name"] == name)["instances"]["READY"]


async def run_load(up: Up, name: str, seconds: float, clients: int) -> dict:
    """Closed-loop streamed requests for `seconds`, READY sampled meanwhile."""
    ttft: list[float] = []
    total: list[float] = []
    statuses: dict[int, int] = {}
    served: set[str] = set()
    ready: list[int] = []
    end = time.monotonic() + seconds
    body = {**BODY, "model": name}

    async def one_client(client: httpx.AsyncClient) -> None:
        while time.monotonic() < end:
            t0 = time.perf_counter()
            first = None
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if first is None and line.startswith("data: {") and '"content"' in line:
                        first = time.perf_counter() - t0
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            served.add(r.headers.get("x-stoker-instance", "?"))
            if r.status_code == 200 and first is not None:
                ttft.append(first)
                total.append(time.perf_counter() - t0)

    async def sampler(client: httpx.AsyncClient) -> None:
        while time.monotonic() < end:
            ready.append(await ready_count(client, name))
            await asyncio.sleep(0.05)

    async with httpx.AsyncClient(base_url=up.base, timeout=300) as client:
        await asyncio.gather(*(one_client(client) for _ in range(clients)), sampler(client))
    return {"ttft": ttft, "total": total, "statuses": statuses, "served": sorted(served), "ready": ready}


def variant(up: Up, name: str, flags: list[str], seconds: float, clients: int) -> dict:
    deploy = [
        "deploy",
        name,
        "--model",
        MODEL,
        "--min-warm",
        "2",
        "--max",
        "2",
        "--idle-timeout",
        "600",
        *flags,
    ]
    up.cli(*deploy)
    deadline = time.monotonic() + 300
    while asyncio.run(_ready(up, name)) < 2:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name}: two READY instances not reached in 300 s:\n{up.tail()}")
        time.sleep(0.2)
    before = up.metric("stoker_instance_recycles_total", deployment=name, outcome="replaced")
    say(f"{name}: {clients} clients for {seconds:.0f} s")
    out = asyncio.run(run_load(up, name, seconds, clients))
    out["recycled"] = (
        up.metric("stoker_instance_recycles_total", deployment=name, outcome="replaced") - before
    )
    out["deploy"] = "stoker " + shlex.join(deploy)
    up.cli("rm", name)
    return out


async def _ready(up: Up, name: str) -> int:
    async with httpx.AsyncClient(base_url=up.base, timeout=30) as client:
        return await ready_count(client, name)


def summary(runs: list[dict]) -> dict:
    ttft = [x for r in runs for x in r["ttft"]]
    total = [x for r in runs for x in r["total"]]
    statuses: dict[str, int] = {}
    for r in runs:
        for code, n in r["statuses"].items():
            statuses[str(code)] = statuses.get(str(code), 0) + n
    return {
        "requests": sum(statuses.values()),
        "not_200": sum(n for code, n in statuses.items() if code != "200"),
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "total_p50_s": pct(total, 50),
        "total_p99_s": pct(total, 99),
        "recycled": sum(r["recycled"] for r in runs),
        "instances_served": sum(len(r["served"]) for r in runs),
        "min_ready": min((min(r["ready"]) for r in runs if r["ready"]), default=None),
        "ready_samples": sum(len(r["ready"]) for r in runs),
    }


def table(res: dict) -> str:
    b, r = res["summary"]["baseline"], res["summary"]["recycled"]
    rows = [
        ("requests", b["requests"], r["requests"], ""),
        ("answers other than 200", b["not_200"], r["not_200"], ""),
        (
            "TTFT p50",
            fmt_s(b["ttft_p50_s"]),
            fmt_s(r["ttft_p50_s"]),
            fmt_x(ratio(r["ttft_p50_s"], b["ttft_p50_s"])),
        ),
        (
            "TTFT p99",
            fmt_s(b["ttft_p99_s"]),
            fmt_s(r["ttft_p99_s"]),
            fmt_x(ratio(r["ttft_p99_s"], b["ttft_p99_s"])),
        ),
        (
            "total p50",
            fmt_s(b["total_p50_s"]),
            fmt_s(r["total_p50_s"]),
            fmt_x(ratio(r["total_p50_s"], b["total_p50_s"])),
        ),
        (
            "total p99",
            fmt_s(b["total_p99_s"]),
            fmt_s(r["total_p99_s"]),
            fmt_x(ratio(r["total_p99_s"], b["total_p99_s"])),
        ),
        ("recycles replaced", b["recycled"], r["recycled"], ""),
        ("lowest READY sampled", b["min_ready"], r["min_ready"], ""),
    ]
    head = f"| {res['rounds']} × {res['seconds']:.0f} s, {res['clients']} clients | baseline | max age {res['max_age']} | ratio |"
    return "\n".join([head, "|---|---|---|---|", *(f"| {a} | {x} | {y} | {z} |" for a, x, y, z in rows)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="load per variant per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-age", default="20s", help="the recycled variant's --max-instance-age")
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "recycle.json")
    ap.add_argument(
        "--home", type=Path, default=Path("~/.cache/stoker-bench").expanduser(), help="STOKER_HOME"
    )
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    env = {**os.environ, "STOKER_HOME": str(args.home)}
    import_builtin_snapshot(args.home, MODEL)
    procs = Processes(stop_all_timeout=60.0)
    t0 = time.perf_counter()
    results: dict = {
        "machine": machine_info(("torch", "transformers")),
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv),
        "seconds": args.seconds,
        "rounds": args.rounds,
        "clients": args.clients,
        "max_age": args.max_age,
        "runs": {"baseline": [], "recycled": []},
    }
    try:
        with tempfile.TemporaryDirectory(prefix="stoker-recycle-bench-") as tmp:
            up = Up(procs, env, Path(tmp) / "up.log")
            for i in range(args.rounds):
                say(f"round {i + 1} of {args.rounds}")
                for name, flags in (("baseline", []), ("recycled", ["--max-instance-age", args.max_age])):
                    results["runs"][name].append(variant(up, name, flags, args.seconds, args.clients))
    finally:
        procs.stop_all()
    results["summary"] = {name: summary(runs) for name, runs in results["runs"].items()}
    results["elapsed_s"] = time.perf_counter() - t0
    for runs in results["runs"].values():  # samples are summarised; keep the file small
        for r in runs:
            r["ttft"], r["total"] = len(r["ttft"]), len(r["total"])
            r["ready"] = {"samples": len(r["ready"]), "min": min(r["ready"], default=None)}
    write_results(args.out, results, table(results))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    print(json.dumps({"interrupted": True}), file=sys.stderr)
