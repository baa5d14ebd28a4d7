"""Snapshots to and from object storage, against a real S3 server (moto) on loopback.

moto runs as its own process; where a test needs to see or shape the traffic, a counting proxy
process (tests/snapshots/s3_support.py) stands between the client and moto: it records every
request, can slow the bytes down, park requests, or answer a few with an S3 error. Pulls and pushes
run in this process (the library) or as `stoker snapshot` subprocesses (the CLI), as a user would.
The snapshots are small generated models (a few MiB of random float32) with 1 MiB parts, so
"larger than the part size" costs nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

from snapshots import CorruptSnapshot, SnapshotRecord, SnapshotStore, UnsafeFileError, UnsafePathError
from snapshots.errors import RemoteDenied, RemoteError, RemoteNotFound, RemoteUnavailable
from snapshots.importer import import_hf_dir
from snapshots.pulldir import Journal, Part, journal_path, lock_path
from snapshots.remote import RemoteConfig, pull, push, read_manifest
from snapshots.s3 import S3Uri, is_retryable
from tests.deadlines import CLI, deadline
from tests.snapshots.s3_support import (
    ACCESS_KEY,
    SECRET_KEY,
    MotoServer,
    Proxy,
    aws_env,
    free_port,
    get_bytes,
    waiting_for_flock,
)
from tests.snapshots.support import assert_one_line_error

MiB = 1024 * 1024
PART = 1 * MiB
WEIGHTS = "model.safetensors"


# --- fixtures and helpers --------------------------------------------------------------------------


def make_model(dst: Path, weight_bytes: int) -> Path:
    """A config, a tokenizer file and `weight_bytes` of random float32 safetensors (never part-aligned)."""
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (dst / "tokenizer.json").write_text(json.dumps({"version": "1.0", "salt": uuid.uuid4().hex}))
    n = weight_bytes // 4
    header = json.dumps({"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}}).encode()
    (dst / WEIGHTS).write_bytes(struct.pack("<Q", len(header)) + header + os.urandom(4 * n))
    return dst


def config(url: str, **settings: Any) -> RemoteConfig:
    defaults = {"part_size": PART, "concurrency": 4, "retry_backoff_s": 0.05}
    return RemoteConfig(endpoint_url=url, **{**defaults, **settings})


def run_cli(env: dict[str, str], *args: str, timeout: float = CLI) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stoker.cli.main", "snapshot", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def cli_json(env: dict[str, str], *args: str) -> dict[str, Any]:
    proc = run_cli(env, *args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def popen_cli(env: dict[str, str], *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "stoker.cli.main", "snapshot", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


async def until(condition: Callable[[], bool], what: str, within_s: float = deadline(30)) -> None:
    end = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}: not within {within_s:g} s")
        await asyncio.sleep(0.01)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def hidden_leftovers(root: Path) -> list[str]:
    """Pull dirs, journals, locks and temp dirs left in a store root."""
    return sorted(p.name for p in root.glob(".*")) if root.exists() else []


def same_bytes(a: Path, b: Path, files: list[str]) -> bool:
    return all((a / f).read_bytes() == (b / f).read_bytes() for f in files)


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    server = MotoServer(tmp_path_factory.mktemp("moto")).start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def shared_proxy(moto: MotoServer) -> Iterator[Proxy]:
    proxy = Proxy(moto.url)
    yield proxy
    proxy.stop()


@pytest.fixture
def proxy(shared_proxy: Proxy) -> Proxy:
    """The counting proxy in front of `moto`, reset: no records, no rate limit, nothing held or failing."""
    shared_proxy.release()
    shared_proxy.set_rate(0)
    shared_proxy.fail("", 0, 503, "SlowDown")
    shared_proxy.reset()
    return shared_proxy


@pytest.fixture
def env(home_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The CLI's environment (test credentials, none of the user's AWS config), also set in this process."""
    out = aws_env(home_env, tmp_path)
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    for key, value in out.items():
        if key.startswith("AWS_"):
            monkeypatch.setenv(key, value)
    return out


def client(url: str, key: str = ACCESS_KEY, secret: str = SECRET_KEY) -> Any:
    """A plain boto3 client, for setting the bucket up as a test needs it."""
    return boto3.client(
        "s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id=key, aws_secret_access_key=secret
    )


@pytest.fixture
def s3(moto: MotoServer) -> Any:
    return client(moto.url)


@pytest.fixture
def bucket(s3: Any) -> str:
    name = f"test-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name)
    return name


