"""Why a deployment's instances failed: the last failure, kept for the operator, and when repeated
failed starts make the deployment unavailable (so held requests hear why instead of waiting).

A failure is recorded with the phase it happened in, as the pool saw it:

    snapshot       making the snapshot local (pull, pin, start-time check) failed
    process_start  the engine could not be spawned, or exited before its server ever answered (the
                   CPU engine's imports and snapshot checks; all of vLLM's start, whose server
                   answers only once the model is loaded)
    model_load     the engine answered "not ready" (loading), then exited
    wait_ready     the engine ran on, not ready, past the start timeout
    serving        a READY or SLEEPING instance's process died
    health         its engine said it is failed (/health 503, or ejected again and again)
    sleep, wake    a sleep or a wake call failed
    key            its engine refused the instance's own key

with the exit code when the process ended by itself, and the tail of its log: bounded (20 lines
of at most 300 characters), and with the instance's own key and anything that looks like a
credential replaced by `[redacted]`, since the record is shown by the admin API and part of it
(`headline`) to callers in a 503.

Failed starts in a row are counted (a start that reaches READY resets the count). At `threshold`
in a row the deployment is unavailable: the pool tells the activator (`Demand.set_unavailable`),
which answers held and new requests 503 with the reason at once, while the pool keeps retrying
with its backoff. Worked example, threshold 3, the CPU engine on a snapshot transformers cannot
load (about 5.5 s a start on this machine), restart backoff 1, 2, 4 ... s:

    t = 0     start 1          t = 5.5   fails (1 in a row), next start not before 6.5
    t = 6.5   start 2          t = 12    fails (2 in a row), next not before 14
    t = 14    start 3          t = 19.5  fails (3 in a row): unavailable, "instance failed to start
              (3 in a row): model_load, exit code 1: stoker: error: cannot load …"; a request held
              since t = 0 gets that 503 at 19.5 s, not at the 120 s hold deadline
    t = 23.5  start 4 ...      a start that reaches READY makes the deployment available again

When the policy stops asking for instances (nobody is calling), unavailability is lifted but the
count is kept: the next request is held and starts an instance, and if that start fails too the
deployment is unavailable again at once, with the newest reason. So a deployment is never left
refusing requests for a cause nobody has tried since.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from warm_pool.errors import StartFailed
from warm_pool.log_text import ERROR_LINE, FAILURE_LOG_LINES

MAX_MESSAGE_CHARS = 500
REDACTED = "[redacted]"
# What a credential looks like in a log line: our own keys, bearer tokens, `key=value` pairs whose
# name says secret, AWS access key ids, Hugging Face tokens. The value is replaced, the name kept.
_CREDENTIALS = (
    re.compile(r"sk-[A-Za-z0-9_-]{8,}"),
    re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]{8,}"),
    re.compile(
        r"(?i)((?:api[_-]?key|token|secret|password|passwd|authorization|credentials?)['\"]?\s*[=:]\s*['\"]?)"
        r"(?!bearer\b|\[redacted\])[^\s'\",}]{4,}"
    ),
    re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),
    re.compile(r"\bhf_[A-Za-z0-9]{20,}\b"),
)


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """`text` with every one of `secrets` (the instance's key) and anything shaped like a credential
    replaced by `[redacted]`. Short secrets are not searched for: they would blank ordinary words."""
    for secret in secrets:
        if len(secret) >= 8:
            text = text.replace(secret, REDACTED)
    for pattern in _CREDENTIALS:
        text = pattern.sub(lambda m: (m.group(1) if m.groups() else "") + REDACTED, text)
    return text


@dataclass(frozen=True)
class FailureRecord:
    """One failure of one instance. `at` is wall-clock epoch seconds (for display only)."""

    instance: str
    phase: str
    message: str  # one line, bounded, redacted
    at: float
    exit_code: int | None = None
    log_tail: tuple[str, ...] = ()  # the log's last meaningful lines, redacted

    @property
    def cause(self) -> str:
        """The line that says why: the last log line naming an error, else the last line, else the
        message."""
        errors = [line for line in self.log_tail if ERROR_LINE.search(line) and " WARNING " not in line]
        return (errors or self.log_tail or (self.message,))[-1]

    @property
    def headline(self) -> str:
        """One line: phase, exit code, cause. What `stoker ls` and a 503 show."""
        code = f", exit code {self.exit_code}" if self.exit_code is not None else ""
        return f"{self.phase}{code}: {self.cause}"

    def with_exit_code(self, code: int) -> FailureRecord:
        return FailureRecord(self.instance, self.phase, self.message, self.at, code, self.log_tail)

    def to_dict(self) -> dict[str, Any]:
        return {
            "instance": self.instance,
            "phase": self.phase,
            "exit_code": self.exit_code,
            "message": self.message,
            "headline": self.headline,
            "log_tail": list(self.log_tail),
            "at": self.at,
        }


def record_of(
    instance: str, phase: str, exc: BaseException | str, at: float, secret: str = ""
) -> FailureRecord:
    """The record of a failure: `exc` an exception from a start (a `StartFailed` knows its own phase,
    exit code and log), or the reason a running instance was failed. `phase` is where the pool was."""
    message, code, lines = str(exc), None, ()
    if isinstance(exc, StartFailed):
        phase, code, lines = exc.phase or phase, exc.exit_code, exc.log_lines
        # Its message ends with the log's tail on one line; the record keeps the lines instead.
        if exc.log_tail and message.endswith(f"; log: {exc.log_tail}"):
            message = message[: -len(f"; log: {exc.log_tail}")]
    secrets = (secret,) if secret else ()
    one_line = " ".join(message.split())[:MAX_MESSAGE_CHARS]
    tail = tuple(redact(line, secrets)[:300] for line in lines[-FAILURE_LOG_LINES:])
    return FailureRecord(instance, phase, redact(one_line, secrets), at, code, tail)


@dataclass
class StartFailures:
    """Failed starts in a row, the last failure of any kind, and whether that makes the deployment
    unavailable. No clock and no I/O: the pool calls it and tells the activator what it returns."""

    threshold: int  # failed starts in a row that make the deployment unavailable; 0: never
    in_a_row: int = 0
    last: FailureRecord | None = None
    unavailable: str | None = field(default=None)  # the reason the activator was given, while it stands

    def start_failed(self, record: FailureRecord) -> str | None:
        """A start failed. Returns the reason to give the activator now (at or past the threshold;
        a newer failure gives a newer reason), else None."""
        self.in_a_row += 1
        self.last = record
        if self.threshold and self.in_a_row >= self.threshold:
            self.unavailable = f"instance failed to start ({self.in_a_row} in a row): {record.headline}"
            return self.unavailable
        return None

    def started(self) -> bool:
        """A start reached READY. True if the deployment was unavailable: the activator must hear
        that it is no longer."""
        was = self.unavailable is not None
        self.in_a_row, self.unavailable = 0, None
        return was

    def failed(self, record: FailureRecord) -> None:
        """A running instance failed: the last failure, but no failed start."""
        self.last = record

    def exit_code_known(self, instance: str, code: int) -> None:
        """The exit code of an instance whose death was recorded before its process was reaped."""
        if self.last is not None and self.last.instance == instance and self.last.exit_code is None:
            self.last = self.last.with_exit_code(code)

    def lift(self) -> bool:
        """Nothing is being started (nobody calls) or the deployment was deployed again: requests
        are held again, and the next failed start decides anew. True if it was unavailable."""
        was = self.unavailable is not None
        self.unavailable = None
        return was
