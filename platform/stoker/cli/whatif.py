"""`stoker simulate --from-log FILE`: the platform's own arrivals, replayed through other policies
and settings, priced with the price table, with the slow starts each would have caused.

    stoker simulate --from-log ~/.stoker/arrivals/arrivals.jsonl [--deployment chat] \\
        [--policy predictive --policy kpa ...] [--prices prices.yaml] [--profile cpu] [--idle-timeout 5m] [--json]

The log is `stoker.control.arrival_log`'s (arrival times, tokens in and out; no content). Each policy runs
through the same simulator as `stoker simulate --trace` (`warm_pool.simulate`) with the same
instance model and scaling flags. Cost = (READY (and draining) seconds × ready_hour + starting and
waking seconds × starting_hour) × `--gpus` + SLEEPING seconds × sleeping_hour, at the prices of the engine the
profile models (`gpu` and `vllm-cpu`: vllm, `cpu`: cpu), from `--prices FILE` or else
`--gpu-price`/`--sleep-price`. Snapshot storage is left out: it is the same under every policy.
A slow start is a request served by an instance that started or woke after it arrived (the
simulator's `cold_starts`: what `stoker_cold_start_requests_total` counts live).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from stoker.cli.admin_client import add_url_args, base_url, text
from stoker.errors import CLIError

PROFILE_ENGINE = {"gpu": "vllm", "vllm-cpu": "vllm", "cpu": "cpu"}
SIMULATED_TIERS = ("wake", "runtime", "page_cache", "disk", "object_storage")  # the simulator's start tiers
COLUMNS = (
    ("policy", "policy", "{}"),
    ("requests", "requests", "{}"),
    ("slow_starts", "slow starts", "{}"),
    ("cold_start_share", "cold share", "{:.2%}"),
    ("p99_wait_s", "p99 wait s", "{:.2f}"),
    ("gpu_seconds", "READY s", "{:.0f}"),
    ("starting_seconds", "starting s", "{:.0f}"),
    ("sleep_seconds", "sleep s", "{:.0f}"),
    ("cost_usd", "cost $", "{:.4f}"),
    ("cost_per_1k_requests", "$/1k req", "{:.4f}"),
)


def add_whatif_args(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("what-if over the platform's arrival log")
    w.add_argument(
        "--from-log",
        type=Path,
        metavar="FILE",
        help="replay $STOKER_HOME/arrivals/arrivals.jsonl (or its .1) instead of a --trace",
    )
    w.add_argument(
        "--deployment", metavar="NAME", help="only this deployment's arrivals (default: all in the log)"
    )
    w.add_argument(
        "--measured-starts",
        action="store_true",
        help="start times from the running platform's own measurements of --deployment (its "
        "stoker_instance_startup_seconds by tier, read from --url's /metrics): the tiers it has started "
        "from replace the profile's, so its engine settings (GPUs, context length, eager mode) count as "
        "they measured; starts through a warm runtime model one kept",
    )
    add_url_args(w)
    w.add_argument(
        "--prices",
        type=Path,
        metavar="FILE",
        help="price table, YAML or JSON, as `stoker up --prices` takes (default: --gpu-price and --sleep-price)",
    )


def price_table(args: argparse.Namespace):
    from stoker.control.prices import ENGINES, PriceError, PriceTable, load_prices

    if args.prices is None:
        gpu, sleep = dict.fromkeys(ENGINES, args.gpu_price), dict.fromkeys(ENGINES, args.sleep_price)
        return PriceTable(gpu, gpu, sleep)
    try:
        return load_prices(args.prices)
    except PriceError as exc:
        raise CLIError(f"--prices {exc}") from None


def measured_starts(args: argparse.Namespace) -> dict[str, float]:
    """The mean seconds to READY by tier of `--deployment`'s starts, as the platform measured them."""
    from prometheus_client.parser import text_string_to_metric_families

    if not args.deployment:
        raise CLIError("--measured-starts reads one deployment's starts: name it with --deployment")
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text(args, "/metrics")):
        if family.name != "stoker_instance_startup_seconds":
            continue
        for sample in family.samples:
            if sample.labels.get("deployment") != args.deployment:
                continue
            tier = sample.labels.get("tier", "")
            if sample.name.endswith("_sum"):
                sums[tier] = sums.get(tier, 0.0) + sample.value
            elif sample.name.endswith("_count"):
                counts[tier] = counts.get(tier, 0.0) + sample.value
    measured = {tier: sums[tier] / n for tier, n in counts.items() if n > 0 and tier in SIMULATED_TIERS}
    if not measured:
        raise CLIError(f"the platform at {base_url(args)} has measured no start of {args.deployment!r} yet")
    return measured