@pytest.fixture
def snapshot(store: SnapshotStore, tmp_path: Path) -> SnapshotRecord:
    """A 3 MiB (plus a bit) model in this test's store: its weights span four 1 MiB parts."""
    return import_hf_dir(make_model(tmp_path / "model", 3 * MiB + 1000), store)


def files_of(record: SnapshotRecord) -> list[str]:
    return sorted(p.name for p in record.path.iterdir() if p.name != "manifest.json")


# --- config and URIs (pure) ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("uri", "fragment"),
    [
        ("http://bucket/prefix", "not an S3 URI"),
        ("s3://", "invalid bucket name"),
        ("s3://ab/x", "invalid bucket name 'ab'"),
        ("s3://Bucket/x", "invalid bucket name"),
        ("s3://bucket/a//b", "invalid prefix"),
        ("s3://bucket/a/../b", "invalid prefix"),
    ],
)
def test_bad_uris_are_refused(uri: str, fragment: str) -> None:
    with pytest.raises(RemoteError, match=re.escape(fragment)):
        S3Uri.parse(uri)


def test_uri_keys() -> None:
    where = S3Uri.parse("s3://models/team/tiny/")
    assert (where.bucket, where.prefix) == ("models", "team/tiny")
    assert where.key("manifest.json") == "team/tiny/manifest.json"
    assert where.url("sub/w.safetensors") == "s3://models/team/tiny/sub/w.safetensors"
    assert S3Uri.parse("s3://models").key("manifest.json") == "manifest.json"


@pytest.mark.parametrize(
    ("settings", "fragment"),
    [
        ({"part_size": 1000}, "invalid part size 1000"),
        ({"part_size": 6 * 1024 * MiB}, "invalid part size"),
        ({"concurrency": 0}, "invalid concurrency 0"),
        ({"retry_attempts": 0}, "invalid retry attempts 0"),
        ({"retry_backoff_s": -1}, "invalid retry backoff -1"),
        ({"endpoint_url": "ftp://x"}, "invalid endpoint URL 'ftp://x'"),
    ],
)
def test_config_rejects_bad_settings(settings: dict[str, Any], fragment: str) -> None:
    with pytest.raises(RemoteError, match=re.escape(fragment)):
        RemoteConfig(**settings)


def test_config_endpoint_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    assert RemoteConfig.from_env().endpoint_url == "http://127.0.0.1:9000"
    assert RemoteConfig.from_env("http://127.0.0.1:1").endpoint_url == "http://127.0.0.1:1"
    # S3's cap of 10,000 parts grows the upload part size for huge files: 1 TiB / 10,000 > 64 MiB.
    assert RemoteConfig().upload_part_size(1024**4) == -(-(1024**4) // 10_000)


def _client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


@pytest.mark.parametrize(
    ("exc", "retried"),
    [
        (_client_error("SlowDown", 503), True),
        (_client_error("Throttling", 400), True),
        (_client_error("InternalError", 500), True),
        (_client_error("503", 503), True),  # a HEAD: no body, the status is the code
        (_client_error("AccessDenied", 403), False),
        (_client_error("NoSuchKey", 404), False),
        (_client_error("InvalidAccessKeyId", 403), False),
        (_client_error("PreconditionFailed", 412), False),
        (EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), True),
        (ConnectionResetError(), True),
        (TimeoutError(), True),
        (OSError(28, "No space left on device"), False),
        (ValueError("a bug"), False),
    ],
)
def test_retry_policy(exc: BaseException, retried: bool) -> None:
    assert is_retryable(exc) is retried


# --- push and pull ---------------------------------------------------------------------------------


