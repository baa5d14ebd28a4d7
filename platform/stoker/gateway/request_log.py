"""The request log: one de-identified JSON line per inference request, opt-in, and the taps that
measure each request for it, for drift (`stoker.gateway.drift`) and for traces (`stoker.gateway.otel`).

    gateway ─▶ Observer.tap(...) ─▶ RequestTap (wraps `send`) ─▶ deployment.serve
                 └─ None: nobody wants this request (no log, no trace): nothing runs per chunk
    finally ─▶ Observer.done(tap) ─▶ RequestRecord ─▶ RequestLogFile (JSONL), Drift, Tracing

Logged when `stoker up --request-log` is given, or when the deployment's own setting says so
(`log_requests`, or `log_content`, which adds the prompt and the answer with anything shaped like a
credential masked: `warm_pool.failures.redact`, as instance logs are). A record holds the time, the
deployment, the revision that answered (`x-stoker-revision`), the caller's key *id* (never the key),
the status, the token counts the answer reports (its `usage`, read from the last two chunks as the
rate limiter's `UsageTap` reads it, which `RequestTap` is; for a stream without usage, its events),
TTFT and end-to-end seconds, the cold-start flag (`x-stoker-cold-start`), the finish reason, the
prompt's length in characters and whether the answer reads as a refusal (`drift.is_refusal`).

The file is `$STOKER_HOME/request-log/requests.jsonl`, opened without following links, mode 0600,
appended with one `write` per record; past `max_bytes` it is renamed `requests.jsonl.1` (and .1 to
.2, ...) and only `keep` old files are kept. The write is synchronous: one small append to the page
cache per request, cheaper than handing it to a thread.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from stoker.gateway.drift import Drift, is_refusal
from stoker.gateway.limits import TAIL, UsageTap
from warm_pool.failures import redact

log = logging.getLogger("stoker.request_log")

LOG_DIR = "request-log"
LOG_FILE = "requests.jsonl"
DEFAULT_MAX_BYTES = 64 << 20
DEFAULT_KEEP = 4
HEAD_BYTES = 4096  # of the answer, kept for the refusal check (a refusal says so at once)
CONTENT_BYTES = 1 << 20  # of the answer, kept when its content is logged (a stream: ~5k tokens)
CONTENT_CHARS = 32_768  # of the prompt and of the answer, written at most

# The answer's fields, read from bytes without parsing every event (tokens: `UsageTap.tokens`).
_FINISH = re.compile(rb'"finish_reason"\s*:\s*"([A-Za-z_]+)"')
_TEXT = re.compile(rb'"(?:content|text)"\s*:\s*"((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class RequestRecord:
    """One request as the log writes it (`content`: prompt and answer, only when asked)."""

    time: float  # epoch seconds at arrival
    deployment: str
    revision: int | None
    key_id: str
    status: int
    stream: bool
    prompt_tokens: int | None
    completion_tokens: int | None
    ttft_s: float | None  # arrival to the answer's first byte (keep-alives of a held stream aside)
    e2e_s: float
    cold_start: bool | None
    finish_reason: str | None
    prompt_chars: int
    refusal: bool
    prompt: Any = None
    answer: str | None = None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        if self.prompt is None and self.answer is None:
            del out["prompt"], out["answer"]
        return out


class RequestTap(UsageTap):
    """`send` for one observed request: the rate limiter's usage reading (`UsageTap`), plus the
    first byte's time, the revision and cold-start headers, and the answer's head (or all of it,
    bounded, when its content is logged)."""

    __slots__ = (
        "_capture",
        "_clock",
        "_head",
        "_kept",
        "arrival",
        "cold",
        "first_byte",
        "instance",
        "meta",
        "revision_header",
    )

    def __init__(
        self, send: Callable, clock: Callable[[], float], meta: dict[str, Any], capture: int
    ) -> None:
        # No ticket: no headers added, nothing charged. No prompt estimate: a stream that reports no
        # usage has its prompt tokens unknown (None), its completion counted one event a token.
        super().__init__(send, None, prompt_estimate=None)  # type: ignore[arg-type]
        self._clock = clock
        self.arrival = clock()
        self.first_byte: float | None = None
        self.meta = meta  # deployment, key_id, stream, prompt, log (bool), content (bool), wall
        self.revision_header: int | None = None
        self.cold: bool | None = None
        self.instance: str | None = None  # x-stoker-instance: for traces, not the log
        self._capture = capture
        self._head: list[bytes] = []
        self._kept = 0

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            for name, value in message.get("headers", ()):
                if name == b"x-stoker-revision" and value.isdigit() and len(value) <= 10:
                    self.revision_header = int(value)
                elif name == b"x-stoker-cold-start":
                    self.cold = value == b"true"
                elif name == b"x-stoker-instance":
                    self.instance = value.decode("latin-1")
        elif chunk := message.get("body"):
            if self.first_byte is None and chunk.strip():  # a held stream's keep-alives are blank
                self.first_byte = self._clock()
            if self._kept < self._capture:
                self._head.append(chunk[: self._capture - self._kept])
                self._kept += len(self._head[-1])
        await super().__call__(message)

    def record(self, scope: dict) -> RequestRecord:
        """What was seen, once the answer is over."""
        end = self._clock()
        meta = self.meta
        prompt_tokens, completion = self.tokens() or (None, None)  # `UsageTap`'s reading
        finish = _FINISH.findall(self._prev[-TAIL:] + self._last[-TAIL:])
        answer = answer_text(b"".join(self._head)) if self.status == 200 else ""
        revision = self.revision_header
        if revision is None:
            revision = scope.get("stoker.revision")
        content = meta["content"]
        return RequestRecord(
            time=round(meta["wall"], 3),
            deployment=meta["deployment"],
            revision=revision,
            key_id=meta["key_id"],
            status=self.status or 499,
            stream=meta["stream"],
            prompt_tokens=prompt_tokens,
            completion_tokens=completion,
            ttft_s=None if self.first_byte is None else round(self.first_byte - self.arrival, 6),
            e2e_s=round(end - self.arrival, 6),
            cold_start=self.cold,
            finish_reason=finish[-1].decode() if finish else None,
            prompt_chars=prompt_chars(meta["prompt"]),
            refusal=is_refusal(answer),
            prompt=masked_prompt(meta["prompt"]) if content else None,
            answer=redact(answer[:CONTENT_CHARS]) if content else None,
        )


def answer_text(data: bytes) -> str:
    """The answer's text from a completion's body or a stream's events: every `content` (chat) or
    `text` (completions) string, joined. A string cut off by the capture's end is left out."""
    parts = []
    for raw in _TEXT.findall(data):
        try:
            parts.append(json.loads(b'"' + raw + b'"'))
        except ValueError:
            continue
    return "".join(parts)


