"""`stoker simulate --fleet FILE`: several deployments sharing a few devices, in virtual time.

    stoker simulate --fleet fleet.yaml [--baseline dedicated] [--json] [--seed N] [instance model flags]

FILE (YAML or JSON) names the devices and the deployments on them:

    devices: 3                  # how many devices the deployments share
    device_memory_gb: 80        # each device's memory
    deployments:
      - name: chat
        trace: traces/azure-llm-conv-2023-first29min.csv   # relative to FILE's directory
        thin: 50                # keep every 50th request (default 1)
        shift_s: 300            # rotate the trace by 300 s within its length (default 0)
        weights_gb: 16
        kv_gb: 4                # the KV-cache budget an awake instance reserves besides (default 0)
        policy: predictive      # default predictive

Every deployment is simulated as `stoker simulate` would (the same instance model flags, one model
for all), its decisions passing through the fleet arbiter (`warm_pool.fleet_sim`). `--baseline
dedicated` also runs the same deployments with a device each under `kpa`, in the same run. Prints,
per mode, a row per deployment and one for the fleet, or with `--json` one JSON object per mode.
`--adapters N` runs the file's deployments cycled to N both as LoRA adapters on B bases and as N
merged deployments, on the same devices (`stoker.cli.fleet_adapters`).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from stoker.errors import CLIError

GB = 1 << 30
MAX_DEVICES = 4096
TOP_KEYS = {"devices", "device_memory_gb", "deployments"}
DEPLOYMENT_KEYS = {"name", "trace", "thin", "shift_s", "weights_gb", "kv_gb", "policy"}
# Each time round the file's deployments (`cycled`) is rotated this much further: not a divisor of
# the traces' 1,741 s, so 200 copies of a deployment start at different times.
CYCLE_SHIFT_S = 97
COLUMNS = (
    ("name", "deployment", "{}"),
    ("requests", "requests", "{}"),
    ("rejected", "rejected", "{}"),
    ("slow_cold_starts", "slow cold starts", "{}"),
    ("wakes", "wakes", "{}"),
    ("p99_wait_s", "p99 wait s", "{:.2f}"),
    ("device_seconds", "device s", "{:.0f}"),
    ("peak_devices", "peak devices", "{}"),
)


def add_fleet_args(p: argparse.ArgumentParser) -> None:
    """`stoker simulate`'s fleet flags."""
    p.add_argument(
        "--fleet",
        type=Path,
        metavar="FILE",
        help="simulate the deployments a YAML or JSON file names on shared devices (instead of --trace)",
    )
    p.add_argument(
        "--baseline",
        choices=["dedicated"],
        help="with --fleet: also run each deployment on a device of its own under kpa",
    )
    a = p.add_argument_group("adapters (with --fleet)")
    a.add_argument(
        "--adapters",
        type=int,
        metavar="N",
        help="the file's deployments cycled to N, run as LoRA adapters on --bases bases against the "
        "same N as merged deployments (each a full model), side by side",
    )
    a.add_argument("--bases", type=int, metavar="B", help="with --adapters: base deployments (default 1)")
    a.add_argument(
        "--max-adapters",
        type=int,
        metavar="N",
        help="with --adapters: adapters each instance keeps loaded (default 4)",
    )
    a.add_argument(
        "--adapter-load-s",
        type=float,
        metavar="S",
        help="with --adapters: seconds to load an adapter onto an instance (default: the profile's)",
    )


