"""Models already in the local Hugging Face cache, by repo id (`org/name`, `org/name@revision`).

The cache is huggingface_hub's layout, read here without it and never downloaded into:

    <hub>/models--<org>--<name>/refs/<branch>          the commit a branch points at (main by default)
    <hub>/models--<org>--<name>/snapshots/<commit>/    the files of that commit, links into blobs/

`<hub>` is `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else
`~/.cache/huggingface/hub`, as huggingface_hub itself looks. The snapshot directory is then
imported as any local model directory is (`importer.import_hf_dir`, which follows a cache's links
into its own `blobs/` and no others). A repo id, branch or commit not in the cache is one line
that says where it looked and how to fetch it; nothing here touches the network.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from snapshots.errors import InvalidSource

# Hugging Face's own rule for repo ids: `org/name`, each part letters, digits, '-', '_', '.'.
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
REPO_REF = re.compile(rf"(?P<repo>{_PART}/{_PART})(?:@(?P<revision>[A-Za-z0-9._/-]{{1,128}}))?")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_MAX_REF_BYTES = 256


def is_repo_ref(ref: str) -> bool:
    """`org/name` or `org/name@revision`: what a Hugging Face repo id looks like (a relative path of
    two parts does too; callers try a path that exists first)."""
    return REPO_REF.fullmatch(ref) is not None and ".." not in ref


def hub_cache_dir(env: Mapping[str, str] = os.environ) -> Path:
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    cache = (
        Path(env["XDG_CACHE_HOME"]).expanduser()
        if env.get("XDG_CACHE_HOME")
        else Path("~/.cache").expanduser()
    )
    return cache / "huggingface" / "hub"


def resolve(ref: str, env: Mapping[str, str] = os.environ) -> Path:
    """The cached snapshot directory of `org/name[@revision]` (a branch, default main, or a commit
    hash); InvalidSource naming where it looked if the cache does not hold it."""
    match = REPO_REF.fullmatch(ref)
    if match is None or ".." in ref:
        raise InvalidSource(f"{ref!r} is not a Hugging Face repo id (org/name or org/name@revision)")
    repo, revision = match["repo"], match["revision"] or "main"
    hub = hub_cache_dir(env)
    root = hub / f"models--{repo.replace('/', '--')}"
    fetch = f"fetch it first, e.g. `huggingface-cli download {repo}` (Stoker never downloads)"
    if not root.is_dir():
        raise InvalidSource(f"{repo} is not in the local Hugging Face cache (looked for {root}); {fetch}")
    commit = revision if _COMMIT.fullmatch(revision) else _read_ref(root / "refs" / revision)
    if commit is None:
        raise InvalidSource(
            f"{repo}: no revision {revision!r} in the Hugging Face cache ({root}/refs); {fetch}"
        )
    snapshot = root / "snapshots" / commit
    if not snapshot.is_dir():
        raise InvalidSource(
            f"{repo}@{revision}: commit {commit[:12]} is not in the cache ({snapshot}); {fetch}"
        )
    return snapshot


def _read_ref(path: Path) -> str | None:
    """The commit a ref file names, if it is one (never more than a few bytes read)."""
    try:
        with path.open("rb") as f:
            text = f.read(_MAX_REF_BYTES).decode("ascii", "replace").strip()
    except OSError:
        return None
    return text if _COMMIT.fullmatch(text) else None


def default_name(ref: str) -> str:
    """A snapshot name for a repo id: its name part (`org/SmolLM2-135M` → `SmolLM2-135M`)."""
    return ref.split("@", 1)[0].split("/", 1)[1]
