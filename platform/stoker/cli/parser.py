"""The CLI's conventions, shared by every command: `StokerParser` and `run`.

Errors a user can cause end as one line on stderr (`stoker: error: …`) and exit status 1, never a
traceback and never argparse's usage text: `StokerParser` makes argparse's own errors (a bad flag
value, a missing argument, an unknown command) look the same, with a "did you mean" where a
close name exists, and shows every flag's default in `--help`. `run` parses and calls the command,
turning our errors into that one line. `stoker.cli.main` builds the whole parser; the warm runtime
(`stoker.cli.runtime`) builds only `stoker engine`'s, so the two share these without importing
each other.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys

from snapshots.errors import SnapshotError
from stoker.errors import CLIError
from stoker.paths import use_store
from stoker.spec.durations import duration


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


def port(value: str) -> int:
    """An argparse type: a TCP port a server can listen on, 1..65535 (a larger number would be
    taken modulo 65536 by the socket layer, and the server would listen somewhere else)."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a port in 1..65535, got {value!r}") from None
    if not 1 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 1..65535, got {value}")
    return number


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


def run(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    """Parse `argv` and call its command; our errors become one line on stderr and status 1."""
    quiet_progress_bars()
    args = parser.parse_args(argv)
    try:
        use_store(getattr(args, "store", None))
        return int(args.func(args) or 0)
    except (SnapshotError, CLIError) as exc:
        print(f"stoker: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def duration_or_off(value: str) -> float | None:
    """A duration, or None for `off` (or any zero duration): a setting that can be switched off."""
    if value.strip().lower() == "off":
        return None
    return duration(value) or None
