"""`stoker revisions`, `stoker traffic`, `stoker rollback`: a deployment's history and where its
traffic goes (the admin API's `stoker.api.revisions`).

    stoker revisions chat [--json]      every revision: traffic share, state, snapshot
    stoker traffic chat 4=10 3=90       a canary: one user (`user` / x-stoker-session) sees one side
    stoker rollback chat [--to 3]       back to an earlier revision's exact snapshot and settings
"""

from __future__ import annotations

import argparse
import json
import urllib.parse

from stoker.cli.admin_client import add_url_args, call
from stoker.errors import CLIError


def register(sub: argparse._SubParsersAction) -> None:
    revisions = sub.add_parser("revisions", help="a deployment's revisions, their traffic and state")
    revisions.add_argument("name", help="the deployment")
    revisions.add_argument("--json", action="store_true", help="print a JSON list")
    revisions.set_defaults(func=cmd_revisions)

    traffic = sub.add_parser("traffic", help="split a deployment's traffic between revisions by percent")
    traffic.add_argument("name", help="the deployment")
    traffic.add_argument(
        "split",
        nargs="+",
        type=_share,
        metavar="REV=PERCENT",
        help="e.g. 4=10 3=90 (whole percents, sum 100)",
    )
    traffic.add_argument("--json", action="store_true", help="print the revisions as JSON")
    traffic.set_defaults(func=cmd_traffic)

    rollback = sub.add_parser(
        "rollback",
        help="return to an earlier revision's exact snapshot and settings (warm before the switch)",
    )
    rollback.add_argument("name", help="the deployment")
    rollback.add_argument(
        "--to", type=_revision, metavar="REV", help="the revision (default: the one before the serving one)"
    )
    rollback.add_argument("--json", action="store_true", help="print the revisions as JSON")
    rollback.set_defaults(func=cmd_rollback)
    for command in (revisions, traffic, rollback):
        add_url_args(command)


def _revision(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"must be a revision number (1, 2, ...), got {value!r}")
    return int(value)


def _share(value: str) -> tuple[int, int]:
    rev, sep, percent = value.partition("=")
    if not sep or not rev.isdigit() or not percent.isdigit() or int(percent) > 100:
        raise argparse.ArgumentTypeError(f"a revision = a whole percent 0..100, e.g. 3=90; got {value!r}")
    return int(rev), int(percent)


def _path(name: str, tail: str) -> str:
    return f"/admin/v1/deployments/{urllib.parse.quote(name, safe='')}/{tail}"


def cmd_revisions(args: argparse.Namespace) -> int:
    rows = call(args, "GET", _path(args.name, "revisions"))["data"]
    _print(args, rows)
    return 0


def cmd_traffic(args: argparse.Namespace) -> int:
    split: dict[str, int] = {}
    for rev, percent in args.split:
        if str(rev) in split:
            raise CLIError(f"revision {rev} is given twice")
        split[str(rev)] = percent
    out = call(args, "PUT", _path(args.name, "traffic"), {"traffic": split})
    _print(args, out["revisions"])
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    body = {"to": args.to} if args.to is not None else {}
    out = call(args, "POST", _path(args.name, "rollback"), body)
    if not args.json:
        print(f"rolling {args.name} back to revision {out['revision']} (snapshot {out['snapshot_id'][:12]})")
    _print(args, out["revisions"])
    return 0


def _print(args: argparse.Namespace, rows: list[dict]) -> None:
    if args.json:
        print(json.dumps(rows))
        return
    print(
        f"{'REVISION':<9} {'TRAFFIC':>7}  {'STATE':<10} {'READY':>5}  {'ENGINE':<6} {'SNAPSHOT':<12}  MODEL"
    )
    for r in rows:
        state = r["state"].split(":", 1)[0]
        print(
            f"{r['revision']:<9} {str(r['traffic_percent']) + '%':>7}  {state:<10} {r['ready']:>5}  "
            f"{r['engine']:<6} {r['snapshot_id'][:12]:<12}  {r['model']}"
        )
    for r in rows:  # why a revision failed or was rolled back, in full
        if ":" in r["state"]:
            print(f"revision {r['revision']}: {r['state']}")