def row(report, prices, engine: str, tokens: int, devices: int = 1) -> dict:
    """One policy's what-if: the simulator's report, priced (see the module); awake seconds count
    `devices` times (`--gpus`), as the live cost does."""
    cost = (
        report.gpu_seconds * prices.per_second(engine, "READY") * devices
        + report.starting_seconds * prices.per_second(engine, "STARTING") * devices
        + report.sleep_seconds * prices.per_second(engine, "SLEEPING")
    )
    out = {k: v for k, v in report.summary().items() if k not in ("cost_usd", "cost_per_1k_requests")}
    return out | {
        "slow_starts": report.cold_starts,
        "cost_usd": round(cost, 9),
        "cost_per_1k_requests": round(cost / report.requests * 1000, 9),
        "cost_per_1k_tokens": round(cost / tokens * 1000, 9) if tokens else None,
    }


def cmd_from_log(args: argparse.Namespace) -> int:
    from stoker.cli.sim_setup import format_table, setup
    from stoker.control.arrival_log import load_arrivals
    from warm_pool.errors import PoolError
    from warm_pool.simulate import simulate
    from warm_pool.trace import TraceError, TraceRequest

    if args.trace is not None or args.fleet is not None:
        raise CLIError(
            "--from-log replays the arrival log: give it instead of --trace or --fleet, not with them"
        )
    if args.plot is not None:
        raise CLIError("--plot draws --trace runs only; leave it out with --from-log")
    prices = price_table(args)
    engine = PROFILE_ENGINE[args.profile]
    try:
        if not isinstance(args.thin, int) or args.thin < 1:
            raise TraceError(f"--thin must be a whole number ≥ 1, got {args.thin!r}")
        if not args.time_scale > 0:
            raise TraceError(f"--time-scale must be a number > 0, got {args.time_scale!r}")
        model, scaling, policies = setup(args)
        measured = measured_starts(args) if args.measured_starts else {}
        model = dataclasses.replace(model, startup=dataclasses.replace(model.startup, **measured))
        if "runtime" in measured and model.warm_runtimes == 0:
            # Its starts came through a warm runtime, which forks the next one at each start
            # (`warm_pool.succession`): the simulated platform keeps one, replaced at once.
            model = dataclasses.replace(model, warm_runtimes=1, runtime_refill_s=0.0)
        kept = load_arrivals(args.from_log, args.deployment)[:: args.thin]
        trace = tuple(
            TraceRequest((r.t - kept[0].t) * args.time_scale, r.context_tokens, r.generated_tokens)
            for r in kept
        )
        tokens = sum(r.context_tokens + r.generated_tokens for r in trace)
        reports = [
            simulate(trace, policy, scaling=scaling, model=model, seed=args.seed) for policy in policies
        ]
    except PoolError as exc:
        raise CLIError(str(exc)) from None
    if args.gpus < 1:
        raise CLIError(f"--gpus: an instance holds at least 1 device, got {args.gpus}")
    rows = [row(report, prices, engine, tokens, args.gpus) for report in reports]
    if args.json:
        extra = {
            "from_log": str(args.from_log),
            "deployment": args.deployment,
            "engine": engine,
            "seed": args.seed,
            "measured_starts": measured,  # seconds to READY by tier, where the platform measured them
        }
        for r in rows:
            print(json.dumps(r | extra))
    else:
        if measured:
            print(
                "measured starts: " + ", ".join(f"{tier} {s:.1f} s" for tier, s in sorted(measured.items()))
            )
        print(format_table(rows, COLUMNS))
    return 0
