"""The docs a user reads: the generated reference is current, every `stoker …` command shown in a
code block parses with the real CLI, and the site builds in MkDocs' strict mode."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from stoker.cli.main import build_parser
from tests.deadlines import CLI

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
GENERATED = ("cli.md", "deployment-fields.md")

PROMPT = re.compile(r"^\$\s+")
ENV_PREFIX = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)+")  # STOKER_URL=http://gw:8080 stoker …
PROGRAMS = ("stoker", ".venv/bin/stoker")
SHELL_OPERATORS = {"|", "||", "&&", ";", "&", ">", ">>", "<", "2>", "2>&1", "2>/dev/null"}


def commands(path: Path) -> list[tuple[int, str]]:
    """(line number, command) of every `stoker …` line inside the ``` code blocks of `path`,
    with backslash continuations joined."""
    found = []
    lines = path.read_text().splitlines()
    fenced = False
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.lstrip().startswith("```"):
            fenced = not fenced
            index += 1
            continue
        text = ENV_PREFIX.sub("", PROMPT.sub("", line.strip()))
        if fenced and text.split(" ", 1)[0] in PROGRAMS and " " in text:
            start = index
            while text.endswith("\\") and index + 1 < len(lines):
                index += 1
                text = text[:-1] + " " + lines[index].strip()
            found.append((start + 1, text))
        index += 1
    return found


def argv_of(command: str) -> list[str]:
    words = shlex.split(command, comments=True)[1:]
    for at, word in enumerate(words):
        if word in SHELL_OPERATORS or word.startswith(("2>", ">", "|")):
            return words[:at]
    return words


def parse_error(parser, argv: list[str]) -> str | None:
    """Why `argv` does not parse, or None; `--help` and `--version` exit 0 and are fine."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            parser.parse_args(argv)
    except SystemExit as exc:
        if exc.code not in (0, None):
            return err.getvalue().strip() or f"exit status {exc.code}"
    return None


def test_the_generated_reference_is_current(tmp_path):
    subprocess.run(
        [sys.executable, str(DOCS / "gen_reference.py"), "--out", str(tmp_path)], check=True, timeout=CLI
    )
    stale = [
        name
        for name in GENERATED
        if not (DOCS / "reference" / name).exists()
        or (tmp_path / name).read_text() != (DOCS / "reference" / name).read_text()
    ]
    assert not stale, f"docs/reference/{', '.join(stale)} out of date with the code: run `make docs`"


def test_the_pages_show_commands():
    shown = {path.name: len(commands(path)) for path in PAGES}
    assert shown["README.md"] >= 5, shown
    assert sum(shown.values()) >= 50, shown


def test_every_stoker_command_shown_parses():
    parser = build_parser()
    failures = []
    for path in PAGES:
        for line, command in commands(path):
            try:
                argv = argv_of(command)
            except ValueError as exc:  # unbalanced quotes
                failures.append(f"{path.relative_to(ROOT)}:{line}: {command}\n    {exc}")
                continue
            if (why := parse_error(parser, argv)) is not None:
                failures.append(f"{path.relative_to(ROOT)}:{line}: {command}\n    {why}")
    assert not failures, "commands in the docs that `stoker` refuses:\n" + "\n".join(failures)


def test_a_bad_command_is_caught():
    """The check above can fail: a flag the CLI lacks is reported."""
    assert (
        parse_error(build_parser(), argv_of("stoker deploy chat --model smollm2 --no-such-flag")) is not None
    )
    assert parse_error(build_parser(), argv_of("stoker deploy --help")) is None


def test_the_site_builds_strict(tmp_path):
    mkdocs = Path(sys.executable).parent / "mkdocs"
    command = [str(mkdocs)] if mkdocs.exists() else [sys.executable, "-m", "mkdocs"]
    result = subprocess.run(
        [
            *command,
            "build",
            "--strict",
            "--quiet",
            "-f",
            str(ROOT / "mkdocs.yml"),
            "-d",
            str(tmp_path / "site"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "NO_COLOR": "1"},
        timeout=CLI,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}{result.stderr}"


@pytest.mark.parametrize("name", GENERATED)
def test_the_generated_pages_are_in_the_nav(name):
    assert f"reference/{name}" in (ROOT / "mkdocs.yml").read_text()
