"""Many deployments on a few shared devices against a device each, in the fleet simulator.

    python bench/fleet_bench.py [--traces DIR] [--out bench/results/fleet.json] [--seed N]

Twelve deployments made from the two shared Azure traces (code: bursts and idle gaps; conv: steady),
each thinned (every 20th to every 2000th request: low-traffic endpoints of the same shapes) and
rotated in time by a different shift, so their busy spells fall at different times. Sizes: 8B-class
models (16 GB of weights + 8 GB of KV budget) and 14B-class (28 + 12 GB), on 80 GB devices; every
instance uses the simulator's GPU-class model (`warm_pool.profiles.GPU`: wake 1 s, fresh start
20-28 s) and a sleeping one keeps 0.75 GB on its device.

Runs `dedicated` (a device each, `kpa`: Knative's scaler, no sleeping tier) and `shared` on 2, 3 and
4 devices (each deployment's own policy, `predictive`), then searches the fewest shared devices
with no more slow cold starts (requests that waited for a fresh process) than dedicated. The goal
(issue 13): the fleet on a quarter of the dedicated device count, with no more slow cold starts
than dedicated kpa and p99 wait at most one wake time above it. Deterministic for a seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shlex
import sys
import time
from pathlib import Path

from common import REPO, say, write_results

from warm_pool.fleet_sim import ASLEEP_RESIDUAL, GB, FleetDeployment, rotate, simulate_fleet
from warm_pool.profiles import GPU
from warm_pool.trace import load_trace

TRACES = {"code": "azure-llm-code-2023-first29min.csv", "conv": "azure-llm-conv-2023-first29min.csv"}
DEVICE_GB = 80
SMALL, LARGE = (16, 8), (28, 12)  # (weights, KV) GB
# (trace, thin, size): six of each trace, thin from 20 to 2000, sizes alternating.
FLEET = [
    ("code", 20, SMALL), ("code", 50, LARGE), ("code", 100, SMALL), ("code", 200, LARGE),
    ("code", 500, SMALL), ("code", 2000, LARGE),
    ("conv", 20, LARGE), ("conv", 50, SMALL), ("conv", 100, LARGE), ("conv", 200, SMALL),
    ("conv", 500, LARGE), ("conv", 2000, SMALL),
]  # fmt: skip
SHIFT_STEP_S = 145.0  # deployment i is rotated by i × 145 s (the traces are ~1740 s long)
SHARED_DEVICES = (2, 3, 4)


def deployments(traces_dir: Path) -> list[FleetDeployment]:
    full = {name: load_trace(traces_dir / file) for name, file in TRACES.items()}
    out = []
    for i, (name, thin, (weights, kv)) in enumerate(FLEET):
        trace = rotate(full[name][::thin], i * SHIFT_STEP_S)
        out.append(FleetDeployment(f"{name}-x{thin}", trace, (weights + kv) * GB, ASLEEP_RESIDUAL))
    return out


def run(deps: list[FleetDeployment], mode: str, devices: int, seed: int) -> dict:
    started = time.perf_counter()
    report = simulate_fleet(
        deps, devices=devices, device_memory=DEVICE_GB * GB, mode=mode, model=GPU, seed=seed
    )
    row = {**report.summary(), "policy": ",".join(sorted({d.policy for d in report.deployments}))}
    row["evicted"] = sum(d.evicted for d in report.deployments)
    row["peak_used_gb"] = max(report.peak_used.values()) / GB
    row["elapsed_s"] = time.perf_counter() - started
    say(
        f"{mode} on {report.devices} devices: {row['slow_cold_starts']} slow cold starts, {row['elapsed_s']:.1f} s"
    )
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", type=Path, default=REPO.parent / "shared" / "traces")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "fleet.json")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    missing = [f for f in TRACES.values() if not (args.traces / f).is_file()]
    if missing:
        print(f"fleet_bench: {args.traces} lacks {', '.join(missing)} (see --traces)", file=sys.stderr)
        return 1
    started = time.perf_counter()
    deps = deployments(args.traces)
    kpa = [dataclasses.replace(d, policy="kpa") for d in deps]
    dedicated = run(kpa, "dedicated", len(kpa), args.seed)
    shared = {n: run(deps, "shared", n, args.seed) for n in SHARED_DEVICES}
    fewest = None
    for n in range(1, len(deps) + 1):
        row = shared.get(n) or run(deps, "shared", n, args.seed)
        shared[n] = row
        if row["slow_cold_starts"] <= dedicated["slow_cold_starts"]:
            fewest = n
            break
    quarter = math.ceil(len(deps) / 4)
    goal_row = shared.get(quarter) or run(deps, "shared", quarter, args.seed)
    shared[quarter] = goal_row
    goal = {
        "devices": quarter,
        "slow_cold_starts_ok": goal_row["slow_cold_starts"] <= dedicated["slow_cold_starts"],
        "p99_wait_ok": goal_row["p99_wait_s"] <= dedicated["p99_wait_s"] + GPU.startup.wake,
    }
    goal["met"] = goal["slow_cold_starts_ok"] and goal["p99_wait_ok"]
    results = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "seed": args.seed,
        "device_gb": DEVICE_GB,
        "model": dataclasses.asdict(GPU),
        "fleet": [
            {
                "name": d.name,
                "requests": len(d.trace),
                "awake_gb": d.awake_bytes / GB,
                "shift_s": i * SHIFT_STEP_S,
            }
            for i, d in enumerate(deps)
        ],
        "dedicated": dedicated,
        "shared": [shared[n] for n in sorted(shared)],
        "fewest_devices_no_more_slow_cold_starts": fewest,
        "goal": goal,
        "elapsed_s": time.perf_counter() - started,
    }
    write_results(args.out, results, table(results))
    return 0


def table(results: dict) -> str:
    lines = [
        "| mode | policy | devices | requests | rejected | slow cold starts | wakes | evicted | p99 wait | "
        "device-s (any awake) | peak devices in use | most GB reserved on a device |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in [results["dedicated"], *results["shared"]]:
        lines.append(
            f"| {r['mode']} | {r['policy']} | {r['devices']} | {r['requests']} | {r['rejected']} | "
            f"{r['slow_cold_starts']} | {r['wakes']} | {r['evicted']} | {r['p99_wait_s']:.2f} s | "
            f"{r['device_seconds']:.0f} | {r['peak_devices']} | {r['peak_used_gb']:.1f} |"
        )
    g = results["goal"]
    d = results["dedicated"]
    q = next(r for r in results["shared"] if r["devices"] == g["devices"])
    lines += [
        "",
        f"Fewest shared devices with no more slow cold starts than dedicated kpa "
        f"({d['slow_cold_starts']}): **{results['fewest_devices_no_more_slow_cold_starts']}** "
        f"(of {d['devices']} dedicated).",
        "",
        f"Goal (a quarter of the dedicated count, {g['devices']} devices; slow cold starts ≤ dedicated's "
        f"{d['slow_cold_starts']}; p99 wait ≤ dedicated's {d['p99_wait_s']:.2f} s + one wake, "
        f"{GPU.startup.wake:g} s): slow cold starts {q['slow_cold_starts']} "
        f"({'ok' if g['slow_cold_starts_ok'] else 'not met'}), p99 wait {q['p99_wait_s']:.2f} s "
        f"({'ok' if g['p99_wait_ok'] else 'not met'}): **{'met' if g['met'] else 'not met'}**.",
        "",
        "| deployment | requests | awake GB | dedicated: slow cold / p99 wait / device-s | "
        f"shared on {g['devices']}: slow cold / wakes / p99 wait / device-s |",
        "|---|---|---|---|---|",
    ]
    for f, a, b in zip(results["fleet"], d["deployments"], q["deployments"], strict=True):
        lines.append(
            f"| {f['name']} | {f['requests']} | {f['awake_gb']:g} | {a['slow_cold_starts']} / "
            f"{a['p99_wait_s']:.2f} s / {a['device_seconds']:.0f} | {b['slow_cold_starts']} / {b['wakes']} / "
            f"{b['p99_wait_s']:.2f} s / {b['device_seconds']:.0f} |"
        )
    lines += [
        "",
        f"Simulated (`warm_pool.fleet_sim`, seed {results['seed']}), {results['device_gb']} GB devices, the "
        "GPU-class instance model for every deployment (wake 1 s, page cache 20 s, disk 28 s; 16 requests "
        "per instance). Deployment `code-x50` is every 50th request of the code trace; deployment i is "
        f"rotated by i × {SHIFT_STEP_S:g} s. A slow cold start is a request that waited for a fresh "
        "process (not a wake). Device-s: the seconds each device had anything awake on it. Evicted: "
        "instances put to sleep (or stopped asleep) to make room for another deployment. "
        f"Command: `{results['command']}`.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
