"""`stoker snapshot`: import models into the local snapshot store, list them, verify them.

    stoker snapshot import SOURCE [--name NAME] [--json]     a model directory or a .gguf file
    stoker snapshot import --builtin smollm2 [--name NAME] [--json]
    stoker snapshot ls [--json]
    stoker snapshot verify REF                                 name, id, or id prefix (8+ hex)

The store lives at `$STOKER_HOME/snapshots`. Only the GGUF path imports torch and transformers.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from snapshots import (
    BUILTINS,
    InvalidSource,
    SnapshotRecord,
    SnapshotStore,
    builtin_path,
    import_gguf,
    import_hf_dir,
)
from stoker.paths import snapshot_store_dir


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "snapshot",
        help="import, list and verify model snapshots",
        description="Model snapshots: content-addressed copies of models in Hugging Face layout.",
    )
    sub = parser.add_subparsers(dest="snapshot_command", required=True, metavar="SUBCOMMAND")

    imp = sub.add_parser("import", help="import a model directory, a .gguf file, or a builtin model")
    imp.add_argument(
        "source", nargs="?", metavar="SOURCE", help="a Hugging Face layout directory or a .gguf file"
    )
    imp.add_argument("--builtin", metavar="NAME", help=f"a model shipped in a package: {', '.join(BUILTINS)}")
    imp.add_argument("--name", help="alias for the snapshot (default: the directory or file name)")
    imp.add_argument("--json", action="store_true", help="print one JSON object")
    imp.set_defaults(func=cmd_import)

    ls = sub.add_parser("ls", help="list the snapshots in the store")
    ls.add_argument("--json", action="store_true", help="print a JSON list")
    ls.set_defaults(func=cmd_ls)

    verify = sub.add_parser("verify", help="re-hash every file of a snapshot")
    verify.add_argument("ref", metavar="REF", help="a name, a full id, or an id prefix of 8+ hex characters")
    verify.set_defaults(func=cmd_verify)


def _store() -> SnapshotStore:
    return SnapshotStore(snapshot_store_dir())


def _human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB", "TiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{size:.1f} {unit}"


def _default_name(path: Path) -> str | None:
    stem = path.resolve().name if path.is_dir() else path.stem
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", stem).lstrip("._-")[:128]
    return name or None


def _say_converting(path: Path) -> None:
    print(f"converting {path.name} to float32 safetensors (about a minute, once per file)", file=sys.stderr)


def _import_source(source: str, store: SnapshotStore, name: str | None) -> SnapshotRecord:
    if "://" in source:
        scheme = source.split("://", 1)[0]
        if scheme == "s3":
            raise InvalidSource(f"s3:// sources are not supported yet: {source}; import a local directory")
        raise InvalidSource(f"unsupported source {source}: give a local model directory or .gguf file")
    path = Path(source).expanduser()
    if not path.exists():
        raise InvalidSource(f"no such file or directory: {source}")
    name = name or _default_name(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return import_gguf(path, store, name, on_convert=_say_converting)
    return import_hf_dir(path, store, name)


def cmd_import(args: argparse.Namespace) -> int:
    if args.source and args.builtin:
        raise InvalidSource("give either SOURCE or --builtin, not both")
    if not args.source and not args.builtin:
        raise InvalidSource("give a SOURCE (a model directory or a .gguf file) or --builtin NAME")
    store = _store()
    if args.builtin:
        path = builtin_path(args.builtin)
        record = import_gguf(path, store, args.name or args.builtin, on_convert=_say_converting)
    else:
        record = _import_source(args.source, store, args.name)
    if args.json:
        keys = ("id", "name", "path", "bytes", "dtype")
        print(json.dumps({k: v for k, v in record.to_dict().items() if k in keys}))
    else:
        print(f"id:    {record.id}")
        print(f"name:  {', '.join(record.names) or '-'}")
        print(f"path:  {record.path}")
        print(f"size:  {_human_bytes(record.bytes)} ({record.dtype})")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    store = _store()
    records = store.list()
    if args.json:
        print(json.dumps([r.to_dict() for r in records], indent=2))
        return 0
    if not records:
        print(f"no snapshots in {store.root}")
        return 0
    rows = [("ID", "NAME", "DTYPE", "SIZE", "PATH")]
    rows += [
        (r.id[:12], ",".join(r.names) or "-", r.dtype, _human_bytes(r.bytes), str(r.path)) for r in records
    ]
    widths = [
        max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)
    ]  # the path is last: no padding
    for *cells, path in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(cells, widths, strict=True)) + "  " + path)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    store = _store()
    record = store.resolve(args.ref)
    problems = store.verify(record.id)
    if not problems:
        print(f"ok  {record.id}  {record.path}")
        return 0
    for problem in problems:
        print(problem)
    print(f"snapshot {record.id[:12]}: {len(problems)} problem(s)", file=sys.stderr)
    return 1
