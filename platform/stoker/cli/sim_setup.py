"""What the three `stoker simulate` commands (`--trace`, `--fleet`, `--from-log`) share: the
simulated instance and the scaling from their flags (`instance_model`, `setup`) and the table they
print (`format_table`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math

from stoker.errors import CLIError

DEFAULT_POLICIES = ("kpa", "keepalive", "histogram", "predictive")
COLUMNS = (
    ("policy", "policy", "{}"),
    ("requests", "requests", "{}"),
    ("rejected", "rejected", "{}"),
    ("cold_start_share", "cold share", "{:.2%}"),
    ("p50_wait_s", "p50 wait s", "{:.2f}"),
    ("p99_wait_s", "p99 wait s", "{:.2f}"),
    ("p99_ttft_s", "p99 TTFT s", "{:.2f}"),
    ("gpu_seconds", "GPU s", "{:.0f}"),
    ("starting_seconds", "starting s", "{:.0f}"),
    ("sleep_seconds", "sleep s", "{:.0f}"),
    ("cost_per_1k_requests", "$/1k req", "{:.3f}"),
)


def instance_model(args: argparse.Namespace):
    """The preset named by --profile with any flags given laid over it."""
    from warm_pool.policies.base import Tier
    from warm_pool.profiles import PROFILES

    model = PROFILES[args.profile]
    startup = model.startup
    for name in ("wake", "page_cache", "disk", "object_storage"):
        value = getattr(args, f"{name}_s")
        if value is not None:
            startup = dataclasses.replace(startup, **{name: value})
    changes = {"startup": startup}
    for flag, field in (
        ("concurrency", "concurrency"),
        ("prefill_tps", "prefill_tps"),
        ("decode_tps", "decode_tps"),
        ("jitter", "jitter"),
        ("page_cache_ttl", "page_cache_ttl_s"),
        ("max_queue", "max_queue"),
        ("deadline", "deadline_s"),
    ):
        if getattr(args, flag) is not None:
            changes[field] = getattr(args, flag)
    if args.initial_tier is not None:
        changes["initial_tier"] = Tier(args.initial_tier)
    return dataclasses.replace(model, **changes)


def setup(args: argparse.Namespace):
    """(instance model, scaling, the policies) the flags ask for; `PoolError` or `CLIError`."""
    from warm_pool.policies import make_policy
    from warm_pool.policies.base import ScalingConfig
    from warm_pool.policies.settings import bind_policy

    names = args.policy or list(DEFAULT_POLICIES)
    model = instance_model(args)
    as_deployed = args.idle_timeout is not None or args.stable_window is not None
    idle = args.idle_timeout if args.idle_timeout is not None else ScalingConfig.idle_timeout_s
    window = args.stable_window if args.stable_window is not None else ScalingConfig.stable_window_s
    scaling = ScalingConfig(
        min_warm=args.min_warm,
        max=args.max,
        target_concurrency=args.target_concurrency or model.concurrency,
        idle_timeout_s=idle,
        stable_window_s=min(window, idle),
    )
    for price in (args.gpu_price, args.sleep_price):
        if not (math.isfinite(price) and price >= 0):
            raise CLIError(f"prices must be numbers ≥ 0, got {price}")
    if as_deployed:  # exactly as the live pool binds a deployment's policy
        return model, scaling, [bind_policy(name, scaling) for name in names]
    return model, scaling, [make_policy(name, scaling) for name in names]


def format_table(rows: list[dict], columns=COLUMNS) -> str:
    cells = [[fmt.format(row[key]) for key, _, fmt in columns] for row in rows]
    heads = [head for _, head, _ in columns]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]
    lines = [
        "  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(heads, widths, strict=True)))
    ]
    for c in cells:
        lines.append(
            "  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(c, widths, strict=True)))
        )
    return "\n".join(lines)
