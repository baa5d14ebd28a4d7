"""Benchmark overload: what the admitted requests, the refused ones and the platform's memory look like
at 1× (the baseline), 3×, 10× and 30× the concurrency a `--max 1` deployment takes, side by side in
one run.

    python bench/overload_bench.py [--levels 1,3,10,30,30] [--seconds 30] [--max-queued 16]
                                   [--max-tokens 64] [--model tiny|smollm2]
                                   [--out bench/results/overload.json] [--home DIR]

One `stoker up --max-queued Q` (its own `STOKER_HOME`, default `~/.cache/stoker-bench`), one
deployment (`--max 1 --idle-timeout 600`) of the tests' tiny random model (what is measured is the
platform: the tiny model leaves the 2 cores to it and the clients; `--model smollm2`: SmolLM2-135M,
its snapshot imported into the home), warmed by one request.
One instance takes `CAPACITY` requests at once (the CPU engine's slots: 8), so level k is k × 8
closed-loop clients started together (the spike), each sending its next request as soon as its
last one ended: half streamed chat, half plain, `max_tokens` tokens each (`ignore_eos`, so every
answer costs the same). A refused client waits the refusal's `Retry-After` first, as the openai
client does. Levels run one after the other, in the order given, `--seconds` each; the last, 30×,
twice, so that memory that grew with the requests served (not with the clients at once) would show. Every
client's connection is made before its level's clock starts.

Every request is classified as the reliability suite does (complete; refused cleanly: 429/503 with
Retry-After and OpenAI's error object; lost: anything else, or no end within the hold deadline plus
a minute). Reported per level: requests, complete, refused, lost, the refusal rate, the admitted
streams' TTFT (their first token event) and every admitted request's total latency (p50, p99), the refusals' latency (p50, p99, max), the RSS of the `stoker up` process and of its
whole tree (its engine included) before the level, at its peak (sampled every 100 ms) and after
(once the queue is empty), and the CPU of `stoker up`, its engine, the clients and other work on
the machine; the ratios against level 1.

What bounds an admitted request: at most Q held ahead of it, served CAPACITY at a time, so it waits
at most ceil(Q / CAPACITY) service times S and takes at most ceil(Q / CAPACITY) + 1 of them (3 S
with Q = 16), and it is never held past the hold deadline. S is measured at the same level, from the
streams: total less TTFT (the wait and a prefill of a few tokens); on a machine whose CPU the engine
shares (with the clients, the refusals, other work) S grows with the load, and the bound with it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
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
    CLK_TCK,
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
CAPACITY = 8  # requests one CPU-engine instance takes at once (warm_pool.pool_spec: instance_concurrency)
ERROR_FIELDS = {"message", "type", "param", "code"}
MIB = 2**20


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, math.ceil(p / 100 * len(xs)) - 1)]


# ---- memory ------------------------------------------------------------------------------------------


def rss(pid: int) -> int:
    """VmRSS of `pid` in bytes, 0 if it is gone."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def tree(pid: int) -> set[int]:
    """`pid` and every live process below it."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    found, frontier = {pid}, {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def memory(pid: int) -> dict[str, int]:
    return {"up": rss(pid), "tree": sum(rss(p) for p in tree(pid))}


def cpu_sample(pid: int) -> dict[str, float]:
    """CPU seconds so far: the machine's busy time, `stoker up`'s own, the rest of its tree's (the
    engine: it runs in a session of its own, so the tree is walked by parent, not by group), and
    this benchmark's (the clients)."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    t = os.times()
    out = {
        "at": time.perf_counter(),
        "busy": (v[0] + v[1] + v[2] + v[5] + v[6]) / CLK_TCK,  # user nice system irq softirq
        "client": t.user + t.system,
        "up": 0.0,
        "engine": 0.0,
    }
    for p in tree(pid):
        with contextlib.suppress(OSError, IndexError, ValueError):
            f = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            out["up" if p == pid else "engine"] += sum(int(x) for x in f[11:15]) / CLK_TCK
    return out


