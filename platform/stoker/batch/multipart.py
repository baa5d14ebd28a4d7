"""The upload's `multipart/form-data` body, parsed as it arrives: the file part's bytes go straight
to disk (`files.Upload.write`), never whole into memory.

Everything is bounded: the preamble and each part's headers (8 KiB), the number of parts (8), each
plain field (1 KiB: `purpose` is a word), the file part (`BatchConfig.upload_limit_bytes`, a 413
past it). The parser keeps only what the next delimiter could still straddle: at most the
delimiter's length less one, past what it has handed on. Each malformed body is a 400 naming the
field, in OpenAI's shape; a body that ends early (the client left) is `ClientGone`.

    --BOUNDARY\\r\\n
    Content-Disposition: form-data; name="purpose"\\r\\n\\r\\n
    batch\\r\\n
    --BOUNDARY\\r\\n
    Content-Disposition: form-data; name="file"; filename="in.jsonl"\\r\\n
    Content-Type: application/octet-stream\\r\\n\\r\\n
    {"custom_id": ...}\\n ...\\r\\n
    --BOUNDARY--\\r\\n
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from email.message import Message
from typing import Any

from stoker.errors import APIError, invalid
from stoker.http import ClientGone

MAX_HEADER_BYTES = 8 << 10
MAX_PARTS = 8
MAX_FIELD_BYTES = 1 << 10
_BOUNDARY = re.compile(r"[0-9A-Za-z'()+_,\-./:=? ]{1,70}")


class Sink:
    """Where the file part's bytes go: `files.Upload` (`write` raises `files.OverLimit`)."""

    def write(self, chunk: bytes) -> None: ...


@dataclass
class Form:
    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None  # the file part's, once one came


def boundary_of(content_type: str) -> bytes:
    message = Message()
    message["content-type"] = content_type
    if message.get_content_type() != "multipart/form-data":
        raise APIError(
            415, "Upload a file as multipart/form-data.", param="file", code="unsupported_media_type"
        )
    boundary = message.get_param("boundary")
    if not isinstance(boundary, str) or not _BOUNDARY.fullmatch(boundary):
        raise invalid("The multipart body names no valid boundary.", "file")
    return boundary.encode("ascii")


def _disposition(headers: bytes) -> tuple[str, str | None]:
    """The part's form field name and its filename (None for a plain field)."""
    try:
        text = headers.decode("utf-8")
    except UnicodeDecodeError:
        raise invalid("A multipart part's headers are not UTF-8.", "file") from None
    message = Message()
    for line in text.split("\r\n"):
        name, sep, value = line.partition(":")
        if not sep:
            raise invalid("A multipart part has a malformed header line.", "file")
        message[name.strip()] = value.strip()
    if message.get_content_disposition() != "form-data":
        raise invalid("Each multipart part must be `Content-Disposition: form-data`.", "file")
    name = message.get_param("name", header="content-disposition")
    filename = message.get_param("filename", header="content-disposition")
    if not isinstance(name, str) or not name:
        raise invalid("A multipart part names no field.", "file")
    if filename is not None and not isinstance(filename, str):
        filename = str(filename)
    return name, filename


async def read_form(receive: Callable[[], Any], boundary: bytes, open_sink: Callable[[], Sink]) -> Form:
    """The form's plain fields and its one file (`file`), whose bytes go into `open_sink()`'s sink
    as they arrive. `open_sink` is called once, when the file part begins."""
    delimiter = b"\r\n--" + boundary
    keep = len(delimiter) - 1
    buf = bytearray(b"\r\n")  # the first delimiter has no CRLF before it: one is made up
    form, parts, state, done = Form(), 0, "preamble", False
    part_name, part_file, field_bytes, sink = "", None, bytearray(), None
    more = True

    while True:
        if state == "preamble":
            i = buf.find(delimiter)
            if i < 0:
                if len(buf) > MAX_HEADER_BYTES:
                    raise invalid("The multipart body does not begin with its boundary.", "file")
            else:
                del buf[: i + len(delimiter)]
                state = "after"
                continue
        elif state == "after":
            if len(buf) >= 2:
                if buf[:2] == b"--":
                    done = True
                    break
                if buf[:2] != b"\r\n":
                    raise invalid("The multipart body has a malformed boundary line.", "file")
                del buf[:2]
                parts += 1
                if parts > MAX_PARTS:
                    raise invalid(f"The multipart body has more than {MAX_PARTS} parts.", "file")
                state = "headers"
                continue
        elif state == "headers":
            i = buf.find(b"\r\n\r\n")
            if i < 0:
                if len(buf) > MAX_HEADER_BYTES:
                    raise invalid("A multipart part's headers are too long.", "file")
            else:
                part_name, part_file = _disposition(bytes(buf[:i]))
                del buf[: i + 4]
                if part_file is not None:
                    if part_name != "file" or sink is not None:
                        raise invalid("Send one file, in the field `file`.", "file")
                    form.filename = part_file
                    sink = open_sink()
                elif part_name in form.fields:
                    raise invalid(f"The field `{part_name}` is given twice.", part_name)
                field_bytes = bytearray()
                state = "body"
                continue
        elif state == "body":
            i = buf.find(delimiter)
            end = i if i >= 0 else max(0, len(buf) - keep)
            if end:
                if part_file is not None:
                    sink.write(bytes(buf[:end]))
                else:
                    field_bytes += buf[:end]
                    if len(field_bytes) > MAX_FIELD_BYTES:
                        raise invalid(f"The field `{part_name}` is too long.", part_name)
                del buf[:end]
            if i >= 0:
                del buf[: len(delimiter)]
                if part_file is None:
                    try:
                        form.fields[part_name] = field_bytes.decode("utf-8")
                    except UnicodeDecodeError:
                        raise invalid(f"The field `{part_name}` is not UTF-8.", part_name) from None
                state = "after"
                continue
        if not more:
            break
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        buf += message.get("body", b"")
        more = message.get("more_body", False)
    if not done:
        raise invalid("The multipart body ends before its closing boundary.", "file")
    while more:  # an epilogue after the closing boundary: read and dropped, bounded
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        buf += message.get("body", b"")
        if len(buf) > MAX_HEADER_BYTES:
            raise invalid("The multipart body goes on past its closing boundary.", "file")
        more = message.get("more_body", False)
    return form
