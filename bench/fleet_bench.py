"""Many deployments on 3 shared devices against a device each, in the fleet simulator: a quarter,
a sixth and an eighth of the dedicated device count, in one run.

    python bench/fleet_bench.py [--out bench/results/fleet.json] [--seed N] [--only quarter,...]

The fleets are the files `stoker simulate --fleet` reads (bench/fleets/quarter.yaml, sixth.yaml,
eighth.yaml; each names its deployments, traces, thinning, shifts and sizes), loaded by the CLI's
own loader (`stoker.cli.fleet.load_fleet`), so `stoker simulate --fleet bench/fleets/eighth.yaml
--baseline dedicated` prints the same figures as the eighth's rows here. The quarter is twelve
low-traffic endpoints cut from the two shared Azure traces (code: bursts and idle gaps; conv:
steady), each thinned (every 20th to every 2000th request) and rotated by a different shift, 8B-
and 14B-class sizes alternating (16 + 8 GB and 28 + 12 GB of weights + KV budget) on 80 GB devices.
The sixth and the eighth are the same twelve cycled to 18 and 24, thinned 1.5 and 2 times more:
about the same total traffic over more, quieter endpoints. Every instance uses the simulator's
GPU-class model (`warm_pool.profiles.GPU`: wake 1 s, fresh start 20-28 s); a sleeping one keeps
0.75 GB on its device.

For each fleet: `dedicated` (a device each, `kpa`: Knative's scaler, no sleeping tier) and `shared`
on 3 devices (each deployment's own policy, `predictive`, through the fleet arbiter). The goal
(issues 13 and 28): no more slow cold starts (requests that waited for a fresh process) than
dedicated, and p99 wait at most an allowance above dedicated's: one wake (1 s) for the quarter, two
(2 s) for the eighth, and 1.5 s between them for the sixth. Deterministic for a seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from pathlib import Path

from common import REPO, say, write_results

from stoker.cli.fleet import load_fleet
from stoker.errors import CLIError
from warm_pool.fleet_sim import ASLEEP_RESIDUAL, GB, simulate_fleet
from warm_pool.profiles import GPU

FLEETS = REPO / "bench" / "fleets"
# (name, file, the p99 wait allowed above dedicated's, in wakes)
RATIOS = (("quarter", "quarter.yaml", 1.0), ("sixth", "sixth.yaml", 1.5), ("eighth", "eighth.yaml", 2.0))


def run(deps: list, mode: str, devices: int, memory: int, seed: int) -> dict:
    started = time.perf_counter()
    report = simulate_fleet(deps, devices=devices, device_memory=memory, mode=mode, model=GPU, seed=seed)
    row = {**report.summary(), "policy": ",".join(sorted({d.policy for d in report.deployments}))}
    row["evicted"] = sum(d.evicted for d in report.deployments)
    row["peak_used_gb"] = max(report.peak_used.values()) / GB
    row["elapsed_s"] = time.perf_counter() - started
    say(
        f"{mode} on {report.devices} devices ({len(deps)} deployments): {row['slow_cold_starts']} slow "
        f"cold starts, p99 wait {row['p99_wait_s']:.2f} s, {row['elapsed_s']:.1f} s"
    )
    return row


def ratio(name: str, path: Path, allowance: float, seed: int) -> dict:
    fleet = load_fleet(path, asleep_bytes=ASLEEP_RESIDUAL)
    deps, memory = fleet["deployments"], fleet["memory"]
    kpa = [dataclasses.replace(d, policy="kpa") for d in deps]
    dedicated = run(kpa, "dedicated", len(kpa), memory, seed)
    shared = run(deps, "shared", fleet["devices"], memory, seed)
    allowed = allowance * GPU.startup.wake
    goal = {
        "slow_cold_starts_ok": shared["slow_cold_starts"] <= dedicated["slow_cold_starts"],
        "p99_wait_ok": shared["p99_wait_s"] <= dedicated["p99_wait_s"] + allowed,
        "p99_allowance_s": allowed,
    }
    goal["met"] = goal["slow_cold_starts_ok"] and goal["p99_wait_ok"]
    return {
        "name": name,
        "file": str(path.relative_to(REPO)),
        "deployments": len(deps),
        "devices": fleet["devices"],
        "device_gb": memory / GB,
        "fleet": [{"name": d.name, "requests": len(d.trace), "awake_gb": d.awake_bytes / GB} for d in deps],
        "dedicated": dedicated,
        "shared": shared,
        "goal": goal,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "fleet.json")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--only", default="", help="comma-separated ratios to run (quarter, sixth, eighth; default all)"
    )
    args = ap.parse_args()
    wanted = [r for r in args.only.split(",") if r]
    unknown = sorted(set(wanted) - {name for name, _, _ in RATIOS})
    if unknown:
        print(f"fleet_bench: unknown ratio {unknown[0]} (quarter, sixth, eighth)", file=sys.stderr)
        return 2
    started = time.perf_counter()
    rows = []
    for name, file, allowance in RATIOS:
        if wanted and name not in wanted:
            continue
        try:
            rows.append(ratio(name, FLEETS / file, allowance, args.seed))
        except CLIError as exc:  # a trace missing beside the repository, say
            print(f"fleet_bench: {exc}", file=sys.stderr)
            return 1
    results = {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "seed": args.seed,
        "model": dataclasses.asdict(GPU),
        "ratios": rows,
        "elapsed_s": time.perf_counter() - started,
    }
    write_results(args.out, results, table(results))
    return 0


def table(results: dict) -> str:
    lines = [
        "| fleet | deployments | mode | policy | devices | requests | rejected | slow cold starts | wakes | "
        "evicted | p99 wait | device-s (any awake) | peak devices in use | most GB reserved on a device |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["ratios"]:
        for row in (r["dedicated"], r["shared"]):
            lines.append(
                f"| {r['name']} | {r['deployments']} | {row['mode']} | {row['policy']} | {row['devices']} | "
                f"{row['requests']} | {row['rejected']} | {row['slow_cold_starts']} | {row['wakes']} | "
                f"{row['evicted']} | {row['p99_wait_s']:.2f} s | {row['device_seconds']:.0f} | "
                f"{row['peak_devices']} | {row['peak_used_gb']:.1f} |"
            )
    lines += [
        "",
        "| fleet | slow cold starts, shared ≤ dedicated | p99 wait, shared ≤ dedicated + allowance | goal |",
    ]
    lines.append("|---|---|---|---|")
    for r in results["ratios"]:
        d, s, g = r["dedicated"], r["shared"], r["goal"]
        lines.append(
            f"| {r['name']} ({r['deployments']} on {r['devices']}) | {s['slow_cold_starts']} ≤ "
            f"{d['slow_cold_starts']}: {'ok' if g['slow_cold_starts_ok'] else 'not met'} | "
            f"{s['p99_wait_s']:.2f} s ≤ {d['p99_wait_s']:.2f} + {g['p99_allowance_s']:g} s: "
            f"{'ok' if g['p99_wait_ok'] else 'not met'} | **{'met' if g['met'] else 'not met'}** |"
        )
    lines += [
        "",
        f"Simulated (`warm_pool.fleet_sim`, seed {results['seed']}), 80 GB devices, the GPU-class instance "
        "model for every deployment (wake 1 s, page cache 20 s, disk 28 s; 16 requests per instance). "
        "Fleets: bench/fleets/quarter.yaml, sixth.yaml, eighth.yaml (deployment `code-x50` is every 50th "
        "request of the code trace). A slow cold start is a request that waited for a fresh process (not "
        "a wake). Device-s: the seconds each device had anything awake on it. Evicted: instances put to "
        "sleep (or stopped asleep) to make room for another deployment. "
        f"Command: `{results['command']}`.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
