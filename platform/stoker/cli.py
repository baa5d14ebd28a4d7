"""The `stoker` command line.

Each command group lives in its own module and registers its parser here; heavy imports (torch,
transformers) happen inside the command that needs them, so `stoker --help` stays instant.
Errors a user can cause end as one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from snapshots.errors import SnapshotError
from stoker.errors import CLIError
from stoker.paths import use_store


def build_parser() -> argparse.ArgumentParser:
    from stoker import engine_cli, platform_cli, simulate_cli, snapshot_cli

    parser = argparse.ArgumentParser(prog="stoker", description="Serverless inference for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    snapshot_cli.add_parser(sub)
    engine_cli.add_parser(sub)
    platform_cli.add_parsers(sub)
    simulate_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        use_store(getattr(args, "store", None))
        return int(args.func(args) or 0)
    except (SnapshotError, CLIError) as exc:
        print(f"stoker: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
