"""What a batch request (`POST /v1/batches`) and each line of its input file must be.

The request is checked whole when it arrives (a 400 naming the field). The input file is checked
line by line by the runner while the batch is `validating`: a file that is not a batch input at all
(over `max_lines` requests) fails the batch, as OpenAI's does; a bad line does not. It goes to the
error file at once, with its line number, so that every line of the input ends in the output file
or the error file:

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "tiny", "messages": [...], "max_tokens": 16}}

A line must be one JSON object (the gateway's own parser and depth bound, at most the gateway's
body bound) with a `custom_id` (a non-empty string of at most 512 characters, unique in the file:
a repeat is an error line, the first stays), `method` POST, `url` the batch's endpoint, and a
`body` that is an object naming `model`, not streaming. Blank lines are no requests and are
skipped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from stoker.batch.config import BatchConfig
from stoker.batch.files import FILE_ID
from stoker.errors import APIError, invalid
from stoker.gateway.endpoint import MAX_BODY_BYTES
from stoker.http import parse_json_object
from stoker.spec.durations import parse_duration

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
FIELDS = ("input_file_id", "endpoint", "completion_window", "metadata")
MAX_CUSTOM_ID = 512
MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


@dataclass(frozen=True)
class BatchRequest:
    input_file_id: str
    endpoint: str
    completion_window: str
    window_s: float
    metadata: dict[str, str] | None


def batch_request(body: Any, config: BatchConfig) -> BatchRequest:
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise invalid(f"Unknown field(s) {unknown}; allowed: {', '.join(FIELDS)}.", unknown[0])
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str) or not FILE_ID.fullmatch(file_id):
        raise invalid(f"'input_file_id' must be a file id (file-...), got {file_id!r}.", "input_file_id")
    endpoint = body.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise invalid(f"'endpoint' must be one of {', '.join(ENDPOINTS)}; got {endpoint!r}.", "endpoint")
    window = body.get("completion_window")
    seconds = None
    if isinstance(window, str) and len(window) <= 32:
        try:
            seconds = parse_duration(window)
        except ValueError:
            seconds = None
    if seconds is None or not config.min_window_s <= seconds <= config.max_window_s:
        raise invalid(
            f"'completion_window' must be a duration from {config.min_window_s:g}s to "
            f'{config.max_window_s:g}s such as "24h", got {window!r}.',
            "completion_window",
        )
    return BatchRequest(file_id, endpoint, window, seconds, metadata(body.get("metadata")))


def metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    ok = isinstance(value, dict) and len(value) <= MAX_METADATA_KEYS
    ok = ok and all(
        isinstance(k, str)
        and isinstance(v, str)
        and 0 < len(k) <= MAX_METADATA_KEY
        and len(v) <= MAX_METADATA_VALUE
        for k, v in value.items()
    )
    if not ok:
        raise invalid(
            f"'metadata' must be an object of at most {MAX_METADATA_KEYS} string values, keys of 1 to "
            f"{MAX_METADATA_KEY} characters, values of at most {MAX_METADATA_VALUE}.",
            "metadata",
        )
    return dict(value)


@dataclass(frozen=True)
class Entry:
    """A valid line: where it is in the input (to read again when it is sent) and its id."""

    line: int  # 1-based
    offset: int
    length: int
    custom_id: str
    model: str


@dataclass(frozen=True)
class BadLine:
    line: int
    custom_id: str | None
    message: str
    code: str = "invalid_request"


class TooManyLines(Exception):
    pass


def scan(f: BinaryIO, endpoint: str, max_lines: int) -> Iterator[Entry | BadLine]:
    """Every non-blank line of the input, in order, as an `Entry` or a `BadLine`; raises
    `TooManyLines` past `max_lines` requests. Reads one line at a time (each at most the gateway's
    body bound; a longer one is read past, not kept)."""
    seen: set[str] = set()
    offset, number, requests = 0, 0, 0
    while True:
        raw = f.readline(MAX_BODY_BYTES + 1)
        if not raw:
            return
        start, number = offset, number + 1
        offset += len(raw)
        if len(raw) > MAX_BODY_BYTES and not raw.endswith(b"\n"):
            while (more := f.readline(1 << 20)) and not more.endswith(b"\n"):
                offset += len(more)
            offset += len(more)
            requests += 1
            if requests > max_lines:
                raise TooManyLines(f"the input holds more than {max_lines} requests")
            yield BadLine(number, None, f"Line {number} is longer than {MAX_BODY_BYTES} bytes.")
            continue
        if not raw.strip():
            continue
        requests += 1
        if requests > max_lines:
            raise TooManyLines(f"the input holds more than {max_lines} requests")
        yield check_line(raw, number, start, endpoint, seen)


def check_line(raw: bytes, number: int, offset: int, endpoint: str, seen: set[str]) -> Entry | BadLine:
    try:
        line = parse_json_object(raw.strip())
    except APIError as exc:
        return BadLine(number, None, f"Line {number} is not a JSON object: {exc.message}")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID:
        return BadLine(
            number, None, f"Line {number}: 'custom_id' must be a string of 1 to {MAX_CUSTOM_ID} characters."
        )
    if custom_id in seen:
        return BadLine(
            number,
            custom_id,
            f"Line {number}: 'custom_id' {custom_id!r} is used by an earlier line.",
            "duplicate_custom_id",
        )
    seen.add(custom_id)
    problem = None
    body = line.get("body")
    if line.get("method") != "POST":
        problem = "'method' must be \"POST\""
    elif line.get("url") != endpoint:
        problem = f"'url' must be the batch's endpoint, {endpoint!r}"
    elif not isinstance(body, dict):
        problem = "'body' must be a JSON object"
    elif not isinstance(body.get("model"), str) or not body["model"]:
        problem = "'body.model' must be a non-empty string"
    elif body.get("stream", False) is not False:
        problem = "'body.stream' must be false (a batch's answers are not streamed)"
    if problem is not None:
        return BadLine(number, custom_id, f"Line {number}: {problem}.")
    return Entry(number, offset, len(raw), custom_id, body["model"])


def request_body(raw: bytes, priority: int) -> tuple[bytes, str]:
    """A valid line's request body as it is sent, at the batch's `priority`, and its model."""
    body = json.loads(raw)["body"]
    body["priority"] = priority
    return json.dumps(body, ensure_ascii=False).encode(), body["model"]
