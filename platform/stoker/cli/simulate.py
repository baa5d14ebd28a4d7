"""`stoker simulate`: replay a request trace through the scaling policies, in virtual time.

    stoker simulate --trace FILE [--policy NAME ...] [--thin K] [--time-scale S] [--seed N]
                    [--json] [--plot FILE.png] [instance model, scaling and price flags]

Each policy is the same function the live pool runs (`warm_pool.policies`), driven by the
discrete-event simulator (`warm_pool.simulate`). Prints a table, or with `--json` one JSON object
per policy per line; `--plot` draws requests/s, the forecast and instances by state over time
(matplotlib, the optional extra `sim`). The instance model defaults to the GPU-class preset
(`--profile gpu`); `--profile cpu` is the CPU engine and `--profile vllm-cpu` vLLM's CPU build (no sleep
mode), as measured on this machine.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from stoker.cli import fleet, whatif
from stoker.cli.sim_setup import DEFAULT_POLICIES, format_table, setup
from stoker.errors import CLIError
from stoker.spec.durations import duration


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="replay a request trace through the scaling policies")
    p.add_argument(
        "--trace", type=Path, help="CSV with TIMESTAMP, ContextTokens, GeneratedTokens (or --fleet FILE)"
    )
    fleet.add_fleet_args(p)
    whatif.add_whatif_args(p)
    p.add_argument(
        "--policy",
        action="append",
        metavar="NAME",
        help=f"a policy to run (repeat for more; default: {', '.join(DEFAULT_POLICIES)})",
    )
    p.add_argument("--thin", type=int, default=1, help="keep every K-th request (default 1)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply every time by S (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seeds the service-time jitter (default 0)")
    p.add_argument("--json", action="store_true", help="one JSON object per policy per line")
    p.add_argument("--plot", type=Path, metavar="FILE.png", help="draw the run over time (needs matplotlib)")

    m = p.add_argument_group("instance model (defaults: the --profile preset)")
    m.add_argument(
        "--profile",
        choices=["gpu", "cpu", "vllm-cpu"],
        default="gpu",
        help="the instance preset the flags below adjust (default gpu)",
    )
    m.add_argument("--concurrency", type=int, help="requests one instance serves at once")
    m.add_argument("--prefill-tps", type=float, help="prompt tokens per second")
    m.add_argument("--decode-tps", type=float, help="generated tokens per second per stream")
    m.add_argument("--jitter", type=float, help="log-normal sigma on each service time")
    for tier in ("wake", "page-cache", "disk", "object-storage"):
        m.add_argument(
            f"--{tier}-s", type=duration, help=f"time to READY from the {tier} tier (default: the preset's)"
        )
    m.add_argument("--initial-tier", choices=["page_cache", "disk", "object_storage"], help="snapshot at t=0")
    m.add_argument(
        "--page-cache-ttl",
        type=duration,
        help="how long the page cache keeps the snapshot (default: the preset's)",
    )
    m.add_argument("--max-queue", type=int, help="requests held at once (default 100)")
    m.add_argument(
        "--deadline", type=duration, help="how long a held request waits before rejection (default 2m)"
    )

    s = p.add_argument_group("scaling and prices")
    s.add_argument("--max", type=int, default=16, help="instances at most (default 16)")
    s.add_argument("--min-warm", type=int, default=0, help="instances every policy keeps READY (default 0)")
    s.add_argument(
        "--target-concurrency", type=int, help="requests per instance aimed at (default: --concurrency)"
    )
    s.add_argument(
        "--idle-timeout",
        type=duration,
        help="configure each policy as a deployment with this --idle-timeout would be (with "
        "--stable-window; default: the policies' own settings)",
    )
    s.add_argument(
        "--stable-window", type=duration, help="the platform's --stable-window for that (default 1m)"
    )
    s.add_argument("--gpu-price", type=float, default=3.00, help="$ per GPU-hour (default 3.00)")
    s.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="devices each instance holds, as `stoker deploy --gpus` (default 1)",
    )
    s.add_argument(
        "--sleep-price", type=float, default=0.08, help="$ per sleeping-instance-hour (default 0.08)"
    )
    p.set_defaults(func=cmd_simulate)


def cmd_simulate(args: argparse.Namespace) -> int:
    from warm_pool.errors import PoolError
    from warm_pool.simulate import Prices, simulate
    from warm_pool.trace import load_trace

    if args.from_log is not None:  # a what-if over the platform's own arrivals (`stoker.cli.whatif`)
        return whatif.cmd_from_log(args)
    if args.fleet is not None or args.trace is None or args.baseline is not None or fleet.adapter_flags(args):
        return fleet.cmd_fleet(args)
    try:
        if args.plot is not None:
            _check_plot_target(args.plot)
        model, scaling, policies = setup(args)
        trace = load_trace(args.trace, thin=args.thin, time_scale=args.time_scale)
        try:
            prices = Prices(args.gpu_price, args.sleep_price, args.gpus)
        except ValueError as exc:
            raise CLIError(f"--gpus: {exc}") from None
        reports = [
            simulate(trace, policy, scaling=scaling, model=model, prices=prices, seed=args.seed)
            for policy in policies
        ]
    except PoolError as exc:
        raise CLIError(str(exc)) from None

    if args.json:
        extra = {
            "trace": str(args.trace),
            "thin": args.thin,
            "time_scale": args.time_scale,
            "seed": args.seed,
        }
        for report in reports:
            print(json.dumps({**report.summary(), **extra}))
    else:
        print(format_table([r.summary() for r in reports]))
    if args.plot is not None:
        title = f"{args.trace.name} (thin {args.thin}, time × {args.time_scale:g}, {args.profile} model)"
        plot_timelines(reports, args.plot, title)
    return 0


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise CLIError("--plot needs matplotlib: pip install 'stoker[sim]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _check_plot_target(path: Path) -> None:
    """Before a run, not after it: a bad --plot should not cost the whole simulation."""
    if path.suffix.lower() != ".png":
        raise CLIError(f"--plot writes a PNG file; got {path}")
    if not path.parent.is_dir():
        raise CLIError(f"--plot: no such directory {path.parent}")
    _pyplot()


def plot_timelines(reports, path: Path, title: str) -> None:
    """Requests/s and each policy's forecast on top; below, one panel per policy with its
    instances by state (READY, starting or waking, SLEEPING) over time."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(reports) + 1, 1, figsize=(11, 2.2 * (len(reports) + 1)), sharex=True)
    top = axes[0]
    first = reports[0].timeline
    times = [row[0] / 60 for row in first]
    top.plot(times, [row[1] for row in first], color="0.5", lw=0.8, label="requests/s")
    for report in reports:
        forecast = [row[2] for row in report.timeline]
        if any(not math.isnan(f) for f in forecast):
            top.plot(
                [row[0] / 60 for row in report.timeline], forecast, lw=1.2, label=f"{report.policy} forecast"
            )
    top.set_ylabel("requests/s")
    top.legend(loc="upper left", fontsize=8)
    top.set_title(title, fontsize=10)
    for ax, report in zip(axes[1:], reports, strict=True):
        t = [row[0] / 60 for row in report.timeline]
        ready = [row[3] for row in report.timeline]
        coming = [row[4] + row[5] for row in report.timeline]
        asleep = [row[6] for row in report.timeline]
        ax.stackplot(t, ready, coming, asleep, labels=["READY", "starting/waking", "SLEEPING"],
                     colors=["tab:green", "tab:orange", "tab:blue"], alpha=0.8, step="post")  # fmt: skip
        ax.set_ylabel("instances")
        ax.set_title(
            f"{report.policy}: cold {report.cold_start_share:.1%}, GPU {report.gpu_seconds:.0f} s, "
            f"${report.cost_per_1k_requests:.3f}/1k requests",
            fontsize=9,
        )
        ax.legend(loc="upper left", fontsize=7)
    axes[-1].set_xlabel("minutes")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise CLIError(f"--plot: cannot write {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
