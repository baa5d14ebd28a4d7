"""The upload's `multipart/form-data` body, parsed as it arrives by python-multipart (the parser
starlette's own forms use): the file part's bytes go straight to disk (`files.Upload.write`), never
whole into memory.

What python-multipart leaves to its caller is bounded here: the header bytes of each part (8 KiB),
the number of parts (8), each plain field (1 KiB: `purpose` is a word), one file part, in the field
`file` (its size is `BatchConfig.upload_limit_bytes`, a 413 past it: the sink's), and the epilogue
after the closing boundary. Each malformed body is a 400 naming the field, in OpenAI's shape; a
body that ends early (the client left) is `ClientGone`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from email.message import Message
from typing import Any

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from stoker.errors import APIError, invalid
from stoker.http import ClientGone

MAX_HEADER_BYTES = 8 << 10
MAX_PARTS = 8
MAX_FIELD_BYTES = 1 << 10
MAX_BOUNDARY = 70  # RFC 2046's limit


class Sink:
    """Where the file part's bytes go: `files.Upload` (`write` raises `files.OverLimit`)."""

    def write(self, chunk: bytes) -> None: ...


@dataclass
class Form:
    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None  # the file part's, once one came


def boundary_of(content_type: str) -> bytes:
    kind, params = parse_options_header(content_type)
    if kind != b"multipart/form-data":
        raise APIError(
            415, "Upload a file as multipart/form-data.", param="file", code="unsupported_media_type"
        )
    boundary = params.get(b"boundary", b"")
    if not 1 <= len(boundary) <= MAX_BOUNDARY or not boundary.isascii():
        raise invalid("The multipart body names no valid boundary.", "file")
    return boundary


class _Reader:
    """python-multipart's callbacks: each part's headers, then its bytes to the sink or a field."""

    def __init__(self, open_sink: Callable[[], Sink]) -> None:
        self.form = Form()
        self._open_sink = open_sink
        self._sink: Sink | None = None
        self.parts = 0
        self.ended = False
        self._headers: list[tuple[bytearray, bytearray]] = []
        self._header_bytes = 0
        self._name = ""
        self._file: str | None = None
        self._field = bytearray()

    def callbacks(self) -> dict[str, Any]:
        return {
            "on_part_begin": self._part_begin,
            "on_header_begin": lambda: self._headers.append((bytearray(), bytearray())),
            "on_header_field": lambda data, start, end: self._header(0, data[start:end]),
            "on_header_value": lambda data, start, end: self._header(1, data[start:end]),
            "on_headers_finished": self._headers_finished,
            "on_part_data": lambda data, start, end: self._data(data[start:end]),
            "on_part_end": self._part_end,
            "on_end": self._end,
        }

    def _part_begin(self) -> None:
        self.parts += 1
        if self.parts > MAX_PARTS:
            raise invalid(f"The multipart body has more than {MAX_PARTS} parts.", "file")
        self._headers, self._header_bytes, self._field = [], 0, bytearray()

    def _header(self, which: int, data: bytes) -> None:
        self._header_bytes += len(data)
        if self._header_bytes > MAX_HEADER_BYTES:
            raise invalid("A multipart part's headers are too long.", "file")
        self._headers[-1][which].extend(data)

    def _headers_finished(self) -> None:
        message = Message()
        try:
            for name, value in self._headers:
                message[name.decode("utf-8").strip()] = value.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise invalid("A multipart part's headers are not UTF-8.", "file") from None
        if message.get_content_disposition() != "form-data":
            raise invalid("Each multipart part must be `Content-Disposition: form-data`.", "file")
        name = message.get_param("name", header="content-disposition")
        filename = message.get_param("filename", header="content-disposition")
        if not isinstance(name, str) or not name:
            raise invalid("A multipart part names no field.", "file")
        self._name, self._file = name, None if filename is None else str(filename)
        if self._file is not None:
            if name != "file" or self._sink is not None:
                raise invalid("Send one file, in the field `file`.", "file")
            self.form.filename = self._file
            self._sink = self._open_sink()
        elif name in self.form.fields:
            raise invalid(f"The field `{name}` is given twice.", name)

    def _data(self, data: bytes) -> None:
        if self._file is not None:
            self._sink.write(data)
            return
        self._field += data
        if len(self._field) > MAX_FIELD_BYTES:
            raise invalid(f"The field `{self._name}` is too long.", self._name)

    def _part_end(self) -> None:
        if self._file is None:
            try:
                self.form.fields[self._name] = self._field.decode("utf-8")
            except UnicodeDecodeError:
                raise invalid(f"The field `{self._name}` is not UTF-8.", self._name) from None

    def _end(self) -> None:
        self.ended = True


async def read_form(receive: Callable[[], Any], boundary: bytes, open_sink: Callable[[], Sink]) -> Form:
    """The form's plain fields and its one file (`file`), whose bytes go into `open_sink()`'s sink
    as they arrive. `open_sink` is called once, when the file part begins."""
    reader = _Reader(open_sink)
    parser = MultipartParser(boundary, reader.callbacks())
    epilogue, more = 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        more = message.get("more_body", False)
        if reader.ended:  # after the closing boundary: read and dropped, bounded
            epilogue += len(chunk)
            if epilogue > MAX_HEADER_BYTES:
                raise invalid("The multipart body goes on past its closing boundary.", "file")
            continue
        try:
            parser.write(chunk)
        except MultipartParseError:
            raise invalid("The multipart body is malformed.", "file") from None
    if not reader.ended:
        raise invalid("The multipart body ends before its closing boundary.", "file")
    return reader.form
