"""`stoker up`, `stoker deploy`, `stoker ls`, `stoker describe`, `stoker logs`, `stoker rm`,
`stoker keys`: run the platform, and manage its deployments and API keys.

`up` runs the gateway in the foreground. The others talk to a running platform's admin API at
`--url` (default `$STOKER_URL`, else http://127.0.0.1:8080: `stoker.admin_client`), with
`$STOKER_ADMIN_KEY` as their bearer key when set, and print one line on any error. Flags that take
seconds take durations too (`90s`, `5m`, `1h30m`: `stoker.durations`).
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import json
import os
import shlex
import sys
import time
import urllib.parse
from pathlib import Path

from snapshots.sizes import format_size
from stoker.admin_client import add_url_option, call, stream
from stoker.durations import duration, format_duration
from stoker.errors import CLIError
from stoker.paths import add_store_option
from warm_pool.policies import DEFAULT_POLICY, POLICIES


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Where a process serves, and its log."""
    p.add_argument("--host", default="127.0.0.1", help="address to serve on")
    p.add_argument("--port", type=int, default=8080, help="port to serve on")
    p.add_argument(
        "--allow-open",
        action="store_true",
        help="serve a non-loopback address without STOKER_ADMIN_KEY (anyone who reaches it is admin)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="what the log shows",
    )


def add_activator_args(p: argparse.ArgumentParser) -> None:
    """The activator's: how requests are held, proxied, and sick instances ejected."""
    p.add_argument(
        "--hold-deadline", type=duration, default="120s", help="how long a request may wait for capacity"
    )
    p.add_argument("--max-queued", type=int, default=100, help="requests held per deployment at once")
    p.add_argument(
        "--keepalive-interval",
        type=_duration_or_off,
        default="5s",
        help="time between the keep-alives (blank lines) a held stream gets; 0 or off: none, and a held "
        "stream's headers wait for its answer",
    )
    p.add_argument(
        "--first-byte-timeout",
        type=duration,
        default="300s",
        help="how long a plain request waits for its whole answer's headers",
    )
    p.add_argument(
        "--stream-headers-timeout",
        type=duration,
        default="10s",
        help="how long a stream waits for an instance's headers before it is retried elsewhere",
    )
    p.add_argument(
        "--eject-after", type=int, default=3, help="failures in a row that take an instance out of routing"
    )
    p.add_argument(
        "--eject-time",
        type=duration,
        default="10s",
        help="how long the first ejection lasts; doubled on each one in a row, up to 300 s",
    )
    p.add_argument(
        "--replace-after-ejections",
        type=int,
        default=3,
        help="ejections in a row after which an instance is replaced as stopped or wedged",
    )
    p.add_argument(
        "--health-interval",
        type=duration,
        default="5s",
        help="time between probes of each instance's /health",
    )
    p.add_argument("--health-timeout", type=duration, default="2s", help="how long a /health probe may take")


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
        "--vllm-cpu-kv-cache",
        metavar="GIB",
        type=float,
        default=1.0,
        help="GiB of host memory for each vLLM CPU instance's KV cache",
    )


def add_limit_args(p: argparse.ArgumentParser) -> None:
    """Default limits of tenant keys."""
    limits = p.add_argument_group("limits of tenant keys that set none of their own (default: none)")
    limits.add_argument("--key-rps", type=float, metavar="R", help="requests per second per key")
    limits.add_argument(
        "--key-tpm", type=int, metavar="T", help="tokens (prompt + completion) per minute per key"
    )
    limits.add_argument(
        "--key-max-concurrent", type=int, metavar="N", help="requests held + in flight at once per key"
    )


