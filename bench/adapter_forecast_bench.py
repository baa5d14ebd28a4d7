"""Each adapter's own forecast on its base, against the base forecasting only their sum, in the
fleet simulator: side by side on the same requests.

    python bench/adapter_forecast_bench.py [--traces DIR] [--hours 4] [--seed N] [--out bench/results/adapter_forecast.json]

The users: internal apps whose fine-tunes are called by schedules (an evaluation every 7 minutes, a
digest every 15), each a burst of 1-3 requests, every period ± 2 %, plus, in one scenario, an
adapter called at random (Poisson, one request per 5 minutes on average). Request sizes are drawn
from the shared Azure code trace (`--traces`). One base on one 80 GB device with the GPU-class
instance model (`warm_pool.profiles.GPU`: wake 1 s, fresh start 20-28 s, adapter load 0.25 s), the
default policy (`predictive`), four adapters kept per instance. Each scenario runs twice:

    sum        the base's policy sees only the sum of its adapters' traffic (no adapter named to it:
               `simulate_adapters(..., forecast=False)`)
    forecast   each request names its adapter to the base's tracker, and the policy forecasts each
               adapter on its own (`warm_pool.policies.adapter_forecast`): the base READY for an
               adapter's expected request, the adapter loaded ahead

plus the 200-adapter cut of docs/benchmarks/scaling.md ("Adapters against merged models") both ways,
where 100 adapters share each base and instances load an adapter every few seconds: there the
forecast must change nothing (no load ahead while the LRUs turn over; the bases never idle).

Reported per scenario and side: requests, slow cold starts (a request served by an instance started,
not woken, after it arrived) in all and after learning (from 6 of the longest period on, when every
scheduled adapter has the 5 gaps its window needs), requests that waited for an adapter load, loads made ahead, p99 wait,
device-seconds; and the ratios forecast / sum. Deterministic for a seed; JSON and a table.
"""

from __future__ import annotations

import argparse
import random
import shlex
import sys
import time
from pathlib import Path

from common import REPO, say, write_results

from warm_pool.adapter_sim import Adapter, Base, simulate_adapters
from warm_pool.fleet_sim import GB
from warm_pool.profiles import GPU
from warm_pool.trace import TraceRequest, load_trace

CODE = "azure-llm-code-2023-first29min.csv"
# An adapter's window needs 5 gaps (`HistogramConfig.min_samples`): after 6 of the longest period,
# every scheduled adapter has had them. Slow cold starts from then on are counted apart.
LEARNING_PERIODS = 6
DEVICE_GB = 80
BASE_GB = 24  # 16 GB of weights + 8 GB of KV budget, as the fleet files' 8B-class endpoints
SCENARIOS = {
    # name: (periods of the scheduled adapters in seconds, random adapter's mean gap or None)
    "3 schedules (7, 10, 15 min)": ((420.0, 600.0, 900.0), None),
    "3 schedules + 1 random (5 min)": ((420.0, 600.0, 900.0), 300.0),
    "6 schedules (10 to 25 min)": ((600.0, 900.0, 1200.0, 1500.0, 600.0, 900.0), None),
    "1 schedule (15 min)": ((900.0,), None),
}


def scheduled(rows, periods, random_gap_s, hours: float, seed: int) -> list[Adapter]:
    rnd, end, out = random.Random(seed), hours * 3600.0, []
    for k, period in enumerate(periods):
        t, reqs = rnd.uniform(0.0, period), []
        while t < end:
            for j in range(rnd.randint(1, 3)):
                row = rnd.choice(rows)
                reqs.append(
                    TraceRequest(t + j * rnd.uniform(0.0, 1.0), row.context_tokens, row.generated_tokens)
                )
            t += period * rnd.uniform(0.98, 1.02)
        out.append(Adapter(f"job-{k}", "base-0", tuple(sorted(reqs, key=lambda r: r.t))))
    if random_gap_s is not None:
        t, reqs = 0.0, []
        while (t := t + rnd.expovariate(1.0 / random_gap_s)) < end:
            row = rnd.choice(rows)
            reqs.append(TraceRequest(t, row.context_tokens, row.generated_tokens))
        out.append(Adapter("random", "base-0", tuple(reqs)))
    return out