def cmd_fleet(args: argparse.Namespace) -> int:
    from stoker.cli.sim_setup import instance_model
    from warm_pool.errors import PoolError
    from warm_pool.fleet_sim import simulate_fleet

    if args.fleet is None:
        if args.baseline is not None:
            raise CLIError("--baseline needs --fleet FILE")
        if adapter_flags(args):
            raise CLIError(f"{adapter_flags(args)[0]} needs --fleet FILE")
        raise CLIError("simulate needs --trace FILE or --fleet FILE")
    for flag, value in (("--trace", args.trace), ("--policy", args.policy), ("--plot", args.plot)):
        if value is not None:
            raise CLIError(f"--fleet takes no {flag}: the file names each deployment's trace and policy")
    if args.adapters is not None:
        from stoker.cli.fleet_adapters import cmd_adapters

        return cmd_adapters(args)
    if adapter_flags(args):
        raise CLIError(f"{adapter_flags(args)[0]} needs --adapters N")
    try:
        model = instance_model(args)
        fleet = load_fleet(args.fleet, asleep_bytes=_asleep_bytes(args.profile, model.can_sleep))
        runs = [("shared", fleet["deployments"], fleet["devices"])]
        if args.baseline == "dedicated":
            kpa = [_with_policy(d, "kpa") for d in fleet["deployments"]]
            runs.append(("dedicated", kpa, len(kpa)))
        reports = [
            simulate_fleet(
                deps, devices=n, device_memory=fleet["memory"], mode=mode, model=model, seed=args.seed
            )
            for mode, deps, n in runs
        ]
    except PoolError as exc:
        raise CLIError(str(exc)) from None
    for report in reports:
        if args.json:
            print(json.dumps(report.summary()))
        else:
            print(format_report(report))
    return 0


def adapter_flags(args: argparse.Namespace) -> list[str]:
    """The adapter flags given, as typed."""
    names = ("adapters", "bases", "max_adapters", "adapter_load_s")
    return [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) is not None]


def _asleep_bytes(profile: str, can_sleep: bool) -> int:
    """What an asleep instance keeps on its device, the live fleet's figures: vLLM's CUDA context on
    a GPU, the CPU engine's measured residual; nothing where the engine cannot sleep."""
    from warm_pool.fleet import ASLEEP_RESIDUAL

    if not can_sleep:
        return 0
    return ASLEEP_RESIDUAL["vllm" if profile == "gpu" else "cpu"]


def _with_policy(deployment, policy: str):
    import dataclasses

    return dataclasses.replace(deployment, policy=policy)


# ---- the file ----------------------------------------------------------------------------------------


