"""`stoker snapshot push` and `stoker snapshot pull`: snapshots to and from object storage (S3).

    stoker snapshot push REF s3://bucket/prefix [--json]
    stoker snapshot pull s3://bucket/prefix [--name NAME] [--json]    prints the snapshot id
    both: [--endpoint-url URL] [--part-size 8MiB] [--concurrency 8] [--retries 5]

Credentials and region come from the standard AWS chain; `--endpoint-url` (or `AWS_ENDPOINT_URL`)
points at an S3-compatible store (MinIO, SeaweedFS, Ceph, R2). A progress bar (bytes, bytes/s,
time left) goes to stderr when stderr is a terminal and `--json` is not given. A plain pull prints
its summary on stderr and only the id on stdout, so `ID=$(stoker snapshot pull s3://...)` works.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from snapshots import SnapshotStore
from snapshots.sizes import format_size, parse_size
from snapshots.store import check_name
from stoker.errors import CLIError
from stoker.paths import snapshot_budget, snapshot_store_dir

if TYPE_CHECKING:
    from snapshots.remote import RemoteConfig

# aiobotocore and rich are imported inside the commands: together they cost ~0.8 s, which every
# other `stoker` command (and `--help`) would pay at start-up otherwise.


def register(sub: argparse._SubParsersAction) -> None:
    """Register `push` and `pull` under `stoker snapshot`."""
    push_parser = sub.add_parser("push", help="upload a snapshot to object storage (s3://bucket/prefix)")
    push_parser.add_argument(
        "ref", metavar="REF", help="a name, a full id, or an id prefix of 8+ hex characters"
    )
    push_parser.add_argument("uri", metavar="S3_URI", help="where to put it: s3://bucket/prefix")
    _transfer_options(push_parser)
    push_parser.set_defaults(func=cmd_push)

    pull_parser = sub.add_parser("pull", help="download a snapshot from object storage into the store")
    pull_parser.add_argument("uri", metavar="S3_URI", help="where it is: s3://bucket/prefix")
    pull_parser.add_argument("--name", help="alias for the pulled snapshot")
    _transfer_options(pull_parser)
    pull_parser.set_defaults(func=cmd_pull)


def _transfer_options(parser: argparse.ArgumentParser) -> None:
    # Numbers are taken as strings and checked here, so a bad one is our one-line error rather
    # than argparse's usage text.
    parser.add_argument(
        "--endpoint-url", help="an S3-compatible store (default: $AWS_ENDPOINT_URL, else AWS)"
    )
    parser.add_argument(
        "--part-size", default="8MiB", help="bytes per ranged GET / upload part (default 8MiB)"
    )
    parser.add_argument("--concurrency", default="8", help="requests in flight at once (default 8)")
    parser.add_argument(
        "--retries", default="5", help="attempts per request on throttling/5xx/network errors"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object, no progress")


def _count(flag: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise CLIError(f"{flag} must be a whole number, not {text!r}") from None


def _config(args: argparse.Namespace) -> RemoteConfig:
    from snapshots.remote import RemoteConfig

    try:
        part_size = parse_size(args.part_size)
    except ValueError as exc:
        raise CLIError(f"--part-size: {exc}") from None
    return RemoteConfig.from_env(
        args.endpoint_url,
        part_size=part_size,
        concurrency=_count("--concurrency", args.concurrency),
        retry_attempts=_count("--retries", args.retries),
    )


@contextmanager
def _progress(args: argparse.Namespace, verb: str) -> Iterator[Callable[[int, int], None] | None]:
    """A progress callback drawing a rich bar on stderr, or None where no one would see it."""
    if args.json or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    bars = Progress(
        TextColumn(f"{verb} [bold]{args.uri}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    task = bars.add_task(verb, total=None)
    with bars:
        yield lambda done, total: bars.update(task, completed=done, total=total)


def _rate(nbytes: int, seconds: float) -> str:
    return f"{format_size(int(nbytes / seconds))}/s" if seconds > 0 and nbytes else "-"


def cmd_push(args: argparse.Namespace) -> int:
    from snapshots.remote import push
    from snapshots.s3 import S3Uri

    S3Uri.parse(args.uri)
    config = _config(args)
    store = SnapshotStore(snapshot_store_dir(), snapshot_budget())
    with _progress(args, "pushing") as progress:
        report = asyncio.run(push(store, args.ref, args.uri, config, progress))
    if args.json:
        print(json.dumps(report.to_dict()))
        return 0
    print(
        f"pushed {report.id[:12]} to {report.uri}: {report.files} files, "
        f"{format_size(report.bytes_uploaded)} uploaded, {format_size(report.bytes_skipped)} already there, "
        f"{report.seconds:.1f} s ({_rate(report.bytes_uploaded, report.seconds)})"
        + (f", {report.compile_caches} compile cache(s)" if report.compile_caches else "")
    )
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from snapshots.remote import pull
    from snapshots.s3 import S3Uri

    S3Uri.parse(args.uri)  # bad input fails before any connection is made...
    if args.name is not None:
        check_name(args.name)  # ...and before the download, not after it
    config = _config(args)
    store = SnapshotStore(snapshot_store_dir(), snapshot_budget())
    with _progress(args, "pulling") as progress:
        report = asyncio.run(pull(store, args.uri, config, progress))
    if args.name is not None:
        store.set_name(args.name, report.id)
    if args.json:
        print(json.dumps({**report.to_dict(), "name": args.name}))
        return 0
    if report.bytes_downloaded or report.bytes_reused:
        how = f"{format_size(report.bytes_downloaded)} downloaded"
        if report.bytes_reused:
            how += f", {format_size(report.bytes_reused)} kept from an interrupted pull"
        how += f", {report.seconds:.1f} s ({_rate(report.bytes_downloaded, report.seconds)})"
    else:
        how = "already in the store" + (" (pulled meanwhile by another pull)" if report.shared else "")
    if report.compile_caches:
        how += f"; {report.compile_caches} compile cache(s)"
    print(f"pulled {report.uri}: {how}\npath: {report.path}", file=sys.stderr)
    print(report.id)
    return 0
