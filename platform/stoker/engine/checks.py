"""Checks on a snapshot directory before the engine spends seconds importing torch to load it."""

from __future__ import annotations

from pathlib import Path

PICKLED = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def refuse_unloadable(snapshot_dir: Path) -> None:
    """Raise ValueError (one line) for a directory the engine must not or cannot load."""
    if not snapshot_dir.is_dir():
        raise ValueError(f"snapshot directory not found: {snapshot_dir}")
    pickled = sorted(p.name for p in snapshot_dir.iterdir() if p.suffix in PICKLED)
    if pickled:
        raise ValueError(
            f"refusing pickled weights {', '.join(pickled)} in {snapshot_dir}: unpickling runs code"
        )
    if not (snapshot_dir / "config.json").is_file():
        raise ValueError(f"no config.json in {snapshot_dir}: not a Hugging Face-layout snapshot")
    if not any(snapshot_dir.glob("*.safetensors")):
        raise ValueError(f"no *.safetensors weights in {snapshot_dir}")
