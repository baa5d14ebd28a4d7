"""Hugging Face repo ids from the local cache (`snapshots.hf_cache`): found where huggingface_hub
puts them, imported as the directory they stand for, never fetched; and a clear line when absent."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from snapshots import hf_cache
from snapshots.errors import InvalidSource
from tests.snapshots.support import RunCLI, assert_one_line_error

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_model(hub: Path, repo: str, source: Path, commit: str = COMMIT, branch: str = "main") -> Path:
    """`source`'s files laid out as huggingface_hub caches them: blobs by hash, the revision's
    snapshot as relative links into them, and a ref naming the commit."""
    root = hub / f"models--{repo.replace('/', '--')}"
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in sorted(source.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        (root / "blobs" / digest).write_bytes(f.read_bytes())
        (snapshot / f.name).symlink_to(Path("../../blobs") / digest)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / branch).write_text(commit)
    return snapshot


@pytest.mark.parametrize(
    ("env", "hub"),
    [
        ({"HF_HUB_CACHE": "/a/hub", "HF_HOME": "/b", "XDG_CACHE_HOME": "/c"}, "/a/hub"),
        ({"HF_HOME": "/b", "XDG_CACHE_HOME": "/c"}, "/b/hub"),
        ({"XDG_CACHE_HOME": "/c"}, "/c/huggingface/hub"),
        ({}, os.path.expanduser("~/.cache/huggingface/hub")),
    ],
)
def test_the_cache_is_where_huggingface_hub_puts_it(env, hub):
    assert hf_cache.hub_cache_dir(env) == Path(hub)


@pytest.mark.parametrize(
    ("ref", "is_repo"),
    [("org/name", True), ("org/name@v1.0", True), ("HuggingFaceTB/SmolLM2-135M", True), ("name", False),
     ("a/b/c", False), ("../x", False), ("./x", False), ("org/..", False), ("/abs/path", False)],
)  # fmt: skip
def test_what_looks_like_a_repo_id(ref, is_repo):
    assert hf_cache.is_repo_ref(ref) is is_repo


def test_a_revision_is_main_a_branch_or_a_commit(tmp_path: Path, tiny_model_dir: Path):
    hub = tmp_path / "hub"
    snapshot = cache_model(hub, "acme/tiny", tiny_model_dir)
    other = "f" * 40
    cache_model(hub, "acme/tiny", tiny_model_dir, commit=other, branch="dev")
    env = {"HF_HUB_CACHE": str(hub)}
    assert hf_cache.resolve("acme/tiny", env) == snapshot
    assert hf_cache.resolve("acme/tiny@dev", env).name == other
    assert hf_cache.resolve(f"acme/tiny@{COMMIT}", env) == snapshot
    with pytest.raises(InvalidSource, match=r"no revision 'v9' in the Hugging Face cache"):
        hf_cache.resolve("acme/tiny@v9", env)
    with pytest.raises(InvalidSource, match=rf"commit {'e' * 12} is not in the cache"):
        hf_cache.resolve(f"acme/tiny@{'e' * 40}", env)
    (hub / "models--acme--tiny" / "refs" / "main").write_text("../../../../etc")  # not a commit
    with pytest.raises(InvalidSource, match="no revision 'main'"):
        hf_cache.resolve("acme/tiny", env)


def test_import_by_repo_id_is_the_directory_import_and_names_it(
    cli: RunCLI, home_env: dict[str, str], tiny_model_dir: Path, tmp_path: Path
):
    cache_model(tmp_path / "hf" / "hub", "acme/tiny-llama", tiny_model_dir)
    home_env["HF_HOME"] = str(tmp_path / "hf")
    home_env.pop("HF_HUB_CACHE", None)
    by_repo = cli("import", "acme/tiny-llama", "--json")
    assert by_repo.returncode == 0, by_repo.stderr
    by_dir = cli("import", str(tiny_model_dir), "--json")
    a, b = json.loads(by_repo.stdout), json.loads(by_dir.stdout)
    assert a["id"] == b["id"] and a["name"] == "tiny-llama"  # the same bytes: the same snapshot

    where = tmp_path / "hf" / "hub" / "models--acme--absent"
    assert_one_line_error(
        cli("import", "acme/absent"),
        "acme/absent is not in the local Hugging Face cache",
        str(where),
        "huggingface-cli download",
    )