def test_push_pull_round_trip(
    env: dict[str, str], moto: MotoServer, s3: Any, bucket: str, snapshot: SnapshotRecord, tmp_path: Path
) -> None:
    uri = f"s3://{bucket}/models/tiny"
    transfer = ("--endpoint-url", moto.url, "--part-size", "1MiB")
    pushed = cli_json(env, "push", snapshot.id[:12], uri, *transfer)
    assert (pushed["id"], pushed["uri"], pushed["bytes_uploaded"]) == (snapshot.id, uri, snapshot.bytes)
    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"])
    assert keys == sorted(f"models/tiny/{f}" for f in [*files_of(snapshot), "manifest.json"])

    elsewhere = {**env, "STOKER_HOME": str(tmp_path / "elsewhere")}
    pulled = cli_json(elsewhere, "pull", uri, *transfer, "--name", "tiny")
    assert pulled["id"] == snapshot.id
    assert (pulled["bytes_downloaded"], pulled["bytes_reused"], pulled["name"]) == (snapshot.bytes, 0, "tiny")
    assert same_bytes(snapshot.path, Path(pulled["path"]), [*files_of(snapshot), "manifest.json"])
    dest = SnapshotStore(tmp_path / "elsewhere" / "snapshots")
    [listed] = dest.list()
    assert (listed.id, listed.names) == (snapshot.id, ("tiny",))
    assert dest.verify(snapshot.id) == []
    assert dest.remotes(snapshot.id) == [uri]
    assert hidden_leftovers(dest.root) == []

    again = run_cli(elsewhere, "pull", uri, *transfer)  # plain output: the id alone on stdout
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines() == [snapshot.id]
    assert "already in the store" in again.stderr

    # A pull honours the store's budget like an import, and `--store` puts the store elsewhere.
    tight = {**env, "STOKER_HOME": str(tmp_path / "tight"), "STOKER_SNAPSHOT_BUDGET": "1KiB"}
    refused = run_cli(tight, "pull", uri, *transfer)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith("stoker: error: ") and "budget" in refused.stderr
    other = tmp_path / "nvme" / "store"
    placed = cli_json(elsewhere, "pull", uri, *transfer, "--store", str(other))
    assert Path(placed["path"]).parent == other and SnapshotStore(other).verify(snapshot.id) == []


