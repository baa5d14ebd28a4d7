"""What an engine's log says, cleaned for people: the last meaningful lines, the error first. The
same for a local process's log file and a pod's log."""

from __future__ import annotations

import re

FAILURE_LOG_LINES = 20  # what a failure record keeps of the log: a traceback's last frames and its error
# Lines a dying vLLM prints after its error that say nothing about it: nanobind's leak report at
# interpreter exit (dozens of lines) and vLLM's own shutdown chatter.
_NOISE = re.compile(
    r"^nanobind: |^- leaked|^- \.\.\. skipped|\[shutdown\]|^INFO: |resource_tracker|warnings\.warn|refleaks"
)
ERROR_LINE = re.compile(r"\w(Error|Exception)\b|\bERROR\b|^stoker: error: ")
# Terminal escapes (transformers colours its load report) and other control characters: a log
# line shown in a table or a JSON answer carries neither.
_CONTROL = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|[\x00-\x08\x0b-\x1f\x7f]")


def meaningful_lines(text: str, lines: int) -> list[str]:
    """The last meaningful lines of a log (at most `lines`, each at most 300 characters). The last
    line that names an error leads, if the tail itself does not hold it."""
    cleaned = (_CONTROL.sub("", line).strip() for line in text.splitlines())
    kept = [line for line in cleaned if line and not _NOISE.search(line)]
    tail = kept[-lines:]
    errors = [line for line in kept if ERROR_LINE.search(line) and " WARNING " not in line]
    if errors and errors[-1] not in tail:
        tail = [errors[-1], *tail[-(lines - 1) :]]
    return [line[:300] for line in tail]
