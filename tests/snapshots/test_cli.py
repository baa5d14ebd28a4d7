"""`stoker snapshot` driven as a user would: the real CLI in a subprocess, one STOKER_HOME per test."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.deadlines import CLI, deadline
from tests.snapshots.support import RunCLI, assert_one_line_error, snapshot_dirs


def ls_json(cli: RunCLI) -> list[dict]:
    proc = cli("ls", "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def import_json(cli: RunCLI, *args: str) -> dict:
    proc = cli("import", *args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_import_then_ls(cli: RunCLI, tiny_model_dir: Path) -> None:
    imported = import_json(cli, str(tiny_model_dir))
    assert set(imported) == {"id", "name", "path", "bytes", "dtype", "kind", "adapter"}
    assert (imported["kind"], imported["adapter"]) == ("model", None)
    source_bytes = sum(p.stat().st_size for p in tiny_model_dir.iterdir())
    assert (imported["name"], imported["dtype"], imported["bytes"]) == ("tiny-llama", "float32", source_bytes)
    [listed] = ls_json(cli)
    assert {k: listed[k] for k in imported} == imported
    assert listed["created"]
    assert Path(listed["path"], "config.json").read_bytes() == (tiny_model_dir / "config.json").read_bytes()

    header, columns, row = cli("ls").stdout.splitlines()
    assert header.endswith(f"in {Path(imported['path']).parent}/<ID>")  # the path, less the id
    assert columns.split() == "ID NAME DTYPE SIZE KIND RANK BASE LAST USED PINNED BY CACHED WHERE".split()
    assert row.split()[:3] == [imported["id"][:12], "tiny-llama", "float32"]
    assert row.split()[-1] == "local"

    human = cli("import", str(tiny_model_dir))
    assert human.returncode == 0 and imported["id"] in human.stdout and imported["path"] in human.stdout


def test_same_bytes_same_id_stored_once(cli: RunCLI, tiny_model_dir: Path, store_root: Path) -> None:
    first = import_json(cli, str(tiny_model_dir))
    second = import_json(cli, str(tiny_model_dir))
    renamed = import_json(cli, str(tiny_model_dir), "--name", "another")
    assert first["id"] == second["id"] == renamed["id"]
    assert renamed["name"] == "another"
    assert snapshot_dirs(store_root) == [first["id"]]
    [listed] = ls_json(cli)
    assert sorted(listed["names"]) == ["another", "tiny-llama"]


def test_pickled_weights_refused_and_nothing_stored(
    cli: RunCLI, tiny_model_dir: Path, tmp_path: Path, store_root: Path
) -> None:
    src = shutil.copytree(tiny_model_dir, tmp_path / "with-pickle")
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04\x95 a pickle")
    proc = cli("import", str(src))
    assert_one_line_error(proc, "pytorch_model.bin", "unpickling runs code")
    assert ls_json(cli) == []
    assert snapshot_dirs(store_root) == []


def test_verify_good_flipped_and_deleted(cli: RunCLI, tiny_model_dir: Path) -> None:
    imported = import_json(cli, str(tiny_model_dir), "--name", "tiny")
    ok = cli("verify", "tiny")
    assert ok.returncode == 0 and "ok" in ok.stdout, ok.stderr

    weights = Path(imported["path"], "model.safetensors")
    weights.chmod(0o644)
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x80
    weights.write_bytes(bytes(data))
    flipped = cli("verify", imported["id"][:10])
    assert flipped.returncode == 1
    assert "model.safetensors" in flipped.stdout and "corrupt" in flipped.stdout
    assert "Traceback" not in flipped.stderr

    Path(imported["path"], "tokenizer.json").unlink()
    both = cli("verify", imported["id"])
    assert both.returncode == 1
    assert "tokenizer.json: missing" in both.stdout and "model.safetensors" in both.stdout


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["import", "/does/not/exist"], ["no such file or directory: /does/not/exist"]),
        (["import", "{empty}"], ["no config.json"]),
        (["import", "--builtin", "gpt5"], ["unknown builtin model 'gpt5'", "smollm2"]),
        (["import", "{tiny}", "--builtin", "smollm2"], ["not both"]),
        (["import"], ["SOURCE", "--builtin"]),
        (
            ["import", "s3://bucket/models/x"],
            ["is in object storage", "stoker snapshot pull s3://bucket/models/x"],
        ),
        (["import", "{tiny}", "--name", "a b"], ["invalid snapshot name 'a b'"]),
        (["import", "{fake_gguf}"], ["is not a GGUF file"]),
        (["verify", "nothing-by-this-name"], ["no snapshot matches 'nothing-by-this-name'"]),
    ],
    ids=[
        "missing",
        "no-config",
        "unknown-builtin",
        "both",
        "neither",
        "s3",
        "bad-name",
        "not-gguf",
        "verify-unknown",
    ],
)
def test_bad_input_is_one_line(
    cli: RunCLI, tiny_model_dir: Path, tmp_path: Path, args: list[str], fragments: list[str]
) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "fake.gguf").write_bytes(b"not a gguf at all")
    paths = {"empty": tmp_path / "empty", "tiny": tiny_model_dir, "fake_gguf": tmp_path / "fake.gguf"}
    args = [a.format(**paths) for a in args]
    assert_one_line_error(cli(*args), *fragments)


def big_model(dst: Path, tiny_model_dir: Path) -> Path:
    """The tiny model's config plus 200 MB of float32 zeros: slow enough to copy to be caught halfway."""
    dst.mkdir()
    shutil.copy(tiny_model_dir / "config.json", dst / "config.json")
    save_file({"w": torch.zeros(50_000_000)}, str(dst / "model.safetensors"))
    return dst


def test_import_killed_midway_leaves_nothing_visible(
    cli: RunCLI, home_env: dict[str, str], tiny_model_dir: Path, tmp_path: Path, store_root: Path
) -> None:
    src = big_model(tmp_path / "big", tiny_model_dir)
    proc = subprocess.Popen(
        [sys.executable, "-m", "stoker.cli.main", "snapshot", "import", str(src)],
        env=home_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    partial = None
    end = time.monotonic() + deadline(60)
    while partial is None and proc.poll() is None and time.monotonic() < end:
        for tmp in store_root.glob(".tmp-*"):
            weights = tmp / "model.safetensors"
            if weights.exists() and weights.stat().st_size > 0:
                partial = tmp
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert partial is not None, "the import finished before it could be killed halfway"
    assert proc.returncode == -signal.SIGKILL
    assert partial.exists()  # the killed writer's leftovers: hidden, not a snapshot

    assert ls_json(cli) == []
    imported = import_json(cli, str(src))
    assert not partial.exists()  # cleaned up by the next import: its writer's pid is dead
    assert snapshot_dirs(store_root) == [imported["id"]]
    assert [s["id"] for s in ls_json(cli)] == [imported["id"]]


def test_write_failure_is_one_line_and_leaves_nothing(
    home_env: dict[str, str], tiny_model_dir: Path, store_root: Path
) -> None:
    # A real write error, EFBIG: files may not grow past 100 kB, and the 400 kB weights must.
    code = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))\n"
        "from stoker.cli.main import main\n"
        f"sys.exit(main(['snapshot', 'import', {str(tiny_model_dir)!r}]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=home_env, capture_output=True, text=True, timeout=CLI
    )
    assert_one_line_error(proc, "model.safetensors", "File too large")
    assert snapshot_dirs(store_root) == []
    assert os.listdir(store_root) == []  # not even a name
