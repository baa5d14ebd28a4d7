"""Benchmark the CPU engine on the embedded model (SmolLM2-135M-Instruct, fp32), beside its baselines.

    python bench/engine_bench.py [--quick] [--only SECTIONS] [--out bench/results/engine.json] [--home DIR]

Starts real `stoker engine` processes on free 127.0.0.1 ports (`--threads 2`) and measures:

1. start to ready (spawn → `/health` 200), split into the engine's own phases from `/metrics`;
2. weight load from the snapshot's safetensors, page cache warm and cold, against `dd bs=16M`
   reading the same file, and transformers' `from_pretrained` as the default-path reference;
   then the engine's own first load (`stoker.engine.weights.load_model`: memory-mapped into a model
   built without weights) against `from_pretrained`, warm and cold, and `stoker snapshot warm`'s
   read speed (`snapshots.pagecache.warm`) from cold disk against `dd`;
3. sleep and wake (levels 1 and 2) against a fresh start, with the engine's RSS;
4. time to first token for a ~200-token chat prompt;
5. decode tokens/s at 1 and at 8 concurrent streams.

The machine is shared and noisy: every figure is a median of several repetitions, and every
comparison is a ratio of medians measured in this same run. All samples go to the JSON file; a
markdown table goes to stdout and next to the JSON (`.md`).

The snapshot is imported once into `--home` (default `~/.cache/stoker-bench`, used as
`STOKER_HOME`) and reused by later runs. Cold-cache measurements drop the page cache
(`echo 3 > /proc/sys/vm/drop_caches`, root only; otherwise `posix_fadvise(DONTNEED)` on the file).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
from common import (
    HOST,
    REPO,
    CpuShare,
    Processes,
    _interrupt,
    dd_read,
    drop_page_cache,
    fmt_s,
    fmt_x,
    free_port,
    machine_info,
    med,
    ratio,
    run_json,
    say,
    stoker_command,
    write_results,
)

from snapshots import pagecache

MODEL = "smollm2"
THREADS = 2
PAGE = 4096
TTFT_PROMPT_TOKENS = 200


@dataclass(frozen=True)
class Plan:
    starts: int  # fresh engine starts
    load_reps: int  # weight loads (and dd reads) per cache state
    wake_reps: int  # sleep/wake cycles per level
    ttft_reps: int
    decode_reps: int  # per concurrency level
    decode_tokens: int  # max_tokens per decode stream
    fp_reps: int  # from_pretrained runs (fresh interpreters)
    first_load_reps: int  # engine first loads per path and cache state (fresh interpreters)
    streams: int = 8


FULL = Plan(
    starts=3,
    load_reps=3,
    wake_reps=3,
    ttft_reps=5,
    decode_reps=3,
    decode_tokens=64,
    fp_reps=3,
    first_load_reps=3,
)
QUICK = Plan(
    starts=2,
    load_reps=2,
    wake_reps=2,
    ttft_reps=3,
    decode_reps=1,
    decode_tokens=32,
    fp_reps=1,
    first_load_reps=2,
)
SECTIONS = ("startup", "weight_load", "first_load", "serving")


# ---- processes ---------------------------------------------------------------------------------------


def proc_memory(pid: int) -> dict[str, float]:
    """VmRSS and its split (RssAnon, RssFile, RssShmem) of one process, in MiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[key] = round(int(value.split()[0]) / 1024, 1)
    return out


def children_of(pid: int) -> list[int]:
    pids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            pids += [int(p) for p in (task / "children").read_text().split()]
    return pids


def cached_bytes(path: Path) -> int | None:
    """How much of `path` is in the page cache (util-linux `fincore`), or None without it."""
    if not shutil.which("fincore"):
        return None
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", str(path)],
        capture_output=True,
        text=True,
    )
    return int(out.stdout.split()[0]) if out.returncode == 0 and out.stdout.strip() else None


# ---- the engine --------------------------------------------------------------------------------------


class EngineProcess:
    def __init__(self, procs: Processes, snapshot: Path, env: dict[str, str], log_path: Path) -> None:
        self.procs, self.snapshot, self.env, self.log_path = procs, snapshot, env, log_path
        self.port = free_port()
        self.base = f"http://{HOST}:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.spawned_at = 0.0

    def spawn(self) -> None:
        cmd = [
            *stoker_command(),
            "engine",
            "--snapshot",
            str(self.snapshot),
            "--host",
            HOST,
            "--port",
            str(self.port),
            "--served-model-name",
            MODEL,
            "--threads",
            str(THREADS),
            "--log-level",
            "warning",
        ]
        log = self.log_path.open("ab")
        self.spawned_at = time.perf_counter()
        self.proc = self.procs.spawn(cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        log.close()

    def wait_ready(self, timeout: float = 240.0, interval: float = 0.05) -> float:
        """Poll `/health` until 200; the moment it answered (perf_counter)."""
        deadline = time.perf_counter() + timeout
        with httpx.Client(base_url=self.base, timeout=5.0) as client:
            while time.perf_counter() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"engine exited with {self.proc.returncode}:\n{self.log_tail()}")
                with contextlib.suppress(httpx.TransportError):
                    if client.get("/health").status_code == 200:
                        return time.perf_counter()
                time.sleep(interval)
        raise RuntimeError(f"engine not ready within {timeout:.0f} s:\n{self.log_tail()}")

    def phases(self) -> dict[str, float]:
        text = httpx.get(self.base + "/metrics", timeout=10.0).text
        out = {}
        for m in re.finditer(
            r'^stoker_engine_startup_phase_seconds\{[^}]*phase="(\w+)"[^}]*\}\s+(\S+)$', text, re.M
        ):
            out[m.group(1)] = float(m.group(2))
        return out

    def pid(self) -> int:
        """The engine's pid: the spawned process, unless it forked a worker (then the biggest child)."""
        kids = children_of(self.proc.pid)
        if not kids:
            return self.proc.pid
        return max(kids, key=lambda p: proc_memory(p).get("VmRSS", 0))

    def memory(self) -> dict[str, float]:
        return proc_memory(self.pid())

    def log_tail(self, n: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-n:]
        return ""

    def stop(self) -> None:
        if self.proc is not None:
            self.procs.stop(self.proc)