def side(adapters, bases, devices: int, seed: int, forecast: bool, learnt_at: float) -> dict:
    started = time.perf_counter()
    r = simulate_adapters(
        adapters,
        bases,
        devices=devices,
        device_memory=DEVICE_GB * GB,
        model=GPU,
        seed=seed,
        forecast=forecast,
    )
    f = r.fleet
    return {
        "requests": f.requests,
        "rejected": f.rejected,
        "slow_cold_starts": f.slow_cold_starts,
        "slow_cold_starts_after_learning": sum(1 for t in r.slow_at if t >= learnt_at),
        "paid_loads": r.paid_loads,
        "prefetched": r.prefetched,
        "adapter_loads": r.adapter_loads,
        "p99_wait_s": f.p99_wait_s,
        "device_seconds": f.device_seconds,
        "elapsed_s": time.perf_counter() - started,
    }


def ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", type=Path, default=REPO.parent / "shared" / "traces")
    ap.add_argument("--hours", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "adapter_forecast.json")
    args = ap.parse_args()
    if not (args.traces / CODE).is_file():
        print(f"adapter_forecast_bench: {args.traces} lacks {CODE} (see --traces)", file=sys.stderr)
        return 1
    started = time.perf_counter()
    rows = load_trace(args.traces / CODE)
    base = [Base("base-0", BASE_GB * GB)]
    runs = []
    for n, (name, (periods, random_gap)) in enumerate(SCENARIOS.items()):
        adapters = scheduled(rows, periods, random_gap, args.hours, args.seed + n)
        learnt = LEARNING_PERIODS * max(periods)
        sides = {k: side(adapters, base, 1, args.seed, k == "forecast", learnt) for k in ("sum", "forecast")}
        runs.append(
            {"scenario": name, "adapters": len(adapters), "devices": 1, "learnt_at_s": learnt, **sides}
        )
        say(
            f"{name}: {sides['sum']['slow_cold_starts']} → {sides['forecast']['slow_cold_starts']} slow cold starts"
        )
    sys.path.insert(0, str(REPO / "platform"))
    from stoker.cli.fleet import _asleep_bytes, load_fleet
    from stoker.cli.fleet_adapters import _base

    fleet = load_fleet(
        REPO / "bench" / "fleets" / "adapters.yaml", asleep_bytes=_asleep_bytes("gpu", True), count=200
    )
    deps, names = fleet["deployments"], ["base-0", "base-1"]
    cut = [Adapter(d.name, names[i % 2], d.trace) for i, d in enumerate(deps)]
    bases = [_base(b, [d for i, d in enumerate(deps) if i % 2 == k]) for k, b in enumerate(names)]
    sides = {
        k: side(cut, bases, fleet["devices"], args.seed, k == "forecast", 0.0) for k in ("sum", "forecast")
    }
    runs.append(
        {"scenario": "200 adapters on 2 bases (the fleet cut)", "adapters": 200, "devices": fleet["devices"],
         "learnt_at_s": 0.0, **sides}
    )  # fmt: skip
    for run in runs:
        s, f = run["sum"], run["forecast"]
        run["ratios"] = {
            k: ratio(f[k], s[k]) for k in ("slow_cold_starts", "paid_loads", "p99_wait_s", "device_seconds")
        }
    results = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "seed": args.seed,
        "hours": args.hours,
        "model": "gpu",
        "runs": runs,
        "elapsed_s": time.perf_counter() - started,
    }
    write_results(args.out, results, table(results))
    return 0


def table(results: dict) -> str:
    lines = [
        "| scenario | requests | slow cold starts (sum → forecast) | of them after learning | waited for a load | "
        "loaded ahead | p99 wait | device-s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in results["runs"]:
        s, f, r = run["sum"], run["forecast"], run["ratios"]
        x = {k: "" if v is None else f" ({v:.2f}×)" for k, v in r.items()}
        lines.append(
            f"| {run['scenario']} | {s['requests']} | {s['slow_cold_starts']} → {f['slow_cold_starts']}"
            f"{x['slow_cold_starts']} | {s['slow_cold_starts_after_learning']} → "
            f"{f['slow_cold_starts_after_learning']} | {s['paid_loads']} → {f['paid_loads']} | {f['prefetched']} | "
            f"{s['p99_wait_s']:.2f} → {f['p99_wait_s']:.2f} s | {s['device_seconds']:.0f} → "
            f"{f['device_seconds']:.0f}{x['device_seconds']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
