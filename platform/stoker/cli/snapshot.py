"""`stoker snapshot`: import models into the local snapshot store, list them, verify them.

    stoker snapshot import SOURCE [--name NAME] [--json]     a model directory, a .gguf file, a PEFT
                                                               LoRA adapter directory, or a Hugging
                                                               Face repo id in the local cache
    stoker snapshot import --builtin smollm2 [--name NAME] [--json]
    stoker snapshot ls [--json]                                most recently used first
    stoker snapshot verify REF                                 name, id, or id prefix (8+ hex)
    stoker snapshot warm REF [--json]                          read its files into the page cache
    stoker snapshot rm REF                                     unless a deployment uses it or it is pinned
    stoker snapshot gc [--budget SIZE] [--dry-run] [--json]   leftovers, then LRU down to the budget

The store lives at `$STOKER_HOME/snapshots`, within `$STOKER_SNAPSHOT_BUDGET` bytes if that is set
(`50G`, `512MiB`; see `stoker.paths`). Only the GGUF path imports torch and transformers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from snapshots import (
    BUILTINS,
    InvalidSource,
    SnapshotRecord,
    SnapshotStore,
    builtin_path,
    hf_cache,
    import_adapter_dir,
    import_gguf,
    import_hf_dir,
    is_adapter_dir,
    pagecache,
)
from snapshots.errors import SnapshotNotFound
from snapshots.sizes import format_size
from snapshots.usage import GcReport
from stoker.cli import snapshot_remote
from stoker.errors import CLIError
from stoker.paths import add_store_args, snapshot_budget, snapshot_store_dir


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "snapshot",
        help="import, list and verify model snapshots",
        description="Model snapshots: content-addressed copies of models in Hugging Face layout.",
    )
    sub = parser.add_subparsers(dest="snapshot_command", required=True, metavar="SUBCOMMAND")

    imp = sub.add_parser(
        "import", help="import a model directory, a .gguf file, a LoRA adapter directory, or a builtin model"
    )
    imp.add_argument(
        "source",
        nargs="?",
        metavar="SOURCE",
        help="a Hugging Face layout directory, a .gguf file, a PEFT LoRA adapter directory "
        "(adapter_config.json + adapter_model.safetensors), or a repo id (org/name[@revision]) already "
        "in the local Hugging Face cache ($HF_HOME/hub)",
    )
    imp.add_argument("--builtin", metavar="NAME", help=f"a model shipped in a package: {', '.join(BUILTINS)}")
    imp.add_argument(
        "--name", help="alias for the snapshot (default: the directory or file name, or the repo's name)"
    )
    imp.add_argument("--json", action="store_true", help="print one JSON object")
    imp.set_defaults(func=cmd_import)

    ls = sub.add_parser("ls", help="list the snapshots in the store, most recently used first")
    ls.add_argument("--json", action="store_true", help="print a JSON list")
    ls.set_defaults(func=cmd_ls)

    gc = sub.add_parser(
        "gc",
        help="remove leftovers and evict least recently used snapshots down to the budget",
        description="Remove what dead imports and pulls left behind, names of removed snapshots, and "
        "then the least recently used unpinned snapshots until the store fits its budget.",
    )
    gc.add_argument(
        "--budget", metavar="SIZE", help="evict down to this (e.g. 20G); default $STOKER_SNAPSHOT_BUDGET"
    )
    gc.add_argument("--dry-run", action="store_true", help="show what would be removed; remove nothing")
    gc.add_argument("--json", action="store_true", help="print one JSON object")
    gc.set_defaults(func=cmd_gc)

    verify = sub.add_parser("verify", help="re-hash every file of a snapshot")
    verify.add_argument("ref", metavar="REF", help="a name, a full id, or an id prefix of 8+ hex characters")
    verify.set_defaults(func=cmd_verify)

    warm = sub.add_parser(
        "warm",
        help="read a snapshot's files into the page cache, so the next start loads at memory speed",
    )
    warm.add_argument("ref", metavar="REF", help="a name, a full id, or an id prefix of 8+ hex characters")
    warm.add_argument("--json", action="store_true", help="print one JSON object")
    warm.set_defaults(func=cmd_warm)

    rm = sub.add_parser(
        "rm", help="remove a snapshot from the store; refused while a deployment uses it or it is pinned"
    )
    rm.add_argument("ref", metavar="REF", help="a name, a full id, or an id prefix of 8+ hex characters")
    rm.set_defaults(func=cmd_rm)

    snapshot_remote.register(sub)
    add_store_args(parser)
    for command in sub.choices.values():
        add_store_args(command)


def _store() -> SnapshotStore:
    return SnapshotStore(snapshot_store_dir(), snapshot_budget())


def _default_name(path: Path) -> str | None:
    stem = path.resolve().name if path.is_dir() else path.stem
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", stem).lstrip("._-")[:128]
    return name or None


def _say_converting(path: Path) -> None:
    print(
        f"converting {path.name} to float32 safetensors (about half a minute, once per file)", file=sys.stderr
    )


def _import_source(source: str, store: SnapshotStore, name: str | None) -> SnapshotRecord:
    if "://" in source:
        scheme = source.split("://", 1)[0]
        if scheme == "s3":
            raise InvalidSource(f"{source} is in object storage: `stoker snapshot pull {source}` fetches it")
        raise InvalidSource(f"unsupported source {source}: give a local model directory or .gguf file")
    path = Path(source).expanduser()
    if not path.exists() and hf_cache.is_repo_ref(source):  # a path that exists wins over a repo id
        return _import_dir(hf_cache.resolve(source), store, name or hf_cache.default_name(source))
    if not path.exists():
        raise InvalidSource(f"no such file or directory: {source}")
    name = name or _default_name(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return import_gguf(path, store, name, on_convert=_say_converting)
    return _import_dir(path, store, name)


def _import_dir(path: Path, store: SnapshotStore, name: str | None) -> SnapshotRecord:
    if path.is_dir() and is_adapter_dir(path):
        return import_adapter_dir(path, store, name)
    return import_hf_dir(path, store, name)


def _adapter_line(record: SnapshotRecord) -> str:
    """`LoRA r=4, alpha 8, on down_proj,q_proj,v_proj, for BASE` (an adapter's line in `import`)."""
    a = record.adapter
    assert a is not None
    targets = ",".join(a.target_modules)
    return f"LoRA r={a.rank}, alpha {a.lora_alpha:g}, on {targets}, for {a.base_model or '(no base named)'}"


def cmd_import(args: argparse.Namespace) -> int:
    if args.source and args.builtin:
        raise InvalidSource("give either SOURCE or --builtin, not both")
    if not args.source and not args.builtin:
        raise InvalidSource("give a SOURCE (a model directory or a .gguf file) or --builtin NAME")
    store = _store()
    if args.builtin:
        path = builtin_path(args.builtin)
        record = import_gguf(
            path,
            store,
            args.name or args.builtin,
            on_convert=_say_converting,
            generation=dict(BUILTINS[args.builtin].generation),
        )
    else:
        record = _import_source(args.source, store, args.name)
    if args.json:
        keys = ("id", "name", "path", "bytes", "dtype", "kind", "adapter")
        print(json.dumps({k: v for k, v in record.to_dict().items() if k in keys}))
    else:
        print(f"id:    {record.id}")
        print(f"name:  {', '.join(record.names) or '-'}")
        print(f"path:  {record.path}")
        print(f"size:  {format_size(record.bytes)} ({record.dtype})")
        if record.adapter is not None:
            print(f"kind:  adapter ({_adapter_line(record)})")
    return 0


def _iso(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch, datetime.UTC).isoformat(timespec="seconds")


def _ago(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit} ago"
    return f"{max(int(seconds), 0)}s ago"


def _residency(path: Path) -> float | None:
    """The fraction of the snapshot in the page cache, where `snapshots.pagecache` can tell."""
    try:
        from snapshots import pagecache
    except ImportError:
        return None
    residency = getattr(pagecache, "residency", None)
    if residency is None:
        return None
    try:
        return float(residency(path))
    except Exception:  # a listing must not fail over a cache statistic
        return None


def _ls_entry(store: SnapshotStore, record: SnapshotRecord) -> dict[str, Any]:
    """What `ls` says about one snapshot; SnapshotNotFound if it was evicted meanwhile."""
    remotes = getattr(store, "remotes", None)
    used = store.last_used(record.id)
    return {
        **record.to_dict(),
        "last_used": _iso(used),
        "last_used_epoch": used,
        "pinned": store.is_pinned(record.id),
        "pinned_by": store.pinned_by(record.id),
        "remotes": list(remotes(record.id)) if remotes is not None else [],
        "page_cache": _residency(record.path),
    }


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "~"


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    """Left-aligned columns two spaces apart; the last column is not padded."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1] for row in rows]


def cmd_ls(args: argparse.Namespace) -> int:
    store = _store()
    entries = []
    for record in store.list():
        try:
            entries.append(_ls_entry(store, record))
        except SnapshotNotFound:
            continue
    entries.sort(key=lambda e: (-e["last_used_epoch"], e["id"]))
    if args.json:
        print(json.dumps(entries, indent=2))
        return 0
    if not entries:
        print(f"no snapshots in {store.root}")
        return 0
    total = format_size(sum(e["bytes"] for e in entries))
    budget = f" of the {format_size(store.budget_bytes)} budget" if store.budget_bytes else ""
    print(f"{len(entries)} snapshot(s), {total}{budget}, in {store.root}/<ID>")
    now = time.time()
    # KIND, RANK and BASE after SIZE: an adapter's rank and the base it was trained on (as given).
    rows = [
        ("ID", "NAME", "DTYPE", "SIZE", "KIND", "RANK", "BASE", "LAST USED", "PINNED BY", "CACHED", "WHERE")
    ]
    for e in entries:
        pinned = ",".join(e["pinned_by"]) or "?" if e["pinned"] else "-"
        cached = "-" if e["page_cache"] is None else f"{e['page_cache']:.0%}"
        adapter = e["adapter"] or {}
        rows.append(
            (
                e["id"][:12],
                _clip(",".join(e["names"]) or "-", 24),
                e["dtype"],
                format_size(e["bytes"]),
                e["kind"],
                str(adapter.get("rank", "-")),
                _clip(adapter.get("base_model") or "-", 24),
                _ago(now - e["last_used_epoch"]),
                _clip(pinned, 16),
                cached,
                ", ".join(["local", *e["remotes"]]),
            )
        )
    print("\n".join(_table(rows)))
    return 0


def _print_gc(report: GcReport, names: dict[str, str]) -> None:
    verb = "would remove" if report.dry_run else "removed"
    rows = []
    for item in report.removed:
        if item.kind == "snapshot" and item.id:
            own = ",".join(sorted(n for n, i in names.items() if i == item.id))
            what = f"{item.id[:12]} ({own})" if own else item.id[:12]
        else:
            what = (
                item.path.name
                if item.kind in ("temp", "pull", "trash")
                else f"{item.path.parent.name}/{item.path.name}"
            )
        rows.append((verb, item.kind, format_size(item.bytes) if item.bytes else "-", what))
    if rows:
        print("\n".join(_table(rows)))
    freed = "would free" if report.dry_run else "freed"
    budget = f" (budget {format_size(report.budget)})" if report.budget is not None else " (no budget)"
    summary = "nothing to remove" if not rows else f"{freed} {format_size(report.bytes_freed)}"
    print(f"{summary}; snapshots take {format_size(report.stored_bytes)}{budget}")
    if report.problem:
        print(f"stoker: warning: {report.problem}", file=sys.stderr)


def cmd_gc(args: argparse.Namespace) -> int:
    budget = snapshot_budget(args.budget) if args.budget is not None else snapshot_budget()
    store = SnapshotStore(snapshot_store_dir(), budget)
    names = store.names()  # before: evicting a snapshot removes its names
    report = store.gc(dry_run=args.dry_run)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        _print_gc(report, names)
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


def cmd_warm(args: argparse.Namespace) -> int:
    store = _store()
    record = store.resolve(args.ref)
    before = pagecache.residency(record.path)
    report = pagecache.warm(record.path)
    after = pagecache.residency(record.path)
    touch = getattr(store, "touch", None)  # a warm is a use: it keeps the snapshot off the LRU end
    if touch is not None:
        touch(record.id)
    if args.json:
        out = {"id": record.id, "path": str(record.path), "bytes": report.bytes, "files": report.files}
        out |= {"seconds": report.seconds, "gb_per_s": report.gb_per_s}
        print(json.dumps(out | {"residency_before": before, "residency_after": after}))
    else:
        print(
            f"warmed {record.id[:12]}: {format_size(report.bytes)} in {report.seconds:.2f} s "
            f"({report.gb_per_s:.2f} GB/s); in the page cache before {before:.0%}, after {after:.0%}"
        )
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    store = _store()
    record = store.resolve(args.ref)
    users = _deployments_using(record.id)
    if users:
        raise CLIError(
            f"snapshot {record.id[:12]} is used by deployment {', '.join(users)}; not removed "
            f"(`stoker rm {users[0]}` first)"
        )
    if not store.remove(record.id):  # SnapshotPinned (one line) while an instance or a process holds it
        raise SnapshotNotFound(f"snapshot {record.id[:12]} was removed meanwhile")
    names = f" ({', '.join(record.names)})" if record.names else ""
    print(f"removed {record.id[:12]}{names}, {format_size(record.bytes)}")
    return 0


def _deployments_using(snapshot_id: str) -> list[str]:
    """The deployments in the registry (`$STOKER_HOME/stoker.db`) that serve this snapshot, running
    or not: one at zero instances holds no pin, but its next start needs the files."""
    from stoker.control.registry import Registry
    from stoker.paths import data_dir

    db = data_dir() / "stoker.db"
    if not db.is_file():
        return []
    registry = Registry(db)
    try:
        return [spec.name for spec in registry.all() if spec.snapshot_id == snapshot_id]
    finally:
        registry.close()
