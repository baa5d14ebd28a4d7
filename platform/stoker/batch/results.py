"""A batch's output and error files, which are also the journal of what it has done.

Each answer is one line appended with one `write` (`O_APPEND`), then fdatasynced (syncs are
coalesced: a line written while a sync runs is covered by the next one). A line names its input
line in its id (`batch_req_<batch>_<line>`), so after a crash `recover` reads both files back and
knows exactly which input lines are answered: those are never sent again, and every other one is.
A last line without its newline is a write the crash cut: it is cut off (truncated) and its input
line sent again. So an input line's answer is in the files at most once, whatever moment the
process was killed at, and at least once when the batch ends:

    output.jsonl   {"id": "batch_req_<b>_3", "custom_id": "q3",
                    "response": {"status_code": 200, "request_id": "...", "body": {...}}, "error": null}
    errors.jsonl   {"id": "batch_req_<b>_4", "custom_id": "q4",
                    "response": {"status_code": 400, "request_id": "...", "body": {"error": ...}}, "error": null}
                   {"id": "batch_req_<b>_5", "custom_id": null, "response": null,
                    "error": {"code": "invalid_request", "message": "Line 5: ...", "line": 5}}

Recovery reads line by line (never a whole file), and counts what `request_counts` and `usage`
need: answers in each file, and the prompt and completion tokens of the 200s.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stoker.batch.disk import DiskError, open_regular

OUTPUT, ERRORS = "output.jsonl", "errors.jsonl"


def request_id(batch_id: str, line: int) -> str:
    return f"batch_req_{batch_id.removeprefix('batch_')}_{line}"


def line_of(rid: Any) -> int | None:
    if not isinstance(rid, str) or not rid.startswith("batch_req_"):
        return None
    tail = rid.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() and len(tail) <= 9 else None


@dataclass
class Tally:
    """What the result files hold: the input lines answered, and the counts shown on the batch."""

    done: set[int] = field(default_factory=set)
    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    by_model: dict[str, int] = field(default_factory=dict)  # tokens of the 200s, by their body's model

    def add(self, line: int, ok: bool, body: Any) -> None:
        """Input line `line` answered: `ok` (a 200, with its answer's `body`) or not."""
        self.done.add(line)
        if not ok:
            self.failed += 1
            return
        self.completed += 1
        usage = body.get("usage") if isinstance(body, dict) else None
        if isinstance(usage, dict):
            tokens_in, tokens_out = _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))
            self.input_tokens += tokens_in
            self.output_tokens += tokens_out
            model = body.get("model")
            if (
                isinstance(model, str)
                and len(model) <= 256
                and (len(self.by_model) < 64 or model in self.by_model)
            ):
                self.by_model[model] = self.by_model.get(model, 0) + tokens_in + tokens_out


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 40 else 0


class _Appender:
    def __init__(self, path: Path) -> None:
        self.path = path
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            self.fd = os.open(path, flags, 0o600)
        except OSError as exc:
            raise DiskError(f"cannot open {path}: {exc.strerror or exc}") from None
        self._lock = asyncio.Lock()
        self._dirty = False

    async def append(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]
        self._dirty = True
        async with self._lock:
            if self._dirty:
                self._dirty = False
                await asyncio.to_thread(os.fdatasync, self.fd)

    def close(self) -> None:
        os.close(self.fd)


class ResultLog:
    """One batch's two result files, in its work directory."""

    def __init__(self, work_dir: Path, batch_id: str) -> None:
        self.batch_id = batch_id
        self.output_path, self.errors_path = work_dir / OUTPUT, work_dir / ERRORS
        self.tally = Tally()
        self._out: _Appender | None = None
        self._err: _Appender | None = None

    def recover(self) -> Tally:
        """Read both files back (cutting a torn last line); open them for appending."""
        self.tally = Tally()
        for path, ok in ((self.output_path, True), (self.errors_path, False)):
            _read_back(path, ok, self.tally)
        self._out, self._err = _Appender(self.output_path), _Appender(self.errors_path)
        return self.tally

    async def answer(self, line: int, custom_id: str | None, status: int, body: Any) -> None:
        """An answer from the endpoint: a 200 to the output file, anything else to the errors."""
        record = {
            "id": request_id(self.batch_id, line),
            "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id(self.batch_id, line), "body": body},
            "error": None,
        }
        ok = status == 200
        await (self._out if ok else self._err).append(_encode(record))
        self.tally.add(line, ok, body if ok else None)

    async def refuse(self, line: int, custom_id: str | None, code: str, message: str) -> None:
        """A line that got no answer: invalid, cancelled, expired, or its key is gone."""
        record = {
            "id": request_id(self.batch_id, line),
            "custom_id": custom_id,
            "response": None,
            "error": {"code": code, "message": message, "line": line},
        }
        await self._err.append(_encode(record))
        self.tally.add(line, False, None)

    def sizes(self) -> tuple[int, int]:
        return _size(self.output_path), _size(self.errors_path)

    def close(self) -> None:
        for appender in (self._out, self._err):
            if appender is not None:
                appender.close()
        self._out = self._err = None


def _encode(record: dict[str, Any]) -> bytes:
    return json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _read_back(path: Path, ok: bool, tally: Tally) -> None:
    fd = open_regular(path, os.O_RDWR)
    if fd is None:
        return
    with os.fdopen(fd, "r+b") as f:
        good = 0
        while raw := f.readline():
            if not raw.endswith(b"\n"):
                break  # torn: the crash cut this write
            good += len(raw)
            try:
                record = json.loads(raw)
            except ValueError:
                continue
            line = line_of(record.get("id")) if isinstance(record, dict) else None
            if line is None or line in tally.done:
                continue
            response = record.get("response")
            body = response.get("body") if isinstance(response, dict) else None
            tally.add(line, ok, body if ok else None)
        if good != os.fstat(f.fileno()).st_size:
            f.truncate(good)
            os.fsync(f.fileno())