async def test_push_parts_manifest_last_then_nothing_twice(
    env: dict[str, str], store: SnapshotStore, snapshot: SnapshotRecord, proxy: Proxy, bucket: str
) -> None:
    uri = f"s3://{bucket}/p"
    report = await push(store, snapshot.id, uri, config(proxy.url))
    assert (report.bytes_uploaded, report.bytes_skipped, report.files) == (snapshot.bytes, 0, 3)
    requests = proxy.requests()
    writes = [(r["method"], r["path"]) for r in requests if r["method"] in ("PUT", "POST")]
    assert writes[-1] == ("PUT", f"/{bucket}/p/manifest.json")  # last: a half push is no snapshot
    weights = (snapshot.path / WEIGHTS).stat().st_size
    part_puts = [r for r in requests if r["method"] == "PUT" and r["path"] == f"/{bucket}/p/{WEIGHTS}"]
    assert len(part_puts) == -(-weights // PART) == 4  # multipart: one PUT per part
    assert all(r["status"] == 200 for r in requests if r["method"] != "HEAD")

    proxy.reset()
    again = await push(store, snapshot.id, uri, config(proxy.url))
    assert (again.bytes_uploaded, again.bytes_skipped) == (0, snapshot.bytes)
    assert [(r["method"], r["path"]) for r in proxy.requests() if r["method"] != "HEAD"] == [
        ("PUT", f"/{bucket}/p/manifest.json")
    ]
    assert (await read_manifest(uri, config(proxy.url))).snapshot_id == snapshot.id


async def test_failed_multipart_upload_is_aborted_and_no_manifest_lands(
    env: dict[str, str], store: SnapshotStore, snapshot: SnapshotRecord, proxy: Proxy, s3: Any, bucket: str
) -> None:
    proxy.fail(WEIGHTS, 1, 403, "AccessDenied", method="PUT")  # one part of the weights is refused
    with pytest.raises(RemoteDenied, match="access denied"):
        await push(store, snapshot.id, f"s3://{bucket}/p", config(proxy.url))
    assert s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert s3.list_objects_v2(Bucket=bucket, Prefix="p/manifest.json")["KeyCount"] == 0


async def test_large_file_pulled_as_parallel_ranged_gets(
    env: dict[str, str],
    store: SnapshotStore,
    snapshot: SnapshotRecord,
    moto: MotoServer,
    proxy: Proxy,
    bucket: str,
    tmp_path: Path,
) -> None:
    uri = f"s3://{bucket}/p"
    await push(store, snapshot.id, uri, config(moto.url))
    proxy.set_rate(16 * MiB)  # ~60 ms per 1 MiB range, so the four ranges are in flight together
    dest = SnapshotStore(tmp_path / "dest")
    with pytest.raises(CorruptSnapshot, match="not the expected 000000000000"):
        await pull(dest, uri, config(proxy.url), expected_id="0" * 64)
    proxy.reset()
    seen: list[tuple[int, int]] = []
    report = await pull(dest, uri, config(proxy.url), lambda done, total: seen.append((done, total)))

    assert (report.id, report.bytes_downloaded, report.bytes_reused) == (snapshot.id, snapshot.bytes, 0)
    assert seen[0] == (0, snapshot.bytes) and seen[-1] == (snapshot.bytes, snapshot.bytes)
    assert [done for done, _ in seen] == sorted(done for done, _ in seen)  # no retries here: only forward
    assert same_bytes(snapshot.path, report.path, files_of(snapshot))
    requests = proxy.requests()
    weights = (snapshot.path / WEIGHTS).stat().st_size
    gets = [r for r in requests if r["method"] == "GET" and r["path"] == f"/{bucket}/p/{WEIGHTS}"]
    spans = sorted(
        tuple(int(x) for x in re.fullmatch(r"bytes=(\d+)-(\d+)", r["range"]).groups()) for r in gets
    )
    assert spans == [(o, min(o + PART, weights) - 1) for o in range(0, weights, PART)]
    assert sum(r["bytes"] for r in gets) == weights  # each byte once
    # In parallel: some range began before another had ended.
    assert any(
        a["started"] < b["ended"] and b["started"] < a["ended"] for a, b in itertools.combinations(gets, 2)
    )
    [config_get] = [r for r in requests if r["method"] == "GET" and r["path"].endswith("/config.json")]
    assert config_get["range"] is None  # a small file is one plain GET


async def test_pull_resumes_after_sigkill_and_after_the_server_died(
    env: dict[str, str], store: SnapshotStore, tmp_path: Path
) -> None:
    record = import_hf_dir(make_model(tmp_path / "big", 8 * MiB), store)
    server = MotoServer(tmp_path).start()
    proxy = Proxy(server.url, rate=4 * MiB)  # 0.25 s a part: a pull is caught with most to go
    uri = "s3://resume/p"

    async def publish() -> None:  # moto forgets all on restart; same bytes and part size, same ETags
        client(server.url).create_bucket(Bucket="resume")
        await push(store, record.id, uri, config(server.url))

    try:
        await publish()
        dest_env = {**env, "STOKER_HOME": str(tmp_path / "dest")}
        dest = SnapshotStore(tmp_path / "dest" / "snapshots")
        journal = journal_path(dest.pull_dir(record.id))
        args = ("pull", uri, "--endpoint-url", proxy.url, "--part-size", "1MiB", "--concurrency", "1")

        def parts_on_disk() -> int:
            return len(Journal(journal).load())

        # 1. The puller is SIGKILLed (no cleanup of any kind) with two parts on disk.
        proc = popen_cli(dest_env, *args, "--json")
        await until(lambda: proc.poll() is not None or parts_on_disk() >= 2, "two parts on disk")
        proc.kill()
        await asyncio.to_thread(proc.communicate, timeout=CLI)
        assert proc.returncode == -signal.SIGKILL
        assert dest.list() == []  # nothing half-downloaded is visible...
        assert dest.pull_dir(record.id).is_dir()  # ...but it is kept to resume from
        first_parts = parts_on_disk()

        # 2. The next pull goes on from there, until the server dies under it.
        proc = popen_cli(dest_env, *args, "--retries", "2", "--json")
        await until(
            lambda: proc.poll() is not None or parts_on_disk() >= first_parts + 2, "two more parts on disk"
        )
        server.kill()
        out, err = await asyncio.to_thread(proc.communicate, timeout=CLI)
        assert_one_line_error(
            subprocess.CompletedProcess(proc.args, proc.returncode, out, err), "cannot reach"
        )
        assert dest.list() == []
        kept = sum(p.length for p in Journal(journal).load())

        # 3. The server is back (and the bytes pushed again): the pull completes, keeping the parts.
        server.start()
        await publish()
        proxy.set_rate(0)
        proxy.reset()
        report = await pull(dest, uri, config(proxy.url, concurrency=1))
        assert report.id == record.id
        assert report.bytes_reused >= kept >= 3 * PART
        assert report.bytes_downloaded == record.bytes - report.bytes_reused
        over_the_wire = sum(get_bytes(proxy.requests(), f"/resume/p/{f}") for f in files_of(record))
        assert over_the_wire == report.bytes_downloaded
        assert same_bytes(record.path, report.path, files_of(record))
        assert [r.id for r in dest.list()] == [record.id]
        assert hidden_leftovers(dest.root) == []
    finally:
        proxy.stop()
        server.kill()


async def test_resumed_pull_rehashes_the_landed_prefix_and_refetches_a_part_changed_on_disk(
    env: dict[str, str],
    store: SnapshotStore,
    moto: MotoServer,
    proxy: Proxy,
    bucket: str,
    tmp_path: Path,
) -> None:
    """Each byte is hashed once, in order as parts land, so a part's journal record holds the
    sha256 of its file up to the part's end. A pull cancelled mid-file and resumed re-hashes that
    prefix: a byte changed on disk in between is caught in the part that holds it, which is fetched
    again with every part after it, and the snapshot that lands is the bucket's, byte for byte."""
    record = import_hf_dir(make_model(tmp_path / "big", 6 * MiB), store)
    uri = f"s3://{bucket}/p"
    await push(store, record.id, uri, config(moto.url))
    original = (record.path / WEIGHTS).read_bytes()
    dest = SnapshotStore(tmp_path / "dest")
    journal = Journal(journal_path(dest.pull_dir(record.id)))

    def weight_parts() -> list[Part]:
        return sorted((p for p in journal.load() if p.path == WEIGHTS), key=lambda p: p.offset)

    proxy.set_rate(4 * MiB)  # 0.25 s a part, one at a time: cancelled with most of the file to go
    task = asyncio.create_task(pull(dest, uri, config(proxy.url, concurrency=1)))
    await until(lambda: task.done() or len(weight_parts()) >= 2, "two parts of the weights journaled")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert dest.list() == [] and dest.pull_dir(record.id).is_dir()
    landed = weight_parts()
    assert 2 <= len(landed) < len(original) // PART
    for part in landed:  # the digest of the whole prefix, each part's offset following the last
        assert part.prefix_sha256 == sha256(original[: part.offset + part.length])
    assert [p.offset for p in landed] == [n * PART for n in range(len(landed))]

    pulled = dest.pull_dir(record.id) / WEIGHTS
    on_disk = bytearray(pulled.read_bytes())  # one byte of the second part, journaled as fine, goes bad
    on_disk[PART + PART // 2] ^= 0x01
    pulled.write_bytes(bytes(on_disk))

    proxy.set_rate(0)
    proxy.reset()
    report = await pull(dest, uri, config(proxy.url))
    assert report.id == record.id
    assert get_bytes(proxy.requests(), f"/{bucket}/p/{WEIGHTS}") == len(original) - PART  # part 0 kept
    assert report.bytes_downloaded + report.bytes_reused == record.bytes
    assert (report.path / WEIGHTS).read_bytes() == original
    assert dest.verify(record.id) == []
    assert hidden_leftovers(dest.root) == []


def test_a_journal_of_per_part_digests_keeps_nothing(tmp_path: Path) -> None:
    """Records from before the prefix digest (a `sha256` of the part alone) load as nothing, so a
    pull fetches those parts afresh rather than checking them against the wrong digest."""
    journal = Journal(tmp_path / "journal")
    old = {"path": WEIGHTS, "offset": 0, "length": 4, "etag": '"e"', "sha256": sha256(b"abcd")}
    journal.path.write_text(json.dumps(old) + "\n")
    assert journal.load() == []
    journal.append(Part(WEIGHTS, 0, 4, '"e"', sha256(b"abcd")), Part(WEIGHTS, 4, 2, '"e"', sha256(b"abcdef")))
    assert [(p.offset, p.prefix_sha256) for p in journal.load()] == [
        (0, sha256(b"abcd")),
        (4, sha256(b"abcdef")),
    ]


async def test_altered_byte_in_bucket_is_refused(
    env: dict[str, str],
    store: SnapshotStore,
    snapshot: SnapshotRecord,
    moto: MotoServer,
    s3: Any,
    bucket: str,
    tmp_path: Path,
) -> None:
    uri = f"s3://{bucket}/p"
    await push(store, snapshot.id, uri, config(moto.url))
    original = (snapshot.path / WEIGHTS).read_bytes()
    altered = bytearray(original)
    altered[len(altered) // 2] ^= 0x01
    s3.put_object(Bucket=bucket, Key=f"p/{WEIGHTS}", Body=bytes(altered))

    dest = SnapshotStore(tmp_path / "dest")
    with pytest.raises(CorruptSnapshot, match=rf"^{WEIGHTS}: sha256 .* does not match the manifest"):
        await pull(dest, uri, config(moto.url))
    assert dest.list() == [] and not dest.path_of(snapshot.id).exists()
    kept = Journal(journal_path(dest.pull_dir(snapshot.id))).load()
    assert {p.path for p in kept} == {"config.json", "tokenizer.json"}  # the bad file's parts are dropped

    s3.put_object(Bucket=bucket, Key=f"p/{WEIGHTS}", Body=original)
    report = await pull(dest, uri, config(moto.url))
    assert (report.bytes_downloaded, report.bytes_reused) == (len(original), snapshot.bytes - len(original))
    assert dest.verify(snapshot.id) == []


async def test_two_processes_pulling_at_once_fetch_each_byte_once(
    env: dict[str, str],
    store: SnapshotStore,
    snapshot: SnapshotRecord,
    moto: MotoServer,
    proxy: Proxy,
    bucket: str,
    tmp_path: Path,
) -> None:
    uri = f"s3://{bucket}/p"
    await push(store, snapshot.id, uri, config(moto.url))
    dest_env = {**env, "STOKER_HOME": str(tmp_path / "dest")}
    dest = SnapshotStore(tmp_path / "dest" / "snapshots")
    args = ("pull", uri, "--endpoint-url", proxy.url, "--part-size", "1MiB", "--json")

    proxy.hold(WEIGHTS)  # whoever takes the snapshot's lock first stops on the weights, holding it
    procs = [popen_cli(dest_env, *args) for _ in range(2)]
    lock = lock_path(dest.pull_dir(snapshot.id))

    def one_pulling_one_waiting() -> bool:
        if any(p.poll() is not None for p in procs):
            return True  # an early exit: the asserts below say what went wrong
        return proxy.stats()["held"] >= 1 and any(waiting_for_flock(p.pid, lock) for p in procs)

    await until(one_pulling_one_waiting, "one pull holding the lock, the other waiting for it")
    proxy.release()
    outs = [await asyncio.to_thread(p.communicate, timeout=CLI) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    a, b = sorted((json.loads(out) for out, _ in outs), key=lambda r: -r["bytes_downloaded"])

    assert a["id"] == b["id"] == snapshot.id
    assert (a["bytes_downloaded"], a["shared"]) == (snapshot.bytes, False)
    assert (b["bytes_downloaded"], b["shared"]) == (0, True)  # it waited, then found it stored
    requests = proxy.requests()
    for f in files_of(snapshot):
        assert get_bytes(requests, f"/{bucket}/p/{f}") == (snapshot.path / f).stat().st_size
    assert len([r for r in requests if r["method"] == "GET" and r["path"].endswith("manifest.json")]) == 2
    assert [r.id for r in dest.list()] == [snapshot.id]


async def test_two_tasks_pulling_at_once_fetch_each_byte_once(
    env: dict[str, str],
    store: SnapshotStore,
    snapshot: SnapshotRecord,
    moto: MotoServer,
    proxy: Proxy,
    bucket: str,
    tmp_path: Path,
) -> None:
    uri = f"s3://{bucket}/p"
    await push(store, snapshot.id, uri, config(moto.url))
    dest = SnapshotStore(tmp_path / "dest")
    proxy.hold(WEIGHTS)
    tasks = [asyncio.create_task(pull(dest, uri, config(proxy.url))) for _ in range(2)]
    lock = lock_path(dest.pull_dir(snapshot.id))
    await until(
        lambda: proxy.stats()["held"] >= 1 and waiting_for_flock(os.getpid(), lock),
        "one pulling, one waiting",
    )
    proxy.release()
    reports = sorted(await asyncio.gather(*tasks), key=lambda r: r.bytes_downloaded)
    assert [(r.bytes_downloaded, r.shared) for r in reports] == [(0, True), (snapshot.bytes, False)]
    requests = proxy.requests()
    assert sum(get_bytes(requests, f"/{bucket}/p/{f}") for f in files_of(snapshot)) == snapshot.bytes
    assert [r.id for r in dest.list()] == [snapshot.id]


async def test_throttling_is_retried_and_4xx_is_not(
    env: dict[str, str],
    store: SnapshotStore,
    snapshot: SnapshotRecord,
    moto: MotoServer,
    proxy: Proxy,
    bucket: str,
    tmp_path: Path,
) -> None:
    uri = f"s3://{bucket}/p"
    await push(store, snapshot.id, uri, config(moto.url))
    weights = f"/{bucket}/p/{WEIGHTS}"

    proxy.fail(WEIGHTS, 1, 403, "AccessDenied")
    with pytest.raises(RemoteDenied, match="access denied"):
        await pull(SnapshotStore(tmp_path / "denied"), uri, config(proxy.url))
    # Not retried: the HEAD once, then a one-byte GET asking why (a HEAD's error has no body).
    assert [(r["method"], r["status"]) for r in proxy.requests() if r["path"] == weights] == [
        ("HEAD", 403),
        ("GET", 206),
    ]

    proxy.reset()
    proxy.fail(WEIGHTS, 3, 503, "SlowDown")
    report = await pull(SnapshotStore(tmp_path / "throttled"), uri, config(proxy.url))
    statuses = [r["status"] for r in proxy.requests() if r["path"] == weights]
    assert statuses.count(503) == 3 and statuses.count(206) == 4
    assert report.bytes_downloaded == snapshot.bytes


# --- refused before a byte is fetched ---------------------------------------------------------------


def _put_manifest(s3: Any, bucket: str, files: list[dict[str, Any]]) -> None:
    doc = {"version": 1, "dtype": "float32", "source": "", "created": "", "files": files}
    s3.put_object(Bucket=bucket, Key="p/manifest.json", Body=json.dumps(doc).encode())


@pytest.mark.parametrize("bad", ["../escape.json", "/etc/cron.d/job", "sub/../../escape"])
async def test_manifest_with_unsafe_path_is_refused(
    env: dict[str, str], moto: MotoServer, s3: Any, bucket: str, tmp_path: Path, bad: str
) -> None:
    _put_manifest(s3, bucket, [{"path": bad, "size": 3, "sha256": sha256(b"abc")}])
    with pytest.raises(UnsafePathError, match=re.escape(repr(bad))):
        await pull(SnapshotStore(tmp_path / "store"), f"s3://{bucket}/p", config(moto.url))
    assert not (tmp_path / "store").exists()
    assert not (tmp_path / "escape.json").exists()


async def test_pickled_weights_are_refused(
    env: dict[str, str], moto: MotoServer, s3: Any, bucket: str, tmp_path: Path
) -> None:
    pickle = b"\x80\x04\x95 a pickle"
    s3.put_object(Bucket=bucket, Key="p/pytorch_model.bin", Body=pickle)
    _put_manifest(s3, bucket, [{"path": "pytorch_model.bin", "size": len(pickle), "sha256": sha256(pickle)}])
    with pytest.raises(UnsafeFileError, match=re.escape("pytorch_model.bin is pickled weights")):
        await pull(SnapshotStore(tmp_path / "store"), f"s3://{bucket}/p", config(moto.url))
    assert not (tmp_path / "store").exists()


# --- one-line errors from the CLI -------------------------------------------------------------------


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A moto server that checks every request's signature and permissions against its IAM.

    Two users: `puller` may do anything in S3, `nobody` has no policy. Auth is switched on (moto's
    `/moto-api/reset-auth`, the server-mode form of INITIAL_NO_AUTH_ACTION_COUNT) after the setup.
    """
    server = MotoServer(tmp_path_factory.mktemp("guarded")).start()
    admin = client(server.url)
    admin.create_bucket(Bucket="guarded")
    iam = boto3.client(
        "iam", endpoint_url=server.url, region_name="us-east-1", aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
    )  # fmt: skip
    keys = {}
    for user, policy in (("puller", "s3:*"), ("nobody", None)):
        iam.create_user(UserName=user)
        if policy:
            statement = {"Effect": "Allow", "Action": policy, "Resource": "*"}
            document = json.dumps({"Version": "2012-10-17", "Statement": [statement]})
            iam.put_user_policy(UserName=user, PolicyName="s3", PolicyDocument=document)
        key = iam.create_access_key(UserName=user)["AccessKey"]
        keys[user] = (key["AccessKeyId"], key["SecretAccessKey"])
    server.enable_auth()
    yield {"url": server.url, **keys}
    server.kill()


@pytest.mark.parametrize(
    ("case", "args", "fragments"),
    [
        ("unknown-key", ["pull", "s3://guarded/p"], ["wrong AWS credentials", "InvalidAccessKeyId"]),
        (
            "wrong-secret",
            ["push", "{id}", "s3://guarded/p"],
            ["wrong AWS credentials", "SignatureDoesNotMatch"],
        ),
        (
            "puller",
            ["pull", "s3://no-such-bucket/p"],
            ["no such bucket", "s3://no-such-bucket/p/manifest.json"],
        ),
    ],
)
def test_cli_errors_are_one_line(
    env: dict[str, str],
    guarded: dict[str, Any],
    snapshot: SnapshotRecord,
    case: str,
    args: list[str],
    fragments: list[str],
) -> None:
    key, secret = guarded["puller"]
    if case == "unknown-key":
        key = "AKIAIOSFODNN7EXAMPLE"
    elif case == "wrong-secret":
        secret = "not-the-secret"
    run_env = {**env, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret}
    args = [a.format(id=snapshot.id) for a in args]
    assert_one_line_error(run_cli(run_env, *args, "--endpoint-url", guarded["url"]), *fragments)


async def test_access_denied_and_no_credentials(
    env: dict[str, str], guarded: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    store = SnapshotStore(tmp_path / "store")
    nobody_key, nobody_secret = guarded["nobody"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", nobody_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", nobody_secret)
    with pytest.raises(
        RemoteDenied, match=r"^access denied: GET s3://guarded/p/manifest.json \(AccessDenied\)"
    ):
        await pull(store, "s3://guarded/p", config(guarded["url"]))
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(RemoteDenied, match=r"^no AWS credentials found"):
        await pull(store, "s3://guarded/p", config(guarded["url"]))


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["pull", "http://bucket/p"], ["not an S3 URI"]),
        (["push", "tiny", "s3://b/p"], ["invalid bucket name 'b'"]),
        (["pull", "s3://bucket/p", "--part-size", "lots"], ["--part-size", "'lots' is not a size"]),
        (["pull", "s3://bucket/p", "--concurrency", "many"], ["--concurrency must be a whole number"]),
        (["pull", "s3://bucket/p", "--concurrency", "0"], ["invalid concurrency 0"]),
        (["pull", "s3://bucket/p", "--name", "a b"], ["invalid snapshot name 'a b'"]),
    ],
)
def test_cli_bad_arguments_fail_before_any_request(
    env: dict[str, str], capsys: pytest.CaptureFixture[str], args: list[str], fragments: list[str]
) -> None:
    # In this process (the same `main` the command runs): these fail before any event loop starts.
    from stoker.cli.main import main

    assert main(["snapshot", *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("stoker: error: "), err
    assert all(f in err[0] for f in fragments), err[0]


async def test_no_snapshot_at_prefix_and_unreachable_store(
    env: dict[str, str], moto: MotoServer, bucket: str
) -> None:
    with pytest.raises(RemoteNotFound, match=re.escape(f"no snapshot at s3://{bucket}/nothing/here")):
        await read_manifest(f"s3://{bucket}/nothing/here", config(moto.url))
    closed = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RemoteUnavailable, match=rf"^cannot reach {closed} .* \(after 2 attempts\)$"):
        await pull(SnapshotStore(Path("/nonexistent")), "s3://bucket/p", config(closed, retry_attempts=2))


async def test_disk_full_while_pulling_is_one_line_and_leaves_nothing(
    env: dict[str, str],
    store: SnapshotStore,
    snapshot: SnapshotRecord,
    moto: MotoServer,
    bucket: str,
    tmp_path: Path,
) -> None:
    uri = f"s3://{bucket}/p"
    await push(store, snapshot.id, uri, config(moto.url))
    # A real write error, EFBIG: no file may grow past 1 MiB, and the 3 MiB weights must.
    code = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))\n"
        "from stoker.cli.main import main\n"
        f"sys.exit(main(['snapshot', 'pull', {uri!r}, '--endpoint-url', {moto.url!r}]))\n"
    )
    dest_env = {**env, "STOKER_HOME": str(tmp_path / "dest")}
    proc = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", code],
        env=dest_env,
        capture_output=True,
        text=True,
        timeout=CLI,
    )
    assert_one_line_error(proc, "File too large", "the partial pull was removed")
    dest = SnapshotStore(tmp_path / "dest" / "snapshots")
    assert dest.list() == []
    assert hidden_leftovers(dest.root) == []


def test_dropping_a_files_parts_keeps_every_other_files_appended_meanwhile(tmp_path: Path) -> None:
    """`Journal.drop` reads and rewrites under the journal's lock: appends from other files'
    workers while it runs are all kept (a read, then a rewrite outside the lock, lost them)."""
    import threading

    journal = Journal(tmp_path / "journal")
    for n in range(3):
        journal.append(Part("bad.bin", n, 1, "e", "s"))
    start = threading.Event()

    def append(name: str) -> None:
        start.wait()
        for n in range(200):
            journal.append(Part(name, n, 1, "e", "s"))

    workers = [threading.Thread(target=append, args=(f"f{i}.json",)) for i in range(2)]
    for w in workers:
        w.start()
    start.set()
    kept = journal.drop("bad.bin")
    for w in workers:
        w.join()
    assert all(p.path != "bad.bin" for p in kept)
    loaded = journal.load()
    assert sorted((p.path, p.offset) for p in loaded) == sorted(
        (f"f{i}.json", n) for i in range(2) for n in range(200)
    )
