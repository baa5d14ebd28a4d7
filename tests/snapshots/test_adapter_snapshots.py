"""Adapter snapshots: a PEFT LoRA adapter for the tests' tiny Llama, built with `peft`, imported as a
snapshot of kind "adapter"; checked against bases (`base_mismatch`), pushed to and pulled from a real
S3 server (moto on loopback), listed, counted in the budget, and kept while pinned."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch
from safetensors.torch import save_file

from snapshots import (
    CorruptSnapshot,
    InvalidSource,
    Manifest,
    SnapshotStore,
    UnsafeFileError,
    adapter_info,
    base_mismatch,
    import_adapter_dir,
    import_hf_dir,
)
from snapshots.adapter import MAX_RANK
from snapshots.manifest import MANIFEST_NAME
from tests.conftest import build_tiny_adapter
from tests.deadlines import CLI
from tests.snapshots.s3_support import ACCESS_KEY, SECRET_KEY, MotoServer, aws_env
from tests.snapshots.support import RunCLI, assert_one_line_error, snapshot_dirs

TARGETS = ["q_proj", "v_proj", "down_proj"]
# The tiny Llama (tests/conftest.py): hidden 64, 4 heads of 16, 2 KV heads, intermediate 128, 2 layers.
TINY_SHAPES = (("down_proj", 128, 64), ("q_proj", 64, 64), ("v_proj", 64, 32))


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A rank-4 LoRA adapter (alpha 8) on q_proj, v_proj and down_proj of the tiny Llama, as PEFT saves it."""
    out = tmp_path_factory.mktemp("adapter") / "tiny-lora"
    build_tiny_adapter(tiny_model_dir, out, seed=0, rank=4, targets=tuple(TARGETS), scale=0.0)
    return out


def copy_of(adapter_dir: Path, tmp_path: Path, name: str = "edited") -> Path:
    return shutil.copytree(adapter_dir, tmp_path / name)


def edit_config(src: Path, **changes: Any) -> Path:
    path = src / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return src


def base_config(tiny_model_dir: Path) -> dict[str, Any]:
    return json.loads((tiny_model_dir / "config.json").read_text())


# --- import and the record -------------------------------------------------------------------------


def test_import_records_kind_base_rank_targets_and_fingerprint(
    adapter_dir: Path, tiny_model_dir: Path, store: SnapshotStore, tmp_path: Path
) -> None:
    record = import_adapter_dir(adapter_dir, store, "tiny-lora")
    assert record.kind == "adapter" and record.names == ("tiny-lora",)
    info = record.adapter
    assert info is not None
    assert (info.base_model, info.rank, info.lora_alpha) == (str(tiny_model_dir), 4, 8)
    assert info.target_modules == ("down_proj", "q_proj", "v_proj")
    assert (info.shapes, info.layers, info.all_layers) == (TINY_SHAPES, 2, True)
    assert info == adapter_info(adapter_dir)
    assert store.verify(record.id) == []

    on_disk = json.loads((record.path / MANIFEST_NAME).read_text())
    assert on_disk["kind"] == "adapter"
    assert on_disk["adapter"]["fingerprint"] == {
        "layers": 2,
        "all_layers": True,
        "modules": {m: {"in": i, "out": o} for m, i, o in TINY_SHAPES},
    }
    assert on_disk["adapter"]["target_modules"] == ["down_proj", "q_proj", "v_proj"]

    # Same bytes, same id: from another directory, under another name, stored once.
    again = import_adapter_dir(copy_of(adapter_dir, tmp_path, "elsewhere"), store, "again")
    assert again.id == record.id and snapshot_dirs(store.root) == [record.id]


def test_models_stay_models_and_old_manifests_read_as_models(
    tiny_model_dir: Path, store: SnapshotStore
) -> None:
    record = import_hf_dir(tiny_model_dir, store)
    assert (record.kind, record.adapter) == ("model", None)
    doc = json.loads((record.path / MANIFEST_NAME).read_text())
    assert doc.pop("kind") == "model"
    old = Manifest.from_json(json.dumps(doc))  # written before `kind` existed
    assert (old.kind, old.adapter, old.snapshot_id) == ("model", None, record.id)


