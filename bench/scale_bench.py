"""Benchmark scale from zero for the embedded model (SmolLM2-135M-Instruct), split into its phases.

    python bench/scale_bench.py [--quick] [--out bench/results/scale.json] [--home DIR]

(From zero side by side with Ray Serve, warm runtime and wake: `python bench/zero_bench.py`, which
builds on this bench's platform and client.)

1. **Cold start through the platform.** Runs `stoker up --stable-window 1` (its own `STOKER_HOME`,
   default `~/.cache/stoker-bench`, whose snapshot store engine_bench shares) on a free 127.0.0.1
   port and `stoker deploy smollm2 --model smollm2 --min-warm 0 --idle-timeout 3`. Then, N times:
   wait until `stoker ls --json` shows no instance, send a streamed chat request (a ~20-token user
   message, `max_tokens` 16, `temperature` 0) and time its first content chunk (TTFT) and its end.
   The platform's `/metrics` read before and after splits the TTFT: `stoker_cold_start_seconds`
   (snapshot made local, process start = interpreter + imports + bind, model load = weights +
   warm-up; together: ready), the hold overhead (`stoker_queue_wait_seconds`, the time held, minus
   the time to ready: the poke, the tick, the health poll's granularity), and the first token (TTFT
   − held: slot granted → first content chunk; of which `stoker_cold_start_first_byte_seconds`,
   READY → the instance's first byte, is also reported). Right after each cold request, the same
   request again while the instance is READY gives the warm TTFT.
2. **Asleep, at the engine level** (written before the pool had a sleeping tier): one
   `stoker engine` on the same snapshot, launched as the pool launches it, without the gateway:
   `POST /sleep?level=L`, then `POST /wake_up` and the same streamed request, timed from the
   `/wake_up` call to the first content chunk; N times per level (1: weights dropped, page cache
   kept; 2: page cache dropped too).

Reported: medians over the N repetitions and the ratio cold-start TTFT / asleep TTFT. All samples
go to the JSON file; a markdown table goes to stdout and next to the JSON (`.md`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shlex
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
    Processes,
    _interrupt,
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

MODEL = "smollm2"
IDLE_TIMEOUT_S = 3
MAX_TOKENS = 16
PHASES = ("snapshot_local", "process_start", "model_load", "total_to_ready")


@dataclass(frozen=True)
class Plan:
    reps: int  # cold starts, and sleep/wake cycles per level


FULL = Plan(reps=3)
QUICK = Plan(reps=2)


# ---- processes ---------------------------------------------------------------------------------------


def pid_start_ticks(pid: int) -> int | None:
    with contextlib.suppress(OSError, IndexError, ValueError):
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    return None


class InstanceWatch:
    """Engine processes the platform starts (from its records, `$STOKER_HOME/instances/*.json`),
    remembered by PID and start time so that any left behind can be stopped, and only those."""

    def __init__(self, home: Path) -> None:
        self.dir = home / "instances"
        self.seen: dict[int, int | None] = {}

    def scan(self) -> None:
        for path in self.dir.glob("*.json"):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                pid = int(json.loads(path.read_text())["pid"])
                self.seen.setdefault(pid, pid_start_ticks(pid))

    def leftovers(self) -> list[int]:
        return [p for p, ticks in self.seen.items() if ticks is not None and pid_start_ticks(p) == ticks]

    def kill_leftovers(self) -> list[int]:
        left = self.leftovers()
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)
        return left


# ---- requests and metrics ----------------------------------------------------------------------------


def chat_body(model: str = MODEL) -> dict:
    # A distinct opening per request, so no prefix of an earlier prompt is reused (~20 tokens).
    tag = uuid.uuid4().hex[:6]
    return {
        "model": model,
        "messages": [
            {
                "role": "user",
                "content": f"Note {tag}. What is the capital of France? Answer in one short sentence.",
            }
        ],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@dataclass
class Stream:
    sent: float
    first_byte: float | None = None
    first_content: float | None = None
    done: float | None = None
    keepalives: int = 0
    content_chunks: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    text: str = ""
    headers: dict | None = None

    def summary(self) -> dict:
        return {
            "ttft_s": self.first_content - self.sent,
            "first_byte_s": self.first_byte - self.sent,
            "end_s": self.done - self.sent,
            "keepalive_comments": self.keepalives,
            "content_chunks": self.content_chunks,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "text": self.text,
            "cold_start_header": (self.headers or {}).get("x-stoker-cold-start"),
            "instance": (self.headers or {}).get("x-stoker-instance"),
        }


async def stream_chat(client: httpx.AsyncClient, sent: float | None = None, model: str = MODEL) -> Stream:
    """One streamed chat request for `model`; times from `sent` (default: now) to each milestone."""
    s = Stream(sent=sent if sent is not None else time.perf_counter())
    async with client.stream("POST", "/v1/chat/completions", json=chat_body(model)) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        s.headers = dict(r.headers)
        async for line in r.aiter_lines():
            now = time.perf_counter()
            if line.startswith(":"):
                s.keepalives += 1
                continue
            if not line.startswith("data: "):
                continue
            s.first_byte = s.first_byte or now
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
                    s.content_chunks += 1
                    s.text += content
    s.done = time.perf_counter()
    if s.first_content is None:
        raise RuntimeError("stream produced no content")
    return s


SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)$", re.M)
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[tuple[str, frozenset], float]:
    return {
        (m.group(1), frozenset(LABEL.findall(m.group(2) or ""))): float(m.group(3))
        for m in SAMPLE.finditer(text)
    }


def metric(ms: dict, name: str, **labels: str) -> float:
    return ms.get((name, frozenset(labels.items())), 0.0)


# ---- 1. cold start through the platform --------------------------------------------------------------


class StokerUp:
    def __init__(self, procs: Processes, env: dict[str, str], log_path: Path) -> None:
        self.procs, self.log_path = procs, log_path
        self.port = free_port()
        self.base = f"http://{HOST}:{self.port}"
        self.env = {**env, "STOKER_URL": self.base}
        self.proc: subprocess.Popen | None = None

    def start(self, *extra: str) -> None:
        """`stoker up` with a 1 s stable window, `extra` flags after; returns once /healthz answers."""
        cmd = [
            *stoker_command(),
            "up",
            "--host",
            HOST,
            "--port",
            str(self.port),
            "--stable-window",
            "1",
            "--log-level",
            "info",
            *extra,
        ]
        with self.log_path.open("ab") as log:
            self.proc = self.procs.spawn(cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"stoker up exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.base + "/healthz", timeout=2).status_code == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"stoker up not healthy within 120 s:\n{self.log_tail()}")

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        out = subprocess.run(
            [*stoker_command(), *args], env=self.env, capture_output=True, text=True, timeout=300
        )
        if out.returncode != 0:
            raise RuntimeError(f"stoker {shlex.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
        return out

    def instances(self) -> dict[str, int]:
        data = json.loads(self.cli("ls", "--json").stdout)
        return next(d["instances"] for d in data if d["name"] == MODEL)

    def wait_zero(self, watch: InstanceWatch, timeout: float = 120.0) -> float:
        """Until `stoker ls --json` shows no instance of the deployment; seconds waited."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            watch.scan()
            if not any(self.instances().values()):
                return time.monotonic() - t0
            time.sleep(0.5)
        raise RuntimeError(f"instances did not go to zero within {timeout:.0f} s: {self.instances()}")

    def metrics(self) -> dict:
        return parse_metrics(httpx.get(self.base + "/metrics", timeout=10).text)

    def log_tail(self, n: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-n:]
        return ""

    def stop(self) -> None:
        if self.proc is not None:
            self.procs.stop(self.proc, timeout=90.0)


