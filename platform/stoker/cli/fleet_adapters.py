"""`stoker simulate --fleet FILE --adapters N --bases B`: N fine-tunes as LoRA adapters on B bases,
against the same N as merged deployments (each a full model), on the same shared devices.

    stoker simulate --fleet FILE --adapters 200 --bases 2 [--max-adapters 4] [--adapter-load-s S] [--json]

The N deployments are FILE's cycled to N (`stoker.cli.fleet.cycled`: each time round rotated a
further 97 s), so both sides replay the same requests at the same times. The merged side is exactly
`stoker simulate --fleet` over those N (mode `shared`, FILE's devices). The adapter side makes
adapter i an adapter on base `base-<i mod B>` (`warm_pool.adapter_sim`); a base's instance is the
largest footprint among its adapters' deployments, and its policy theirs (they must agree). Service
times are drawn per deployment from the seed, so a request's jitter differs between the sides.

Prints the two side by side (devices in use at peak, devices' worth of memory reserved at peak,
device-seconds, slow cold starts, per 1,000 requests, p99 wait, adapter loads), or with `--json` one
object: `merged` (the plain fleet mode's line), `adapters` (the bases' fleet line with every
adapter's row) and `side_by_side`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

from stoker.cli.fleet import GB, _asleep_bytes, load_fleet
from stoker.errors import CLIError

MOST = 100_000  # the most adapters, bases or loaded adapters a flag takes
ROWS = (
    ("requests", "requests", "{}"),
    ("rejected", "rejected", "{}"),
    ("peak_devices", "devices in use at peak", "{}"),
    ("packed_devices", "devices' worth reserved at peak", "{}"),
    ("device_seconds", "device-seconds (any awake)", "{:.0f}"),
    ("slow_cold_starts", "slow cold starts", "{}"),
    ("slow_cold_starts_per_1k", "slow cold starts per 1k requests", "{:.1f}"),
    ("p99_wait_s", "p99 wait s", "{:.2f}"),
    ("adapter_loads", "adapter loads", "{}"),
    ("prefetched", "of them loaded ahead", "{}"),
    ("paid_loads", "requests that waited for a load", "{}"),
)


def cmd_adapters(args: argparse.Namespace) -> int:
    from stoker.cli.sim_setup import instance_model
    from warm_pool.adapter_sim import MAX_ADAPTERS as DEFAULT_MAX
    from warm_pool.adapter_sim import Adapter, simulate_adapters
    from warm_pool.errors import PoolError
    from warm_pool.fleet_sim import simulate_fleet

    if args.baseline is not None:
        raise CLIError("--adapters takes no --baseline: it runs its own (the merged deployments)")
    n, bases = _whole("--adapters", args.adapters, 1), _whole("--bases", args.bases or 1, 1)
    if bases > n:
        raise CLIError(f"--bases {bases} is more than --adapters {n}: a base needs an adapter")
    max_adapters = _whole(
        "--max-adapters", DEFAULT_MAX if args.max_adapters is None else args.max_adapters, 1
    )
    try:
        model = instance_model(args)
        if args.adapter_load_s is not None:
            model = dataclasses.replace(model, adapter_load_s=args.adapter_load_s)
        fleet = load_fleet(args.fleet, asleep_bytes=_asleep_bytes(args.profile, model.can_sleep), count=n)
        deps, devices, memory = fleet["deployments"], fleet["devices"], fleet["memory"]
        merged = simulate_fleet(deps, devices=devices, device_memory=memory, model=model, seed=args.seed)
        names = [f"base-{b}" for b in range(bases)]
        adapters = [Adapter(d.name, names[i % bases], d.trace) for i, d in enumerate(deps)]
        on_bases = simulate_adapters(
            adapters,
            [_base(name, [d for i, d in enumerate(deps) if i % bases == b]) for b, name in enumerate(names)],
            devices=devices,
            device_memory=memory,
            model=model,
            max_adapters=max_adapters,
            seed=args.seed,
        )
    except PoolError as exc:
        raise CLIError(str(exc)) from None
    sides = {
        "merged": _side(merged, 0, 0, 0),
        "adapters": _side(on_bases.fleet, on_bases.adapter_loads, on_bases.prefetched, on_bases.paid_loads),
    }
    out = {
        "adapters": n,
        "bases": bases,
        "devices": devices,
        "device_memory_gb": memory / GB,
        "max_adapters": max_adapters,
        "adapter_load_s": model.adapter_load_s,
        "seed": args.seed,
        "side_by_side": sides,
        "merged": merged.summary(),
        "on_bases": on_bases.summary(),
    }
    print(json.dumps(out) if args.json else format_side_by_side(out))
    return 0


def _whole(flag: str, value: int, low: int) -> int:
    if not low <= value <= MOST:
        raise CLIError(f"{flag} must be a whole number in {low}..{MOST}, got {value}")
    return value


def _base(name: str, deps: list):
    """A base for these deployments' adapters: their largest footprint, their one policy."""
    from warm_pool.adapter_sim import Base

    policies = sorted({d.policy for d in deps})
    if len(policies) > 1:
        raise CLIError(f"{name}: its adapters' deployments name policies {', '.join(policies)}: want one")
    awake = max(d.awake_bytes for d in deps)
    return Base(name, awake, max(d.asleep_bytes for d in deps), policies[0])


def _side(report, loads: int, prefetched: int, paid: int) -> dict[str, object]:
    return {
        "requests": report.requests,
        "rejected": report.rejected,
        "peak_devices": report.peak_devices,
        "packed_devices": math.ceil(report.peak_reserved / report.memory),
        "device_seconds": round(report.device_seconds, 1),
        "slow_cold_starts": report.slow_cold_starts,
        "slow_cold_starts_per_1k": round(report.slow_cold_starts / report.requests * 1000, 2),
        "p99_wait_s": round(report.p99_wait_s, 4),
        "adapter_loads": loads,
        "prefetched": prefetched,
        "paid_loads": paid,
    }


def format_side_by_side(out: dict) -> str:
    m, a = out["side_by_side"]["merged"], out["side_by_side"]["adapters"]
    head = (
        f"{out['adapters']} adapters on {out['bases']} base(s) against {out['adapters']} merged "
        f"deployments, on {out['devices']} shared device(s) of {out['device_memory_gb']:g} GB "
        f"(max_adapters {out['max_adapters']}, adapter load {out['adapter_load_s']:g} s)"
    )
    cells = [(label, fmt.format(m[key]), fmt.format(a[key])) for key, label, fmt in ROWS]
    widths = [max(len(c[i]) for c in [("", "merged", "adapters"), *cells]) for i in range(3)]
    lines = [head, "  ".join(["".ljust(widths[0]), "merged".rjust(widths[1]), "adapters".rjust(widths[2])])]
    lines += ["  ".join([c[0].ljust(widths[0]), c[1].rjust(widths[1]), c[2].rjust(widths[2])]) for c in cells]
    return "\n".join(lines) + "\n"