def test_the_adapter_record_is_part_of_the_id(adapter_dir: Path, store: SnapshotStore) -> None:
    record = import_adapter_dir(adapter_dir, store)
    doc = json.loads((record.path / MANIFEST_NAME).read_text())
    raised = Manifest.from_json(json.dumps({**doc, "adapter": {**doc["adapter"], "rank": 64}}))
    as_model = Manifest.from_json(json.dumps({k: v for k, v in doc.items() if k not in ("kind", "adapter")}))
    assert raised.snapshot_id != record.id and as_model.snapshot_id != record.id


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        ({"kind": "lora"}, "bad kind in manifest: 'lora'"),
        ({"kind": "model"}, "manifest of kind 'model' with an adapter record"),
        ({"adapter": None}, "not a valid adapter record"),
        ({"adapter": {"rank": 4}}, "not a valid adapter record"),
    ],
)
def test_a_malformed_adapter_manifest_is_corrupt(
    edit: dict[str, Any], fragment: str, adapter_dir: Path, store: SnapshotStore
) -> None:
    record = import_adapter_dir(adapter_dir, store)
    doc = {**json.loads((record.path / MANIFEST_NAME).read_text()), **edit}
    with pytest.raises(CorruptSnapshot, match=re.escape(fragment)):
        Manifest.from_json(json.dumps(doc))


def test_a_pickled_adapter_is_refused_as_pickled_weights_are(
    cli: RunCLI, adapter_dir: Path, tmp_path: Path, store_root: Path
) -> None:
    src = copy_of(adapter_dir, tmp_path)
    (src / "adapter_model.safetensors").unlink()
    (src / "adapter_model.bin").write_bytes(b"\x80\x04\x95 a pickle")
    with pytest.raises(UnsafeFileError, match=re.escape("refusing adapter_model.bin: pickled weights")):
        adapter_info(src)
    assert_one_line_error(cli("import", str(src)), "refusing adapter_model.bin", "unpickling runs code")
    assert snapshot_dirs(store_root) == []


def _lora_tensors(src: Path, **extra: torch.Tensor) -> None:
    tensors = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 4),
        **extra,
    }
    save_file(tensors, str(src / "adapter_model.safetensors"))


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ("peft_type", "peft_type 'IA3': only LoRA adapters"),
        ("rank", f"rank r=512: it must be a whole number from 1 to {MAX_RANK}"),
        ("missing", "it has no adapter_model.safetensors"),
        ("not lora", "'base_model.model.lm_head.weight', which is not a LoRA A or B weight"),
        ("no B", "has no lora_B for base_model.model.model.layers.1.mlp.up_proj"),
        ("shapes", "inconsistent with rank r=8"),
    ],
)
def test_what_is_not_a_servable_lora_adapter_is_refused(
    change: str, fragment: str, adapter_dir: Path, tmp_path: Path, store: SnapshotStore
) -> None:
    src = copy_of(adapter_dir, tmp_path)
    if change == "peft_type":
        edit_config(src, peft_type="IA3")
    elif change == "rank":
        edit_config(src, r=512)
    elif change == "missing":
        (src / "adapter_model.safetensors").unlink()
    elif change == "not lora":
        _lora_tensors(src, **{"base_model.model.lm_head.weight": torch.zeros(8, 64)})
    elif change == "no B":
        _lora_tensors(
            src, **{"base_model.model.model.layers.1.mlp.up_proj.lora_A.weight": torch.zeros(4, 64)}
        )
    elif change == "shapes":
        edit_config(src, r=8)
    with pytest.raises(InvalidSource, match=re.escape(fragment)):
        import_adapter_dir(src, store)
    assert snapshot_dirs(store.root) == []


# --- against a base --------------------------------------------------------------------------------


def test_base_mismatch_none_for_its_base_and_naming_both_for_another(
    adapter_dir: Path, tiny_model_dir: Path
) -> None:
    info = adapter_info(adapter_dir)
    assert base_mismatch(info, base_config(tiny_model_dir)) is None

    wider = {**base_config(tiny_model_dir), "hidden_size": 128, "head_dim": 32}
    message = base_mismatch(info, wider, base="other-base")
    assert message is not None
    assert str(tiny_model_dir) in message and "other-base" in message
    assert "q_proj 64->64 (the base's is 128->128)" in message
    assert "down_proj 128->64 (the base's is 128->128)" in message

    deeper = {**base_config(tiny_model_dir), "num_hidden_layers": 4}
    assert "2 layers (the base has 4)" in (base_mismatch(info, deeper, base="deep") or "")
    # A base without what a module needs (no intermediate_size: no down_proj to fit) does not fit.
    partial = {k: v for k, v in base_config(tiny_model_dir).items() if k != "intermediate_size"}
    assert "implies no down_proj" in (base_mismatch(info, partial) or "")


