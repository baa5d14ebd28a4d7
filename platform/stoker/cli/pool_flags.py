"""The control plane's flags, which `stoker up` and `stoker controller` share: how the pools scale
(policy, stable window, warm runtimes, instance age), where engines run and on which devices, what
they cost, how often the controller checkpoints; and `platform_settings`, what they read into.
The serving flags every plane takes are `stoker.cli.up`'s."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from stoker.cli.parser import duration_or_off
from stoker.errors import CLIError
from stoker.spec.durations import duration


def add_pool_args(p: argparse.ArgumentParser) -> None:
    """The pools': scale-down window, failed starts, vLLM."""
    p.add_argument(
        "--device-memory",
        metavar="SIZE",
        help="share one device of SIZE (e.g. 2GiB) between every deployment's CPU-engine instances: each "
        "reserves its weights plus --instance-kv while awake, and the fleet arbiter puts instances to sleep "
        "to make room (default: off, every instance on its own)",
    )
    p.add_argument(
        "--instance-kv",
        metavar="SIZE",
        default="256MiB",
        help="each instance's KV-cache budget on a shared device",
    )
    p.add_argument(
        "--share-gpus",
        action="store_true",
        help="share this machine's GPUs (their memory read with NVML) between every deployment's vLLM instances, "
        "each started with --gpu-memory-utilization from its footprint (needs nvidia-ml-py: the gpu extra)",
    )
    p.add_argument("--stable-window", type=duration, default="60s", help="how long a scale-down waits")
    p.add_argument(
        "--max-instance-age",
        type=duration_or_off,
        default="off",
        metavar="DURATION",
        help="replace an instance READY for longer (a new one READY first, then the old one drained; one at a "
        "time per deployment); a deployment's own `stoker deploy --max-instance-age` wins (default: off)",
    )
    p.add_argument(
        "--warm-runtimes",
        type=int,
        default=1,
        metavar="N",
        help="CPU-engine processes kept started ahead of need once a CPU-engine deployment exists, imports "
        "done and no model: a start takes one and loads only the weights, and it forks the next (0: off)",
    )
    p.add_argument(
        "--vllm-warm-runtimes",
        type=int,
        default=0,
        metavar="N",
        help="vLLM processes kept imported ahead of need once a vLLM deployment exists, each ~0.6 GB of "
        "host memory: a vLLM start takes one and skips both its processes' imports (default: 0, off)",
    )
    p.add_argument(
        "--unavailable-after",
        type=int,
        default=3,
        metavar="N",
        help="failed starts in a row after which held and new requests are refused at once with the reason, "
        "while starts go on being retried (0: never)",
    )
    p.add_argument(
        "--vllm",
        metavar="CMD",
        help="the command that runs vLLM's CLI (default: $STOKER_VLLM, else `vllm` on PATH)",
    )
    p.add_argument(
        "--vllm-args",
        metavar="ARGS",
        default="",
        help="extra arguments for every vLLM instance, e.g. '--enforce-eager' (one quoted string; default none)",
    )
    p.add_argument(
        "--prices",
        type=Path,
        metavar="FILE",
        help="the price table, YAML or JSON, that `stoker cost` and stoker_cost_usd_total use: $ per device-hour "
        "READY and starting (by engine), per sleeping hour, per GB-month of snapshot (default: $3.00 per "
        "device-hour, $0.08 asleep; README: Cost)",
    )
    p.add_argument(
        "--checkpoint-interval",
        type=duration_or_off,
        default="30s",
        metavar="DURATION",
        help="how often cost, the dashboard's last hour and the policies' learned state are written to "
        "$STOKER_HOME/checkpoints (and once more at a clean shutdown), to be carried on after a restart "
        "(1s to 1h, or off)",
    )
    p.add_argument(
        "--vllm-cpu-kv-cache",
        metavar="GIB",
        type=float,
        default=1.0,
        help="GiB of host memory for each vLLM CPU instance's KV cache",
    )


def platform_settings(args: argparse.Namespace):
    """The platform's settings from the pool flags (`stoker.serve.options.PlatformSettings`)."""
    from snapshots.errors import SnapshotError
    from snapshots.sizes import parse_size
    from stoker.control.vllm import VllmOptions
    from stoker.serve.options import PlatformSettings
    from warm_pool.fleet import Devices

    try:
        vllm = VllmOptions(
            args.vllm,
            tuple(shlex.split(args.vllm_args)),
            args.vllm_cpu_kv_cache,
            getattr(args, "vllm_warm_runtimes", 0),
        )
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    if args.unavailable_after < 0:
        raise CLIError(f"--unavailable-after must be 0 (never) or more, got {args.unavailable_after}")
    devices, kv = None, 256 << 20
    try:
        if args.device_memory and args.share_gpus:
            raise CLIError("--device-memory (a CPU budget) and --share-gpus exclude each other")
        if args.device_memory:
            devices = Devices.cpu_budget(parse_size(args.device_memory))
        elif args.share_gpus:
            devices = gpu_devices()
        kv = parse_size(args.instance_kv)
    except (SnapshotError, ValueError) as exc:
        raise CLIError(f"--device-memory/--instance-kv: {exc}") from None
    return PlatformSettings(
        vllm=vllm,
        stable_window_s=args.stable_window,
        unavailable_after=args.unavailable_after,
        devices=devices,
        instance_kv_bytes=kv,
        max_instance_age_s=max_instance_age_of(args),
        warm_runtimes=warm_runtimes_of(args),
        prices=prices_of(args),
        checkpoint_interval_s=checkpoint_interval_of(args),
    )


def checkpoint_interval_of(args: argparse.Namespace) -> float | None:
    from stoker.control.checkpoint import interval_error

    interval = getattr(args, "checkpoint_interval", None)
    if interval is not None and (message := interval_error(interval)) is not None:
        raise CLIError(f"--checkpoint-interval {message}")
    return interval


def warm_runtimes_of(args: argparse.Namespace) -> int:
    n = getattr(args, "warm_runtimes", 0)
    if n < 0:
        raise CLIError(f"--warm-runtimes must be 0 (off) or more, got {n}")
    return n


def max_instance_age_of(args: argparse.Namespace) -> float | None:
    from warm_pool.recycle import max_age_error

    age = getattr(args, "max_instance_age", None)
    if age is not None and (message := max_age_error(age)) is not None:
        raise CLIError(f"--max-instance-age {message.replace(repr(age), f'{age:g}s')}")
    return age


def prices_of(args: argparse.Namespace):
    """The --prices table, or None (list prices); a bad file is one line naming the field."""
    from stoker.control.prices import PriceError, load_prices

    if getattr(args, "prices", None) is None:
        return None
    try:
        return load_prices(args.prices)
    except PriceError as exc:
        raise CLIError(f"--prices {exc}") from None


def gpu_devices():
    from warm_pool.fleet import Devices
    from warm_pool.launch import GpuInventory

    gpus = GpuInventory.from_env().gpus
    if not gpus:
        raise CLIError("--share-gpus: no GPU found (set STOKER_GPUS or CUDA_VISIBLE_DEVICES)")
    try:
        return Devices.from_nvml(gpus)
    except ImportError:
        raise CLIError("--share-gpus reads the GPUs' memory with NVML: pip install 'stoker[gpu]'") from None
    except Exception as exc:  # pynvml's NVMLError and its kin: no driver, no such device
        raise CLIError(f"--share-gpus: NVML could not read the GPUs: {exc}") from None