def add_parsers(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser("up", help="run the platform (gateway, activators, warm pools) in the foreground")
    for add in (add_serve_args, add_activator_args, add_pool_args, add_limit_args):
        add(up)
    add_store_option(up)
    up.set_defaults(func=cmd_up)

    deploy = sub.add_parser("deploy", help="create or update a deployment")
    deploy.add_argument("name", help="the deployment's name, which clients send as `model`")
    deploy.add_argument(
        "--model",
        required=True,
        help="snapshot name or id, s3://bucket/prefix, a local model dir or .gguf file, or a Hugging Face "
        "repo id (org/name[@revision]) already in the local Hugging Face cache",
    )
    deploy.add_argument(
        "--engine", choices=["cpu", "vllm"], default="cpu", help="the engine its instances run"
    )
    deploy.add_argument("--policy", default=DEFAULT_POLICY, help=f"scaling policy: {', '.join(POLICIES)}")
    deploy.add_argument("--min-warm", type=int, default=0, help="instances kept READY even when idle")
    deploy.add_argument("--max", type=int, default=1, help="instances at most")
    deploy.add_argument(
        "--idle-timeout", type=duration, default="5m", help="how long without requests before zero instances"
    )
    deploy.add_argument("--target-concurrency", type=int, default=4, help="in-flight requests per instance")
    deploy.add_argument(
        "--grace-period", type=duration, default="30s", help="how long draining requests may take to finish"
    )
    deploy.add_argument("--json", action="store_true", help="print the deployment as JSON")
    deploy.set_defaults(func=cmd_deploy)

    ls = sub.add_parser("ls", help="list deployments and their instances")
    ls.add_argument("name", nargs="?", help="only this deployment (default: all)")
    ls.add_argument("--json", action="store_true", help="print a JSON list")
    ls.set_defaults(func=cmd_ls)

    describe = sub.add_parser(
        "describe", help="one deployment in full: settings, instances, last decision, last failure"
    )
    describe.add_argument("name", help="the deployment")
    describe.add_argument("--json", action="store_true", help="print the admin API's JSON")
    describe.set_defaults(func=cmd_describe)

    logs = sub.add_parser("logs", help="an instance's log (the one that wrote last, unless --instance)")
    logs.add_argument("name", help="the deployment")
    logs.add_argument(
        "--instance", metavar="ID", help="an instance id, live or gone (`stoker describe` names them)"
    )
    logs.add_argument(
        "--tail", type=_lines, default=100, metavar="N", help="the last N lines (at most 10000)"
    )
    logs.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="then print what it writes next, until it is gone (or Ctrl-C)",
    )
    logs.set_defaults(func=cmd_logs)

    rm = sub.add_parser("rm", help="drain and remove a deployment")
    rm.add_argument("name", help="the deployment")
    rm.set_defaults(func=cmd_rm)

    keys = sub.add_parser("keys", help="API keys: which tenant may call which deployments")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True, metavar="COMMAND")
    create = keys_sub.add_parser("create", help="make a key (printed once, never stored in clear)")
    create.add_argument("--tenant", required=True, help="who the key is for")
    create.add_argument(
        "--deployment", action="append", required=True, help="a deployment the key may call (repeatable)"
    )
    create.add_argument("--rps", type=float, help="requests per second (default: the platform's --key-rps)")
    create.add_argument("--tpm", type=int, help="tokens per minute (default: the platform's --key-tpm)")
    create.add_argument(
        "--max-concurrent",
        type=int,
        help="requests held + in flight at once (default: the platform's --key-max-concurrent)",
    )
    create.add_argument("--json", action="store_true", help="print the id and key as JSON")
    create.set_defaults(func=cmd_keys_create)
    keys_ls = keys_sub.add_parser("ls", help="list keys (id, tenant, deployments, created; never the key)")
    keys_ls.add_argument("--json", action="store_true", help="print a JSON list")
    keys_ls.set_defaults(func=cmd_keys_ls)
    revoke = keys_sub.add_parser("revoke", help="revoke a key at once")
    revoke.add_argument("id", help="the key's id (`stoker keys ls`)")
    revoke.set_defaults(func=cmd_keys_revoke)
    for command in (deploy, ls, describe, logs, rm, create, keys_ls, revoke):
        add_url_option(command)


def _duration_or_off(value: str) -> float | None:
    """A duration, or None for `off` (or any zero duration): a setting that can be switched off."""
    if value.strip().lower() == "off":
        return None
    return duration(value) or None


def _lines(value: str) -> int:
    if not value.isdigit() or int(value) > 10_000:
        raise argparse.ArgumentTypeError(f"must be a number of lines in 0..10000, got {value!r}")
    return int(value)


