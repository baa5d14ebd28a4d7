"""The `stoker` command line.

Each command group lives in its own module and registers its parser here; heavy imports (torch,
transformers) happen inside the command that needs them, so `stoker --help` stays instant.
Errors a user can cause end as one line on stderr (`stoker: error: …`) and exit status 1, never a
traceback and never argparse's usage text: `StokerParser` makes argparse's own errors (a bad flag
value, a missing argument, an unknown command) look the same, with a "did you mean" where a
close name exists, and shows every flag's default in `--help`.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from importlib import metadata

from snapshots.errors import SnapshotError
from stoker.errors import CLIError
from stoker.paths import use_store


class DefaultsFormatter(argparse.HelpFormatter):
    """Adds "(default: X)" to a flag's help, unless the help already says what the default is or
    there is none to show (None, False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        nothing = default is None or default is False or default == argparse.SUPPRESS  # 0 is a default
        if not action.option_strings or nothing or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


class StokerParser(argparse.ArgumentParser):
    """argparse with the CLI's conventions (subcommand parsers inherit the class)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # argparse's is the usage text and exit status 2
        if message.startswith("unrecognized arguments: "):
            message += _suggest(message.split()[2], _option_strings(self))
        self.exit(1, f"stoker: error: {message} (see `{self.prog} --help`)\n")

    def _check_value(self, action: argparse.Action, value) -> None:
        # argparse's own check, with a suggestion: `stoker dploy`, `--engine vlm`.
        if action.choices is not None and value not in action.choices:
            names = [str(c) for c in action.choices]
            raise argparse.ArgumentError(
                action, f"invalid choice: {value!r} (choose from {', '.join(names)}){_suggest(value, names)}"
            )


def _suggest(value: str, names: list[str]) -> str:
    close = difflib.get_close_matches(value, names, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every flag of `parser` and of the commands under it."""
    found: list[str] = []
    for action in parser._actions:
        found += action.option_strings
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _option_strings(sub)
    return found


def version() -> str:
    try:
        return metadata.version("stoker")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    from stoker import (
        cascade_cli,
        engine_cli,
        eval_cli,
        node_cli,
        planes_cli,
        platform_cli,
        serve_cli,
        simulate_cli,
        snapshot_cli,
    )

    parser = StokerParser(prog="stoker", description="Serverless inference for LLMs.")
    parser.add_argument("--version", action="version", version=f"stoker {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    snapshot_cli.add_parser(sub)
    engine_cli.add_parser(sub)
    from stoker.engine import runtime  # `stoker runtime`: the warm-runtime tier's process

    runtime.add_parser(sub)
    serve_cli.add_parser(sub)
    platform_cli.add_parsers(sub)
    cascade_cli.add_parser(sub)
    planes_cli.add_parsers(sub)
    node_cli.add_parser(sub)
    simulate_cli.add_parser(sub)
    eval_cli.add_parser(sub)
    from stoker import bench_cli  # capacity planning: `stoker bench`, `stoker plan`

    bench_cli.add_parsers(sub)
    from stoker import cost_cli  # live cost: `stoker cost`

    cost_cli.add_parser(sub)
    return parser


def quiet_progress_bars() -> None:
    """No progress bars where nobody watches: transformers and huggingface_hub draw theirs on
    stderr, which in a pipe or a log file (an engine's) is only noise. Set before they are imported
    (both read the variable then); a user who sets it keeps their choice."""
    if sys.stderr.isatty():
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    quiet_progress_bars()
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
