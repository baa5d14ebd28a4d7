"""The manifest: round trip, a stable content-only id, and refusal of unsafe or malformed input."""

from __future__ import annotations

import hashlib
import json

import pytest

from snapshots import CorruptSnapshot, FileEntry, Manifest, UnsafePathError


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def entries(*files: tuple[str, int, str]) -> tuple[FileEntry, ...]:
    return tuple(FileEntry(*f) for f in files)


def test_round_trip_keeps_content_and_metadata() -> None:
    m = Manifest(
        dtype="bfloat16",
        files=entries(("model.safetensors", 10, sha(b"w")), ("config.json", 2, sha(b"{}"))),
        source="/models/x",
        created="2025-01-02T03:04:05+00:00",
    )
    back = Manifest.from_json(m.to_json())
    assert back == m
    assert (back.source, back.created, back.version) == ("/models/x", "2025-01-02T03:04:05+00:00", 1)
    assert [e.path for e in back.files] == ["config.json", "model.safetensors"]  # sorted by path
    assert back.snapshot_id == m.snapshot_id
    assert back.total_bytes == 12


# Pinned ids: if canonicalization ever changes, every stored snapshot's id would change with it.
ID_TABLE = [
    ("float32", entries(), "9595969d97c93a31edba80742b49a0c4d992a3931cda10750ea3cf4874f0b206"),
    (
        "float32",
        entries(("config.json", 2, sha(b"{}"))),
        "7a6324dd0fbdaac94af317168edae8c1624273430c1c02b42f75278e83c7db41",
    ),
    (
        "bfloat16",
        entries(("model.safetensors", 1024, sha(b"w")), ("config.json", 2, sha(b"{}"))),
        "94859a525df596ca14c68125768c0c46d5d0704bfc47756f7222a8fdda33c16f",
    ),
    (
        "float16",
        entries(("sub/dir/tokenizer.json", 0, sha(b""))),
        "4d2e07f79d2583bb4cc684c47ad0927740e45690f74f1574665c09c4a434de01",
    ),
]


@pytest.mark.parametrize(("dtype", "files", "expected"), ID_TABLE)
def test_id_is_pinned(dtype: str, files: tuple[FileEntry, ...], expected: str) -> None:
    assert Manifest(dtype=dtype, files=files).snapshot_id == expected


def test_id_is_sha256_of_canonical_json() -> None:
    canonical = b'{"dtype":"float32","files":[],"version":1}'
    assert Manifest(dtype="float32", files=()).canonical_bytes() == canonical
    assert Manifest(dtype="float32", files=()).snapshot_id == sha(canonical)


BASE = entries(("config.json", 2, sha(b"{}")), ("model.safetensors", 8, sha(b"weights!")))


@pytest.mark.parametrize(
    "variant",
    [
        Manifest(dtype="float32", files=tuple(reversed(BASE))),
        Manifest(dtype="float32", files=BASE, source="s3://elsewhere/x"),
        Manifest(dtype="float32", files=BASE, created="1999-12-31T23:59:59+00:00"),
    ],
    ids=["file-order", "source", "created"],
)
def test_id_ignores_order_and_metadata(variant: Manifest) -> None:
    assert variant.snapshot_id == Manifest(dtype="float32", files=BASE).snapshot_id


@pytest.mark.parametrize(
    "variant",
    [
        Manifest(dtype="bfloat16", files=BASE),
        Manifest(dtype="float32", files=(*BASE[:1], FileEntry("model.safetensors", 9, BASE[1].sha256))),
        Manifest(dtype="float32", files=(*BASE[:1], FileEntry("model.safetensors", 8, sha(b"weights?")))),
        Manifest(dtype="float32", files=(*BASE[:1], FileEntry("model2.safetensors", 8, BASE[1].sha256))),
        Manifest(dtype="float32", files=BASE[:1]),
    ],
    ids=["dtype", "size", "sha256", "path", "fewer-files"],
)
def test_id_changes_with_content(variant: Manifest) -> None:
    assert variant.snapshot_id != Manifest(dtype="float32", files=BASE).snapshot_id


def manifest_text(path: object) -> str:
    return json.dumps(
        {"version": 1, "dtype": "float32", "files": [{"path": path, "size": 1, "sha256": sha(b"x")}]}
    )


@pytest.mark.parametrize(
    "path",
    ["../x", "/etc/passwd", "a/../../b", "a/..", "a\\b", "", "./a", "a//b", "manifest.json", 7, None],
)
def test_unsafe_paths_are_refused(path: object) -> None:
    with pytest.raises(UnsafePathError) as info:
        Manifest.from_json(manifest_text(path))
    assert repr(path) in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("path", ["config.json", "sub/model-00001-of-00002.safetensors", "a..b", ".hidden"])
def test_ordinary_paths_are_accepted(path: str) -> None:
    assert Manifest.from_json(manifest_text(path)).files[0].path == path


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[]",
        json.dumps({"version": 2, "dtype": "float32", "files": []}),
        json.dumps({"version": 1, "dtype": "", "files": []}),
        json.dumps({"version": 1, "dtype": "float32", "files": "x"}),
        json.dumps(
            {"version": 1, "dtype": "float32", "files": [{"path": "a", "size": -1, "sha256": sha(b"")}]}
        ),
        json.dumps({"version": 1, "dtype": "float32", "files": [{"path": "a", "size": 1, "sha256": "ABC"}]}),
        json.dumps(
            {
                "version": 1,
                "dtype": "float32",
                "files": [
                    {"path": "a", "size": 1, "sha256": sha(b"1")},
                    {"path": "a", "size": 1, "sha256": sha(b"1")},
                ],
            }
        ),
    ],
    ids=["not-json", "not-object", "version", "dtype", "files-type", "negative-size", "bad-sha", "duplicate"],
)
def test_malformed_manifests_are_corrupt(text: str) -> None:
    with pytest.raises(CorruptSnapshot):
        Manifest.from_json(text)
