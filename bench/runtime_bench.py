"""From zero to the first token through a warm runtime, against a fresh process start and against the
bare imports every fresh process pays, side by side in one interleaved run.

    python bench/runtime_bench.py [--rounds 5] [--out bench/results/runtime.json] [--home DIR]

The issue's goal: from zero to the first token through a warm runtime in at most half the time a
fresh `python -c "import torch, transformers"` takes on the same machine, in the same run.

Two platforms on the same snapshot store (`$HOME/snapshots`, default `~/.cache/stoker-bench`, the
SmolLM2 snapshot `stoker snapshot import --builtin smollm2`), each its own data dir:

    fresh     `stoker up --stable-window 1 --warm-runtimes 0`: a request at zero starts a fresh
              `stoker engine` process (interpreter, imports, weights, warm-up)
    runtime   `stoker up --stable-window 1 --warm-runtimes 1`: the start is handed to the warm runtime
              (imports done), which becomes the engine (weights, warm-up)
    imports   `python -c "import torch, transformers"` with Stoker's interpreter, wall time

Both deploy `smollm2 --model smollm2 --min-warm 0 --idle-timeout 3`. Each round measures the three
kinds in an order that rotates from round to round, each from a settled state: both deployments at
zero instances and the runtime platform's runtime ready (its imports done, nothing importing in the
background). The two request kinds send the same streamed chat (scale_bench.stream_chat: a ~20-token
message with a fresh opening, `max_tokens` 16, temperature 0) and time request sent → first content
chunk (TTFT), with the platform's cold-start phases for the start (`stoker_cold_start_seconds`:
process_start = spawn or handoff → serving minus the model load; model_load = weights + warm-up),
then the same request again on the READY instance: TTFT minus that is what the start itself added
(on a loaded machine, generating the first token is slow for every kind of start alike). Caveat:
the runtime platform's keeper starts the replacement runtime 10 s after the take
(`RuntimeKeeper.refill_delay_s`), which on 2 cores can fall on that second request and slow it.
Page cache warm (the snapshot was read by the previous starts). Reported: medians, the ratios
fresh / runtime and runtime / imports (goal ≤ 0.5); JSON to bench/results/runtime.json, the table
beside it (`.md`) and on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
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
    REPO,
    Processes,
    _interrupt,
    fmt_s,
    fmt_x,
    import_builtin_snapshot,
    machine_info,
    med,
    ratio,
    say,
    write_results,
)
from scale_bench import InstanceWatch, StokerUp, cold_split, stream_chat

MODEL = "smollm2"
KINDS = ("fresh", "runtime", "imports")
SETTLE_S = 300.0
IMPORTS = [sys.executable, "-c", "import torch, transformers"]


class Platform(StokerUp):
    """One `stoker up` (scale_bench's) on a free loopback port, its own data dir, the shared
    snapshot store, with `runtimes` warm runtimes, the model deployed at zero."""

    def __init__(self, procs: Processes, home: Path, store: Path, log: Path, runtimes: int) -> None:
        env = {
            **os.environ,
            "STOKER_HOME": str(home),
            "STOKER_SNAPSHOT_STORE": str(store),
            "HF_HUB_OFFLINE": "1",
        }
        super().__init__(procs, env, log)
        self.home, self.runtimes = home, runtimes
        self.watch = InstanceWatch(home)

    def start(self) -> None:
        super().start("--warm-runtimes", str(self.runtimes))
        self.cli("deploy", MODEL, "--model", MODEL, "--min-warm", "0", "--idle-timeout", "3")

    def settled(self) -> bool:
        """No instance of the deployment, and (with runtimes) every runtime ready."""
        self.watch.scan()
        if any(self.instances().values()):
            return False
        ready = self.metrics().get(("stoker_warm_runtimes", frozenset({("engine", "cpu")})), 0.0)
        return ready >= self.runtimes

    def settle(self) -> float:
        t0 = time.monotonic()
        deadline = t0 + SETTLE_S
        while not self.settled():
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.home.name}: not at zero with its runtimes ready within {SETTLE_S:.0f} s:\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.25)
        return time.monotonic() - t0

    def stop(self) -> None:
        super().stop()
        self.watch.scan()
        if left := self.watch.kill_leftovers():
            say(f"killed engine processes {self.home.name} left behind: {left}")


async def one_request(p: Platform) -> dict:
    before = p.metrics()
    async with httpx.AsyncClient(base_url=p.base, timeout=300.0) as client:
        stream = await stream_chat(client)
    sample = stream.summary()
    if sample["cold_start_header"] != "true":
        raise RuntimeError(f"{p.home.name}: the request was not a cold start: {sample}")
    sample |= cold_split(before, p.metrics())
    tiers = {"runtime": 0.0, "page_cache": 0.0, "disk": 0.0}
    after = p.metrics()
    for tier in tiers:
        key = ("stoker_instance_startup_seconds_count", frozenset({("deployment", MODEL), ("tier", tier)}))
        tiers[tier] = after.get(key, 0.0) - before.get(key, 0.0)
    sample["start_tier"] = next((t for t, n in tiers.items() if n), None)
    # The same request again on the READY instance: what a start adds is TTFT minus this.
    async with httpx.AsyncClient(base_url=p.base, timeout=300.0) as client:
        warm = (await stream_chat(client)).summary()
    sample["warm_ttft_s"], sample["warm_was_cold"] = warm["ttft_s"], warm["cold_start_header"] == "true"
    return sample


def imports_once() -> dict:
    t0 = time.perf_counter()
    subprocess.run(IMPORTS, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return {"wall_s": time.perf_counter() - t0}


def table(res: dict) -> str:
    s = res["summary"]
    rows = [
        "| kind | median (s) | samples (s) |",
        "|---|---|---|",
        *(
            f"| {k} | {fmt_s(s[k]['median_s'])} | {', '.join(fmt_s(x) for x in s[k]['samples_s'])} |"
            for k in KINDS
        ),
        "",
        f"fresh start TTFT / warm runtime TTFT: {fmt_x(s['fresh_over_runtime'])}; "
        f"warm runtime TTFT / bare imports: {fmt_x(s['runtime_over_imports'])} (goal ≤ 0.50: "
        f"{'met' if s['goal_met'] else 'not met'})",
        "",
        "| start | process_start | model_load | held (to READY) | TTFT on READY after | TTFT − that |",
        "|---|---|---|---|---|---|",
        *(
            f"| {k} | {fmt_s(s[k]['process_start_s'])} | {fmt_s(s[k]['model_load_s'])} | {fmt_s(s[k]['held_s'])}"
            f" | {fmt_s(s[k]['warm_ttft_s'])} | {fmt_s(s[k]['start_cost_s'])} |"
            for k in ("fresh", "runtime")
        ),
        "",
        f"what the warm runtime's start added to the first token / bare imports: "
        f"{fmt_x(s['runtime_start_cost_over_imports'])}; median 1-min load average during the run: "
        f"{s['load_1m']:.1f} on {os.cpu_count()} CPUs",
    ]
    return "\n".join(rows)


def summarize(samples: dict[str, list[dict]]) -> dict:
    out: dict = {}
    for kind in KINDS:
        key = "wall_s" if kind == "imports" else "ttft_s"
        xs = [x[key] for x in samples[kind]]
        out[kind] = {"median_s": med(xs), "samples_s": xs}
        if kind != "imports":
            for field in ("process_start_s", "model_load_s", "held_s", "warm_ttft_s"):
                out[kind][field] = med([x[field] for x in samples[kind]])
            # What the start itself added to the first token: its TTFT less a READY instance's.
            out[kind]["start_cost_s"] = med([x["ttft_s"] - x["warm_ttft_s"] for x in samples[kind]])
    out["fresh_over_runtime"] = ratio(out["fresh"]["median_s"], out["runtime"]["median_s"])
    out["runtime_over_imports"] = ratio(out["runtime"]["median_s"], out["imports"]["median_s"])
    out["goal_met"] = out["runtime_over_imports"] is not None and out["runtime_over_imports"] <= 0.5
    out["load_1m"] = med([x["load_1m"] for k in KINDS for x in samples[k]])
    out["runtime_start_cost_over_imports"] = ratio(out["runtime"]["start_cost_s"], out["imports"]["median_s"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--rounds", type=int, default=5, help="interleaved rounds (each measures every kind once)"
    )
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "runtime.json")
    ap.add_argument("--home", type=Path, default=Path("~/.cache/stoker-bench").expanduser(), help="its store")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    t_start = time.perf_counter()
    record = import_builtin_snapshot(args.home)
    results: dict = {
        "machine": machine_info(("torch", "transformers")),
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv),
        "snapshot": {"id": record.get("id"), "path": record.get("path")},
        "rounds": args.rounds,
    }
    procs = Processes(stop_all_timeout=60.0)
    samples: dict[str, list[dict]] = {k: [] for k in KINDS}
    with tempfile.TemporaryDirectory(prefix="stoker-runtime-bench-") as tmp:
        store = args.home / "snapshots"
        fresh = Platform(procs, Path(tmp) / "fresh", store, Path(tmp) / "fresh.log", runtimes=0)
        warm = Platform(procs, Path(tmp) / "runtime", store, Path(tmp) / "runtime.log", runtimes=1)
        platforms = {"fresh": fresh, "runtime": warm}
        try:
            for p in platforms.values():
                p.home.mkdir(parents=True)
                p.start()
            for rnd in range(args.rounds):
                order = KINDS[rnd % 3 :] + KINDS[: rnd % 3]
                for kind in order:
                    for p in platforms.values():  # nothing of this bench runs in the background
                        p.settle()
                    if kind == "imports":
                        sample = imports_once()
                    else:
                        sample = asyncio.run(one_request(platforms[kind]))
                        if kind == "runtime" and sample["start_tier"] != "runtime":
                            raise RuntimeError(
                                f"the runtime platform's start was not from its runtime: {sample}"
                            )
                    sample["load_1m"] = os.getloadavg()[0]  # a shared machine: what else ran
                    samples[kind].append(sample)
                    shown = sample.get("ttft_s", sample.get("wall_s"))
                    say(f"round {rnd + 1}/{args.rounds} {kind}: {shown:.2f} s")
        except Exception:
            for name, p in platforms.items():
                print(f"--- {name} stoker up log (tail) ---\n{p.log_tail()}", file=sys.stderr)
            raise
        finally:
            for p in platforms.values():
                p.stop()
            procs.stop_all()
    results["samples"] = samples
    results["summary"] = summarize(samples)
    results["elapsed_s"] = time.perf_counter() - t_start
    write_results(args.out, results, table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