def load_fleet(path: Path, *, asleep_bytes: int, count: int | None = None) -> dict:
    """The file's devices, memory (bytes) and deployments (`FleetDeployment`s, traces loaded);
    `CLIError` naming the file and field for anything wrong. With `count`, the deployments are the
    file's cycled to that many (`cycled`)."""
    from warm_pool.fleet_sim import FleetDeployment, rotate
    from warm_pool.policies import POLICIES
    from warm_pool.trace import TraceError, load_trace

    data = _read(path)
    where = f"fleet {path}"
    if not isinstance(data, dict):
        raise CLIError(f"{where}: want a mapping with devices, device_memory_gb and deployments")
    _no_unknown(where, data, TOP_KEYS, "")
    for key in sorted(TOP_KEYS):
        if key not in data:
            raise CLIError(f"{where}: missing {key}")
    devices = _whole(where, "devices", data["devices"], 1, MAX_DEVICES)
    memory_gb = _number(where, "device_memory_gb", data["device_memory_gb"], above=0)
    entries = data["deployments"]
    if not isinstance(entries, list) or not entries:
        raise CLIError(f"{where}: deployments must be a non-empty list, got {entries!r}")
    if count is not None:
        entries = cycled(entries, count)
    loaded: dict[Path, tuple] = {}
    out, names = [], set()
    for n, entry in enumerate(entries):
        at = f"deployments[{n}]"
        if not isinstance(entry, dict):
            raise CLIError(f"{where}: {at} must be a mapping, got {entry!r}")
        _no_unknown(where, entry, DEPLOYMENT_KEYS, f"{at}.")
        for key in ("name", "trace", "weights_gb"):
            if key not in entry:
                raise CLIError(f"{where}: {at}.{key} is missing")
        name = entry["name"]
        if not isinstance(name, str) or not name.strip():
            raise CLIError(f"{where}: {at}.name must be a non-empty string, got {name!r}")
        if name in names:
            raise CLIError(f"{where}: {at}.name {name!r} is used twice")
        names.add(name)
        at = f"deployment {name}"
        thin = _whole(where, f"{at}: thin", entry.get("thin", 1), 1, 10**9)
        shift = _number(where, f"{at}: shift_s", entry.get("shift_s", 0))
        weights = _number(where, f"{at}: weights_gb", entry["weights_gb"], above=0)
        kv = _number(where, f"{at}: kv_gb", entry.get("kv_gb", 0), at_least=0)
        if weights + kv > memory_gb:
            raise CLIError(
                f"{where}: {at}: weights_gb + kv_gb = {weights + kv:g} does not fit a device "
                f"(device_memory_gb {memory_gb:g})"
            )
        policy = entry.get("policy", "predictive")
        if policy not in POLICIES:
            raise CLIError(f"{where}: {at}: policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        trace_path = entry["trace"]
        if not isinstance(trace_path, str) or not trace_path:
            raise CLIError(f"{where}: {at}: trace must be a path, got {trace_path!r}")
        trace_file = (path.parent / trace_path).resolve()
        try:
            if trace_file not in loaded:
                loaded[trace_file] = load_trace(trace_file)
        except TraceError as exc:
            raise CLIError(f"{where}: {at}: {exc}") from None
        trace = rotate(loaded[trace_file][::thin], shift)
        out.append(
            FleetDeployment(
                name, trace, int((weights + kv) * GB), min(asleep_bytes, int(weights * GB)), policy
            )
        )
    return {"devices": devices, "memory": int(memory_gb * GB), "deployments": out}


def cycled(entries: list, count: int) -> list:
    """`count` deployments cut from the file's: deployment i is entry i mod len(entries), the k-th
    time round (k = i // len(entries)) named `<name>-<k>` (the first time, `<name>`) and rotated
    k × `CYCLE_SHIFT_S` further: the same thinned trace at another time."""
    out = []
    for i in range(count):
        entry, k = entries[i % len(entries)], i // len(entries)
        if k and isinstance(entry, dict):
            shift = entry.get("shift_s", 0)
            shift = shift + k * CYCLE_SHIFT_S if isinstance(shift, int | float) else shift
            entry = {**entry, "name": f"{entry.get('name')}-{k}", "shift_s": shift}
        out.append(entry)
    return out


def _read(path: Path):
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CLIError(f"fleet {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CLIError(f"fleet {path}: cannot read it: {getattr(exc, 'strerror', None) or exc}") from None
    if path.suffix.lower() == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise CLIError(f"fleet {path}: not JSON: {exc}") from None
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise CLIError(f"fleet {path}: not YAML: {' '.join(str(exc).split())}") from None


def _no_unknown(where: str, data: dict, known: set[str], prefix: str) -> None:
    unknown = sorted(str(k) for k in data if k not in known)
    if unknown:
        raise CLIError(f"{where}: unknown field {prefix}{unknown[0]} (known: {', '.join(sorted(known))})")


def _whole(where: str, field: str, value, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise CLIError(f"{where}: {field} must be a whole number in {low}..{high}, got {value!r}")
    return value


def _number(
    where: str, field: str, value, *, above: float | None = None, at_least: float | None = None
) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok and above is not None:
        ok = value > above
    if ok and at_least is not None:
        ok = value >= at_least
    if not ok:
        bound = f" > {above:g}" if above is not None else f" ≥ {at_least:g}" if at_least is not None else ""
        raise CLIError(f"{where}: {field} must be a finite number{bound}, got {value!r}")
    return float(value)


# ---- the table ---------------------------------------------------------------------------------------


def format_report(report) -> str:
    s = report.summary()
    head = f"{s['mode']}: {s['devices']} device(s) of {report.memory / GB:g} GB"
    rows = [{**d, "peak_devices": "–"} for d in s["deployments"]] + [{**s, "name": "fleet"}]
    cells = [[fmt.format(row[key]) if row[key] != "–" else "–" for key, _, fmt in COLUMNS] for row in rows]
    heads = [h for _, h, _ in COLUMNS]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]

    def line(values: list[str]) -> str:
        return "  ".join(
            v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(values, widths, strict=True))
        )

    return "\n".join([head, line(heads), *(line(c) for c in cells)]) + "\n"
