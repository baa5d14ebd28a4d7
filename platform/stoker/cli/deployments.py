"""`stoker deploy`, `stoker ls`, `stoker describe`, `stoker logs`, `stoker rm`, `stoker keys`:
manage a running platform's deployments and API keys (`stoker up` is `stoker.cli.up`'s).

They talk to a running platform's admin API at
`--url` (default `$STOKER_URL`, else http://127.0.0.1:8080: `stoker.cli.admin_client`), with
`$STOKER_ADMIN_KEY` as their bearer key when set, and print one line on any error. Flags that take
seconds take durations too (`90s`, `5m`, `1h30m`: `stoker.spec.durations`).
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import json
import os
import sys
import time
import urllib.parse
from pathlib import Path

from snapshots.sizes import format_size
from stoker.cli import revisions as revision_commands
from stoker.cli.admin_client import add_url_args, call, stream
from stoker.cli.engine_settings import add_engine_args, engine_body, engine_line
from stoker.errors import CLIError
from stoker.spec.deployment import BALANCES, ENGINES, default
from stoker.spec.durations import duration, format_duration
from warm_pool.policies import POLICIES


def seconds(field: str) -> str:
    """A duration field's default as the flag is written: `seconds("idle_timeout_s")` is "5m"."""
    return format_duration(default(field))


