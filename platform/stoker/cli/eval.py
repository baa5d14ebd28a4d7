"""`stoker eval NAME --set FILE [--revision N] [--min-pass-rate R] [--json]`: run a fixed set of
prompts against a deployment and report how many answers pass, so a new revision can be checked
before the traffic moves to it.

The set is JSONL (one case a line) or YAML (a list of cases, or `{cases: [...]}`). A case:

    {"id": "capital", "prompt": "The capital of France is", "expect": "Paris", "max_tokens": 16}
    {"messages": [{"role": "user", "content": "2+2?"}], "exact": "4"}

`prompt` (one user message) or `messages`; `expect` (the answer contains it) or `exact` (the
answer, stripped, is it); `max_tokens` (default 64); `id` (default `#N`, N its place). Every case
is sent to `/v1/chat/completions` at temperature 0, one at a time. With `--revision N` each
request carries `x-stoker-revision: N`, which the gateway honours for the admin key only: that
revision answers if it has instances (warming, standby or serving), whatever the split says.
Exit status 1 when the pass rate is under `--min-pass-rate`, or on any error (one line).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from stoker.cli.admin_client import add_url_args, base_url, tls_context
from stoker.errors import CLIError

MAX_SET_BYTES = 16 << 20
MAX_CASES = 10_000
DEFAULT_MAX_TOKENS = 64
CASE_FIELDS = ("id", "prompt", "messages", "expect", "exact", "max_tokens")
TIMEOUT_S = 600


@dataclass(frozen=True)
class Case:
    id: str
    messages: list[dict[str, Any]]
    expect: str | None
    exact: str | None
    max_tokens: int

    def passes(self, answer: str) -> bool:
        if self.exact is not None:
            return answer.strip() == self.exact.strip()
        return self.expect is not None and self.expect in answer


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="run an evaluation set against a deployment and report its pass rate")
    p.add_argument("name", help="the deployment")
    p.add_argument(
        "--set", required=True, metavar="FILE", dest="set_file", help="the cases: .jsonl, .yaml or .yml"
    )
    p.add_argument(
        "--revision",
        type=int,
        metavar="N",
        help="ask this revision (it must have instances), whatever the traffic split (default: as routed)",
    )
    p.add_argument(
        "--min-pass-rate",
        type=float,
        default=0.0,
        metavar="R",
        help="exit 1 when the share of passing cases is under this (0..1)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    add_url_args(p)
    p.set_defaults(func=cmd_eval)


def load_set(path: str) -> list[Case]:
    """The cases in `path`, or a `CLIError` naming the file, the line or case, and the field."""
    lower = path.lower()
    if not lower.endswith((".jsonl", ".yaml", ".yml")):
        raise CLIError(f"--set: {path!r} must be a .jsonl, .yaml or .yml file")
    text = _read(path)
    items: list[tuple[str, Any]] = []
    if lower.endswith(".jsonl"):
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    items.append((f"line {n}", json.loads(line)))
                except ValueError as exc:
                    raise CLIError(f"--set {path}: line {n} is not JSON ({exc})") from None
    else:
        import yaml

        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise CLIError(f"--set {path}: not YAML ({' '.join(str(exc).split())})") from None
        if isinstance(loaded, dict) and set(loaded) == {"cases"}:
            loaded = loaded["cases"]
        if not isinstance(loaded, list):
            raise CLIError(f"--set {path}: a YAML set is a list of cases, or a mapping with `cases:` only")
        items = [(f"case {n}", item) for n, item in enumerate(loaded, 1)]
    if not items:
        raise CLIError(f"--set {path}: no cases")
    if len(items) > MAX_CASES:
        raise CLIError(f"--set {path}: {len(items)} cases; at most {MAX_CASES}")
    return [_case(path, where, n, item) for n, (where, item) in enumerate(items, 1)]


def _read(path: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        why = "is a symbolic link (not followed)" if exc.errno == errno.ELOOP else exc.strerror
        raise CLIError(f"--set {path}: {why}") from None
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_SET_BYTES + 1)
    if len(data) > MAX_SET_BYTES:
        raise CLIError(f"--set {path}: larger than {MAX_SET_BYTES >> 20} MiB")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise CLIError(f"--set {path}: not UTF-8 text") from None


def _case(path: str, where: str, n: int, item: Any) -> Case:
    def bad(message: str) -> CLIError:
        return CLIError(f"--set {path}: {where}: {message}")

    if not isinstance(item, dict):
        raise bad(f"a case is an object, got {type(item).__name__}")
    if unknown := sorted(set(item) - set(CASE_FIELDS)):
        raise bad(f"unknown field(s) {unknown}; allowed: {', '.join(CASE_FIELDS)}")
    if ("prompt" in item) == ("messages" in item):
        raise bad("give one of 'prompt' (a string) or 'messages' (a list of {role, content})")
    if "prompt" in item:
        if not isinstance(item["prompt"], str) or not item["prompt"]:
            raise bad(f"'prompt' must be a non-empty string, got {item['prompt']!r}")
        messages = [{"role": "user", "content": item["prompt"]}]
    else:
        messages = item["messages"]
        if not (
            isinstance(messages, list)
            and messages
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in messages
            )
        ):
            raise bad("'messages' must be a non-empty list of {role, content} objects")
    if ("expect" in item) == ("exact" in item):
        raise bad("give one of 'expect' (a substring of the answer) or 'exact' (the whole answer)")
    expect, exact = item.get("expect"), item.get("exact")
    if expect is not None and (not isinstance(expect, str) or not expect):
        raise bad(f"'expect' must be a non-empty string, got {expect!r}")
    if "exact" in item and not isinstance(exact, str):
        raise bad(f"'exact' must be a string, got {exact!r}")
    max_tokens = item.get("max_tokens", DEFAULT_MAX_TOKENS)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= 1_000_000:
        raise bad(f"'max_tokens' must be an integer in 1..1000000, got {max_tokens!r}")
    case_id = item.get("id", f"#{n}")
    if not isinstance(case_id, str | int) or isinstance(case_id, bool):
        raise bad(f"'id' must be a string, got {case_id!r}")
    return Case(str(case_id), messages, expect, exact, max_tokens)


def ask(args: argparse.Namespace, case: Case) -> tuple[str, str | None, str | None]:
    """One case's answer: (text, the revision that gave it, finish reason)."""
    base = base_url(args)
    body = {"model": args.name, "messages": case.messages, "max_tokens": case.max_tokens, "temperature": 0}
    headers = {"content-type": "application/json"}
    if key := os.environ.get("STOKER_ADMIN_KEY"):
        headers["authorization"] = f"Bearer {key}"
    if args.revision is not None:
        headers["x-stoker-revision"] = str(args.revision)
    request = urllib.request.Request(
        base + "/v1/chat/completions", data=json.dumps(body).encode(), method="POST", headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=tls_context()) as response:
            answer = json.loads(response.read())
            revision = response.headers.get("x-stoker-revision")
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = f"HTTP {exc.code}"
        raise CLIError(f"case {case.id}: {message}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise CLIError(f"cannot reach the platform at {base} ({reason}); is `stoker up` running?") from None
    except ValueError:
        raise CLIError(f"case {case.id}: the answer is not JSON") from None
    try:
        choice = answer["choices"][0]
        return str(choice["message"].get("content") or ""), revision, choice.get("finish_reason")
    except (KeyError, IndexError, TypeError, AttributeError):
        raise CLIError(f"case {case.id}: the answer has no choices[0].message") from None


def cmd_eval(args: argparse.Namespace) -> int:
    if not 0.0 <= args.min_pass_rate <= 1.0:
        raise CLIError(f"--min-pass-rate must be in 0..1, got {args.min_pass_rate:g}")
    if args.revision is not None and args.revision < 1:
        raise CLIError(f"--revision must be a revision number (1, 2, ...), got {args.revision}")
    cases = load_set(args.set_file)
    base_url(args)  # a bad --url is one line before anything is sent
    results = []
    for case in cases:
        answer, revision, finish = ask(args, case)
        results.append(
            {
                "id": case.id,
                "passed": case.passes(answer),
                "answer": answer,
                "revision": int(revision) if revision and revision.isdigit() else None,
                "finish_reason": finish,
            }
        )
    passed = sum(r["passed"] for r in results)
    rate = passed / len(results)
    report = {
        "deployment": args.name,
        "revision": args.revision,
        "revisions_seen": sorted({r["revision"] for r in results if r["revision"] is not None}),
        "passed": passed,
        "total": len(results),
        "pass_rate": rate,
        "min_pass_rate": args.min_pass_rate,
        "ok": rate >= args.min_pass_rate,
        "cases": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for r in results:
            shown = " ".join(r["answer"].split())
            shown = shown[:60] + "…" if len(shown) > 60 else shown
            print(f"{'PASS' if r['passed'] else 'FAIL'}  {r['id']:<16}  r{r['revision'] or '?'}  {shown}")
        print(
            f"pass rate: {passed}/{len(results)} ({rate:.1%}), revision(s) {report['revisions_seen'] or '?'}"
        )
    if not report["ok"]:
        print(
            f"stoker: error: pass rate {rate:.1%} is under --min-pass-rate {args.min_pass_rate:.1%}",
            file=sys.stderr,
        )
        return 1
    return 0
