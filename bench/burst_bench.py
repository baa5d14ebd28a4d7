"""A burst of cold starts across deployments: K deployments at zero hit at once, through the warm
runtime tier (each start takes the runtime its predecessor forked) against K fresh process starts,
side by side in one interleaved run.

    python bench/burst_bench.py [--rounds 3] [--bursts 1,2,4] [--out bench/results/burst.json]

The issue's goal: the first token of the K-th deployment within 1.5x of the first's for K = 4,
through the runtime tier.

Two platforms on the same snapshot store (`$HOME/snapshots`, default `~/.cache/stoker-bench`, the
SmolLM2 snapshot `stoker snapshot import --builtin smollm2`), each its own data dir, each with the
same four deployments of the model (`burst-0` … `burst-3`, `--min-warm 0 --idle-timeout 3`):

    fresh     `stoker up --warm-runtimes 0`: every start spawns a fresh `stoker engine` (interpreter,
              imports, weights)
    runtime   `stoker up --warm-runtimes 1`: the first start takes the warm runtime, which forks its
              successor before it becomes the engine; the next start takes that one, and so on

Each round, for each K and each platform in an order that rotates from round to round, from a
settled state (every deployment of both platforms at zero, the runtime platform's runtime ready),
K streamed chats (scale_bench.stream_chat, `max_tokens` 16, temperature 0) are sent at once, one to
each of K deployments; each is timed from the common send to its first content chunk. Reported per
K and platform: the first and the last (K-th) first token, their ratio, the runtime's K-th against
fresh's K-th, and the tier each start was counted in (`stoker_instance_startup_seconds_count`).
Caveat (2 cores): K engines load and prefill at once on two cores, so every start of a burst after
the second shares the CPU with the others whatever tier it starts from; the ratio says what the
tier saves of that. JSON to bench/results/burst.json, the table beside it (`.md`) and on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx
import runtime_bench
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
from scale_bench import StokerUp, stream_chat

MODEL = "smollm2"
DEPLOYMENTS = tuple(f"burst-{i}" for i in range(4))
KINDS = ("fresh", "runtime")
TIERS = ("runtime", "page_cache", "disk")
GOAL = 1.5


class Platform(runtime_bench.Platform):
    """runtime_bench's platform (one `stoker up`, its own data dir, the shared snapshot store,
    `runtimes` warm runtimes) with the four deployments at zero."""

    def start(self) -> None:
        StokerUp.start(self, "--warm-runtimes", str(self.runtimes))
        for name in DEPLOYMENTS:
            self.cli("deploy", name, "--model", MODEL, "--min-warm", "0", "--idle-timeout", "3")

    def settled(self) -> bool:
        """No instance of any of the deployments, and (with runtimes) every runtime ready."""
        self.watch.scan()
        listed = json.loads(self.cli("ls", "--json").stdout)
        if any(any(d["instances"].values()) for d in listed if d["name"] in DEPLOYMENTS):
            return False
        ready = self.metrics().get(("stoker_warm_runtimes", frozenset({("engine", "cpu")})), 0.0)
        return ready >= self.runtimes

    def tiers(self) -> dict[str, float]:
        m = self.metrics()
        name = "stoker_instance_startup_seconds_count"
        return {
            t: sum(m.get((name, frozenset({("deployment", d), ("tier", t)})), 0.0) for d in DEPLOYMENTS)
            for t in TIERS
        }


async def burst(p: Platform, k: int) -> dict:
    before = p.tiers()
    sent = time.perf_counter()
    async with httpx.AsyncClient(base_url=p.base, timeout=600.0) as client:
        streams = await asyncio.gather(*(stream_chat(client, sent, model=DEPLOYMENTS[i]) for i in range(k)))
    summaries = [s.summary() for s in streams]
    if any(s["cold_start_header"] != "true" for s in summaries):
        raise RuntimeError(f"{p.home.name}: a request of the burst was not a cold start: {summaries}")
    ttfts = sorted(s["ttft_s"] for s in summaries)
    after = p.tiers()
    return {
        "ttft_s": ttfts,
        "first_s": ttfts[0],
        "last_s": ttfts[-1],
        "tiers": {t: after[t] - before[t] for t in TIERS},
    }


def summarize(samples: dict, bursts: list[int]) -> dict:
    out: dict = {}
    for k in bursts:
        row: dict = {}
        for kind in KINDS:
            xs = samples[str(k)][kind]
            row[kind] = {
                "first_s": med([x["first_s"] for x in xs]),
                "last_s": med([x["last_s"] for x in xs]),
                "last_over_first": med([x["last_s"] / x["first_s"] for x in xs]),
                "tiers": {t: sum(x["tiers"][t] for x in xs) for t in TIERS},
            }
        row["runtime_last_over_fresh_last"] = ratio(row["runtime"]["last_s"], row["fresh"]["last_s"])
        row["runtime_last_over_runtime_first"] = ratio(row["runtime"]["last_s"], row["runtime"]["first_s"])
        out[str(k)] = row
    top = str(max(bursts))
    out["goal"] = f"K={top}: runtime K-th first token within {GOAL}x of the first"
    out["goal_met"] = out[top]["runtime"]["last_over_first"] <= GOAL
    out["load_1m"] = med([x["load_1m"] for k in bursts for kind in KINDS for x in samples[str(k)][kind]])
    return out


def table(res: dict) -> str:
    s, bursts = res["summary"], res["bursts"]
    rows = [
        "| K | start | first token, 1st (s) | first token, K-th (s) | K-th / 1st | starts by tier |",
        "|---|---|---|---|---|---|",
    ]
    for k in bursts:
        for kind in KINDS:
            r = s[str(k)][kind]
            tiers = ", ".join(f"{t} {n:g}" for t, n in r["tiers"].items() if n)
            rows.append(
                f"| {k} | {kind} | {fmt_s(r['first_s'])} | {fmt_s(r['last_s'])} | "
                f"{fmt_x(r['last_over_first'])} | {tiers} |"
            )
    rows += [
        "",
        "runtime K-th / fresh K-th: "
        + ", ".join(f"K={k} {fmt_x(s[str(k)]['runtime_last_over_fresh_last'])}" for k in bursts),
        "",
        f"{s['goal']}: {'met' if s['goal_met'] else 'not met'}; median 1-min load average during the "
        f"run: {s['load_1m']:.1f} on {os.cpu_count()} CPUs; {res['rounds']} rounds, medians",
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds (each measures every K and kind)"
    )
    ap.add_argument("--bursts", default="1,2,4", help="the Ks, comma-separated, each at most 4")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "burst.json")
    ap.add_argument("--home", type=Path, default=Path("~/.cache/stoker-bench").expanduser(), help="its store")
    args = ap.parse_args(argv)
    bursts = [int(x) for x in args.bursts.split(",")]
    if not bursts or not all(1 <= k <= len(DEPLOYMENTS) for k in bursts):
        ap.error(f"--bursts takes Ks of 1..{len(DEPLOYMENTS)}")
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    t_start = time.perf_counter()
    record = import_builtin_snapshot(args.home)
    results: dict = {
        "machine": machine_info(("torch", "transformers")),
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv),
        "snapshot": {"id": record.get("id"), "path": record.get("path")},
        "rounds": args.rounds,
        "bursts": bursts,
    }
    procs = Processes(stop_all_timeout=60.0)
    samples: dict = {str(k): {kind: [] for kind in KINDS} for k in bursts}
    with tempfile.TemporaryDirectory(prefix="stoker-burst-bench-") as tmp:
        store = args.home / "snapshots"
        platforms = {
            "fresh": Platform(procs, Path(tmp) / "fresh", store, Path(tmp) / "fresh.log", runtimes=0),
            "runtime": Platform(procs, Path(tmp) / "runtime", store, Path(tmp) / "runtime.log", runtimes=1),
        }
        try:
            for p in platforms.values():
                p.home.mkdir(parents=True)
                p.start()
            for rnd in range(args.rounds):
                for k in bursts:
                    order = KINDS if (rnd + k) % 2 == 0 else KINDS[::-1]
                    for kind in order:
                        for p in platforms.values():  # nothing of this bench runs in the background
                            p.settle()
                        sample = asyncio.run(burst(platforms[kind], k))
                        sample["load_1m"] = os.getloadavg()[0]
                        samples[str(k)][kind].append(sample)
                        say(
                            f"round {rnd + 1}/{args.rounds} K={k} {kind}: first {sample['first_s']:.2f} s, "
                            f"K-th {sample['last_s']:.2f} s, tiers {sample['tiers']}"
                        )
        except Exception:
            for name, p in platforms.items():
                print(f"--- {name} stoker up log (tail) ---\n{p.log_tail()}", file=sys.stderr)
            raise
        finally:
            for p in platforms.values():
                p.stop()
            procs.stop_all()
    results["samples"] = samples
    results["summary"] = summarize(samples, bursts)
    results["elapsed_s"] = time.perf_counter() - t_start
    write_results(args.out, results, table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