def cold_split(before: dict, after: dict) -> dict:
    d = lambda name, **kw: metric(after, name, **kw) - metric(before, name, **kw)  # noqa: E731
    out = {f"{p}_s": d("stoker_cold_start_seconds_sum", deployment=MODEL, phase=p) for p in PHASES}
    out["cold_starts"] = d("stoker_cold_start_seconds_count", deployment=MODEL, phase="total_to_ready")
    out["first_byte_metric_s"] = d("stoker_cold_start_first_byte_seconds_sum", deployment=MODEL)
    out["held_s"] = d("stoker_queue_wait_seconds_sum", deployment=MODEL)
    out["instance_starts_ready"] = d("stoker_instance_starts_total", deployment=MODEL, outcome="ready")
    return out


async def bench_cold(plan: Plan, up: StokerUp, watch: InstanceWatch) -> dict:
    samples, warm = [], []
    async with httpx.AsyncClient(base_url=up.base, timeout=300.0) as client:
        for i in range(plan.reps):
            waited = up.wait_zero(watch)
            before = up.metrics()
            s = await stream_chat(client)
            watch.scan()
            after = up.metrics()
            w = await stream_chat(client)  # the instance is READY for IDLE_TIMEOUT_S more
            split = cold_split(before, after)
            sample = {**s.summary(), **split, "waited_for_zero_s": waited}
            # TTFT = held (arrival → slot granted) + first token (granted → first content chunk);
            # held = total_to_ready + hold overhead (the poke, the tick, the health poll).
            sample["first_token_s"] = sample["ttft_s"] - split["held_s"]
            sample["hold_overhead_s"] = split["held_s"] - split["total_to_ready_s"]
            sample["first_byte_to_content_s"] = sample["ttft_s"] - sample["first_byte_s"]
            if split["cold_starts"] != 1 or sample["cold_start_header"] != "true":
                raise RuntimeError(
                    f"expected one cold start, got {split['cold_starts']:g} "
                    f"(x-stoker-cold-start: {sample['cold_start_header']})"
                )
            samples.append(sample)
            warm.append({**w.summary()})
            say(
                f"cold start {i + 1}/{plan.reps}: TTFT {sample['ttft_s']:.2f} s (ready after "
                f"{split['total_to_ready_s']:.2f} s); warm TTFT {warm[-1]['ttft_s'] * 1e3:.0f} ms"
            )
    keys = (
        "ttft_s",
        "end_s",
        "snapshot_local_s",
        "process_start_s",
        "model_load_s",
        "total_to_ready_s",
        "held_s",
        "hold_overhead_s",
        "first_token_s",
        "first_byte_metric_s",
        "first_byte_s",
        "first_byte_to_content_s",
    )
    return {
        "what": (
            "streamed chat request at zero instances through `stoker up` (TTFT = sent → first content "
            "chunk, end = sent → [DONE]); phases are deltas of the platform's histogram sums: "
            "stoker_cold_start_seconds by phase (snapshot_local, process_start, model_load, "
            "total_to_ready), stoker_queue_wait_seconds (held = arrival → slot granted) and "
            "stoker_cold_start_first_byte_seconds (first_byte_metric = READY → first byte from the "
            "instance); first_token = TTFT − held (slot granted → first content chunk, as the client "
            "sees it); hold_overhead = held − total_to_ready (the poke, the tick, the health poll's "
            "granularity); first_byte = sent → first SSE event at the client; warm = the same request "
            "again at once, instance READY"
        ),
        "n": plan.reps,
        "median": {k: med([s[k] for s in samples]) for k in keys},
        "samples": samples,
        "warm": {
            "median": {k: med([s[k] for s in warm]) for k in ("ttft_s", "end_s")},
            "samples": warm,
        },
    }


