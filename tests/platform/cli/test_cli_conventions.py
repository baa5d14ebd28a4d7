"""The CLI's conventions, as a user meets them: `--version`; every bad input one line on stderr
(`stoker: error: …`) and exit 1, with a "did you mean" where a close name exists; durations where
seconds are taken; `--url` on every client command, with `$STOKER_URL` named in its help; help and
a default on every flag. Real `stoker` runs, no platform needed (the live side is in
`test_cli_failures.py`)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from importlib import metadata

import pytest

from stoker.cli.main import build_parser
from tests.conftest import STOKER
from tests.deadlines import CLI, deadline
from tests.snapshots.support import assert_one_line_error

CLIENT_COMMANDS = (
    ("deploy",),
    ("ls",),
    ("describe",),
    ("logs",),
    ("rm",),
    ("keys", "create"),
    ("keys", "ls"),
    ("keys", "revoke"),
    ("revisions",),
    ("traffic",),
    ("rollback",),
    ("routes", "create"),
    ("routes", "ls"),
    ("routes", "rm"),
    ("cost",),
    ("eval",),
    ("bench",),
)


def stoker(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "STOKER_URL": "http://127.0.0.1:1", **(env or {})}
    return subprocess.run([STOKER, *args], capture_output=True, text=True, timeout=CLI, env=env)


def test_version():
    proc = stoker("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"stoker {metadata.version('stoker')}"


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["dploy", "x"], ["invalid choice: 'dploy'", "did you mean 'deploy'?"]),
        (["snapshot", "imprt", "x"], ["did you mean 'import'?"]),
        (["deploy", "x", "--model", "m", "--engine", "vlm"], ["did you mean 'vllm'?"]),
        (["deploy", "x", "--model", "m", "--idle-timout", "5m"], ["unrecognized arguments", "did you mean '--idle-timeout'?"]),
        (["deploy", "x", "--model", "m", "--policy", "kpq"], ["'policy' must be one of", "did you mean 'kpa'?"]),
        (["deploy", "x", "--model", "m", "--idle-timeout", "5x"], ["argument --idle-timeout: '5x' is not a duration", "1h30m"]),
        (["deploy", "x", "--model", "m", "--grace-period=-1s"], ["argument --grace-period: '-1s' is not a duration"]),
        (["up", "--hold-deadline", "soon"], ["argument --hold-deadline: 'soon' is not a duration"]),
        (["up", "--unavailable-after", "-1"], ["--unavailable-after must be 0 (never) or more"]),
        (["up", "--checkpoint-interval", "0.5s"], ["--checkpoint-interval must be 1s to 3600s (or off), got 0.5s"]),
        (["controller", "--checkpoint-interval", "2h"], ["--checkpoint-interval must be 1s to 3600s"]),
        (["logs", "x", "--tail", "many"], ["argument --tail: must be a number of lines"]),
        # Past 65535 the socket layer takes the port modulo 65536: `up --port 99999` listened on 34463.
        (["up", "--port", "99999"], ["argument --port: must be a port in 1..65535, got 99999"]),
        (["gateway", "--port", "0"], ["argument --port: must be a port in 1..65535, got 0"]),
        (["controller", "--port", "http"], ["argument --port: must be a port in 1..65535, got 'http'"]),
        (["node", "--controller", "http://c:1", "--node-name", "n", "--port", "70000"], ["must be a port in 1..65535"]),
        (["deploy", "x"], ["--model is required (or --adapter with --base, for a LoRA adapter)"]),
        (["deploy", "x", "--adapter", "./lora"], ["--adapter and --base go together"]),
        (["deploy", "x", "--model", "m", "--adapter", "./lora", "--base", "b"], ["--model and --adapter exclude each other"]),
        ([], ["the following arguments are required: COMMAND"]),
        (["ls", "--url", "localhost:8080"], ["--url: 'localhost:8080' is not an http:// or https:// address"]),
        (["ls"], ["cannot reach the platform at http://127.0.0.1:1"]),  # $STOKER_URL
        (["describe", "x", "--url", "http://127.0.0.1:2"], ["cannot reach the platform at http://127.0.0.1:2"]),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_exit_1_with_a_suggestion(args, fragments):
    assert_one_line_error(stoker(*args), *fragments)


def test_every_client_command_takes_url_and_its_help_names_stoker_url():
    for command in CLIENT_COMMANDS:
        proc = stoker(*command, "--help")
        assert proc.returncode == 0, proc.stderr
        assert (
            "--url URL" in proc.stdout
            and "$STOKER_URL" in proc.stdout
            and "http://127.0.0.1:8080" in proc.stdout
        )


@pytest.mark.parametrize(
    ("argv", "url"),
    [
        (["--url", "http://gw:8080", "ls"], "http://gw:8080"),  # before the command, as kubectl's flags
        (["ls", "--url", "http://gw:8080"], "http://gw:8080"),
        (["--url", "http://a:1", "ls", "--url", "http://b:2"], "http://b:2"),  # the command's own wins
        (["ls"], None),  # neither: $STOKER_URL, else the default (`admin_client.base_url`)
        (["--url", "http://gw:8080", "cost", "--since", "1h"], "http://gw:8080"),
    ],
)
def test_url_is_taken_before_the_command_too(argv, url):
    assert build_parser().parse_args(argv).url == url


def test_url_before_the_command_reaches_the_platform():
    """The real CLI: `stoker --url URL ls` names that address in its error (nothing listens there)."""
    proc = stoker("--url", "http://127.0.0.1:9", "ls")
    assert (
        proc.returncode == 1 and "http://127.0.0.1:9" in proc.stderr and "invalid choice" not in proc.stderr
    )


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("stoker",)):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def test_every_flag_has_help_and_shows_its_default():
    missing = []
    for path, parser in _parsers(build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(
                action, argparse._HelpAction | argparse._VersionAction | argparse._SubParsersAction
            ):
                continue
            shown = formatter._get_help_string(action) if action.help else ""
            if not shown:
                missing.append((" ".join(path), action.option_strings or action.dest, "no help"))
            elif (
                action.option_strings
                and action.default not in (None, False, argparse.SUPPRESS)
                and "default" not in shown
            ):
                missing.append((" ".join(path), action.option_strings, "no default"))
    assert missing == []
    deploy = stoker("deploy", "--help").stdout
    assert "(default: 5m)" in deploy and "(default: 30s)" in deploy and "(default: 0)" in deploy


def test_durations_reach_the_request():
    """What a duration flag parses to is what the deploy request carries (seconds)."""
    args = build_parser().parse_args(
        ["deploy", "x", "--model", "m", "--idle-timeout", "1h30m", "--grace-period", "90"]
    )
    assert (args.idle_timeout, args.grace_period) == (5400.0, 90.0)
    defaults = build_parser().parse_args(["up"])
    assert (defaults.hold_deadline, defaults.stable_window, defaults.unavailable_after) == (120.0, 60.0, 3)


def test_no_progress_bars_when_stderr_is_not_a_terminal():
    """`stoker snapshot import --builtin` drew transformers' bars into pipes; `stoker` turns them off
    for any command whose stderr is not a terminal (an engine's log file included)."""
    code = (
        "from stoker.cli.parser import quiet_progress_bars; quiet_progress_bars()\n"
        "from transformers.utils import logging\n"
        "import huggingface_hub.utils as hub\n"
        "print(logging.is_progress_bar_enabled(), hub.are_progress_bars_disabled())"
    )
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=deadline(120), env=env
    )
    assert proc.stdout.split() == ["False", "True"], proc.stderr
