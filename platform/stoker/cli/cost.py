"""`stoker cost`: what each deployment cost, per 1k tokens and per 1k requests, and its idle share
(the admin API's `stoker.api.cost`; the definitions are `stoker.control.cost`'s).

    stoker cost [--since 1h] [--json]
"""

from __future__ import annotations

import argparse
import json
import urllib.parse

from stoker.cli.admin_client import add_url_args, call
from stoker.errors import CLIError
from stoker.spec.cost import HISTORY_S
from stoker.spec.durations import duration


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cost", help="cost per deployment and revision: $, per 1k tokens and requests, idle share"
    )
    p.add_argument(
        "--since",
        type=duration,
        metavar="DURATION",
        help="only the last DURATION (e.g. 15m, 1h; at most 24h, by whole minutes; default: since the platform started)",
    )
    p.add_argument("--json", action="store_true", help="print a JSON list, one object per deployment")
    add_url_args(p)
    p.set_defaults(func=cmd_cost)


def cmd_cost(args: argparse.Namespace) -> int:
    path = "/admin/v1/cost"
    if args.since is not None:
        if not 1 <= args.since <= HISTORY_S:
            raise CLIError(
                f"--since must be at least 1s and at most 24h (the history kept), got {args.since:g} s"
            )
        path += "?" + urllib.parse.urlencode({"since": f"{args.since:.3f}s"})
    rows = call(args, "GET", path)["data"]
    if args.json:
        print(json.dumps(rows))
    else:
        print(format_table(rows))
    return 0


def _money(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_table(rows: list[dict]) -> str:
    head = ("DEPLOYMENT", "REV", "COST $", "$/1K TOKENS", "$/1K REQ", "IDLE", "REQUESTS", "TOKENS IN/OUT")
    lines = [head]
    for row in rows:
        idle = row["idle_share"]
        for i, r in enumerate([row, *row["revisions"]]):
            lines.append(
                (
                    row["deployment"] if i == 0 else "",
                    "all" if i == 0 else str(r["revision"]),
                    _money(r["cost_usd"]),
                    _money(r["cost_per_1k_tokens"]),
                    _money(r["cost_per_1k_requests"]),
                    ("-" if idle is None else f"{idle:.1%}") if i == 0 else "",
                    str(r["requests"]),
                    f"{r['tokens_in']}/{r['tokens_out']}",
                )
            )
    if not rows:
        return "no deployments have cost anything yet"
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join(
        "  ".join(
            c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True))
        )
        for line in lines
    )