# ---- 2. asleep, at the engine level ------------------------------------------------------------------


async def wait_health(client: httpx.AsyncClient, proc: subprocess.Popen, limit_s: float = 240) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited with {proc.returncode}")
        with contextlib.suppress(httpx.TransportError):
            if (await client.get("/health")).status_code == 200:
                return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"engine not ready within {limit_s:.0f} s")


async def bench_asleep(plan: Plan, procs: Processes, snapshot: Path, env: dict, log_path: Path) -> dict:
    port = free_port()
    # As the pool launches a cpu instance (warm_pool.launch.cpu_engine_spec, PoolSpec defaults).
    cmd = [
        *stoker_command(),
        "engine",
        "--snapshot",
        str(snapshot),
        "--port",
        str(port),
        "--host",
        HOST,
        "--served-model-name",
        MODEL,
        "--max-num-seqs",
        "8",
        "--grace-period",
        "30",
    ]
    with log_path.open("ab") as log:
        proc = procs.spawn(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    out: dict = {
        "what": (
            "one `stoker engine` (launched as the pool launches it), no gateway: POST /sleep?level=L, "
            "then POST /wake_up sent → the streamed request's first content chunk (wake_to_ttft_s); "
            "wake_up_s = the /wake_up call alone; awake = the same request on the awake engine"
        ),
        "command": shlex.join(cmd),
        "n": plan.reps,
    }
    try:
        async with httpx.AsyncClient(base_url=f"http://{HOST}:{port}", timeout=300.0) as client:
            await wait_health(client, proc)
            await stream_chat(client)  # first request after start: not measured
            awake = [(await stream_chat(client)).summary() for _ in range(plan.reps)]
            out["awake"] = {"median": {"ttft_s": med([a["ttft_s"] for a in awake])}, "samples": awake}
            for level in (1, 2):
                reps = []
                for _ in range(plan.reps):
                    t0 = time.perf_counter()
                    (await client.post(f"/sleep?level={level}", timeout=120)).raise_for_status()
                    sleep_s = time.perf_counter() - t0
                    if not (await client.get("/is_sleeping")).json()["is_sleeping"]:
                        raise RuntimeError("engine did not go to sleep")
                    await asyncio.sleep(0.5)
                    t0 = time.perf_counter()
                    (await client.post("/wake_up", timeout=120)).raise_for_status()
                    wake_s = time.perf_counter() - t0
                    s = await stream_chat(client, sent=t0)
                    reps.append(
                        {"sleep_s": sleep_s, "wake_up_s": wake_s, "wake_to_ttft_s": s.summary()["ttft_s"]}
                    )
                    reps[-1]["request_ttft_s"] = reps[-1]["wake_to_ttft_s"] - wake_s
                    reps[-1]["end_s"] = s.done - t0
                out[f"level{level}"] = {
                    "median": {k: med([r[k] for r in reps]) for k in reps[0]},
                    "samples": reps,
                }
                say(
                    f"asleep level {level}: wake + TTFT {out[f'level{level}']['median']['wake_to_ttft_s']:.3f} s"
                )
    finally:
        procs.stop(proc)
    return out


# ---- report ------------------------------------------------------------------------------------------


def table(res: dict) -> str:
    cold, asleep = res["cold"], res["asleep"]
    m, n = cold["median"], cold["n"]
    ttft = m["ttft_s"]
    rows = [
        ("what (SmolLM2-135M, CPU engine)", "median", "split / reference", "ratio"),
        (
            f"cold start → first token, through `stoker up` (n={n})",
            fmt_s(ttft),
            f"snapshot local {fmt_s(m['snapshot_local_s'])} · process start {fmt_s(m['process_start_s'])} · "
            f"model load {fmt_s(m['model_load_s'])} · hold overhead {fmt_s(m['hold_overhead_s'])} · "
            f"first token {fmt_s(m['first_token_s'])} (READY → first byte {fmt_s(m['first_byte_metric_s'])})",
            "–",
        ),
        (
            f"cold start → end of stream ({MAX_TOKENS} tokens)",
            fmt_s(m["end_s"]),
            f"ready after {fmt_s(m['total_to_ready_s'])}",
            "–",
        ),
        (
            f"warm, instance READY, through `stoker up` (n={n})",
            fmt_s(cold["warm"]["median"]["ttft_s"]),
            f"end of stream {fmt_s(cold['warm']['median']['end_s'])}",
            f"cold/warm {fmt_x(ratio(ttft, cold['warm']['median']['ttft_s']), 1)}",
        ),
    ]
    for level, what in ((1, "weights dropped, page cache kept"), (2, "page cache dropped too")):
        lv = asleep[f"level{level}"]["median"]
        rows.append(
            (
                f"asleep level {level} ({what}): /wake_up + request → first token, engine level (n={asleep['n']})",
                fmt_s(lv["wake_to_ttft_s"]),
                f"/wake_up {fmt_s(lv['wake_up_s'])} · request {fmt_s(lv['request_ttft_s'])}",
                f"cold/asleep {fmt_x(ratio(ttft, lv['wake_to_ttft_s']), 1)}",
            )
        )
    rows.append(
        (
            f"awake engine, same request, no gateway (n={asleep['n']})",
            fmt_s(asleep["awake"]["median"]["ttft_s"]),
            "–",
            "–",
        )
    )
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    lines.append("")
    lines.append(
        f"Prompt {cold['samples'][0]['prompt_tokens']} tokens after the chat template, max_tokens {MAX_TOKENS}, "
        f"temperature 0; load average at start {res['machine']['loadavg_start'][0]:.2f}, end "
        f"{res['machine']['loadavg_end'][0]:.2f}. The asleep rows are the engine alone: the pool does not "
        "put instances to sleep yet."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 repetitions instead of 3")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "scale.json")
    ap.add_argument(
        "--home", type=Path, default=Path("~/.cache/stoker-bench").expanduser(), help="STOKER_HOME"
    )
    args = ap.parse_args(argv)
    plan = QUICK if args.quick else FULL

    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with SIGINT ignored
    env = {**os.environ, "STOKER_HOME": str(args.home)}
    args.home.mkdir(parents=True, exist_ok=True)
    procs = Processes(stop_all_timeout=60.0)
    watch = InstanceWatch(args.home)
    t_start = time.perf_counter()
    results: dict = {
        "machine": machine_info(("torch", "transformers")),
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv),
        "plan": plan.__dict__,
    }
    up: StokerUp | None = None
    try:
        with tempfile.TemporaryDirectory(prefix="stoker-scale-bench-") as tmp:
            logs = Path(tmp)
            say(f"importing the builtin snapshot into {args.home} (the first time converts the GGUF, ~1 min)")
            record = run_json([*stoker_command(), "snapshot", "import", "--builtin", MODEL, "--json"], env)
            snapshot = Path(record["path"])
            results["snapshot"] = {"id": record.get("id"), "path": str(snapshot)}
            up = StokerUp(procs, env, logs / "stoker-up.log")
            try:
                up.start()
                deploy = [
                    "deploy",
                    MODEL,
                    "--model",
                    MODEL,
                    "--min-warm",
                    "0",
                    "--idle-timeout",
                    str(IDLE_TIMEOUT_S),
                ]
                up.cli(*deploy)
                results["platform"] = {
                    "up": "stoker up --host 127.0.0.1 --port P --stable-window 1",
                    "deploy": "stoker " + shlex.join(deploy),
                }
                results["cold"] = asyncio.run(bench_cold(plan, up, watch))
                with contextlib.suppress(Exception):
                    up.cli("rm", MODEL)
            except Exception:
                tail = up.log_tail()
                if tail:
                    print(f"--- stoker up log (tail) ---\n{tail}", file=sys.stderr)
                raise
            finally:
                up.stop()
                watch.scan()
                left = watch.kill_leftovers()
                if left:
                    say(f"killed engine processes the platform left behind: {left}")
                    results["engine_processes_left_by_platform"] = left
            results["asleep"] = asyncio.run(bench_asleep(plan, procs, snapshot, env, logs / "engine.log"))
    except KeyboardInterrupt:
        say("interrupted; stopping every process started")
        return 130
    finally:
        procs.stop_all()
        watch.kill_leftovers()

    results["machine"]["loadavg_end"] = os.getloadavg()
    results["elapsed_s"] = time.perf_counter() - t_start
    c, a = results["cold"]["median"]["ttft_s"], results["asleep"]
    results["ratios"] = {
        "cold_over_warm_ttft": ratio(c, results["cold"]["warm"]["median"]["ttft_s"]),
        "cold_over_asleep_level1": ratio(c, a["level1"]["median"]["wake_to_ttft_s"]),
        "cold_over_asleep_level2": ratio(c, a["level2"]["median"]["wake_to_ttft_s"]),
    }
    write_results(args.out, results, table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
