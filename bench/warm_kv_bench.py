"""Warm KV across scale-to-zero: the first request after a wake or a restart, with and without the
prefix blocks kept in the store, against a never-slept engine's prefix-cache hit, in one run.

    python bench/warm_kv_bench.py [--reps 5] [--restarts 3] [--threads 1] [--home DIR]
                                  [--out bench/results/warm_kv.json]

The request: a chat completion (1 token, greedy, streamed) whose system prompt is ~1,500 tokens,
the same every time, and whose user turn changes every time (a returning conversation: only the
system prompt's blocks can be reused). Three `stoker engine` processes on the SmolLM2 snapshot:

- `awake` never sleeps; it has seen the system prompt, so each request is a prefix-cache hit.
- `kept` keeps KV (`--kv-keep-scope`, the default bound): each repetition it sleeps (level 1,
  which writes the blocks) and wakes (which maps them back before `/wake_up` answers).
- `cold` keeps none (`--kv-keep-bytes 0`): the same sleep and wake, then the whole prefill.

In each of `--reps` repetitions, their order rotated, each gets one request; we record time to first
token (request sent → first SSE chunk), and for the sleepers the sleep and the wake (`POST` sent →
200), the engine's own `kv_restore` phase, and whether the request was a prefix hit
(`vllm:prefix_cache_hits`). Then `--restarts` times each of `kept` and `cold` is stopped and a new
process started (the kept blocks are written by the stop), and the same is measured from READY.
The goal (issue 28): the first request after a wake with kept KV within 1.2x of the never-slept hit.

`--threads 1` by default, as bench/wake_bench.py: on a loaded 2-core machine two intra-op threads
turn a 0.1 s first token into noise. Medians; the JSON (`--out`) has every sample. The kept files
this run writes are under a scope of its own and deleted at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
from common import (
    HOST,
    REPO,
    Processes,
    _interrupt,
    free_port,
    import_builtin_snapshot,
    machine_info,
    med,
    ratio,
    say,
    write_results,
)

MODEL = "smollm2"
GOAL = 1.2
# A long system prompt, as a support assistant's would be: ~1,500 SmolLM2 tokens.
RULES = [
    "Answer in the customer's language and keep a friendly, precise tone.",
    "Never promise a delivery date the order system has not confirmed.",
    "Refunds within thirty days need the order number and the original payment method.",
    "Escalate to a human agent when the customer mentions a legal dispute or a safety issue.",
    "Quote prices with their currency and say whether taxes are included.",
    "Do not ask for full card numbers, passwords or one-time codes, ever.",
    "When an item is out of stock, offer the closest alternative and the restock estimate.",
    "Summarise the conversation in one sentence before you hand it to another agent.",
]
SYSTEM = "You are the support assistant of an online hardware store. " + " ".join(
    f"Rule {i + 1}.{j + 1}: {rule}" for i in range(10) for j, rule in enumerate(RULES)
)


class Engine:
    """One `stoker engine` process on the snapshot, with its own flags."""

    def __init__(self, procs: Processes, snapshot: Path, env: dict, threads: int, *flags: str):
        self.procs, self.snapshot, self.env, self.threads, self.flags = procs, snapshot, env, threads, flags
        self.spawn()

    def spawn(self) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "stoker.cli.main", "engine", "--snapshot", str(self.snapshot)]
        cmd += ["--host", HOST, "--port", str(self.port), "--served-model-name", MODEL]
        cmd += ["--threads", str(self.threads), "--device", "cpu", "--log-level", "warning", *self.flags]
        self.log = tempfile.NamedTemporaryFile(prefix="warm-kv-bench-", suffix=".log", delete=False)
        self.proc = self.procs.spawn(
            cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log
        )
        self.client = httpx.Client(base_url=f"http://{HOST}:{self.port}", timeout=300.0)

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"engine exited {self.proc.returncode}: {Path(self.log.name).read_text()[-2000:]}"
                )
            with contextlib.suppress(httpx.TransportError):
                if self.client.get("/health", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.01)
        raise RuntimeError(f"engine not ready in {timeout:.0f} s")

    def first_token(self, turn: str) -> dict:
        """One streamed chat completion: its time to first token and the prefix hit it was counted as."""
        hits = self.metric("vllm:prefix_cache_hits_total")
        body = {
            "model": MODEL,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": turn}],
            "max_tokens": 1,
            "temperature": 0,
            "stream": True,
        }
        sent, first = time.perf_counter(), None
        with self.client.stream("POST", "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if (
                    line.startswith("data: ")
                    and line != "data: [DONE]"
                    and json.loads(line[6:]).get("choices")
                ):
                    first = first or time.perf_counter()
        return {"ttft_s": first - sent, "hit_tokens": self.metric("vllm:prefix_cache_hits_total") - hits}

    def prompt_tokens(self, turn: str) -> int:
        body = {
            "model": MODEL,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": turn}],
            "max_tokens": 1,
            "temperature": 0,
        }
        return self.client.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"]

    def metric(self, name: str, **labels: str) -> float:
        text = self.client.get("/metrics").text
        total = 0.0
        for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)$", text, re.M):
            if all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
                total += float(m.group(2))
        return total

    def phase(self, name: str) -> float | None:
        m = re.search(
            rf'^stoker_engine_startup_phase_seconds\{{[^}}]*phase="{name}"[^}}]*\}}\s+(\S+)$',
            self.client.get("/metrics").text,
            re.M,
        )
        return float(m.group(1)) if m else None

    def timed_post(self, path: str) -> float:
        t0 = time.perf_counter()
        self.client.post(path).raise_for_status()
        return time.perf_counter() - t0

    def stop(self) -> float:
        t0 = time.perf_counter()
        self.client.close()
        self.procs.stop(self.proc, timeout=120.0)
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)
        return time.perf_counter() - t0


def bench(procs, snapshot, env, reps: int, restarts: int, threads: int, scope: str) -> dict:
    engines = {
        "awake": Engine(procs, snapshot, env, threads, "--kv-keep-bytes", "0"),
        "kept": Engine(procs, snapshot, env, threads, "--kv-keep-scope", scope),
        "cold": Engine(procs, snapshot, env, threads, "--kv-keep-bytes", "0"),
    }
    for e in engines.values():
        e.wait_ready()
    tokens = engines["awake"].prompt_tokens("Hello.")
    say(f"the request: {tokens} prompt tokens (system prompt and a short user turn)")
    for e in engines.values():  # each has seen the system prompt before the first measurement
        e.first_token("Where is my order?")
    samples: dict = {role: [] for role in engines}
    keys = list(engines)
    for rep in range(reps):
        order = keys[rep % len(keys) :] + keys[: rep % len(keys)]
        for role in order:
            e, row = engines[role], {}
            if role != "awake":
                row["sleep_s"] = e.timed_post("/sleep?level=1")
                row["wake_s"] = e.timed_post("/wake_up")
                row["kv_restore_s"] = e.phase("kv_restore")
            row.update(e.first_token(f"Question {rep} for the {role} engine: can I return a drill?"))
            samples[role].append(row)
            say(f"rep {rep} {role}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if v is not None))
    out: dict = {"prompt_tokens": tokens, "wakes": samples}
    if restarts:
        starts: dict = {"kept": [], "cold": []}
        for rep in range(restarts):
            for role in ("kept", "cold")[rep % 2 :] + ("kept", "cold")[: rep % 2]:
                e = engines[role]
                row = {"stop_s": e.stop()}
                t0 = time.perf_counter()
                e.spawn()
                e.wait_ready()
                row["start_s"] = time.perf_counter() - t0
                row["kv_restore_s"] = e.phase("kv_restore")
                row.update(e.first_token(f"Question {rep} after a restart of {role}: is shipping free?"))
                starts[role].append(row)
                say(
                    f"restart {rep} {role}: "
                    + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if v is not None)
                )
            row = engines["awake"].first_token(f"Question {rep} between restarts: is shipping free?")
            starts.setdefault("awake", []).append(row)
        out["restarts"] = starts
    for e in engines.values():
        e.stop()
    return out


def summary(res: dict) -> dict:
    def m(rows, key):
        return med([r.get(key) for r in rows])

    def paired(rows, base):  # each repetition's TTFT over the never-slept engine's in the same repetition
        return med([ratio(r["ttft_s"], b["ttft_s"]) for r, b in zip(rows, base, strict=True)])

    wakes, out = res["wakes"], {}
    hit = m(wakes["awake"], "ttft_s")
    for role in ("awake", "kept", "cold"):
        rows = wakes[role]
        out[f"wake/{role}"] = {
            "ttft_s": m(rows, "ttft_s"),
            "ttft_over_hit": ratio(m(rows, "ttft_s"), hit),
            "paired_over_hit": paired(rows, wakes["awake"]),
            "wake_plus_ttft_s": med([r.get("wake_s", 0.0) + r["ttft_s"] for r in rows]),
            "wake_s": m(rows, "wake_s"),
            "sleep_s": m(rows, "sleep_s"),
            "kv_restore_s": m(rows, "kv_restore_s"),
            "hit_tokens": m(rows, "hit_tokens"),
        }
    for role, rows in res.get("restarts", {}).items():
        base = m(res["restarts"]["awake"], "ttft_s")
        out[f"restart/{role}"] = {
            "ttft_s": m(rows, "ttft_s"),
            "ttft_over_hit": ratio(m(rows, "ttft_s"), base),
            "paired_over_hit": paired(rows, res["restarts"]["awake"]),
            "start_s": m(rows, "start_s"),
            "stop_s": m(rows, "stop_s"),
            "kv_restore_s": m(rows, "kv_restore_s"),
            "hit_tokens": m(rows, "hit_tokens"),
        }
    return out


def table(res: dict) -> str:
    def f(x, unit="s"):
        return (
            "–"
            if x is None
            else (f"{x:.3f} s" if unit == "s" else f"{x:.2f}x" if unit == "x" else f"{x:.0f}")
        )

    lines = [
        f"Warm KV across scale-to-zero: SmolLM2, a {res['prompt_tokens']}-token prompt (a ~1,500-token "
        f"system prompt), {res['reps']} wakes, {res['restart_reps']} restarts, --threads {res['threads']}; medians.",
        "",
        "| first request | TTFT | ÷ never-slept hit (medians) | paired ÷ | prefix hit (tokens) | wake / start "
        "| sleep / stop | restore |",
        "|---|---|---|---|---|---|---|---|",
    ]
    names = {
        "wake/awake": "never slept (prefix-cache hit)",
        "wake/kept": "after a wake, kept KV",
        "wake/cold": "after a wake, no kept KV",
        "restart/awake": "never slept, between restarts",
        "restart/kept": "after a restart, kept KV",
        "restart/cold": "after a restart, no kept KV",
    }
    for key, row in res["summary"].items():
        lines.append(
            f"| {names[key]} | {f(row['ttft_s'])} | {f(row['ttft_over_hit'], 'x')} "
            f"| {f(row['paired_over_hit'], 'x')} | {f(row['hit_tokens'], 'n')} "
            f"| {f(row.get('wake_s', row.get('start_s')))} | {f(row.get('sleep_s', row.get('stop_s')))} "
            f"| {f(row['kv_restore_s'])} |"
        )
    w = res["summary"]
    kept, paired = w["wake/kept"]["ttft_over_hit"], w["wake/kept"]["paired_over_hit"]
    lines += [
        "",
        f"Goal: after a wake with kept KV within {GOAL}x of the never-slept hit: {f(kept, 'x')} "
        f"(paired {f(paired, 'x')}). Wake + first token: kept {f(w['wake/kept']['wake_plus_ttft_s'])}, "
        f"without {f(w['wake/cold']['wake_plus_ttft_s'])}. Kept file: {res.get('kept_file_bytes', 0) / 2**20:.1f} MiB.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=5, help="interleaved sleep/wake repetitions")
    p.add_argument("--restarts", type=int, default=3, help="restarts of each sleeper (0: skip)")
    p.add_argument("--threads", type=int, default=1, help="each engine's --threads")
    p.add_argument(
        "--home", type=Path, default=Path("~/.cache/stoker-bench").expanduser(), help="STOKER_HOME"
    )
    p.add_argument("--out", type=Path, default=REPO / "bench/results/warm_kv.json")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    started = time.perf_counter()
    env = {**os.environ, "STOKER_HOME": str(args.home)}
    snapshot = Path(import_builtin_snapshot(args.home, MODEL)["path"])
    scope = f"warm-kv-bench-{uuid.uuid4().hex[:8]}"
    res: dict = {"reps": args.reps, "restart_reps": args.restarts, "threads": args.threads, "scope": scope}
    res["machine"] = machine_info(("torch", "transformers"))
    procs = Processes()
    before = set((snapshot.parent / "kv" / snapshot.name).glob("*.kv"))
    try:
        res.update(bench(procs, snapshot, env, args.reps, args.restarts, args.threads, scope))
    finally:
        procs.stop_all()
        for path in set((snapshot.parent / "kv" / snapshot.name).glob("*.kv")) - before:
            res.setdefault("kept_file_bytes", path.stat().st_size)
            path.unlink()
    res["summary"] = summary(res)
    res["elapsed_s"] = time.perf_counter() - started
    write_results(args.out, res, table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
