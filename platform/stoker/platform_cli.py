"""`stoker up`, `stoker deploy`, `stoker ls`, `stoker rm`, `stoker keys`: run the platform, and
manage its deployments and API keys.

`up` runs the gateway in the foreground. The others talk to a running platform's admin API at
`$STOKER_URL` (default http://127.0.0.1:8080), with `$STOKER_ADMIN_KEY` as their bearer key when
set, and print one line on any error.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import urllib.error
import urllib.parse
import urllib.request

from stoker.errors import CLIError
from stoker.paths import add_store_option
from warm_pool.policies import DEFAULT_POLICY, POLICIES

DEFAULT_URL = "http://127.0.0.1:8080"


def add_parsers(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser("up", help="run the platform (gateway, activators, warm pools) in the foreground")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8080)
    up.add_argument(
        "--allow-open",
        action="store_true",
        help="serve a non-loopback address without STOKER_ADMIN_KEY (anyone who reaches it is admin)",
    )
    up.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    up.add_argument(
        "--stable-window", type=float, default=60.0, help="seconds a scale-down waits (default 60)"
    )
    up.add_argument(
        "--hold-deadline", type=float, default=120.0, help="seconds a request may wait for capacity"
    )
    up.add_argument("--max-queued", type=int, default=100, help="requests held per deployment at once")
    up.add_argument(
        "--keepalive-interval",
        type=float,
        default=5.0,
        help="seconds between the SSE comments a held stream gets (default 5)",
    )
    up.add_argument(
        "--first-byte-timeout",
        type=float,
        default=300.0,
        help="seconds a plain request waits for its whole answer's headers (default 300)",
    )
    up.add_argument(
        "--stream-headers-timeout",
        type=float,
        default=10.0,
        help="seconds a stream waits for an instance's headers before it is retried elsewhere (default 10)",
    )
    up.add_argument(
        "--eject-after", type=int, default=3, help="failures in a row that take an instance out of routing"
    )
    up.add_argument(
        "--eject-time",
        type=float,
        default=10.0,
        help="seconds the first ejection lasts; doubled on each one in a row, up to 300 (default 10)",
    )
    up.add_argument(
        "--replace-after-ejections",
        type=int,
        default=3,
        help="ejections in a row after which an instance is replaced as stopped or wedged (default 3)",
    )
    up.add_argument(
        "--health-interval", type=float, default=5.0, help="seconds between probes of each instance's /health"
    )
    up.add_argument(
        "--health-timeout", type=float, default=2.0, help="seconds a /health probe may take (default 2)"
    )
    up.add_argument(
        "--vllm",
        metavar="CMD",
        help="the command that runs vLLM's CLI (default: $STOKER_VLLM, else `vllm` on PATH)",
    )
    up.add_argument(
        "--vllm-args",
        metavar="ARGS",
        default="",
        help="extra arguments for every vLLM instance, e.g. '--enforce-eager' (one quoted string)",
    )
    up.add_argument(
        "--vllm-cpu-kv-cache",
        metavar="GIB",
        type=float,
        default=1.0,
        help="GiB of host memory for each vLLM CPU instance's KV cache (default 1)",
    )
    limits = up.add_argument_group("limits of tenant keys that set none of their own (default: none)")
    limits.add_argument("--key-rps", type=float, metavar="R", help="requests per second per key")
    limits.add_argument(
        "--key-tpm", type=int, metavar="T", help="tokens (prompt + completion) per minute per key"
    )
    limits.add_argument(
        "--key-max-concurrent", type=int, metavar="N", help="requests held + in flight at once per key"
    )
    add_store_option(up)
    up.set_defaults(func=cmd_up)

    deploy = sub.add_parser("deploy", help="create or update a deployment")
    deploy.add_argument("name")
    deploy.add_argument(
        "--model",
        required=True,
        help="snapshot name or id, s3://bucket/prefix, or a local model dir or .gguf file",
    )
    deploy.add_argument("--engine", choices=["cpu", "vllm"], default="cpu")
    deploy.add_argument(
        "--policy",
        default=DEFAULT_POLICY,
        help=f"scaling policy: {', '.join(POLICIES)} (default {DEFAULT_POLICY})",
    )
    deploy.add_argument("--min-warm", type=int, default=0, help="instances kept READY even when idle")
    deploy.add_argument("--max", type=int, default=1, help="instances at most")
    deploy.add_argument(
        "--idle-timeout", type=float, default=300.0, help="seconds without requests before zero"
    )
    deploy.add_argument("--target-concurrency", type=int, default=4, help="in-flight requests per instance")
    deploy.add_argument(
        "--grace-period", type=float, default=30.0, help="seconds draining requests may finish"
    )
    deploy.add_argument("--json", action="store_true")
    deploy.set_defaults(func=cmd_deploy)

    ls = sub.add_parser("ls", help="list deployments and their instances")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_ls)

    rm = sub.add_parser("rm", help="drain and remove a deployment")
    rm.add_argument("name")
    rm.set_defaults(func=cmd_rm)

    keys = sub.add_parser("keys", help="API keys: which tenant may call which deployments")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True, metavar="COMMAND")
    create = keys_sub.add_parser("create", help="make a key (printed once, never stored in clear)")
    create.add_argument("--tenant", required=True)
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
    create.add_argument("--json", action="store_true")
    create.set_defaults(func=cmd_keys_create)
    keys_ls = keys_sub.add_parser("ls", help="list keys (id, tenant, deployments, created; never the key)")
    keys_ls.add_argument("--json", action="store_true")
    keys_ls.set_defaults(func=cmd_keys_ls)
    revoke = keys_sub.add_parser("revoke", help="revoke a key at once")
    revoke.add_argument("id")
    revoke.set_defaults(func=cmd_keys_revoke)


def cmd_up(args: argparse.Namespace) -> int:
    import logging

    from activator import ActivatorConfig
    from stoker.gateway import Access, build_gateway
    from stoker.http import is_loopback, make_server, own_origins, run_server
    from stoker.keys import KeyStore
    from stoker.limits import Limits
    from stoker.openai_errors import APIError
    from stoker.paths import data_dir, snapshot_store_dir
    from stoker.platform import Platform, VllmOptions

    admin_key = os.environ.get("STOKER_ADMIN_KEY") or None
    if admin_key is None and not is_loopback(args.host) and not args.allow_open:
        raise CLIError(
            f"refusing to serve {args.host} without STOKER_ADMIN_KEY (anyone reaching it could deploy "
            "and call models): set STOKER_ADMIN_KEY, or pass --allow-open"
        )
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        activator_config = ActivatorConfig(
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
        vllm = VllmOptions(args.vllm, tuple(shlex.split(args.vllm_args)), args.vllm_cpu_kv_cache)
        default_limits = Limits.parse(
            {"rps": args.key_rps, "tpm": args.key_tpm, "max_concurrent": args.key_max_concurrent}, "key_"
        )
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    except APIError as exc:
        raise CLIError(exc.message.replace("'key_", "'--key-").replace("_", "-")) from None
    platform = Platform(
        data_dir(),
        store_dir=snapshot_store_dir(),
        activator_config=activator_config,
        stable_window_s=args.stable_window,
        vllm=vllm,
    )
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
    access = Access(admin_key, keys, own_origins(args.host, args.port), default_limits)
    app = build_gateway(platform, access=access)
    server = make_server(app, host=args.host, port=args.port, log_level=args.log_level, grace_period_s=60)
    return 0 if run_server(server) else 1


def cmd_deploy(args: argparse.Namespace) -> int:
    from stoker.registry import policy_error

    if (message := policy_error(args.policy)) is not None:
        raise CLIError(message)  # before reaching for the platform: the answer does not depend on it
    body = {
        "name": args.name,
        "model": args.model,
        "engine": args.engine,
        "policy": args.policy,
        "min_warm": args.min_warm,
        "max": args.max,
        "idle_timeout_s": args.idle_timeout,
        "target_concurrency": args.target_concurrency,
        "grace_period_s": args.grace_period,
    }
    out = _call("POST", "/admin/v1/deployments", body)
    if args.json:
        print(json.dumps(out))
    else:
        print(
            f"deployed {out['name']}: model {out['model']} (snapshot {out['snapshot_id'][:12]}), "
            f"engine {out['engine']}, policy {out['policy']}"
        )
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    data = _call("GET", "/admin/v1/deployments")["data"]
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
        if d.get("unavailable"):
            print(f"  unavailable: {d['unavailable']}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    _call("DELETE", f"/admin/v1/deployments/{args.name}")
    print(f"removed {args.name}")
    return 0


def cmd_keys_create(args: argparse.Namespace) -> int:
    body = {"tenant": args.tenant, "deployments": args.deployment}
    body |= {k: v for k in ("rps", "tpm", "max_concurrent") if (v := getattr(args, k)) is not None}
    out = _call("POST", "/admin/v1/keys", body)
    if args.json:
        print(json.dumps({"id": out["id"], "key": out["key"]}))
    else:
        print(f"key {out['id']} for tenant {out['tenant']} ({', '.join(out['deployments'])}){_limits(out)}:")
        print(out["key"])
        print("(shown once: it is stored hashed)")
    return 0


def cmd_keys_ls(args: argparse.Namespace) -> int:
    import datetime

    data = _call("GET", "/admin/v1/keys")["data"]
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
    _call("DELETE", f"/admin/v1/keys/{urllib.parse.quote(args.id, safe='')}")
    print(f"revoked {args.id}")
    return 0


def _call(method: str, path: str, body: dict | None = None) -> dict:
    base = os.environ.get("STOKER_URL", DEFAULT_URL).rstrip("/")
    data = json.dumps(body).encode() if body is not None else None
    headers = {"content-type": "application/json"}
    if admin_key := os.environ.get("STOKER_ADMIN_KEY"):
        headers["authorization"] = f"Bearer {admin_key}"
    request = urllib.request.Request(base + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = f"HTTP {exc.code}"
        raise CLIError(message) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise CLIError(f"cannot reach the platform at {base} ({reason}); is `stoker up` running?") from None
