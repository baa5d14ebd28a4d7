"""Compare the autoscaling policies on the shared Azure traces, in the simulator.

    python bench/policy_bench.py [--traces DIR] [--out bench/results/policies.json] [--seed N]

All four policies (kpa, keepalive, histogram, predictive) on both traces (code: bursts and idle
gaps; conv: steady and rising), each whole and thinned (every 50th and every 500th request: the
same shapes as low-traffic endpoints), with the simulator's GPU-class instance model and prices
(`warm_pool.profiles.GPU`, `warm_pool.simulate.Prices`), max 16 instances, target concurrency 16 per instance.
Writes the JSON, a markdown table (`.md`), a scatter of cold-start share against GPU-seconds per
trace (`.png`) and the code trace's run over time (`policies_timeline.png`).

The target (issue 5): predictive has at most half of kpa's cold-start share with no more
GPU-seconds on every trace, and is dominated by neither keepalive nor histogram on any (dominated:
the other is no worse on both cold-start share and GPU-seconds, and better on one). GPU-seconds are
judged twice: READY only (the issue's definition), and READY + starting (both hold a GPU).
The verdict table says where the target is met and where not. Deterministic for a seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from common import REPO, say, write_results

from stoker.cli.simulate import plot_timelines
from warm_pool.policies import make_policy
from warm_pool.policies.base import ScalingConfig
from warm_pool.profiles import GPU
from warm_pool.simulate import Prices, simulate
from warm_pool.trace import load_trace

POLICIES = ("kpa", "keepalive", "histogram", "predictive")
TRACES = {"code": "azure-llm-code-2023-first29min.csv", "conv": "azure-llm-conv-2023-first29min.csv"}
THINS = (1, 50, 500)
SCALING = ScalingConfig(max=16, target_concurrency=GPU.concurrency)


def run_all(traces_dir: Path, seed: int) -> tuple[list[dict], dict]:
    rows, timelines = [], {}
    for name, file in TRACES.items():
        for thin in THINS:
            trace = load_trace(traces_dir / file, thin=thin)
            reports = [
                simulate(trace, make_policy(p, SCALING), scaling=SCALING, model=GPU, seed=seed)
                for p in POLICIES
            ]
            say(f"{name} thin {thin}: {len(trace)} requests")
            for report in reports:
                rows.append({"trace": name, "thin": thin, **report.summary()})
            if thin == 1:
                timelines[name] = reports
    return rows, timelines


def dominates(a: dict, b: dict, gpu) -> bool:
    """a is no worse than b on cold-start share and GPU-seconds, and better on one."""
    no_worse = a["cold_start_share"] <= b["cold_start_share"] and gpu(a) <= gpu(b)
    return no_worse and (a["cold_start_share"] < b["cold_start_share"] or gpu(a) < gpu(b))


def verdicts(rows: list[dict]) -> list[dict]:
    out = []
    ready = lambda r: r["gpu_seconds"]  # noqa: E731
    held = lambda r: r["gpu_seconds"] + r["starting_seconds"]  # noqa: E731
    for name in TRACES:
        for thin in THINS:
            by = {r["policy"]: r for r in rows if r["trace"] == name and r["thin"] == thin}
            ours, kpa = by["predictive"], by["kpa"]
            out.append(
                {
                    "trace": name,
                    "thin": thin,
                    "cold_vs_kpa": ours["cold_start_share"] / kpa["cold_start_share"]
                    if kpa["cold_start_share"]
                    else None,
                    "half_of_kpa_cold": ours["cold_start_share"] <= kpa["cold_start_share"] / 2,
                    "gpu_vs_kpa": ready(ours) / ready(kpa),
                    "gpu_held_vs_kpa": held(ours) / held(kpa),
                    "dominated_by": sorted(
                        p for p in ("keepalive", "histogram") if dominates(by[p], ours, ready)
                    ),
                    "dominated_by_held": sorted(
                        p for p in ("keepalive", "histogram") if dominates(by[p], ours, held)
                    ),
                }
            )
    return out


def table(results: dict) -> str:
    lines = [
        "| trace | policy | requests | rejected | cold starts (wakes) | cold share | p50 / p99 wait | p99 TTFT "
        "| GPU s (READY) | starting s | sleep s | $ / 1k requests |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["runs"]:
        label = r["trace"] if r["thin"] == 1 else f"{r['trace']} thin {r['thin']}"
        lines.append(
            f"| {label} | {r['policy']} | {r['requests']} | {r['rejected']} | {r['cold_starts']} "
            f"({r['cold_from_wake']}) | {r['cold_start_share']:.2%} | {r['p50_wait_s']:.2f} / "
            f"{r['p99_wait_s']:.2f} s | {r['p99_ttft_s']:.2f} s | {r['gpu_seconds']:.0f} | "
            f"{r['starting_seconds']:.0f} | {r['sleep_seconds']:.0f} | {r['cost_per_1k_requests']:.3f} |"
        )
    lines += [
        "",
        "| trace | predictive cold share ÷ kpa's | ≤ ½? | GPU s ÷ kpa's (READY; + starting) "
        "| dominated by (READY; + starting) |",
        "|---|---|---|---|---|",
    ]
    for v in results["verdicts"]:
        label = v["trace"] if v["thin"] == 1 else f"{v['trace']} thin {v['thin']}"
        ratio = "–" if v["cold_vs_kpa"] is None else f"{v['cold_vs_kpa']:.2f}"
        dom = ", ".join(v["dominated_by"]) or "none"
        dom_held = ", ".join(v["dominated_by_held"]) or "none"
        lines.append(
            f"| {label} | {ratio} | {'yes' if v['half_of_kpa_cold'] else 'no'} | "
            f"{v['gpu_vs_kpa']:.2f}; {v['gpu_held_vs_kpa']:.2f} | {dom}; {dom_held} |"
        )
    m = results["model"]
    lines += [
        "",
        f"Simulated (`stoker simulate`, seed {results['seed']}), GPU-class instance model: start-up "
        f"wake {m['startup']['wake']:g} s, page cache {m['startup']['page_cache']:g} s, disk "
        f"{m['startup']['disk']:g} s, object storage {m['startup']['object_storage']:g} s (snapshot on "
        f"disk at t=0); prefill {m['prefill_tps']:g} tokens/s, decode {m['decode_tps']:g} tokens/s per stream, "
        f"{m['concurrency']} requests per instance (the target concurrency; kpa and predictive aim at 70 % of "
        f"it), at most {SCALING.max} instances; queue {m['max_queue']}, deadline {m['deadline_s']:g} s. "
        f"Prices ${results['prices']['gpu_per_hour']:.2f} per GPU-hour (READY and starting), "
        f"${results['prices']['sleep_per_hour']:.2f} per sleeping-instance-hour. A cold start is a request "
        "served by an instance that started or woke after it arrived (wakes in brackets). Thinned: every "
        "50th / 500th request of the same trace. Every run starts at zero instances, so the first start "
        "is a cold start for every policy.",
    ]
    return "\n".join(lines)


def scatter(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(TRACES), len(THINS), figsize=(13, 7))
    for i, name in enumerate(TRACES):
        for j, thin in enumerate(THINS):
            ax = axes[i][j]
            for r in (r for r in rows if r["trace"] == name and r["thin"] == thin):
                ax.scatter(r["gpu_seconds"], r["cold_start_share"] * 100, s=40)
                ax.annotate(r["policy"], (r["gpu_seconds"], r["cold_start_share"] * 100), fontsize=8,
                            xytext=(4, 3), textcoords="offset points")  # fmt: skip
            ax.set_title(f"{name}" + ("" if thin == 1 else f", every {thin}th request"), fontsize=10)
            ax.set_xlabel("GPU-seconds (READY)", fontsize=8)
            ax.set_ylabel("cold-start share, %", fontsize=8)
            ax.set_xlim(left=0)
            ax.set_ylim(bottom=0)
    fig.suptitle(
        "Autoscaling policies on the Azure LLM traces (simulated, GPU-class model): lower left is better"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", type=Path, default=REPO.parent / "shared" / "traces")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "policies.json")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    missing = [f for f in TRACES.values() if not (args.traces / f).is_file()]
    if missing:
        print(f"policy_bench: {args.traces} lacks {', '.join(missing)} (see --traces)", file=sys.stderr)
        return 1
    started = time.perf_counter()
    rows, timelines = run_all(args.traces, args.seed)
    results = {
        "seed": args.seed,
        "model": dataclasses.asdict(GPU),
        "prices": dataclasses.asdict(Prices()),
        "scaling": dataclasses.asdict(SCALING),
        "runs": rows,
        "verdicts": verdicts(rows),
        "elapsed_s": time.perf_counter() - started,
    }
    write_results(args.out, results, table(results))
    scatter(rows, args.out.with_suffix(".png"))
    plot_timelines(
        timelines["code"],
        args.out.with_name("policies_timeline.png"),
        "azure-llm-code-2023-first29min.csv (whole, GPU-class model)",
    )
    say(f"wrote {args.out.with_suffix('.png')} and {args.out.with_name('policies_timeline.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