def _admin_key(args: argparse.Namespace) -> str | None:
    from stoker.http import is_loopback

    admin_key = os.environ.get("STOKER_ADMIN_KEY") or None
    if admin_key is None and not is_loopback(args.host) and not args.allow_open:
        raise CLIError(
            f"refusing to serve {args.host} without STOKER_ADMIN_KEY (anyone reaching it could deploy "
            "and call models): set STOKER_ADMIN_KEY, or pass --allow-open"
        )
    return admin_key


def _log_setup(args: argparse.Namespace) -> None:
    import logging

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def _activator_config(args: argparse.Namespace):
    from activator import ActivatorConfig

    try:
        return ActivatorConfig(
            max_queued=args.max_queued,
            hold_deadline_s=args.hold_deadline,
            keepalive_interval_s=args.keepalive_interval,
            first_byte_timeout_s=args.first_byte_timeout,
            stream_headers_timeout_s=args.stream_headers_timeout,
            eject_after=args.eject_after,
            eject_base_s=args.eject_time,
            eject_max_s=max(300.0, args.eject_time),
            replace_after_ejections=args.replace_after_ejections,
            health_interval_s=args.health_interval,
            health_timeout_s=args.health_timeout,
        )
    except ValueError as exc:
        raise CLIError(str(exc)) from None


def _default_limits(args: argparse.Namespace):
    from stoker.limits import Limits
    from stoker.openai_errors import APIError

    try:
        return Limits.parse(
            {"rps": args.key_rps, "tpm": args.key_tpm, "max_concurrent": args.key_max_concurrent}, "key_"
        )
    except APIError as exc:
        raise CLIError(exc.message.replace("'key_", "'--key-").replace("_", "-")) from None


def _platform(args: argparse.Namespace, **extra):
    from snapshots.errors import SnapshotError
    from snapshots.sizes import parse_size
    from stoker.paths import data_dir, snapshot_store_dir
    from stoker.platform import Platform, VllmOptions
    from warm_pool.fleet import Devices

    try:
        vllm = VllmOptions(args.vllm, tuple(shlex.split(args.vllm_args)), args.vllm_cpu_kv_cache)
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
            devices = _gpu_devices()
        kv = parse_size(args.instance_kv)
    except (SnapshotError, ValueError) as exc:
        raise CLIError(f"--device-memory/--instance-kv: {exc}") from None
    return Platform(
        data_dir(),
        store_dir=snapshot_store_dir(),
        stable_window_s=args.stable_window,
        vllm=vllm,
        unavailable_after=args.unavailable_after,
        devices=devices,
        instance_kv_bytes=kv,
        **extra,
    )


def _gpu_devices():
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


def _access(args: argparse.Namespace, admin_key: str | None, default_limits):
    import logging

    from stoker.gateway import Access
    from stoker.http import own_origins
    from stoker.keys import KeyStore
    from stoker.paths import data_dir

    keys = KeyStore(data_dir() / "stoker.db")
    if admin_key is None:
        log = logging.getLogger("stoker.up")
        if len(keys) == 0:
            log.warning(
                "OPEN MODE: no STOKER_ADMIN_KEY and no API keys; anyone who can reach %s:%d may deploy "
                "and call every model. Set STOKER_ADMIN_KEY to require keys.",
                args.host,
                args.port,
            )
        else:
            log.warning(
                "no STOKER_ADMIN_KEY: /v1 takes the %d API key(s), but the admin API is open to anyone "
                "who can reach %s:%d",
                len(keys),
                args.host,
                args.port,
            )
    return Access(admin_key, keys, own_origins(args.host, args.port), default_limits)


def _serve(app, args: argparse.Namespace, platform=None, holder: dict | None = None) -> int:
    """Serve `app` until SIGTERM; `holder["server"]` is the server, for whoever must stop it."""
    from stoker.http import make_server, run_server

    server = make_server(app, host=args.host, port=args.port, log_level=args.log_level, grace_period_s=60)
    if holder is not None:
        holder["server"] = server
    if platform is not None:
        platform.stopping = lambda: server.should_exit
    return 0 if run_server(server) else 1


def cmd_up(args: argparse.Namespace) -> int:
    from stoker.gateway import build_gateway

    admin_key = _admin_key(args)
    _log_setup(args)
    activator_config, limits = _activator_config(args), _default_limits(args)
    platform = _platform(args, activator_config=activator_config)
    app = build_gateway(platform, access=_access(args, admin_key, limits))
    return _serve(app, args, platform)


