"""The `stoker` command line: one parser, every command registered the same way.

Each command group is a module of this folder with a `register(sub)` that adds its commands to the
top parser (as vLLM's `entrypoints/cli/` does with its command classes); `COMMANDS` lists them in
the order `stoker --help` shows them. Flags that several commands share come in groups, each added
by an `add_*_args(parser)` (`add_url_args`, `add_store_args`, `add_activator_args`, …): two names,
one for a command, one for a group of flags. Heavy imports (torch, transformers) happen inside the command
that needs them, so `stoker --help` stays instant. The conventions every command shares (one-line
errors, defaults in `--help`, "did you mean") are `stoker.cli.parser`'s.

Client options (`--url`) are taken before the command too, as kubectl takes its global flags:
`stoker --url http://gw:8080 ls` is `stoker ls --url http://gw:8080`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib import metadata

from stoker.cli.admin_client import add_url_args
from stoker.cli.parser import StokerParser, run

# The command modules, in `stoker --help`'s order; each has `register(sub)`.
COMMANDS = (
    "snapshot",
    "engine",
    "vllm_serve",
    "runtime",
    "up",
    "deployments",
    "routes",
    "planes",
    "node",
    "tls",
    "simulate",
    "eval",
    "bench",
    "cost",
    "crds",
)


def version() -> str:
    try:
        return metadata.version("stoker")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = StokerParser(prog="stoker", description="Serverless inference for LLMs.")
    parser.add_argument("--version", action="version", version=f"stoker {version()}")
    add_url_args(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"stoker.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