def cpu_cores(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Cores used between two samples: by `stoker up`, its engine, the clients, and other work."""
    wall = b["at"] - a["at"]
    cores = {k: (b[k] - a[k]) / wall for k in ("up", "engine", "client")}
    cores["others"] = max(0.0, (b["busy"] - a["busy"]) / wall - sum(cores.values()))
    cores["wall_s"] = wall
    return cores


# ---- the platform ------------------------------------------------------------------------------------


class Up:
    def __init__(self, procs: Processes, env: dict[str, str], log: Path, args: list[str]) -> None:
        self.port = free_port()
        self.base = f"http://{HOST}:{self.port}"
        self.env = {**env, "STOKER_URL": self.base}
        self.log = log
        self.args = ["up", "--host", HOST, "--port", str(self.port), *args]
        with log.open("ab") as out:
            self.proc = procs.spawn(
                [*stoker_command(), *self.args],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
            )
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

    async def metric(self, client: httpx.AsyncClient, name: str, **labels: str) -> float:
        total = 0.0
        for line in (await client.get(self.base + "/metrics")).text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.split()[-1])
        return total


# ---- one request, classified -------------------------------------------------------------------------


def body(i: int, max_tokens: int) -> tuple[str, dict, bool]:
    """The i-th request: streamed chat and plain completions in turn, every answer `max_tokens` long."""
    common = {"model": "bench", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    if i % 2:
        messages = [{"role": "user", "content": f"Say something about the number {i}."}]
        return "/v1/chat/completions", {**common, "messages": messages, "stream": True}, True
    return "/v1/completions", {**common, "prompt": f"The number {i} is"}, False


async def one(client: httpx.AsyncClient, base: str, i: int, max_tokens: int, bound_s: float) -> dict:
    """{kind, stream, seconds, ttft, retry_after, reason}: kind is complete, refused or lost."""
    path, payload, stream = body(i, max_tokens)
    t0 = time.perf_counter()
    out: dict = {"kind": "lost", "stream": stream, "ttft": None, "retry_after": None, "reason": ""}
    try:
        async with asyncio.timeout(bound_s):
            async with client.stream("POST", base + path, json=payload) as r:
                if r.status_code == 200 and stream:
                    data = []
                    async for line in r.aiter_lines():
                        if line.startswith("data:"):
                            if out["ttft"] is None and '"content"' in line:
                                out["ttft"] = time.perf_counter() - t0
                            data.append(line[5:].strip())
                    events = [json.loads(d) for d in data[:-1]] if data and data[-1] == "[DONE]" else None
                    if events is None:
                        out["reason"] = "stream without [DONE]"
                    elif any("error" in e for e in events):
                        error = next(e["error"] for e in events if "error" in e)
                        clean = isinstance(error, dict) and set(error) == ERROR_FIELDS
                        out["kind"], out["reason"] = (
                            ("refused" if clean else "lost"),
                            f"event {error.get('code')}",
                        )
                    else:
                        out["kind"] = "complete"
                else:
                    raw = await r.aread()
                    data = json.loads(raw)
                    if r.status_code == 200:
                        out["kind"] = "complete" if data.get("choices") else "lost"
                    else:
                        error = data.get("error") if isinstance(data, dict) else None
                        after = r.headers.get("retry-after", "")
                        clean = (
                            r.status_code in (429, 503)
                            and after.isdigit()
                            and isinstance(error, dict)
                            and set(error) == ERROR_FIELDS
                        )
                        out["kind"] = "refused" if clean else "lost"
                        out["retry_after"] = int(after) if after.isdigit() else None
                        out["reason"] = (
                            f"{r.status_code} {error.get('code') if isinstance(error, dict) else raw[:80]!r}"
                        )
    except TimeoutError:
        out["reason"] = f"no end within {bound_s:g} s"
    except (httpx.HTTPError, ValueError) as exc:
        out["reason"] = f"{type(exc).__name__}: {exc}"
    out["seconds"] = time.perf_counter() - t0
    return out


# ---- one level ---------------------------------------------------------------------------------------


async def level(up: Up, k: int, seconds: float, max_tokens: int, bound_s: float) -> dict:
    clients = k * CAPACITY
    outcomes: list[dict] = []
    samples: list[dict[str, int]] = []
    lags: list[float] = []  # this client's own event-loop lag: how late a 10 ms sleep wakes
    counter = iter(range(10**9))
    end = math.inf
    # Each client its own connection, kept alive, as separate callers would be (one shared pool of
    # 240 connections costs httpx more per request than the platform's answer), all made before
    # the clock starts: making one takes ~20 ms of this process (its SSL context), which inside
    # the level held the spike's first requests for seconds.
    own = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with contextlib.AsyncExitStack() as stack:
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=httpx.Timeout(bound_s)))
        callers = [
            await stack.enter_async_context(httpx.AsyncClient(timeout=httpx.Timeout(bound_s), limits=own))
            for _ in range(clients)
        ]
        before = memory(up.proc.pid)

        async def closed_loop(mine: httpx.AsyncClient) -> None:
            while time.monotonic() < end:
                out = await one(mine, up.base, next(counter), max_tokens, bound_s)
                outcomes.append(out)
                if out["kind"] == "refused" and out["retry_after"]:
                    await asyncio.sleep(min(out["retry_after"], max(0.0, end - time.monotonic())))

        async def sampler() -> None:
            while time.monotonic() < end:
                samples.append(memory(up.proc.pid))
                await asyncio.sleep(0.1)

        async def lag() -> None:
            while time.monotonic() < end:
                t = time.perf_counter()
                await asyncio.sleep(0.01)
                lags.append(time.perf_counter() - t - 0.01)

        t0 = time.perf_counter()
        end = time.monotonic() + seconds
        await asyncio.gather(*(closed_loop(c) for c in callers), sampler(), lag())
        wall = time.perf_counter() - t0
        # After: every client has its last answer, so nothing is held (recorded, to be sure).
        queued_after = await up.metric(client, "stoker_queue_length", deployment="bench")
        await asyncio.sleep(1.0)
        after = memory(up.proc.pid)
    return {
        "level": k,
        "clients": clients,
        "wall_s": wall,
        "outcomes": outcomes,
        "client_lag_p99_s": pct(lags, 99),
        "queued_after": queued_after,
        "memory": {
            "before": before,
            "peak": {"up": max(s["up"] for s in samples), "tree": max(s["tree"] for s in samples)},
            "after": after,
            "samples": len(samples),
        },
    }


def summary(run: dict, max_queued: int) -> dict:
    out = run["outcomes"]
    complete = [o for o in out if o["kind"] == "complete"]
    refused = [o for o in out if o["kind"] == "refused"]
    lost = [o for o in out if o["kind"] == "lost"]
    ttft = [o["ttft"] for o in complete if o["ttft"] is not None]
    total = [o["seconds"] for o in complete]
    refusal = [o["seconds"] for o in refused]
    reasons: dict[str, int] = {}
    for o in refused + lost:
        reasons[o["reason"]] = reasons.get(o["reason"], 0) + 1
    # One request's service time: a stream's total less its TTFT (its wait, and a prefill of a few
    # tokens); an admitted request takes at most ceil(Q / CAPACITY) + 1 of them (the module doc).
    service = [o["seconds"] - o["ttft"] for o in complete if o["ttft"] is not None]
    service_p99 = pct(service, 99)
    bound = (math.ceil(max_queued / CAPACITY) + 1) * service_p99 if service_p99 else None
    return {
        "level": run["level"],
        "clients": run["clients"],
        "requests": len(out),
        "complete": len(complete),
        "refused": len(refused),
        "lost": len(lost),
        "refusal_rate": len(refused) / len(out) if out else None,
        "admitted_per_s": len(complete) / run["wall_s"],
        "service_p50_s": pct(service, 50),
        "service_p99_s": service_p99,
        "bound_s": bound,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "ttft_max_s": max(ttft, default=None),
        "total_p50_s": pct(total, 50),
        "total_p99_s": pct(total, 99),
        "total_max_s": max(total, default=None),
        "refusal_p50_s": pct(refusal, 50),
        "refusal_p99_s": pct(refusal, 99),
        "refusal_max_s": max(refusal, default=None),
        "reasons": reasons,
        "client_lag_p99_s": run["client_lag_p99_s"],
        "queued_after": run["queued_after"],
        "cpu_cores": run.get("cpu_cores"),
        # `stoker up`'s own CPU per request it answered or refused (the gateway, activator and pool)
        "up_cpu_ms_per_request": 1000 * run["cpu_cores"]["up"] * run["cpu_cores"]["wall_s"] / len(out)
        if run.get("cpu_cores") and out
        else None,
        "memory_mib": {
            when: {what: run["memory"][when][what] / MIB for what in ("up", "tree")}
            for when in ("before", "peak", "after")
        },
    }


def table(res: dict) -> str:
    rows = res["summary"]
    base = rows[0]
    seen: set[int] = set()
    names = []
    for r in rows:  # a level run twice shows whether anything grew with the requests served
        names.append(f"{r['level']}× ({r['clients']} clients{', again' if r['level'] in seen else ''})")
        seen.add(r["level"])
    head = "| offered | " + " | ".join(names) + " |"
    lines = [head, "|---" * (len(rows) + 1) + "|"]

    def row(name: str, cell) -> None:
        lines.append(f"| {name} | " + " | ".join(cell(r) for r in rows) + " |")

    def with_ratio(key: str):
        def cell(r: dict) -> str:
            if r is base:
                return fmt_s(r[key])
            return f"{fmt_s(r[key])} ({fmt_x(ratio(r[key], base[key]))})"

        return cell

    row("requests", lambda r: str(r["requests"]))
    row("complete / refused / lost", lambda r: f"{r['complete']} / {r['refused']} / {r['lost']}")
    row("refusal rate", lambda r: f"{r['refusal_rate']:.0%}" if r["refusal_rate"] is not None else "–")
    row("admitted / s", lambda r: f"{r['admitted_per_s']:.2f}")
    row(
        "service time S p50 / p99 (stream total − TTFT)",
        lambda r: f"{fmt_s(r['service_p50_s'])} / {fmt_s(r['service_p99_s'])}",
    )
    for key, name in (
        ("ttft_p50_s", "admitted stream TTFT p50"),
        ("ttft_p99_s", "admitted stream TTFT p99"),
        ("total_p50_s", "admitted total p50"),
        ("total_p99_s", "admitted total p99"),
    ):
        row(name, with_ratio(key))
    row("admitted total max", with_ratio("total_max_s"))
    bound = res["bound_services"]
    row(
        f"bound ({bound} × S p99): admitted total p99 ÷ it",
        lambda r: f"{fmt_s(r['bound_s'])}: {fmt_x(ratio(r['total_p99_s'], r['bound_s']))}",
    )
    hold = res["hold_deadline_s"]

    def held(r: dict) -> str:
        # Held no longer than the hold deadline, then its first token: within it plus one S p99.
        within = r["ttft_max_s"] is None or r["ttft_max_s"] <= hold + (r["service_p99_s"] or 0.0)
        return f"{fmt_s(r['ttft_max_s'])}: {'yes' if within else 'no'}"

    row(f"stream TTFT max, within the hold deadline ({fmt_s(hold)}) + S p99", held)
    row(
        "refusal latency p50 / p99 / max",
        lambda r: " / ".join(fmt_s(r[k]) for k in ("refusal_p50_s", "refusal_p99_s", "refusal_max_s")),
    )
    row("the client's own event-loop lag p99", lambda r: fmt_s(r["client_lag_p99_s"]))
    row(
        "CPU cores: `stoker up` / engine / clients / other work",
        lambda r: " / ".join(f"{r['cpu_cores'][k]:.2f}" for k in ("up", "engine", "client", "others")),
    )
    row("`stoker up` CPU per request", lambda r: f"{r['up_cpu_ms_per_request']:.2f} ms")
    for what, label in (("up", "`stoker up` RSS"), ("tree", "tree RSS (engine included)")):
        row(
            f"{label} before / peak / after",
            lambda r, w=what: (
                " / ".join(f"{r['memory_mib'][when][w]:.0f}" for when in ("before", "peak", "after")) + " MiB"
            ),
        )
    lines.append("")
    lines.append(
        f"`{res['up']}`, one `--max 1` deployment of {CAPACITY} slots. An admitted request waits for at "
        f"most {res['max_queued']} ahead of it, served {CAPACITY} at a time, so it takes at most "
        f"ceil({res['max_queued']}/{CAPACITY}) + 1 = {bound} service times S (S measured at the same level), "
        f"and is never held past the hold deadline; {res['seconds']:.0f} s per "
        f"level, {res['max_tokens']} tokens per answer of {res['model']}, load average at start "
        f"{res['machine']['loadavg_start'][0]:.2f}."
    )
    return "\n".join(lines)


async def warm(up: Up, bound_s: float) -> None:
    async with httpx.AsyncClient(timeout=bound_s) as client:
        out = await one(client, up.base, 0, 4, bound_s)
        if out["kind"] != "complete":
            raise RuntimeError(f"the warm-up request was {out}:\n{up.tail()}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--levels", default="1,3,10,30,30", help="offered loads, in multiples of one instance's slots"
    )
    ap.add_argument("--seconds", type=float, default=30.0, help="load per level")
    ap.add_argument("--max-queued", type=int, default=2 * CAPACITY, help="stoker up --max-queued")
    ap.add_argument("--hold-deadline", default="60s", help="stoker up --hold-deadline")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--model",
        choices=("tiny", MODEL),
        default="tiny",
        help="the tests' tiny random model (default: what is measured is the platform, and it leaves the "
        "engine a fraction of the CPU), or SmolLM2-135M",
    )
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "overload.json")
    ap.add_argument(
        "--home", type=Path, default=Path("~/.cache/stoker-bench").expanduser(), help="STOKER_HOME"
    )
    args = ap.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    if levels[0] != 1:
        ap.error("--levels must start with 1 (the baseline)")
    signal.signal(signal.SIGTERM, _interrupt)
    env = {**os.environ, "STOKER_HOME": str(args.home)}
    model = args.model
    if model == MODEL:
        import_builtin_snapshot(args.home, MODEL)
    procs = Processes(stop_all_timeout=60.0)
    t0 = time.perf_counter()
    if not args.hold_deadline.rstrip("s").replace(".", "", 1).isdigit():
        ap.error(f"--hold-deadline must be seconds, e.g. 60s, got {args.hold_deadline!r}")
    bound_s = float(args.hold_deadline.rstrip("s")) + 60.0
    up_args = [
        "--max-queued",
        str(args.max_queued),
        "--hold-deadline",
        args.hold_deadline,
        "--warm-runtimes",
        "0",
    ]
    results: dict = {
        "machine": machine_info(("torch", "transformers")),
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv),
        "up": "stoker up " + shlex.join(up_args),
        "hold_deadline_s": float(args.hold_deadline.rstrip("s")),
        "seconds": args.seconds,
        "max_queued": args.max_queued,
        "max_tokens": args.max_tokens,
        "model": "the tiny model (tests/conftest.py)" if model == "tiny" else MODEL,
        "capacity": CAPACITY,
        "bound_services": math.ceil(args.max_queued / CAPACITY) + 1,
        "runs": [],
    }
    try:
        with tempfile.TemporaryDirectory(prefix="stoker-overload-bench-") as tmp:
            if model == "tiny":
                sys.path.insert(0, str(REPO))
                from tests.conftest import build_tiny_model

                model = str(build_tiny_model(Path(tmp) / "tiny"))
            up = Up(procs, env, Path(tmp) / "up.log", up_args)
            up.cli("deploy", "bench", "--model", model, "--max", "1", "--idle-timeout", "600")
            asyncio.run(warm(up, bound_s))
            for k in levels:
                say(f"{k}×: {k * CAPACITY} clients for {args.seconds:.0f} s")
                before = cpu_sample(up.proc.pid)
                results["runs"].append(asyncio.run(level(up, k, args.seconds, args.max_tokens, bound_s)))
                results["runs"][-1]["cpu_cores"] = cpu_cores(before, cpu_sample(up.proc.pid))
                say(f"{k}×: {json.dumps(summary(results['runs'][-1], args.max_queued))}")
    finally:
        procs.stop_all()
    results["summary"] = [summary(r, args.max_queued) for r in results["runs"]]
    results["elapsed_s"] = time.perf_counter() - t0
    for r in results["runs"]:  # summarised above; keep the file small
        r["outcomes"] = len(r["outcomes"])
    write_results(args.out, results, table(results))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    print(json.dumps({"interrupted": True}), file=sys.stderr)