def cmd_deploy(args: argparse.Namespace) -> int:
    from stoker.registry import policy_error

    if (message := policy_error(args.policy)) is not None:
        close = difflib.get_close_matches(args.policy, POLICIES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        # Before reaching for the platform: the answer does not depend on it.
        raise CLIError(message.rstrip(".") + hint)
    body = {
        "name": args.name,
        "model": _model(args.model),
        "engine": args.engine,
        "policy": args.policy,
        "min_warm": args.min_warm,
        "max": args.max,
        "idle_timeout_s": args.idle_timeout,
        "target_concurrency": args.target_concurrency,
        "grace_period_s": args.grace_period,
    }
    out = call(args, "POST", "/admin/v1/deployments", body)
    if args.json:
        print(json.dumps(out))
    else:
        print(
            f"deployed {out['name']}: model {out['model']} (snapshot {out['snapshot_id'][:12]}), "
            f"engine {out['engine']}, policy {out['policy']}"
        )
    return 0


def _model(model: str) -> str:
    """A local path as the platform must see it: absolute, since `stoker up` runs elsewhere. Only
    what is spelled as a path and exists here is touched; names, ids, s3:// and Hugging Face repo
    ids (`org/name`, resolved by the platform in its Hugging Face cache) go as given."""
    path = Path(model).expanduser()
    if model.startswith((".", "/", "~")) or (os.sep in model and path.exists()):
        return str(path.resolve()) if path.exists() else model
    return model


def _deployments(args: argparse.Namespace) -> list[dict]:
    if getattr(args, "name", None):
        return [call(args, "GET", f"/admin/v1/deployments/{urllib.parse.quote(args.name, safe='')}")]
    return call(args, "GET", "/admin/v1/deployments")["data"]


def _ago(epoch: float) -> str:
    return f"{format_duration(max(0, round(time.time() - epoch)))} ago"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "~"


def cmd_ls(args: argparse.Namespace) -> int:
    data = _deployments(args)
    if args.json:
        print(json.dumps(data))
        return 0
    head = f"{'NAME':<20} {'MODEL':<24} {'ENGINE':<6} {'POLICY':<10} {'MIN':>3} {'MAX':>3} {'READY':>5}"
    print(f"{head} {'ASLEEP':>6}  INSTANCES")
    for d in data:
        n = d["instances"]
        counts = ", ".join(f"{k} {state}" for state, k in n.items() if k) or "none"
        print(
            f"{d['name']:<20} {d['model'][:24]:<24} {d['engine']:<6} {d['policy']:<10} {d['min_warm']:>3}"
            f" {d['max']:>3} {n['READY']:>5} {n['SLEEPING']:>6}  {counts}"
        )
        for i in d.get("instance_list") or []:
            if i.get("device"):  # on a shared device: where, and how much it holds there
                print(
                    f"  {i['id']:<30} {i['state']:<10} {i['device']:<6} {format_size(i['reserved_bytes'] or 0)}"
                )
        failure = d.get("last_failure")
        if d.get("unavailable"):
            print(f"  unavailable: {d['unavailable']}")
        elif d.get("failed_starts") and failure:
            # Starts fail but not (yet) enough in a row to refuse requests: say so, briefly.
            line = f"failing: {d['failed_starts']} failed start(s) in a row, last {_ago(failure['at'])}: "
            print("  " + _clip(line + failure["headline"], 160))
    return 0


def cmd_describe(args: argparse.Namespace) -> int:
    [d] = _deployments(args)
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    for line in describe_lines(d):
        print(line)
    return 0


def describe_lines(d: dict) -> list[str]:
    """`stoker describe`: everything about one deployment, as `kubectl describe` lays it out."""
    counts = ", ".join(f"{k} {state}" for state, k in d["instances"].items() if k) or "none"
    out = [
        f"Name:            {d['name']}",
        f"Model:           {d['model']} (snapshot {d['snapshot_id'][:12]})",
        f"Engine:          {d['engine']}",
        f"Policy:          {d['policy']} (min warm {d['min_warm']}, max {d['max']}, "
        f"target concurrency {d['target_concurrency']})",
        f"Idle timeout:    {format_duration(d['idle_timeout_s'])}",
        f"Grace period:    {format_duration(d['grace_period_s'])}",
        f"Instances:       {counts}",
    ]
    if rows := d.get("instance_list"):
        out.append(f"  {'ID':<30} {'STATE':<10} {'SINCE':<12} {'DEVICE':<16} URL")
        for i in rows:
            state = f"{i['state']}/{i['phase']}" if i.get("phase") else i["state"]
            device = f"{i['device']} {format_size(i['reserved_bytes'] or 0)}" if i.get("device") else "-"
            out.append(f"  {i['id']:<30} {state:<10} {_ago(i['since']):<12} {device:<16} {i['url'] or '-'}")
    decision = d.get("decision")
    if decision is None:
        out.append("Last decision:   none yet")
    else:
        forecast = (
            f", forecast {decision['forecast']:.3g} req/s" if decision.get("forecast") is not None else ""
        )
        why = f": {decision['reason']}" if decision.get("reason") else ""
        out.append(
            f"Last decision:   ready {decision['ready']}, sleeping {decision['sleeping']}{forecast}{why}"
        )
    out.append(f"Unavailable:     {d.get('unavailable') or '-'}")
    failure = d.get("last_failure")
    if failure is None:
        out.append("Last failure:    none")
        return out
    code = f", exit code {failure['exit_code']}" if failure.get("exit_code") is not None else ""
    when = datetime.datetime.fromtimestamp(failure["at"]).strftime("%Y-%m-%d %H:%M:%S")
    out += [
        f"Last failure:    {when} ({_ago(failure['at'])}), instance {failure['instance']}",
        f"  phase:         {failure['phase']}{code}; failed starts in a row: {d.get('failed_starts', 0)}",
        f"  message:       {failure['message']}",
    ]
    if failure.get("log_tail"):
        out.append(
            f"  log (last lines; all of it: stoker logs {d['name']} --instance {failure['instance']}):"
        )
        out += [f"    {line}" for line in failure["log_tail"]]
    return out


def cmd_logs(args: argparse.Namespace) -> int:
    query = {"tail": args.tail, "follow": "true" if args.follow else "false"}
    if args.instance:
        query["instance"] = args.instance
    name = urllib.parse.quote(args.name, safe="")
    stream(
        args,
        f"/admin/v1/deployments/{name}/logs?{urllib.parse.urlencode(query)}",
        sys.stdout.buffer,
        follow=args.follow,
    )
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    call(args, "DELETE", f"/admin/v1/deployments/{urllib.parse.quote(args.name, safe='')}")
    print(f"removed {args.name}")
    return 0


def cmd_keys_create(args: argparse.Namespace) -> int:
    body = {"tenant": args.tenant, "deployments": args.deployment}
    body |= {k: v for k in ("rps", "tpm", "max_concurrent") if (v := getattr(args, k)) is not None}
    out = call(args, "POST", "/admin/v1/keys", body)
    if args.json:
        print(json.dumps({"id": out["id"], "key": out["key"]}))
    else:
        print(f"key {out['id']} for tenant {out['tenant']} ({', '.join(out['deployments'])}){_limits(out)}:")
        print(out["key"])
        print("(shown once: it is stored hashed)")
    return 0


def cmd_keys_ls(args: argparse.Namespace) -> int:
    data = call(args, "GET", "/admin/v1/keys")["data"]
    if args.json:
        print(json.dumps(data))
        return 0
    print(f"{'ID':<22} {'TENANT':<20} {'CREATED':<20} DEPLOYMENTS")
    for k in data:
        created = datetime.datetime.fromtimestamp(k["created"]).strftime("%Y-%m-%d %H:%M:%S")
        print(f"{k['id']:<22} {k['tenant']:<20} {created:<20} {', '.join(k['deployments'])}{_limits(k)}")
    return 0


def _limits(key: dict) -> str:
    """A key's own limits, as `stoker keys create` takes them; empty when it sets none."""
    named = [
        (f"{v:g} rps" if n == "rps" else f"{v} {n.replace('_', '-')}")
        for n in ("rps", "tpm", "max_concurrent")
        if (v := key.get(n)) is not None
    ]
    return f" [{', '.join(named)}]" if named else ""


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    call(args, "DELETE", f"/admin/v1/keys/{urllib.parse.quote(args.id, safe='')}")
    print(f"revoked {args.id}")
    return 0
