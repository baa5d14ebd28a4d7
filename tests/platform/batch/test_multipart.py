"""The upload's streaming multipart parser (`stoker.batch.multipart`), fed in chunks of every size."""

from __future__ import annotations

import pytest

from stoker.batch.multipart import MAX_PARTS, boundary_of, read_form
from stoker.errors import APIError

B = b"----b0undary"


def body(file: bytes, purpose: bytes = b"batch") -> bytes:
    return (
        b"--" + B + b"\r\n"
        b'Content-Disposition: form-data; name="purpose"\r\n\r\n' + purpose + b"\r\n"
        b"--" + B + b"\r\n"
        b'Content-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
        b"Content-Type: application/octet-stream\r\n\r\n" + file + b"\r\n"
        b"--" + B + b"--\r\n"
    )


class Sink:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, chunk: bytes) -> None:
        self.data += chunk


def feeder(data: bytes, size: int):
    chunks = [data[i : i + size] for i in range(0, len(data), size)] or [b""]

    async def receive():
        chunk = chunks.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    return receive


@pytest.mark.parametrize("size", [1, 3, 7, len(B) + 5, 64, 1 << 20])
async def test_the_file_and_fields_come_out_whatever_the_chunks(size):
    payload = b'{"a": 1}\r\n--not-the-boundary\r\n' * 50
    sink = Sink()
    form = await read_form(feeder(body(payload), size), B, lambda: sink)
    assert form.fields == {"purpose": "batch"} and form.filename == "in.jsonl"
    assert bytes(sink.data) == payload


async def test_a_body_cut_short_is_refused():
    with pytest.raises(APIError) as caught:
        await read_form(feeder(body(b"x" * 100)[:-20], 16), B, Sink)
    assert caught.value.status == 400 and caught.value.param == "file"


async def test_too_many_parts_are_refused():
    part = b"--" + B + b'\r\nContent-Disposition: form-data; name="f%d"\r\n\r\nv\r\n'
    data = b"".join(part.replace(b"%d", str(i).encode()) for i in range(MAX_PARTS + 1)) + b"--" + B + b"--"
    with pytest.raises(APIError, match="parts"):
        await read_form(feeder(data, 100), B, Sink)


async def test_a_long_field_is_refused_naming_it():
    with pytest.raises(APIError) as caught:
        await read_form(feeder(body(b"x", purpose=b"p" * 5000), 100), B, Sink)
    assert caught.value.param == "purpose"


def test_the_boundary_comes_from_the_content_type():
    assert boundary_of('multipart/form-data; boundary="abc"') == b"abc"
    with pytest.raises(APIError) as caught:
        boundary_of("application/json")
    assert caught.value.status == 415
    with pytest.raises(APIError):
        boundary_of("multipart/form-data")