def register(sub: argparse._SubParsersAction) -> None:
    deploy = sub.add_parser("deploy", help="create or update a deployment")
    deploy.add_argument("name", help="the deployment's name, which clients send as `model`")
    deploy.add_argument(
        "--model",
        help="snapshot name or id, s3://bucket/prefix, a local model dir or .gguf file, or a Hugging Face "
        "repo id (org/name[@revision]) already in the local Hugging Face cache",
    )
    deploy.add_argument(
        "--adapter",
        help="a LoRA adapter instead of a model (a snapshot, s3://bucket/prefix or a local PEFT dir), "
        "served by the instances of --base",
    )
    deploy.add_argument("--base", help="with --adapter: the deployment whose instances serve it")
    deploy.add_argument(
        "--engine", choices=ENGINES, default=default("engine"), help="the engine its instances run"
    )
    deploy.add_argument("--policy", default=default("policy"), help=f"scaling policy: {', '.join(POLICIES)}")
    deploy.add_argument(
        "--min-warm", type=int, default=default("min_warm"), help="instances kept READY even when idle"
    )
    deploy.add_argument("--max", type=int, default=default("max"), help="instances at most")
    deploy.add_argument(
        "--idle-timeout",
        type=duration,
        default=seconds("idle_timeout_s"),
        help="how long without requests before zero instances",
    )
    deploy.add_argument(
        "--target-concurrency",
        type=int,
        default=default("target_concurrency"),
        help="in-flight requests per instance",
    )
    deploy.add_argument(
        "--max-instance-age",
        type=duration,
        default=seconds("max_instance_age_s"),
        metavar="DURATION",
        help="replace an instance READY for longer, without a dip: a new one READY first, then the old one "
        "drained (default 0: the platform's --max-instance-age, off unless it sets one)",
    )
    deploy.add_argument(
        "--grace-period",
        type=duration,
        default=seconds("grace_period_s"),
        help="how long draining requests may take to finish",
    )
    deploy.add_argument(
        "--balance",
        choices=BALANCES,
        default=default("balance"),
        help="which READY instance takes a request: the least busy, or the one that served the same "
        "prompt prefix (bounded by --affinity-bound)",
    )
    deploy.add_argument(
        "--affinity-bound",
        type=float,
        default=default("affinity_bound"),
        help="prefix mode: no instance above this × the mean load",
    )
    deploy.add_argument(
        "--canary",
        type=int,
        metavar="PERCENT",
        help="an update takes only this share of the traffic once warm; the rest stays where it is",
    )
    deploy.add_argument(
        "--auto-rollback",
        action="store_true",
        help="as a canary, this revision rolls itself back when it fails (5xx or slow first bytes)",
    )
    deploy.add_argument(
        "--rollback-error-rate",
        type=float,
        default=default("rollback_error_rate"),
        help="the share of failed answers that fails a canary",
    )
    deploy.add_argument(
        "--rollback-ttft",
        type=duration,
        default=seconds("rollback_ttft_s"),
        help="a first byte later than this is a failed answer (0s: no such objective)",
    )
    deploy.add_argument(
        "--rollback-window",
        type=duration,
        default=seconds("rollback_window_s"),
        help="the window a canary is judged over",
    )
    deploy.add_argument(
        "--rollback-min-requests",
        type=int,
        default=default("rollback_min_requests"),
        help="answers in the window before a canary is judged",
    )
    deploy.add_argument(
        "--log-requests", action="store_true", help="this revision's requests in the request log (no content)"
    )
    deploy.add_argument(
        "--log-content",
        action="store_true",
        help="prompts and answers in the request log too, secrets masked",
    )
    add_engine_args(deploy)
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
    create.add_argument(
        "--priority",
        type=int,
        help="its requests' priority where they name none, -1000..1000, lower served first (default: 0)",
    )
    create.add_argument(
        "--priority-min",
        type=int,
        help="the lowest priority its requests may ask for; one below it is refused (default: any)",
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
        add_url_args(command)
    revision_commands.register(sub)


def _lines(value: str) -> int:
    if not value.isdigit() or int(value) > 10_000:
        raise argparse.ArgumentTypeError(f"must be a number of lines in 0..10000, got {value!r}")
    return int(value)


def cmd_deploy(args: argparse.Namespace) -> int:
    from stoker.spec.deployment import policy_error

    if (message := policy_error(args.policy)) is not None:
        close = difflib.get_close_matches(args.policy, POLICIES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        # Before reaching for the platform: the answer does not depend on it.
        raise CLIError(message.rstrip(".") + hint)
    if args.adapter is not None or args.base is not None:
        return _deploy_adapter(args)
    if args.model is None:
        raise CLIError("--model is required (or --adapter with --base, for a LoRA adapter)")
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
        "max_instance_age_s": args.max_instance_age,
        "balance": args.balance,
        "affinity_bound": args.affinity_bound,
        **_revision_fields(args),
        **engine_body(args),
    }
    out = _post_deploy(args, body)
    if out is None:
        return 0
    new = out["deployed"]
    state = new["state"]
    if state == "warming":
        share = f"{args.canary}% of the traffic" if args.canary is not None else "the traffic"
        state += f"; {share} moves to it once it is READY (`stoker revisions {out['name']}`)"
    print(
        f"deployed {out['name']} revision {new['revision']}: model {new['model']} "
        f"(snapshot {new['snapshot_id'][:12]}), engine {new['engine']}, policy {new['settings']['policy']}: {state}"
    )
    return 0


def _deploy_adapter(args: argparse.Namespace) -> int:
    """`stoker deploy NAME --adapter SRC --base BASE`: the adapter's own settings only; the rest is
    its base's (the platform refuses them if set)."""
    if args.model is not None:
        raise CLIError("--model and --adapter exclude each other: an adapter runs on --base's model")
    if args.adapter is None or args.base is None:
        raise CLIError("--adapter and --base go together: the adapter, and the deployment that serves it")
    body = {"name": args.name, "adapter": _model(args.adapter), "base": args.base, **_revision_fields(args)}
    out = _post_deploy(args, body)
    if out is None:
        return 0
    new = out["deployed"]
    print(
        f"deployed {out['name']} revision {new['revision']}: adapter {new['model']} "
        f"(snapshot {new['snapshot_id'][:12]}) on {args.base}, {new['traffic_percent']}% of its traffic"
    )
    return 0


def _revision_fields(args: argparse.Namespace) -> dict:
    """What a model's deploy and an adapter's both set: the canary's rollback and the request log."""
    fields = {
        "auto_rollback": args.auto_rollback,
        "rollback_error_rate": args.rollback_error_rate,
        "rollback_ttft_s": args.rollback_ttft,
        "rollback_window_s": args.rollback_window,
        "rollback_min_requests": args.rollback_min_requests,
        "log_requests": args.log_requests,
        "log_content": args.log_content,
    }
    if args.canary is not None:
        fields["canary_percent"] = args.canary
    return fields


def _post_deploy(args: argparse.Namespace, body: dict) -> dict | None:
    """The deploy's answer; None once printed as JSON (`--json`)."""
    out = call(args, "POST", "/admin/v1/deployments", body)
    if args.json:
        print(json.dumps(out))
        return None
    return out


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
        if d.get("kind") == "adapter":  # no instances of its own
            where = f"adapter on {d['base']}"
            print(f"{d['name']:<20} {d['model'][:24]:<24} {d['engine']:<6} {where}")
            continue
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
            if i.get("held_up"):  # a start the backend says is stuck (a pod the scheduler cannot place)
                print("  " + _clip(f"{i['id']} {i['state']}, held up: {i['held_up']}", 160))
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
    if d.get("kind") == "adapter":
        split = ", ".join(f"revision {r} {p}%" for r, p in d["traffic"].items())
        return [
            f"Name:            {d['name']}",
            f"Adapter:         {d['model']} (snapshot {d['snapshot_id'][:12]})",
            f"Base:            {d['base']} (its instances serve it: `stoker describe {d['base']}`)",
            f"Revision:        {d['revision']} of {d['latest_revision']}; {split}",
        ]
    counts = ", ".join(f"{k} {state}" for state, k in d["instances"].items() if k) or "none"
    out = [
        f"Name:            {d['name']}",
        f"Model:           {d['model']} (snapshot {d['snapshot_id'][:12]})",
        f"Engine:          {d['engine']}",
        f"Policy:          {d['policy']} (min warm {d['min_warm']}, max {d['max']}, "
        f"target concurrency {d['target_concurrency']})",
        f"Idle timeout:    {format_duration(d['idle_timeout_s'])}",
        f"Grace period:    {format_duration(d['grace_period_s'])}",
        *([f"Max age:         {format_duration(age)}"] if (age := d.get("max_instance_age_s")) else []),
        f"Engine settings: {engine_line(d)}",
        f"Instances:       {counts}",
    ]
    if rows := d.get("instance_list"):
        out.append(f"  {'ID':<30} {'STATE':<10} {'SINCE':<12} {'DEVICE':<16} URL")
        for i in rows:
            state = f"{i['state']}/{i['phase']}" if i.get("phase") else i["state"]
            device = f"{i['device']} {format_size(i['reserved_bytes'] or 0)}" if i.get("device") else "-"
            out.append(f"  {i['id']:<30} {state:<10} {_ago(i['since']):<12} {device:<16} {i['url'] or '-'}")
            if i.get("held_up"):
                out.append(f"    held up: {i['held_up']}")
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


KEY_LIMITS = ("rps", "tpm", "max_concurrent", "priority", "priority_min")  # as the key body names them


def cmd_keys_create(args: argparse.Namespace) -> int:
    body = {"tenant": args.tenant, "deployments": args.deployment}
    body |= {k: v for k in KEY_LIMITS if (v := getattr(args, k)) is not None}
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
        for n in KEY_LIMITS
        if (v := key.get(n)) is not None
    ]
    return f" [{', '.join(named)}]" if named else ""


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    call(args, "DELETE", f"/admin/v1/keys/{urllib.parse.quote(args.id, safe='')}")
    print(f"revoked {args.id}")
    return 0