def _prompt_of(parsed: dict) -> Any:
    if isinstance(messages := parsed.get("messages"), list):
        return messages
    return parsed.get("prompt", parsed.get("input"))  # `input`: a Response's (or embeddings')


def prompt_chars(prompt: Any) -> int:
    """Characters of a prompt: a string, a list of strings, or chat messages (their text parts)."""
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        total = 0
        for item in prompt:
            if isinstance(item, dict):
                item = item.get("content")
                if isinstance(item, list):  # content parts: [{"type": "text", "text": ...}, ...]
                    item = [p.get("text") for p in item if isinstance(p, dict)]
            total += prompt_chars(item)
        return total
    return 0


def masked_prompt(prompt: Any) -> Any:
    """The prompt as the log writes it: chat messages as role and text, credentials masked."""
    if isinstance(prompt, str):
        return redact(prompt[:CONTENT_CHARS])
    if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        out = []
        for m in prompt:
            content = m.get("content")
            text = content if isinstance(content, str) else json.dumps(content)
            out.append({"role": str(m.get("role", "")), "content": redact(text[:CONTENT_CHARS])})
        return out
    return redact(json.dumps(prompt)[:CONTENT_CHARS])


class RequestLogFile:
    """The JSONL file, appended one record a write, rotated by size (see the module)."""

    def __init__(self, dir: Path, max_bytes: int = DEFAULT_MAX_BYTES, keep: int = DEFAULT_KEEP) -> None:
        self.check(max_bytes, keep)
        self.dir = dir
        self.path = dir / LOG_FILE
        self.max_bytes = max_bytes
        self.keep = keep
        self._fd: int | None = None
        self._size = 0

    @staticmethod
    def check(max_bytes: int, keep: int) -> None:
        """ValueError unless these are a size and a count of old files the log can keep."""
        if max_bytes < 4096:
            raise ValueError(
                f"the request log's size before rotation must be 4096 bytes or more, got {max_bytes}"
            )
        if not 1 <= keep <= 100:
            raise ValueError(f"the request log keeps 1..100 old files, got {keep}")

    def _open(self) -> int:
        if self._fd is None:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            if self.dir.is_symlink():  # O_NOFOLLOW guards the file's name, not its directory's
                raise OSError(f"{self.dir} is a symbolic link; the request log is not written through links")
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
            self._fd = os.open(self.path, flags, 0o600)
            self._size = os.fstat(self._fd).st_size
        return self._fd

    def write(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
        if self._size and self._size + len(line) > self.max_bytes:
            self._rotate()
        fd = self._open()
        os.write(fd, line)
        self._size += len(line)

    def _rotate(self) -> None:
        self.close()
        oldest = self.dir / f"{LOG_FILE}.{self.keep}"
        oldest.unlink(missing_ok=True)
        for n in range(self.keep - 1, 0, -1):
            older = self.dir / f"{LOG_FILE}.{n}"
            if older.exists():
                os.replace(older, self.dir / f"{LOG_FILE}.{n + 1}")
        if self.path.exists():
            os.replace(self.path, self.dir / f"{LOG_FILE}.1")

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class Observer:
    """What the gateway calls around each inference request: `tap` before it is served (None when
    nothing wants it), `done` after. `log_all`: `stoker up --request-log`; otherwise a deployment's
    `log_requests`/`log_content` decide. `tracing` (`stoker.gateway.otel.Tracing`) sees every request."""

    def __init__(
        self,
        file: RequestLogFile,
        drift: Drift | None = None,
        *,
        log_all: bool = False,
        tracing: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.file = file
        self.drift = drift
        self.log_all = log_all
        self.tracing = tracing
        self._clock = clock
        self._failed = False

    def tap(self, send: Callable, name: str, deployment: Any, key_id: str, parsed: dict, stream: bool):
        spec = getattr(deployment, "spec", None)
        content = bool(getattr(spec, "log_content", False))
        logged = self.log_all or content or bool(getattr(spec, "log_requests", False))
        if not logged and self.tracing is None:
            return None
        meta = {
            "deployment": name,
            "key_id": key_id,
            "stream": stream,
            "prompt": _prompt_of(parsed),
            "log": logged,
            "content": content,
            "wall": time.time(),
            "model": parsed.get("model"),
            "chat": "messages" in parsed,
        }
        return RequestTap(send, self._clock, meta, CONTENT_BYTES if content else HEAD_BYTES)

    def done(self, tap: RequestTap, scope: dict) -> None:
        """Write, count and trace what `tap` saw; a failure here is logged, never the request's."""
        try:
            record = tap.record(scope)
            if tap.meta["log"]:
                self.file.write(record.to_json())
                if self.drift is not None and record.status == 200:
                    self.drift.record(record, self._clock())
            if self.tracing is not None:
                self.tracing.request(record, tap, scope)
        except Exception:
            if not self._failed:  # once: a full disk would otherwise log every request
                log.exception("could not record a request in the request log")
                self._failed = True

    def register(self, registry: Any) -> None:
        """The drift gauges (`stoker.gateway.drift.DriftCollector`) in the platform's metrics registry."""
        from stoker.gateway.drift import DriftCollector

        if self.drift is not None:
            registry.register(DriftCollector(self.drift, self._clock))

    def routes(self, platform: Any) -> list:
        """The drift admin routes (`stoker.gateway.drift.drift_routes`), when drift is kept."""
        from stoker.gateway.drift import drift_routes

        return drift_routes(self.drift, platform, self._clock) if self.drift is not None else []

    def close(self) -> None:
        self.file.close()
        if self.tracing is not None:
            self.tracing.close()