def test_base_mismatch_against_a_built_base_of_another_hidden_size(adapter_dir: Path, tmp_path: Path) -> None:
    from tests.conftest import build_tiny_model

    other = build_tiny_model(tmp_path / "other", head_dim=32)  # 4 heads of 32: q_proj 64->128
    message = base_mismatch(adapter_info(adapter_dir), base_config(other), base="other")
    assert message is not None and "q_proj 64->64 (the base's is 64->128)" in message


# --- object storage, listing, budget, pins (the CLI, as a user runs it) -------------------------------


def run_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stoker.cli.main", "snapshot", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=CLI,
    )


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    server = MotoServer(tmp_path_factory.mktemp("moto")).start()
    yield server
    server.kill()


def test_push_and_pull_keep_the_adapter_record(
    cli: RunCLI, home_env: dict[str, str], moto: MotoServer, adapter_dir: Path, tmp_path: Path
) -> None:
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client(
        "s3",
        endpoint_url=moto.url,
        region_name="us-east-1",
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
    ).create_bucket(Bucket=bucket)
    here = {**aws_env(home_env, tmp_path), "AWS_ENDPOINT_URL": moto.url}
    there = {**here, "STOKER_HOME": str(tmp_path / "other-home")}

    imported = run_cli(here, "import", str(adapter_dir), "--name", "tiny-lora", "--json")
    assert imported.returncode == 0, imported.stderr
    sent = json.loads(imported.stdout)
    uri = f"s3://{bucket}/adapters/tiny-lora"
    pushed = run_cli(here, "push", "tiny-lora", uri, "--json")
    assert pushed.returncode == 0, pushed.stderr

    pulled = run_cli(there, "pull", uri, "--name", "lora", "--json")
    assert pulled.returncode == 0, pulled.stderr
    assert json.loads(pulled.stdout)["id"] == sent["id"]
    [listed] = json.loads(run_cli(there, "ls", "--json").stdout)
    assert (listed["kind"], listed["adapter"]) == ("adapter", sent["adapter"])
    assert listed["remotes"] == [uri]
    store = SnapshotStore(Path(there["STOKER_HOME"]) / "snapshots")
    assert store.verify(sent["id"]) == []


def test_ls_shows_kind_base_and_rank(cli: RunCLI, adapter_dir: Path, tiny_model_dir: Path) -> None:
    assert cli("import", str(tiny_model_dir), "--name", "base").returncode == 0
    human = cli("import", str(adapter_dir), "--name", "lora")
    assert human.returncode == 0, human.stderr
    assert "kind:  adapter (LoRA r=4, alpha 8, on down_proj,q_proj,v_proj, for " in human.stdout

    _header, columns, *rows = cli("ls").stdout.splitlines()
    assert columns.split()[:7] == ["ID", "NAME", "DTYPE", "SIZE", "KIND", "RANK", "BASE"]
    by_name = {row.split()[1]: row.split() for row in rows}
    # SIZE is two words ("14.8 KiB"): KIND, RANK and BASE follow it.
    assert by_name["lora"][5:8] == ["adapter", "4", _clipped(str(tiny_model_dir), 24)]
    assert by_name["base"][5:8] == ["model", "-", "-"]


def _clipped(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "~"


def test_the_budget_counts_adapters(adapter_dir: Path, tiny_model_dir: Path, store_root: Path) -> None:
    now = [1000.0]
    store = SnapshotStore(store_root, clock=lambda: now[0])
    model = import_hf_dir(tiny_model_dir, store)
    now[0] = 2000.0
    adapter = import_adapter_dir(adapter_dir, store)
    assert 0 < adapter.bytes == sum(p.stat().st_size for p in adapter_dir.iterdir())
    assert store.gc(dry_run=True).stored_bytes == model.bytes + adapter.bytes
    # One byte short of holding both: only because the adapter counts, the least recently used goes.
    tight = SnapshotStore(store_root, model.bytes + adapter.bytes - 1, clock=lambda: now[0])
    assert tight.gc().evicted == [model.id]
    assert tight.ids() == [adapter.id]


def test_rm_refuses_a_pinned_adapter(cli: RunCLI, adapter_dir: Path, store: SnapshotStore) -> None:
    record = import_adapter_dir(adapter_dir, store, "lora")
    with store.pin(record.id, "engine pid 4242"):
        assert_one_line_error(cli("rm", "lora"), "is in use (pinned by engine pid 4242)", "not removed")
    assert store.path_of(record.id).is_dir()
    done = cli("rm", "lora")
    assert done.returncode == 0 and done.stdout.startswith(f"removed {record.id[:12]} (lora), ")
    assert not store.path_of(record.id).exists()
