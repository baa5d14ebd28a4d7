"""`stoker routes create|ls|rm`: a running platform's cascade routes (`stoker.gateway.cascade`), through
its admin API (`stoker.cli.admin_client`: `--url`, `$STOKER_URL`, `$STOKER_ADMIN_KEY`), one line on
any error."""

from __future__ import annotations

import argparse
import json
import math
import urllib.parse

from stoker.cli.admin_client import add_url_args, call
from stoker.spec.routes import DEFAULT_MIN_MEAN_LOGPROB, LOGPROB_FLOOR, OUTCOMES


def register(sub: argparse._SubParsersAction) -> None:
    routes = sub.add_parser(
        "routes", help="cascade routes: a name answered by a small deployment, escalating to a large one"
    )
    routes_sub = routes.add_subparsers(dest="routes_command", required=True, metavar="COMMAND")
    create = routes_sub.add_parser("create", help="create a route, or replace the one of that name")
    create.add_argument("name", help="the route's name, which clients send as `model`")
    create.add_argument("--small", required=True, help="the deployment that answers first")
    create.add_argument(
        "--large", required=True, help="the deployment unsure answers and too-long prompts go to"
    )
    create.add_argument(
        "--min-logprob",
        type=_logprob,
        default=DEFAULT_MIN_MEAN_LOGPROB,
        metavar="X",
        help="escalate a small answer whose mean token logprob is under X (0: escalate all)",
    )
    create.add_argument(
        "--no-context-escalation",
        action="store_true",
        help="answer a prompt too long for the small deployment with its 400, not from the large one",
    )
    create.add_argument("--json", action="store_true", help="print the route as JSON")
    create.set_defaults(func=cmd_create)
    ls = routes_sub.add_parser("ls", help="list routes, with their requests by outcome")
    ls.add_argument("--json", action="store_true", help="print a JSON list")
    ls.set_defaults(func=cmd_ls)
    rm = routes_sub.add_parser("rm", help="remove a route (its deployments stay)")
    rm.add_argument("name", help="the route")
    rm.set_defaults(func=cmd_rm)
    for command in (create, ls, rm):
        add_url_args(command)


def _logprob(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        x = math.nan
    if not math.isfinite(x) or not LOGPROB_FLOOR <= x <= 0:
        raise argparse.ArgumentTypeError(f"must be a number in {LOGPROB_FLOOR:g}..0, got {value!r}")
    return x


def cmd_create(args: argparse.Namespace) -> int:
    body = {
        "name": args.name,
        "small": args.small,
        "large": args.large,
        "min_mean_logprob": args.min_logprob,
        "escalate_on_context": not args.no_context_escalation,
    }
    out = call(args, "POST", "/admin/v1/routes", body)
    if args.json:
        print(json.dumps(out))
    else:
        context = "" if out["escalate_on_context"] else ", no context escalation"
        print(
            f"route {out['name']}: {out['small']}, escalating to {out['large']} under mean logprob "
            f"{out['min_mean_logprob']:g}{context}"
        )
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    data = call(args, "GET", "/admin/v1/routes")["data"]
    if args.json:
        print(json.dumps(data))
        return 0
    print(f"{'NAME':<20} {'SMALL':<20} {'LARGE':<20} {'MIN LOGPROB':>11} {'CONTEXT':<7}  REQUESTS")
    for r in data:
        counts = r.get("requests") or {}
        total = sum(counts.values())
        escalated = total - counts.get("small", 0)
        seen = f"{total} ({escalated} escalated)" if total else "none"
        context = "yes" if r["escalate_on_context"] else "no"
        line = f"{r['name']:<20} {r['small']:<20} {r['large']:<20} {r['min_mean_logprob']:>11g} {context:<7}  {seen}"
        print(line)
        if total:
            print("  " + ", ".join(f"{o} {counts.get(o, 0)}" for o in OUTCOMES))
        if r.get("missing"):
            print(f"  not deployed: {', '.join(r['missing'])} (requests answer 503)")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    call(args, "DELETE", f"/admin/v1/routes/{urllib.parse.quote(args.name, safe='')}")
    print(f"removed route {args.name}")
    return 0
