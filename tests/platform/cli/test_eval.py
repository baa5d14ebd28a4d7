"""`stoker eval`: bad sets are one line and exit 1 (no platform needed); a real set against the tiny
model on a real `stoker up`: the pass rate, `--min-pass-rate`, `--revision`, JSONL and YAML."""

from __future__ import annotations

import json
import os
import subprocess

import httpx
import pytest

from tests.conftest import STOKER
from tests.deadlines import COLD_ANSWER, deadline
from tests.snapshots.support import assert_one_line_error


def stoker(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "STOKER_URL": "http://127.0.0.1:1", **(env or {})}
    return subprocess.run([STOKER, *args], capture_output=True, text=True, timeout=deadline(300), env=env)


@pytest.mark.parametrize(
    ("name", "text", "fragments"),
    [
        ("set.txt", "", ["must be a .jsonl, .yaml or .yml file"]),
        ("set.jsonl", "", ["no cases"]),
        ("set.jsonl", '{"prompt": "a", "expect": "b"}\n{oops\n', ["line 2 is not JSON"]),
        ("set.jsonl", '{"prompt": "a"}\n', ["line 1: give one of 'expect'"]),
        ("set.jsonl", '{"prompt": "a", "messages": [], "expect": "b"}\n', ["give one of 'prompt'"]),
        ("set.jsonl", '{"prompt": "a", "expect": "b", "max_tokens": 0}\n', ["'max_tokens' must be an integer in 1..1000000"]),
        ("set.jsonl", '{"prompt": "a", "expect": "b", "temp": 1}\n', ["unknown field(s) ['temp']"]),
        ("set.jsonl", '{"messages": [{"content": "x"}], "exact": "b"}\n', ["'messages' must be a non-empty list"]),
        ("set.yaml", "prompt: a\n", ["a YAML set is a list of cases"]),
        ("set.yaml", "- [unclosed\n", ["not YAML"]),
        ("set.yml", "cases:\n  - {prompt: a, expect: ''}\n", ["case 1: 'expect' must be a non-empty string"]),
    ],
)  # fmt: skip
def test_a_bad_set_is_one_line(tmp_path, name, text, fragments):
    path = tmp_path / name
    path.write_text(text)
    assert_one_line_error(stoker("eval", "tiny", "--set", str(path)), *fragments)


def test_bad_flags_and_files_are_one_line(tmp_path):
    good = tmp_path / "set.jsonl"
    good.write_text('{"prompt": "a", "expect": "b"}\n')
    assert_one_line_error(stoker("eval", "tiny", "--set", str(tmp_path / "none.jsonl")), "No such file")
    os.symlink(good, tmp_path / "link.jsonl")
    assert_one_line_error(stoker("eval", "tiny", "--set", str(tmp_path / "link.jsonl")), "symbolic link")
    assert_one_line_error(stoker("eval", "tiny", "--set", str(good), "--min-pass-rate", "2"), "0..1")
    assert_one_line_error(stoker("eval", "tiny", "--set", str(good), "--revision", "0"), "--revision")
    assert_one_line_error(
        stoker("eval", "tiny", "--set", str(good)), "cannot reach the platform at http://127.0.0.1:1"
    )


def test_a_set_against_the_tiny_model(shared_platform, tmp_path):
    p = shared_platform
    prompt = "The capital of France is"
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 4,
        "temperature": 0,
    }
    answered = httpx.post(f"{p.url}/v1/chat/completions", json=body, timeout=COLD_ANSWER)
    assert answered.status_code == 200, answered.text
    answer = answered.json()["choices"][0]["message"]["content"]
    revision = int(answered.headers["x-stoker-revision"])
    cases = tmp_path / "set.jsonl"
    never = {"id": "never", "messages": [{"role": "user", "content": prompt}], "expect": "zz-never-zz"}
    same = {"id": "same", "prompt": prompt, "exact": answer, "max_tokens": 4}
    cases.write_text(json.dumps(same) + "\n" + json.dumps({**never, "max_tokens": 4}) + "\n")
    run = p.cli("eval", "tiny", "--set", str(cases), "--json", "--revision", str(revision))
    report = json.loads(run.stdout)
    assert (report["passed"], report["total"], report["pass_rate"]) == (1, 2, 0.5)
    assert [c["passed"] for c in report["cases"]] == [True, False] and report["revisions_seen"] == [revision]
    under = p.cli("eval", "tiny", "--set", str(cases), "--min-pass-rate", "0.9", check=False)
    assert under.returncode == 1 and "pass rate: 1/2 (50.0%)" in under.stdout
    assert under.stderr.strip() == "stoker: error: pass rate 50.0% is under --min-pass-rate 90.0%"
    yaml_set = tmp_path / "set.yaml"
    yaml_set.write_text(
        f"cases:\n  - id: same\n    prompt: {json.dumps(prompt)}\n    exact: {json.dumps(answer)}\n    max_tokens: 4\n"
    )
    assert p.cli("eval", "tiny", "--set", str(yaml_set), "--min-pass-rate", "1").returncode == 0
    missing = p.cli("eval", "tiny", "--set", str(cases), "--revision", "9", check=False)
    assert_one_line_error(missing, "case same: Revision 9 of 'tiny' has no instances")