@dataclass
class Stream:
    sent: float
    first_byte: float | None = None
    first_content: float | None = None
    last_content: float | None = None
    done: float | None = None
    content_chunks: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    text: str = ""

    @property
    def ttft(self) -> float:
        return self.first_content - self.sent


async def stream_chat(client: httpx.AsyncClient, body: dict) -> Stream:
    body = {**body, "model": MODEL, "stream": True, "stream_options": {"include_usage": True}}
    s = Stream(sent=time.perf_counter())
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            now = time.perf_counter()
            if s.first_byte is None:
                s.first_byte = now
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                raise RuntimeError(f"stream error: {obj['error']}")
            if obj.get("usage"):
                s.prompt_tokens = obj["usage"]["prompt_tokens"]
                s.completion_tokens = obj["usage"]["completion_tokens"]
            for choice in obj.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    s.first_content = s.first_content or now
                    s.last_content = now
                    s.content_chunks += 1
                    s.text += content
                if choice.get("finish_reason"):
                    s.finish_reason = choice["finish_reason"]
    s.done = time.perf_counter()
    if s.first_content is None:
        raise RuntimeError(f"stream produced no content (finish_reason={s.finish_reason})")
    return s


async def prompt_tokens_of(client: httpx.AsyncClient, messages: list[dict]) -> int:
    body = {"model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0}
    r = await client.post("/v1/chat/completions", json=body)
    r.raise_for_status()
    return r.json()["usage"]["prompt_tokens"]


def nonce_system() -> dict:
    # A distinct first block per request, so the KV-block sharing (prefix cache) reuses nothing.
    return {"role": "system", "content": f"Session {uuid.uuid4().hex[:12]}. You are a helpful assistant."}


WORDS = (
    ("old", "quiet", "red", "narrow", "busy", "cold", "green", "tall"),
    ("mill", "bridge", "market", "harbour", "library", "orchard", "station", "tower"),
    ("river", "hill", "square", "forest", "coast", "valley", "road", "lake"),
    ("repaired", "painted", "closed", "opened", "visited", "measured", "cleaned", "described"),
)


def filler(n: int) -> str:
    a, b, c, d = WORDS
    return " ".join(
        f"Note {i + 1}: the {a[i % 8]} {b[(i * 3) % 8]} near the {c[(i * 5) % 8]} was {d[(i * 7) % 8]} at dawn."
        for i in range(n)
    )


def ttft_messages(sentences: int) -> list[dict]:
    return [
        nonce_system(),
        {"role": "user", "content": filler(sentences) + "\nSummarise these notes in one sentence."},
    ]


TOPICS = (
    "a lighthouse keeper who finds a map",
    "a city built on the back of a turtle",
    "two rival bakers in a mountain village",
    "a robot learning to paint",
    "a caravan crossing a salt desert",
    "a library where books rewrite themselves",
    "a sailor lost in a sea of fog",
    "a clockmaker who can stop time",
)


def story_body(i: int, max_tokens: int) -> dict:
    user = (
        f"Write a long story about {TOPICS[i % len(TOPICS)]}. Make it at least 800 words, "
        "with many characters, places and details."
    )
    return {
        "messages": [nonce_system(), {"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "temperature": 0.7,
    }


def probe_body() -> dict:
    return {
        "messages": [nonce_system(), {"role": "user", "content": "Say hello."}],
        "max_tokens": 2,
        "temperature": 0,
    }


# ---- 1. start to ready ------------------------------------------------------------------------------


def bench_startup(plan: Plan, procs: Processes, snapshot: Path, env: dict, logs: Path) -> dict:
    # Page cache warm: the snapshot and the engine's imports (torch, transformers, uvicorn) read once.
    dd_read(snapshot / "model.safetensors")
    subprocess.run(
        [sys.executable, "-c", "import stoker.engine.app, stoker.engine.core, uvicorn"], env=env, check=True
    )
    samples = []
    for i in range(plan.starts):
        engine = EngineProcess(procs, snapshot, env, logs / f"start-{i}.log")
        try:
            engine.spawn()
            ready = engine.wait_ready()
            wall = ready - engine.spawned_at
            phases = engine.phases()
            known = sum(phases.get(k, 0.0) for k in ("imports", "weight_load", "warm_up"))
            sample = {
                "wall_s": wall,
                "imports_s": phases.get("imports"),
                "weight_load_s": phases.get("weight_load"),
                "warm_up_s": phases.get("warm_up"),
                "other_s": wall - known,
                "rss_ready_mib": engine.memory(),
                "engine_pid_is_spawned_process": not children_of(engine.proc.pid),
            }
        finally:
            engine.stop()
        samples.append(sample)
        say(f"start {i + 1}/{plan.starts}: {wall:.2f} s")
    keys = ("wall_s", "imports_s", "weight_load_s", "warm_up_s", "other_s")
    return {
        "what": "spawn of `stoker engine` → first /health 200 (polled every 50 ms), page cache warm; "
        "phases from stoker_engine_startup_phase_seconds; other = wall − phases "
        "(interpreter start, CLI import, uvicorn start, poll granularity)",
        "n": plan.starts,
        "median": {k: med([s[k] for s in samples]) for k in keys},
        "samples": samples,
    }


# ---- 2. weight load ---------------------------------------------------------------------------------

LOAD_CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[2]))
from safetensors.torch import load_file
print("ready", flush=True)
sys.stdin.readline()
t0 = time.perf_counter()
sd = load_file(sys.argv[1])
t1 = time.perf_counter()
acc = 0.0
for t in sd.values():  # one element per 4 KiB page: every page of every tensor is faulted in
    flat = t.reshape(-1)
    acc += float(flat[:: max(1, 4096 // flat.element_size())].sum())
t2 = time.perf_counter()
for t in sd.values():  # every byte read (pages now resident)
    acc += float(t.sum())
t3 = time.perf_counter()
nbytes = sum(t.numel() * t.element_size() for t in sd.values())
print(json.dumps({"load_file_s": t1 - t0, "touch_s": t2 - t1, "sum_s": t3 - t2, "bytes": nbytes,
                  "tensors": len(sd), "checksum": acc}), flush=True)
"""

FROM_PRETRAINED_CHILD = r"""
import gc, json, sys, time
import torch
torch.set_num_threads(int(sys.argv[2]))
from transformers import AutoModelForCausalLM
t0 = time.perf_counter()
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
t1 = time.perf_counter()
del m
gc.collect()
t2 = time.perf_counter()
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
t3 = time.perf_counter()
print(json.dumps({"first_s": t1 - t0, "second_s": t3 - t2}), flush=True)
"""


def timed_load(procs: Processes, path: Path, env: dict, cold: bool) -> dict:
    """One `load_file` + touch in a fresh interpreter; torch is imported before the clock starts."""
    child = procs.spawn(
        [sys.executable, "-c", LOAD_CHILD, str(path), str(THREADS)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError("load child failed to start")
        method = drop_page_cache(path) if cold else None
        resident = cached_bytes(path)
        child.stdin.write("go\n")
        child.stdin.flush()
        line = child.stdout.readline()
        if child.wait(120) != 0 or not line:
            raise RuntimeError(f"load child failed ({child.returncode})")
        out = json.loads(line)
    finally:
        procs.stop(child)
    out["load_touch_s"] = out["load_file_s"] + out["touch_s"]
    out["cache_drop"] = method
    out["resident_before_bytes"] = resident
    return out


def bench_weight_load(plan: Plan, procs: Processes, snapshot: Path, env: dict) -> dict:
    path = snapshot / "model.safetensors"
    size = path.stat().st_size
    warm_dd, warm_load, cold_dd, cold_load, fp = [], [], [], [], []
    dd_read(path)  # into the page cache
    for i in range(plan.load_reps):
        pair = [
            lambda: warm_dd.append(dd_read(path)),
            lambda: warm_load.append(timed_load(procs, path, env, False)),
        ]
        for step in pair if i % 2 == 0 else pair[::-1]:  # alternate the order against drift
            step()
    say(f"weight load warm: load+touch {med([s['load_touch_s'] for s in warm_load]):.3f} s")
    for _ in range(plan.fp_reps):
        out = subprocess.run(
            [sys.executable, "-c", FROM_PRETRAINED_CHILD, str(snapshot), str(THREADS)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if out.returncode != 0:
            raise RuntimeError(f"from_pretrained child failed:\n{out.stderr[-3000:]}")
        fp.append(json.loads(out.stdout.strip().splitlines()[-1]))
    say(f"from_pretrained warm: {med([s['first_s'] for s in fp]):.3f} s")
    for i in range(plan.load_reps):

        def cold_dd_step() -> None:
            method = drop_page_cache(path)
            cold_dd.append({**dd_read(path), "cache_drop": method})

        pair = [cold_dd_step, lambda: cold_load.append(timed_load(procs, path, env, True))]
        for step in pair if i % 2 == 0 else pair[::-1]:
            step()
    say(f"weight load cold: load+touch {med([s['load_touch_s'] for s in cold_load]):.3f} s")
    dd_read(path)  # leave the page cache warm for what follows

    def gbps(seconds: float | None) -> float | None:
        return size / seconds / 1e9 if seconds else None

    m = {
        "dd_warm_s": med([s["seconds"] for s in warm_dd]),
        "dd_cold_s": med([s["seconds"] for s in cold_dd]),
        "load_file_warm_s": med([s["load_file_s"] for s in warm_load]),
        "load_touch_warm_s": med([s["load_touch_s"] for s in warm_load]),
        "load_touch_sum_warm_s": med([s["load_touch_s"] + s["sum_s"] for s in warm_load]),
        "load_file_cold_s": med([s["load_file_s"] for s in cold_load]),
        "load_touch_cold_s": med([s["load_touch_s"] for s in cold_load]),
        "load_touch_sum_cold_s": med([s["load_touch_s"] + s["sum_s"] for s in cold_load]),
        "from_pretrained_warm_s": med([s["first_s"] for s in fp]),
        "from_pretrained_warm_second_call_s": med([s["second_s"] for s in fp]),
    }
    return {
        "what": "safetensors.torch.load_file(model.safetensors) then one element per 4 KiB page of every "
        "tensor read (load_touch); load_touch_sum adds t.sum() over every tensor; each in a fresh "
        "interpreter, torch imported before the clock; dd if=FILE of=/dev/null bs=16M (dd's own "
        "time); cold = page cache dropped just before; from_pretrained in a fresh interpreter, "
        "second_call = again in the same process (lazy imports paid)",
        "file": str(path),
        "bytes": size,
        "n": plan.load_reps,
        "median": m,
        "gb_per_s": {
            "dd_warm": gbps(m["dd_warm_s"]),
            "dd_cold": gbps(m["dd_cold_s"]),
            "load_touch_warm": gbps(m["load_touch_warm_s"]),
            "load_touch_cold": gbps(m["load_touch_cold_s"]),
            "from_pretrained_warm": gbps(m["from_pretrained_warm_s"]),
        },
        "ratios": {
            "load_touch_over_dd_warm": ratio(m["load_touch_warm_s"], m["dd_warm_s"]),
            "load_touch_over_dd_cold": ratio(m["load_touch_cold_s"], m["dd_cold_s"]),
            "load_touch_sum_over_dd_warm": ratio(m["load_touch_sum_warm_s"], m["dd_warm_s"]),
            "load_touch_sum_over_dd_cold": ratio(m["load_touch_sum_cold_s"], m["dd_cold_s"]),
            "from_pretrained_over_load_touch_warm": ratio(
                m["from_pretrained_warm_s"], m["load_touch_warm_s"]
            ),
        },
        "samples": {
            "dd_warm": warm_dd,
            "load_warm": warm_load,
            "dd_cold": cold_dd,
            "load_cold": cold_load,
            "from_pretrained_warm": fp,
        },
    }


# ---- 2b. the engine's first load --------------------------------------------------------------------

FIRST_LOAD_CHILD = r"""
import gc, json, sys, time
from pathlib import Path
import torch
torch.set_num_threads(int(sys.argv[2]))
import transformers.models.llama.modeling_llama  # the model's code: imported before the clock
from stoker.engine import weights
snapshot, path = Path(sys.argv[1]), sys.argv[3]

def load():
    if path == "mmap":  # what Engine.load calls
        model, source = weights.load_model(snapshot, torch.float32)
        assert source == weights.MMAP, source
        return model
    return weights.from_pretrained(snapshot, torch.float32)

def touch(model):  # one element per 4 KiB page of every weight: every page is faulted in
    acc = 0.0
    for p in model.parameters():
        flat = p.detach().reshape(-1)
        acc += float(flat[:: max(1, 4096 // flat.element_size())].sum())
    return acc

def memory():
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = round(int(value.split()[0]) / 1024, 1)
    return out

print("ready", flush=True)
sys.stdin.readline()
t0 = time.perf_counter(); model = load(); t1 = time.perf_counter(); touch(model); t2 = time.perf_counter()
rss = memory()
del model
gc.collect()
t3 = time.perf_counter(); model = load(); t4 = time.perf_counter(); touch(model); t5 = time.perf_counter()
print(json.dumps({"load_s": t1 - t0, "touch_s": t2 - t1, "load_touch_s": t2 - t0, "rss_mib": rss,
                  "second_load_s": t4 - t3, "second_load_touch_s": t5 - t3}), flush=True)
"""

LOAD_PATHS = ("mmap", "from_pretrained")


def timed_first_load(procs: Processes, snapshot: Path, env: dict, path: str, cold: bool) -> dict:
    """One engine weight load (+ touch) in a fresh interpreter, its imports done before the clock."""
    child = procs.spawn(
        [sys.executable, "-c", FIRST_LOAD_CHILD, str(snapshot), str(THREADS), path],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError(f"first-load child ({path}) failed to start")
        if cold:  # only the snapshot leaves the page cache: the child's own imports stay warm
            pagecache.drop(snapshot)
        resident = pagecache.residency(snapshot)
        child.stdin.write("go\n")
        child.stdin.flush()
        line = child.stdout.readline()
        if child.wait(300) != 0 or not line:
            raise RuntimeError(f"first-load child ({path}) failed ({child.returncode})")
        out = json.loads(line)
    finally:
        procs.stop(child)
    return {**out, "snapshot_resident_before": resident}


def bench_first_load(plan: Plan, procs: Processes, snapshot: Path, env: dict) -> dict:
    weights_file = snapshot / "model.safetensors"
    size = weights_file.stat().st_size
    samples: dict[str, list] = {f"{p}_{c}": [] for c in ("warm", "cold") for p in LOAD_PATHS}
    for cache in ("warm", "cold"):
        if cache == "warm":
            pagecache.warm(snapshot)
        for i in range(plan.first_load_reps):
            for p in LOAD_PATHS if i % 2 == 0 else LOAD_PATHS[::-1]:  # alternate the order against drift
                samples[f"{p}_{cache}"].append(timed_first_load(procs, snapshot, env, p, cache == "cold"))
        say(
            f"first load {cache}: mmap {med([s['load_touch_s'] for s in samples[f'mmap_{cache}']]):.3f} s, "
            f"from_pretrained {med([s['load_touch_s'] for s in samples[f'from_pretrained_{cache}']]):.3f} s"
        )
    dd_cold, warm_cold = [], []
    for i in range(plan.first_load_reps):

        def dd_step() -> None:
            pagecache.drop(snapshot)
            dd_cold.append(dd_read(weights_file))

        def warm_step() -> None:
            pagecache.drop(snapshot)
            before = pagecache.residency(snapshot)
            r = pagecache.warm(snapshot)
            warm_cold.append(
                {"seconds": r.seconds, "bytes": r.bytes, "files": r.files, "resident_before": before}
            )

        for step in (dd_step, warm_step) if i % 2 == 0 else (warm_step, dd_step):
            step()
    pagecache.warm(snapshot)  # leave the page cache warm for what follows

    m: dict[str, float | None] = {}
    for key, reps in samples.items():
        for field in ("load_s", "touch_s", "load_touch_s", "second_load_s"):
            m[f"{key}_{field}"] = med([s[field] for s in reps])
    m["dd_cold_s"] = med([s["seconds"] for s in dd_cold])
    m["snapshot_warm_cold_s"] = med([s["seconds"] for s in warm_cold])
    warm_bytes = warm_cold[0]["bytes"] if warm_cold else 0
    return {
        "what": "the engine's weight load (stoker.engine.weights.load_model: safetensors memory-mapped into "
        "a model built on the meta device) vs transformers' from_pretrained, both fp32, each in a fresh "
        "interpreter with torch, transformers and the model code imported before the clock; load_touch "
        "= load + one element read per 4 KiB page of every weight; second_load = again in the same "
        "process (lazy imports paid, page cache warm); cold = the snapshot's pages dropped "
        "(posix_fadvise DONTNEED) just before; rss after the first load + touch; snapshot_warm = "
        "snapshots.pagecache.warm of the whole snapshot dir (what `stoker snapshot warm` runs) after a "
        "drop, vs dd bs=16M of model.safetensors after a drop",
        "bytes": size,
        "n": plan.first_load_reps,
        "median": m,
        "gb_per_s": {
            "mmap_cold_load_touch": ratio(size / 1e9, m["mmap_cold_load_touch_s"]),
            "from_pretrained_cold_load_touch": ratio(size / 1e9, m["from_pretrained_cold_load_touch_s"]),
            "dd_cold": ratio(size / 1e9, m["dd_cold_s"]),
            "snapshot_warm_cold": ratio(warm_bytes / 1e9, m["snapshot_warm_cold_s"]),
        },
        "median_rss_mib": {
            key: {k: med([s["rss_mib"][k] for s in reps]) for k in ("VmRSS", "RssAnon", "RssFile")}
            for key, reps in samples.items()
        },
        "ratios": {
            "from_pretrained_over_mmap_warm": ratio(
                m["from_pretrained_warm_load_touch_s"], m["mmap_warm_load_touch_s"]
            ),
            "from_pretrained_over_mmap_cold": ratio(
                m["from_pretrained_cold_load_touch_s"], m["mmap_cold_load_touch_s"]
            ),
            "from_pretrained_over_mmap_second_load": ratio(
                m["from_pretrained_warm_second_load_s"], m["mmap_warm_second_load_s"]
            ),
            "mmap_cold_over_dd_cold": ratio(m["mmap_cold_load_touch_s"], m["dd_cold_s"]),
            "snapshot_warm_speed_over_dd_cold": ratio(
                ratio(warm_bytes, m["snapshot_warm_cold_s"]), ratio(size, m["dd_cold_s"])
            ),
        },
        "samples": {**samples, "dd_cold": dd_cold, "snapshot_warm_cold": warm_cold},
    }


# ---- 3-5. on one running engine --------------------------------------------------------------------


HF_WHAT = (
    "plain transformers generate() in a long-lived process, batch 1, same prompts and threads, no "
    "server; its repetitions alternate with the engine's"
)

HF_CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[2]))
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

class Clock(BaseStreamer):  # generate() hands it the prompt, then each new token
    def __init__(self):
        self.times = []
    def put(self, value):
        self.times.append(time.perf_counter())
    def end(self):
        pass

tok = AutoTokenizer.from_pretrained(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()

def run(messages, **kw):
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    clock = Clock()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**ids, streamer=clock, pad_token_id=tok.eos_token_id, **kw)
    n_prompt = ids["input_ids"].shape[1]
    return t0, clock.times, n_prompt, out.shape[1] - n_prompt

run([{"role": "user", "content": "Hello"}], max_new_tokens=2, do_sample=False)
print("ready", flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "ttft":
        t0, times, n_prompt, n_new = run(cmd["messages"], max_new_tokens=16, do_sample=False)
        res = {"ttft_s": times[1] - t0, "prompt_tokens": n_prompt}
    else:
        n = cmd["max_tokens"]
        t0, times, n_prompt, n_new = run(
            cmd["messages"], max_new_tokens=n, min_new_tokens=n, do_sample=True, temperature=0.7
        )
        res = {"tokens_per_s": n_new / (times[-1] - t0),
               "decode_tokens_per_s": (n_new - 1) / (times[-1] - times[1]), "completion_tokens": n_new}
    print(json.dumps(res), flush=True)
"""


class HFBaseline:
    """A process holding the model under plain transformers, answering one command per stdin line."""

    def __init__(self, procs: Processes, snapshot: Path, env: dict, log_path: Path) -> None:
        self.procs = procs
        with log_path.open("ab") as log:
            self.proc = procs.spawn(
                [sys.executable, "-c", HF_CHILD, str(snapshot), str(THREADS)],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        self.log_path = log_path

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"transformers baseline exited ({self.proc.poll()}):\n{tail}")
        return line

    def wait_ready(self) -> None:
        if self._line().strip() != "ready":
            raise RuntimeError("transformers baseline did not start")

    def ask(self, cmd: dict) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line())

    def stop(self) -> None:
        self.procs.stop(self.proc)


async def bench_ttft(plan: Plan, client: httpx.AsyncClient, hf: HFBaseline) -> dict:
    # Calibrate the filler so that the engine counts ~200 prompt tokens (chat template included).
    lo, hi = 4, 14
    p_lo = await prompt_tokens_of(client, ttft_messages(lo))
    p_hi = await prompt_tokens_of(client, ttft_messages(hi))
    per_sentence = (p_hi - p_lo) / (hi - lo)
    sentences = max(1, round(lo + (TTFT_PROMPT_TOKENS - p_lo) / per_sentence))
    verified = await prompt_tokens_of(client, ttft_messages(sentences))
    samples, base = [], []
    for i in range(plan.ttft_reps):

        async def engine_rep() -> None:
            body = {"messages": ttft_messages(sentences), "max_tokens": 16, "temperature": 0}
            s = await stream_chat(client, body)
            samples.append(
                {"ttft_s": s.ttft, "prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens}
            )

        async def hf_rep() -> None:
            base.append(await asyncio.to_thread(hf.ask, {"op": "ttft", "messages": ttft_messages(sentences)}))

        for step in (engine_rep, hf_rep) if i % 2 == 0 else (hf_rep, engine_rep):
            await step()
    ttft, hf_ttft = med([s["ttft_s"] for s in samples]), med([s["ttft_s"] for s in base])
    say(f"ttft ({verified} prompt tokens): {ttft:.3f} s; transformers generate {hf_ttft:.3f} s")
    return {
        "what": "streamed chat request, max_tokens=16, temperature 0: send → first chunk with non-empty "
        "content; a distinct system message per request defeats prefix (KV block) sharing",
        "n": plan.ttft_reps,
        "prompt_tokens_verified": verified,
        "prompt_tokens_calibration": {"sentences": sentences, "lo": [lo, p_lo], "hi": [hi, p_hi]},
        "median": {"ttft_s": ttft, "prefill_tokens_per_s": ratio(verified, ttft)},
        "samples": samples,
        "baseline_hf_generate": {
            "what": HF_WHAT + "; ttft = call → first new token",
            "median": {"ttft_s": hf_ttft},
            "samples": base,
        },
        "ratios": {"engine_over_hf_generate": ratio(ttft, hf_ttft)},
    }


async def decode_rep(client: httpx.AsyncClient, plan: Plan, conc: int) -> dict:
    streams = await asyncio.gather(
        *(stream_chat(client, story_body(i, plan.decode_tokens)) for i in range(conc))
    )
    total = sum(s.completion_tokens for s in streams)
    wall = max(s.last_content for s in streams) - min(s.first_byte for s in streams)
    return {
        "aggregate_tokens_per_s": total / wall,
        "wall_s": wall,
        "completion_tokens": [s.completion_tokens for s in streams],
        "finish_reasons": [s.finish_reason for s in streams],
        "per_stream_tokens_per_s": [s.completion_tokens / (s.last_content - s.first_byte) for s in streams],
        "per_stream_decode_tokens_per_s": [
            (s.completion_tokens - 1) / (s.last_content - s.first_content)
            if s.completion_tokens > 1 and s.last_content > s.first_content
            else None
            for s in streams
        ],
        "ttft_s": [s.ttft for s in streams],
    }


async def bench_decode(plan: Plan, client: httpx.AsyncClient, hf: HFBaseline) -> dict:
    out: dict = {
        "what": f"streams of max_tokens={plan.decode_tokens}, temperature 0.7, 'write a long story' prompts; "
        "per stream: completion tokens (usage) / (last content chunk − first byte); decode-only: "
        "(tokens − 1) / (last − first content chunk); aggregate: all completion tokens / "
        "(last content chunk of any stream − first byte of any stream)",
        "max_tokens": plan.decode_tokens,
        "n": plan.decode_reps,
    }
    base = []
    for conc in (1, plan.streams):
        reps = []
        for i in range(plan.decode_reps):
            hf_first = conc == 1 and i % 2 == 1  # alternate the order against drift
            cmd = {"op": "decode", "messages": story_body(i, 0)["messages"], "max_tokens": plan.decode_tokens}
            if hf_first:
                base.append(await asyncio.to_thread(hf.ask, cmd))
            reps.append(await decode_rep(client, plan, conc))
            if conc == 1 and not hf_first:  # the baseline is batch 1
                base.append(await asyncio.to_thread(hf.ask, cmd))
        out[f"c{conc}"] = {
            "streams": conc,
            "median": {
                "aggregate_tokens_per_s": med([r["aggregate_tokens_per_s"] for r in reps]),
                "per_stream_tokens_per_s": med([x for r in reps for x in r["per_stream_tokens_per_s"]]),
                "per_stream_decode_tokens_per_s": med(
                    [x for r in reps for x in r["per_stream_decode_tokens_per_s"]]
                ),
                "ttft_s": med([x for r in reps for x in r["ttft_s"]]),
            },
            "samples": reps,
        }
        say(f"decode x{conc}: aggregate {out[f'c{conc}']['median']['aggregate_tokens_per_s']:.1f} tok/s")
    one, many = out["c1"]["median"], out[f"c{plan.streams}"]["median"]
    hf_tps = med([s["tokens_per_s"] for s in base])
    hf_decode = med([s["decode_tokens_per_s"] for s in base])
    out["baseline_hf_generate"] = {
        "what": HF_WHAT
        + "; tokens_per_s = tokens / (last token − call), decode = (tokens − 1) / (last − first)",
        "median": {"tokens_per_s": hf_tps, "decode_tokens_per_s": hf_decode},
        "samples": base,
    }
    out["ratios"] = {
        "aggregate_many_over_one": ratio(many["aggregate_tokens_per_s"], one["aggregate_tokens_per_s"]),
        "per_stream_many_over_one": ratio(many["per_stream_tokens_per_s"], one["per_stream_tokens_per_s"]),
        "one_stream_over_hf_generate": ratio(one["per_stream_tokens_per_s"], hf_tps),
        "one_stream_decode_over_hf_generate": ratio(one["per_stream_decode_tokens_per_s"], hf_decode),
        "aggregate_many_over_hf_generate": ratio(many["aggregate_tokens_per_s"], hf_tps),
    }
    return out


async def wait_health(client: httpx.AsyncClient) -> float:
    """Poll `/health` every 10 ms until 200 (at most 2 minutes); the moment it answered."""
    async with asyncio.timeout(120):
        while True:
            with contextlib.suppress(httpx.TransportError):
                if (await client.get("/health")).status_code == 200:
                    return time.perf_counter()
            await asyncio.sleep(0.01)


async def bench_sleep_wake(
    plan: Plan, client: httpx.AsyncClient, engine: EngineProcess, weights: Path
) -> dict:
    probes = [(await stream_chat(client, probe_body())).ttft for _ in range(plan.wake_reps)]
    out: dict = {
        "what": "POST /sleep?level=L, then POST /wake_up sent → /health 200 (wake_s); then a short "
        "streamed request (2 tokens) sent at once: wake_to_first_token_s = /wake_up sent → its first "
        "content chunk; probe = the same request on an awake engine; RSS of the engine process "
        "(VmRSS, RssAnon, RssFile) in MiB; snapshot_cached = bytes of model.safetensors in the page cache",
        "n": plan.wake_reps,
        "probe_ttft_awake_s": {"median": med(probes), "samples": probes},
    }
    for level in (1, 2):
        reps = []
        for _ in range(plan.wake_reps):
            rss_awake = engine.memory()
            t0 = time.perf_counter()
            r = await client.post(f"/sleep?level={level}", timeout=120)
            r.raise_for_status()
            sleep_s = time.perf_counter() - t0
            asleep = (await client.get("/is_sleeping")).json()["is_sleeping"]
            rss_asleep, cached_asleep = engine.memory(), cached_bytes(weights)
            t0 = time.perf_counter()
            r = await client.post("/wake_up", timeout=120)
            r.raise_for_status()
            wake_post = time.perf_counter() - t0
            wake_s = await wait_health(client) - t0
            rss_woken, cached_woken = engine.memory(), cached_bytes(weights)
            probe = await stream_chat(client, probe_body())
            reps.append(
                {
                    "sleep_s": sleep_s,
                    "is_sleeping": asleep,
                    "wake_s": wake_s,
                    "wake_post_s": wake_post,
                    "engine_wake_up_phase_s": engine.phases().get("wake_up"),
                    "wake_to_first_token_s": probe.first_content - t0,
                    "first_request_ttft_s": probe.ttft,
                    "rss_awake_mib": rss_awake,
                    "rss_asleep_mib": rss_asleep,
                    "rss_after_wake_mib": rss_woken,
                    "rss_after_first_request_mib": engine.memory(),
                    "snapshot_cached_asleep_bytes": cached_asleep,
                    "snapshot_cached_after_wake_bytes": cached_woken,
                    "snapshot_cached_after_first_request_bytes": cached_bytes(weights),
                }
            )
        keys = ("sleep_s", "wake_s", "wake_to_first_token_s", "first_request_ttft_s")
        mem = ("rss_awake_mib", "rss_asleep_mib", "rss_after_wake_mib", "rss_after_first_request_mib")
        out[f"level{level}"] = {
            "median": {k: med([r[k] for r in reps]) for k in keys},
            "median_rss_mib": {k: med([r[k]["VmRSS"] for r in reps]) for k in mem},
            "samples": reps,
        }
        say(f"wake level {level}: {out[f'level{level}']['median']['wake_s']:.3f} s")
    return out


async def bench_serving(
    plan: Plan, engine: EngineProcess, hf: HFBaseline, weights: Path, cond: CpuShare
) -> dict:
    limits = httpx.Limits(max_connections=plan.streams + 4, max_keepalive_connections=plan.streams + 4)
    async with httpx.AsyncClient(base_url=engine.base, timeout=300.0, limits=limits) as client:
        rss_idle = engine.memory()
        with cond.section("ttft"):
            ttft = await bench_ttft(plan, client, hf)
        with cond.section("decode"):
            decode = await bench_decode(plan, client, hf)
        # The baseline maps the same safetensors file: alive, it would keep those pages cached
        # through a level-2 sleep (posix_fadvise cannot drop mapped pages).
        hf.stop()
        with cond.section("sleep_wake"):
            sleep_wake = await bench_sleep_wake(plan, client, engine, weights)
    sleep_wake["rss_awake_idle_fresh_mib"] = rss_idle
    return {"ttft": ttft, "decode": decode, "sleep_wake": sleep_wake}


# ---- report ------------------------------------------------------------------------------------------


def startup_rows(st: dict) -> list[tuple[str, ...]]:
    sm = st["median"]
    return [
        (
            f"engine start → /health 200 (n={st['n']})",
            fmt_s(sm["wall_s"]),
            f"imports {fmt_s(sm['imports_s'])} · weights {fmt_s(sm['weight_load_s'])} · "
            f"warm-up {fmt_s(sm['warm_up_s'])} · other {fmt_s(sm['other_s'])}",
            "–",
        )
    ]


def weight_load_rows(wl: dict) -> list[tuple[str, ...]]:
    wm, gb, wr = wl["median"], wl["gb_per_s"], wl["ratios"]
    mb = wl["bytes"] / 1e6
    return [
        (
            f"load_file + touch {mb:.0f} MB, warm (n={wl['n']})",
            f"{fmt_s(wm['load_touch_warm_s'])} ({gb['load_touch_warm']:.1f} GB/s)",
            f"dd warm {fmt_s(wm['dd_warm_s'])} ({gb['dd_warm']:.1f} GB/s)",
            fmt_x(wr["load_touch_over_dd_warm"]),
        ),
        (
            f"load_file + touch, cold (n={wl['n']})",
            f"{fmt_s(wm['load_touch_cold_s'])} ({gb['load_touch_cold']:.2f} GB/s)",
            f"dd cold {fmt_s(wm['dd_cold_s'])} ({gb['dd_cold']:.2f} GB/s)",
            fmt_x(wr["load_touch_over_dd_cold"]),
        ),
        (
            "from_pretrained, warm (fresh process)",
            fmt_s(wm["from_pretrained_warm_s"]),
            f"load_file + touch warm {fmt_s(wm['load_touch_warm_s'])}",
            fmt_x(wr["from_pretrained_over_load_touch_warm"]),
        ),
    ]


def first_load_rows(fl: dict) -> list[tuple[str, ...]]:
    fm, gb, fr, n = fl["median"], fl["gb_per_s"], fl["ratios"], fl["n"]

    def gbps(x: float | None) -> str:
        return "–" if x is None else f"{x:.2f} GB/s"

    return [
        (
            f"engine weight load + touch, warm, mmap path (n={n})",
            f"{fmt_s(fm['mmap_warm_load_touch_s'])} (load {fmt_s(fm['mmap_warm_load_s'])})",
            f"from_pretrained {fmt_s(fm['from_pretrained_warm_load_touch_s'])} "
            f"(load {fmt_s(fm['from_pretrained_warm_load_s'])})",
            f"from_pretrained/mmap {fmt_x(fr['from_pretrained_over_mmap_warm'])}",
        ),
        (
            f"engine weight load + touch, cold, mmap path (n={n})",
            f"{fmt_s(fm['mmap_cold_load_touch_s'])} ({gbps(gb['mmap_cold_load_touch'])})",
            f"from_pretrained {fmt_s(fm['from_pretrained_cold_load_touch_s'])}; dd cold "
            f"{fmt_s(fm['dd_cold_s'])} ({gbps(gb['dd_cold'])})",
            f"from_pretrained/mmap {fmt_x(fr['from_pretrained_over_mmap_cold'])}, "
            f"mmap/dd {fmt_x(fr['mmap_cold_over_dd_cold'])}",
        ),
        (
            "engine weight load, second in the process, mmap path",
            fmt_s(fm["mmap_warm_second_load_s"]),
            f"from_pretrained {fmt_s(fm['from_pretrained_warm_second_load_s'])}",
            f"from_pretrained/mmap {fmt_x(fr['from_pretrained_over_mmap_second_load'])}",
        ),
        (
            f"`stoker snapshot warm` from cold disk (n={n})",
            f"{fmt_s(fm['snapshot_warm_cold_s'])} ({gbps(gb['snapshot_warm_cold'])})",
            f"dd cold {gbps(gb['dd_cold'])}",
            fmt_x(fr["snapshot_warm_speed_over_dd_cold"]),
        ),
    ]


def serving_rows(res: dict) -> list[tuple[str, ...]]:
    sw, tt, dc, n = res["sleep_wake"], res["ttft"], res["decode"], res["plan"]
    l1 = sw["level1"]
    start = res["startup"]["median"]["wall_s"] if "startup" in res else None
    c1, cn = dc["c1"]["median"], dc[f"c{n['streams']}"]["median"]
    hfd = dc["baseline_hf_generate"]["median"]
    rows = []
    for name, lv in (("1", l1), ("2", sw["level2"])):
        m = lv["median"]
        rows.append(
            (
                f"wake, level {name} → /health 200 (n={sw['n']})",
                fmt_s(m["wake_s"]),
                f"fresh start {fmt_s(start)}",
                f"start/wake {fmt_x(ratio(start, m['wake_s']))}",
            )
        )
        rows.append(
            (
                f"wake, level {name} → first token (2-token request)",
                fmt_s(m["wake_to_first_token_s"]),
                f"same request awake {fmt_s(sw['probe_ttft_awake_s']['median'])}",
                f"start/(wake→token) {fmt_x(ratio(start, m['wake_to_first_token_s']))}",
            )
        )
    r1 = l1["median_rss_mib"]
    rows.append(
        (
            "engine RSS, MiB (level 1)",
            f"awake {r1['rss_awake_mib']:.0f} · asleep {r1['rss_asleep_mib']:.0f}",
            f"after wake {r1['rss_after_wake_mib']:.0f} · after 1st request {r1['rss_after_first_request_mib']:.0f}",
            f"asleep/awake {fmt_x(ratio(r1['rss_asleep_mib'], r1['rss_awake_mib']))}",
        )
    )
    rows.append(
        (
            f"TTFT, {tt['prompt_tokens_verified']}-token prompt (n={tt['n']})",
            fmt_s(tt["median"]["ttft_s"]),
            f"transformers generate {fmt_s(tt['baseline_hf_generate']['median']['ttft_s'])}",
            f"engine/generate {fmt_x(tt['ratios']['engine_over_hf_generate'])}",
        )
    )
    rows.append(
        (
            f"decode, 1 stream × {dc['max_tokens']} tokens (n={dc['n']})",
            f"{c1['per_stream_tokens_per_s']:.1f} tok/s (decode-only {c1['per_stream_decode_tokens_per_s']:.1f})",
            f"transformers generate {hfd['tokens_per_s']:.1f} tok/s (decode-only {hfd['decode_tokens_per_s']:.1f})",
            f"engine/generate {fmt_x(dc['ratios']['one_stream_over_hf_generate'])}",
        )
    )
    rows.append(
        (
            f"decode, {n['streams']} streams × {dc['max_tokens']} tokens (n={dc['n']})",
            f"{cn['aggregate_tokens_per_s']:.1f} tok/s aggregate, {cn['per_stream_tokens_per_s']:.1f} per stream",
            f"1 stream {c1['aggregate_tokens_per_s']:.1f} tok/s",
            f"aggregate {fmt_x(dc['ratios']['aggregate_many_over_one'])}",
        )
    )
    return rows


def table(res: dict) -> str:
    """The markdown table of whichever sections ran."""
    rows = [("what (SmolLM2-135M fp32, 2 threads)", "median", "baseline, same run", "ratio")]
    if "startup" in res:
        rows += startup_rows(res["startup"])
    if "weight_load" in res:
        rows += weight_load_rows(res["weight_load"])
    if "first_load" in res:
        rows += first_load_rows(res["first_load"])
    if "sleep_wake" in res:
        rows += serving_rows(res)
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    sections = res.get("conditions", {}).get("sections", {})
    if sections:
        load = ", ".join(f"{k} {v['others_cores']:.2f}" for k, v in sections.items())
        m = res["machine"]
        lines.append("")
        lines.append(
            f"{m['usable_cpus']} × {m['cpu_model']}, torch {m['torch']}, transformers {m['transformers']}. "
            f"Medians; ratios from the same run. CPU cores used by other processes during each "
            f"section: {load}."
        )
    return "\n".join(lines)


# ---- main --------------------------------------------------------------------------------------------


def import_snapshot(home: Path, env: dict) -> Path:
    say(f"importing the builtin snapshot into {home} (the first time converts the GGUF, ~1 min)")
    record = run_json([*stoker_command(), "snapshot", "import", "--builtin", MODEL, "--json"], env)
    return Path(record["path"])


def _sections(value: str) -> tuple[str, ...]:
    names = tuple(v.strip() for v in value.split(",") if v.strip())
    if not names or any(n not in SECTIONS for n in names):
        raise argparse.ArgumentTypeError(f"sections are {','.join(SECTIONS)}; got {value!r}")
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (about 2 minutes)")
    ap.add_argument(
        "--only",
        type=_sections,
        default=SECTIONS,
        metavar="SECTIONS",
        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)",
    )
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "engine.json")
    ap.add_argument(
        "--home", type=Path, default=Path("~/.cache/stoker-bench").expanduser(), help="STOKER_HOME"
    )
    args = ap.parse_args(argv)
    plan = QUICK if args.quick else FULL

    signal.signal(signal.SIGTERM, _interrupt)
    env = {**os.environ, "STOKER_HOME": str(args.home)}
    args.home.mkdir(parents=True, exist_ok=True)
    procs = Processes()
    cond = CpuShare(procs)
    t_start = time.perf_counter()
    results: dict = {
        "machine": machine_info(("torch", "transformers", "safetensors"), mem_total=True),
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv),
        "plan": plan.__dict__,
    }
    try:
        with tempfile.TemporaryDirectory(prefix="stoker-bench-") as tmp:
            logs = Path(tmp)
            snapshot = import_snapshot(args.home, env)
            results["snapshot"] = {
                "path": str(snapshot),
                "bytes": (snapshot / "model.safetensors").stat().st_size,
            }
            if "startup" in args.only:
                with cond.section("startup"):
                    results["startup"] = bench_startup(plan, procs, snapshot, env, logs)
            if "weight_load" in args.only:
                with cond.section("weight_load"):
                    results["weight_load"] = bench_weight_load(plan, procs, snapshot, env)
            if "first_load" in args.only:
                with cond.section("first_load"):
                    results["first_load"] = bench_first_load(plan, procs, snapshot, env)
            if "serving" in args.only:
                engine = EngineProcess(procs, snapshot, env, logs / "serving.log")
                hf = None
                try:
                    engine.spawn()
                    hf = HFBaseline(procs, snapshot, env, logs / "hf-baseline.log")
                    engine.wait_ready()
                    hf.wait_ready()
                    serving = asyncio.run(
                        bench_serving(plan, engine, hf, snapshot / "model.safetensors", cond)
                    )
                except Exception:
                    tail = engine.log_tail()
                    if tail:
                        print(f"--- engine log (tail) ---\n{tail}", file=sys.stderr)
                    raise
                finally:
                    engine.stop()
                    if hf is not None:
                        hf.stop()
                results.update(serving)
    except KeyboardInterrupt:
        say("interrupted; stopping every process started")
        return 130
    finally:
        procs.stop_all()

    results["machine"]["loadavg_end"] = os.getloadavg()
    results["elapsed_s"] = time.perf_counter() - t_start
    results["conditions"] = {
        "what": CpuShare.__doc__.split("\n\n")[1].replace("\n", " ").strip(),
        "sections": cond.sections,
    }
    order = [
        "machine",
        "command",
        "plan",
        "snapshot",
        "startup",
        "weight_load",
        "first_load",
        "sleep_wake",
        "ttft",
        "decode",
    ]
    results = {k: results[k] for k in order if k in results} | {
        k: v for k, v in results.items() if k not in order
    }
    write_results(args.out, results, table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
