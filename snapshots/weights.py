"""What the importer needs to know about weight files without loading them.

Pickled formats are refused by name, since unpickling runs arbitrary code. A safetensors file is an
8-byte little-endian header length, a JSON header (`{name: {dtype, shape, data_offsets}}`), then
raw tensor bytes; reading the header alone tells the dtype of every tensor and catches files that
are not safetensors at all (a pickle renamed to `.safetensors`, a truncated download).
"""

from __future__ import annotations

import json
import math
import struct
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from snapshots.errors import InvalidSource, UnsafeFileError

PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt"})

# safetensors dtype codes -> torch-style names, as written in config.json and passed to vLLM.
_DTYPE_NAMES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
}
_FLOATING = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})
# The format's own reference implementation refuses headers above 100 MB.
MAX_HEADER_BYTES = 100_000_000


def is_pickle(path: str | Path) -> bool:
    return Path(path).suffix.lower() in PICKLE_SUFFIXES


def pickle_refused(rel: str) -> UnsafeFileError:
    """The importer's refusal of a pickled weights file found at `rel` in a source."""
    kinds = "/".join(sorted(PICKLE_SUFFIXES))
    return UnsafeFileError(
        f"refusing {rel}: pickled weights ({kinds}) are never loaded, since unpickling runs code; "
        "convert them to safetensors"
    )


def read_header(path: Path) -> dict[str, dict]:
    """Return the tensor entries of a safetensors file's header; InvalidSource if it is not one."""
    try:
        with open(path, "rb") as f:
            return read_header_from(f, path)
    except OSError as exc:
        raise InvalidSource(f"cannot read {path}: {exc.strerror or exc}") from exc


def read_header_from(f: BinaryIO, path: Path) -> dict[str, dict]:
    """`read_header` of a file already open (e.g. a descriptor opened without following symlinks)."""

    def bad(why: str) -> InvalidSource:
        return InvalidSource(f"{path.name} is not a valid safetensors file: {why}")

    try:
        size = f.seek(0, 2)
        f.seek(0)
        prefix = f.read(8)
        if len(prefix) < 8:
            raise bad("shorter than 8 bytes")
        (n,) = struct.unpack("<Q", prefix)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise bad(f"header length {n} does not fit a {size}-byte file")
        raw = f.read(n)
    except OSError as exc:
        raise InvalidSource(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad("header is not JSON") from exc
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    data_bytes = size - 8 - n
    tensors = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("dtype"), str)
            and isinstance(entry.get("shape"), list)
            and all(isinstance(d, int) and d >= 0 for d in entry["shape"])
            and isinstance(entry.get("data_offsets"), list)
            and len(entry["data_offsets"]) == 2
            and all(isinstance(o, int) for o in entry["data_offsets"])
        ):
            raise bad(f"malformed entry for tensor {key!r}")
        start, end = entry["data_offsets"]
        if not 0 <= start <= end <= data_bytes:
            raise bad(f"tensor {key!r} lies outside the file")
        tensors[key] = entry
    return tensors


def dominant_dtype(paths: Iterable[Path]) -> str:
    """The floating dtype holding the most parameters across these safetensors files.

    Integer tensors (position ids, quantization scales' indices) are counted only when there is no
    floating tensor at all. Ties go to the name that sorts first, so the answer is deterministic.
    """
    counts: Counter[str] = Counter()
    for path in paths:
        for entry in read_header(path).values():
            counts[entry["dtype"]] += math.prod(entry["shape"])
    if not counts:
        raise InvalidSource("the safetensors files hold no tensors")
    floating = {code: n for code, n in counts.items() if code in _FLOATING}
    pool = floating or dict(counts)
    code = min(pool, key=lambda c: (-pool[c], c))
    return _DTYPE_NAMES.get(code, code.lower())
