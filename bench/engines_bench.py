"""vLLM's CPU build and Stoker's CPU engine on the same snapshot, side by side in one run.

    python bench/engines_bench.py [--quick] [--out bench/results/engines.json] [--home DIR]

Both engines serve the embedded SmolLM2-135M-Instruct (fp32), imported once into `--home` (default
`~/.cache/stoker-bench`, used as `STOKER_HOME`, shared with the other benchmarks), each launched
exactly as the platform launches it (warm_pool.launch): `stoker engine --snapshot DIR` with the
pool's defaults (cpu_engine_spec), and `.venv-vllm/bin/vllm serve <snapshot> --dtype float32
--max-model-len 2048` with `VLLM_CPU_KVCACHE_SPACE=1` and a compile cache root this benchmark owns
(vllm_spec: `VLLM_CACHE_ROOT`, `TORCHINDUCTOR_CACHE_DIR`). Every process listens on 127.0.0.1.

1. Cold start: spawn → `/health` 200, and spawn → first content token of a first request (a short
   streamed chat request sent as soon as `/health` answers). vLLM's first start runs on an empty
   compile cache root (it compiles, then saves its artifacts); its later starts find the cache that
   first start left. Then `--starts` rounds, one start of each engine, the order alternating
   (S V, V S, ...) so that both share the machine's noise. Stoker's engine has no compile cache.
2. TTFT on a 200-token prompt, one request at a time, after one warm-up request.
3. Decode tokens/s at 1 and at 8 concurrent streams, `ignore_eos` so that every stream generates the
   same number of tokens.

Sections 2-3 use vLLM's own client, `vllm bench serve` (from .venv-vllm, `--backend openai`: streamed
`/v1/completions`; dataset `random`, token counts by the snapshot's tokenizer; `--ignore-eos
--temperature 0`), against each server in turn, with the same seed, so that both engines get the
same prompts. The servers of the last start round serve these (an idle server uses ~1% of a core);
the runs alternate their order by section. `vllm bench serve` warms up with its first prompt, which
the prefix cache then answers faster: the TTFT median leaves that first request out.

The machine is shared and noisy: figures are medians, compared as ratios (vLLM/Stoker) measured
in this same run. All samples go to the JSON file; a markdown table goes to stdout and next to the
JSON (`.md`). Logs of every server and client run go to `--home`/engines-bench/logs.
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
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from common import (
    HOST,
    REPO,
    CpuShare,
    Processes,
    _interrupt,
    dd_read,
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
from engine_bench import probe_body, stream_chat

from warm_pool.launch import LaunchSpec, cpu_engine_spec, vllm_spec
from warm_pool.vllm import startup_phases

MODEL = "smollm2"
VLLM = REPO / ".venv-vllm" / "bin" / "vllm"
VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"
ENGINES = ("stoker", "vllm")
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@dataclass(frozen=True)
class Plan:
    starts: int  # start rounds (one start of each engine), after vLLM's first start
    ttft_prompts: int  # measured, one at a time; one more is sent and left out (see the docstring)
    c1_prompts: int  # decode at concurrency 1
    waves: int  # decode at concurrency `streams`: streams × waves prompts
    decode_tokens: int  # output tokens per decode stream (ignore_eos)
    streams: int = 8
    ttft_input: int = 200
    ttft_output: int = 8
    decode_input: int = 32
    start_limit_s: float = 600.0  # vLLM's first start compiles: 1.5-3 min here
    client_limit_s: float = 300.0  # one `vllm bench serve` run


FULL = Plan(starts=3, ttft_prompts=5, c1_prompts=3, waves=2, decode_tokens=64)
QUICK = Plan(starts=1, ttft_prompts=2, c1_prompts=1, waves=1, decode_tokens=16)


# ---- one engine process --------------------------------------------------------------------------------


def launch_spec(engine: str, snapshot: Path, port: int, cache_root: Path) -> LaunchSpec:
    if engine == "stoker":
        # As the pool launches a cpu instance (warm_pool.pool.Pool._launch_spec, PoolSpec defaults).
        extra = ("--max-num-seqs", "8", "--grace-period", "30")
        return cpu_engine_spec(snapshot, port, MODEL, host=HOST, extra_args=extra)
    # As the pool launches vLLM's CPU build (Pool._vllm_spec), with the dtype and context fixed here.
    return vllm_spec(
        snapshot,
        port,
        MODEL,
        [],
        host=HOST,
        dtype="float32",
        max_model_len=2048,
        sleep_mode=False,
        cache_root=cache_root,
        cpu_kv_cache_gib=1.0,
        vllm_command=(str(VLLM),),
    )


def group_pids(pgid: int) -> list[int]:
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                pids.append(int(stat.parent.name))
    return pids


def group_pss_mib(pgid: int) -> float:
    """Proportional set size of a whole process group (vLLM: API server, engine core, worker)."""
    kib = 0
    for pid in group_pids(pgid):
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    kib += int(line.split()[1])
    return kib / 1024


class Server:
    """One engine process on a free loopback port, in its own process group, logging to a file."""

    def __init__(self, procs: Processes, engine: str, snapshot: Path, cache_root: Path, log: Path) -> None:
        self.procs, self.engine, self.log = procs, engine, log
        self.port = free_port()
        self.base = f"http://{HOST}:{self.port}"
        self.spec = launch_spec(engine, snapshot, self.port, cache_root)
        self.proc: subprocess.Popen | None = None
        self.spawned_at = 0.0

    def spawn(self, env: dict[str, str]) -> None:
        env = {**self.spec.environ(env), **OFFLINE}
        with self.log.open("ab") as log:
            self.spawned_at = time.perf_counter()
            self.proc = self.procs.spawn(
                list(self.spec.argv),
                cwd=self.spec.cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    async def wait_health(self, client: httpx.AsyncClient, limit_s: float) -> float:
        """Poll `/health` every 50 ms until 200; the moment it answered (perf_counter)."""
        deadline = self.spawned_at + limit_s
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.engine} exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.TransportError):
                if (await client.get("/health", timeout=5.0)).status_code == 200:
                    return time.perf_counter()
            await asyncio.sleep(0.05)
        raise RuntimeError(f"{self.engine} not healthy within {limit_s:.0f} s:\n{self.log_tail()}")

    async def phases(self, client: httpx.AsyncClient) -> dict:
        """The engine's own account of its start: Stoker's from /metrics, vLLM's from its log."""
        if self.engine == "stoker":
            text = (await client.get("/metrics", timeout=10.0)).text
            pat = r'^stoker_engine_startup_phase_seconds\{[^}]*phase="(\w+)"[^}]*\}\s+(\S+)$'
            return {m.group(1): float(m.group(2)) for m in re.finditer(pat, text, re.M)}
        log = self.log.read_text(errors="replace")
        cache = "none"
        if "Compiling model again due to a load failure" in log:
            cache = "load_failed"
        elif "Directly load AOT compilation" in log:
            cache = "loaded"
        elif "saved AOT compiled function" in log:
            cache = "compiled_and_saved"
        return {**startup_phases(log), "compile_cache": cache}

    def pss_mib(self) -> float:
        return group_pss_mib(self.proc.pid)

    def log_tail(self, n: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-n:]
        return ""

    def stop(self, limit_s: float = 30.0) -> None:
        """SIGTERM the group, then wait until every member has gone, not just the leader: vLLM's
        engine core and worker outlive its API server by a few seconds, busy, and would run into
        the next measurement. SIGKILL what is left after `limit_s`."""
        if self.proc is None:
            return
        self.procs.stop(self.proc, timeout=limit_s)
        deadline = time.perf_counter() + limit_s
        while group_pids(self.proc.pid) and time.perf_counter() < deadline:
            time.sleep(0.1)
        if group_pids(self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)


# ---- 1. cold start -----------------------------------------------------------------------------------


async def start_once(server: Server, env: dict[str, str], limit_s: float) -> dict:
    """Spawn → /health 200 → a first streamed request (2 tokens) → its first content token."""
    server.spawn(env)
    async with httpx.AsyncClient(base_url=server.base, timeout=httpx.Timeout(120.0, connect=5.0)) as client:
        ready = await server.wait_health(client, limit_s)
        probe = await stream_chat(client, probe_body())
        phases = await server.phases(client)
    return {
        "health_s": ready - server.spawned_at,
        "first_token_s": probe.first_content - server.spawned_at,
        "first_request_ttft_s": probe.ttft,
        "answer": probe.text,
        "pss_mib": server.pss_mib(),
        "phases": phases,
    }


def summary(samples: list[dict]) -> dict:
    keys = ("health_s", "first_token_s", "first_request_ttft_s", "pss_mib")
    return {"n": len(samples), "median": {k: med([s[k] for s in samples]) for k in keys}, "samples": samples}


async def bench_starts(
    plan: Plan, procs: Processes, snapshot: Path, cache_root: Path, logs: Path, env: dict
) -> tuple[dict, dict[str, Server]]:
    """vLLM's first start on an empty cache root, then `plan.starts` rounds; the last round's servers
    are left running for the serving sections."""

    def server(engine: str, label: str) -> Server:
        return Server(procs, engine, snapshot, cache_root, logs / f"{engine}-{label}.log")

    fresh_dir(cache_root)
    first = server("vllm", "start0")
    try:
        sample = await start_once(first, env, plan.start_limit_s)
    finally:
        first.stop()
    say(f"vllm first start (empty compile cache): /health {sample['health_s']:.1f} s ({sample['phases']})")
    samples: dict[str, list] = {"stoker": [], "vllm": []}
    order: list[str] = ["vllm (empty cache)"]
    kept: dict[str, Server] = {}
    for i in range(plan.starts):
        last = i == plan.starts - 1
        for engine in ENGINES if i % 2 == 0 else ENGINES[::-1]:
            srv = server(engine, f"start{i + 1}")
            try:
                s = await start_once(srv, env, plan.start_limit_s)
            except BaseException:
                srv.stop()
                raise
            if last:
                kept[engine] = srv
            else:
                srv.stop()
            samples[engine].append(s)
            order.append(engine)
            say(
                f"{engine} start {i + 1}/{plan.starts}: /health {s['health_s']:.2f} s, first token {s['first_token_s']:.2f} s"
            )
    return {
        "what": "spawn (as the platform launches each engine) → first /health 200 (polled every 50 ms) "
        "→ a first streamed chat request (2 tokens, temperature 0) sent at once → its first content "
        "chunk; pss = PSS of the engine's whole process group after that request, MiB; vllm_first = "
        "vLLM on an empty compile cache root (VLLM_CACHE_ROOT, TORCHINDUCTOR_CACHE_DIR); vllm_later "
        "= on the cache the first start left; page cache warm (snapshot and both venvs read before)",
        "order": order,
        "stoker": summary(samples["stoker"]),
        "vllm_first": summary([sample]),
        "vllm_later": summary(samples["vllm"]),
    }, kept


# ---- 2-3. serving, through `vllm bench serve` --------------------------------------------------------


def client_runs(plan: Plan) -> dict[str, dict]:
    """The three client runs per engine: prompt and output lengths, prompts, concurrency, seed."""
    return {
        "ttft": {
            "input_len": plan.ttft_input,
            "output_len": plan.ttft_output,
            "prompts": plan.ttft_prompts + 1,
            "concurrency": 1,
            "seed": 1,
        },
        "c1": {
            "input_len": plan.decode_input,
            "output_len": plan.decode_tokens,
            "prompts": plan.c1_prompts,
            "concurrency": 1,
            "seed": 2,
        },
        f"c{plan.streams}": {
            "input_len": plan.decode_input,
            "output_len": plan.decode_tokens,
            "prompts": plan.streams * plan.waves,
            "concurrency": plan.streams,
            "seed": 3,
        },
    }


def spawn_client(procs: Processes, cmd: list[str], out: Path, log: Path) -> subprocess.Popen:
    out.unlink(missing_ok=True)
    with log.open("wb") as f:
        return procs.spawn(
            cmd, cwd=out.parent, env={**os.environ, **OFFLINE}, stdin=subprocess.DEVNULL, stdout=f, stderr=f
        )


def read_client_result(proc: subprocess.Popen, out: Path, log: Path) -> dict:
    if proc.returncode != 0 or not out.exists():
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n{tail}")
    return json.loads(out.read_text())


async def vllm_bench_serve(
    procs: Processes, server: Server, snapshot: Path, run: dict, out: Path, log: Path, limit_s: float
) -> tuple[list[str], dict]:
    cmd = [
        str(VLLM),
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        server.base,
        "--model",
        MODEL,
        "--tokenizer",
        str(snapshot),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(run["input_len"]),
        "--random-output-len",
        str(run["output_len"]),
        "--random-range-ratio",
        "0",
        "--num-prompts",
        str(run["prompts"]),
        "--max-concurrency",
        str(run["concurrency"]),
        "--request-rate",
        "inf",
        "--ignore-eos",
        "--temperature",
        "0",
        "--num-warmups",
        "1",
        "--seed",
        str(run["seed"]),
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(out.parent),
        "--result-filename",
        out.name,
    ]
    proc = spawn_client(procs, cmd, out, log)
    try:
        deadline = time.perf_counter() + limit_s
        while proc.poll() is None:  # polled, not waited on in a thread: Ctrl-C stays prompt
            if time.perf_counter() > deadline:
                raise RuntimeError(f"vllm bench serve ran past {limit_s:.0f} s: see {log}")
            await asyncio.sleep(0.2)
    finally:
        procs.stop(proc)
    res = read_client_result(proc, out, log)
    bad = [e for e in res.get("errors", []) if e]
    if res.get("failed") or bad or any(n != run["output_len"] for n in res["output_lens"]):
        raise RuntimeError(
            f"{server.engine}: {res.get('failed')} failed requests, output lengths "
            f"{res['output_lens']} (wanted {run['output_len']}): {bad[:3]}"
        )
    return cmd, res


def per_request(res: dict, first: int = 0) -> list[dict]:
    """Each request from `vllm bench serve --save-detailed`: TTFT, end-to-end, TPOT (excl. the first
    token), output tokens, prompt tokens as the server counted them (usage)."""
    rows = []
    for ttft, lat, n, p in zip(
        res["ttfts"], res["latencies"], res["output_lens"], res["input_lens"], strict=True
    ):
        tpot = (lat - ttft) / (n - 1) if n > 1 else None
        rows.append(
            {"ttft_s": ttft, "latency_s": lat, "tpot_s": tpot, "output_tokens": n, "prompt_tokens": p}
        )
    return rows[first:]


def figures(kind: str, res: dict) -> dict:
    reqs = per_request(res, first=1 if kind == "ttft" else 0)
    tpot = med([r["tpot_s"] for r in reqs])
    return {
        "n": len(reqs),
        "median": {
            "ttft_s": med([r["ttft_s"] for r in reqs]),
            "prompt_tokens": med([r["prompt_tokens"] for r in reqs]),
            "tpot_s": tpot,
            "decode_tokens_per_s": 1 / tpot if tpot else None,  # per stream, first token excluded
            "stream_tokens_per_s": med([r["output_tokens"] / r["latency_s"] for r in reqs]),
        },
        "aggregate_tokens_per_s": res["output_throughput"],  # all output tokens / run duration
        "duration_s": res["duration"],
        "requests": reqs,
    }


async def bench_serving(
    plan: Plan, procs: Processes, servers: dict[str, Server], snapshot: Path, logs: Path, cpu: CpuShare
) -> dict:
    out: dict = {
        "client": "vllm bench serve --backend openai (streamed /v1/completions), dataset random "
        "(range ratio 0: every prompt exactly input_len tokens by the snapshot's tokenizer), "
        "--ignore-eos --temperature 0 --num-warmups 1, the same --seed for both engines",
        "what": "ttft = send → first streamed chunk with text; tpot = (end − ttft) / (tokens − 1); "
        "decode_tokens_per_s = 1 / median tpot (one stream's decode speed); stream_tokens_per_s = "
        "tokens / end-to-end; aggregate_tokens_per_s = all output tokens / run duration; the ttft "
        "run's first request (the warm-up's prompt, answered from the prefix cache) is left out",
    }
    for i, (kind, run) in enumerate(client_runs(plan).items()):
        entry: dict = {"run": run}
        with cpu.section(kind):
            for engine in ENGINES if i % 2 == 0 else ENGINES[::-1]:
                cmd, res = await vllm_bench_serve(
                    procs,
                    servers[engine],
                    snapshot,
                    run,
                    logs / f"bench-serve-{engine}-{kind}.json",
                    logs / f"bench-serve-{engine}-{kind}.log",
                    plan.client_limit_s,
                )
                entry[engine] = figures(kind, res)
                entry["order"] = [*entry.get("order", []), engine]
                entry.setdefault("commands", {})[engine] = shlex.join(cmd)
        s, v = entry["stoker"], entry["vllm"]
        say(
            f"{kind}: ttft vllm {fmt_s(v['median']['ttft_s'])} / stoker {fmt_s(s['median']['ttft_s'])}; "
            f"aggregate vllm {v['aggregate_tokens_per_s']:.1f} / stoker {s['aggregate_tokens_per_s']:.1f} tok/s"
        )
        out[kind] = entry
    return out


# ---- report ------------------------------------------------------------------------------------------


def ratios(res: dict) -> dict:
    st, sv = res["starts"], res["serving"]
    s, v1, vl = st["stoker"]["median"], st["vllm_first"]["median"], st["vllm_later"]["median"]
    c1, cn = sv["c1"], sv[f"c{res['plan']['streams']}"]
    return {
        "start_health_first": ratio(v1["health_s"], s["health_s"]),
        "start_health_later": ratio(vl["health_s"], s["health_s"]),
        "start_first_token_first": ratio(v1["first_token_s"], s["first_token_s"]),
        "start_first_token_later": ratio(vl["first_token_s"], s["first_token_s"]),
        "pss_at_start": ratio(vl["pss_mib"], s["pss_mib"]),
        "ttft": ratio(sv["ttft"]["vllm"]["median"]["ttft_s"], sv["ttft"]["stoker"]["median"]["ttft_s"]),
        "c1_stream_tokens_per_s": ratio(
            c1["vllm"]["median"]["stream_tokens_per_s"], c1["stoker"]["median"]["stream_tokens_per_s"]
        ),
        "c1_decode_tokens_per_s": ratio(
            c1["vllm"]["median"]["decode_tokens_per_s"], c1["stoker"]["median"]["decode_tokens_per_s"]
        ),
        "many_aggregate_tokens_per_s": ratio(
            cn["vllm"]["aggregate_tokens_per_s"], cn["stoker"]["aggregate_tokens_per_s"]
        ),
        "many_decode_tokens_per_s": ratio(
            cn["vllm"]["median"]["decode_tokens_per_s"], cn["stoker"]["median"]["decode_tokens_per_s"]
        ),
    }


def table(res: dict) -> str:
    st, sv, r, plan = res["starts"], res["serving"], res["ratios"], res["plan"]
    s, v1, vl = st["stoker"], st["vllm_first"], st["vllm_later"]
    n = plan["streams"]
    tt, c1, cn = sv["ttft"], sv["c1"], sv[f"c{n}"]

    def tps(x: float | None) -> str:
        return "–" if x is None else f"{x:.1f}"

    rows = [
        (
            f"what (SmolLM2-135M fp32, one snapshot; Stoker n={s['n']} starts)",
            "vLLM-CPU",
            "Stoker",
            "vLLM/Stoker",
        ),
        (
            "start → /health 200, vLLM's first start: empty compile cache (n=1)",
            fmt_s(v1["median"]["health_s"]),
            fmt_s(s["median"]["health_s"]),
            fmt_x(r["start_health_first"]),
        ),
        (
            f"start → /health 200, vLLM's later starts: the cache its first start left (n={vl['n']})",
            fmt_s(vl["median"]["health_s"]),
            fmt_s(s["median"]["health_s"]),
            fmt_x(r["start_health_later"]),
        ),
        (
            "start → first token of a first request, vLLM's first start (empty cache)",
            fmt_s(v1["median"]["first_token_s"]),
            fmt_s(s["median"]["first_token_s"]),
            fmt_x(r["start_first_token_first"]),
        ),
        (
            "start → first token of a first request, vLLM's later starts (kept cache)",
            fmt_s(vl["median"]["first_token_s"]),
            fmt_s(s["median"]["first_token_s"]),
            fmt_x(r["start_first_token_later"]),
        ),
        (
            "memory after the first request (PSS of the process group, later starts)",
            f"{vl['median']['pss_mib']:.0f} MiB",
            f"{s['median']['pss_mib']:.0f} MiB",
            fmt_x(r["pss_at_start"]),
        ),
        (
            f"TTFT, {tt['run']['input_len']}-token prompt, one at a time (n={tt['stoker']['n']})",
            fmt_s(tt["vllm"]["median"]["ttft_s"]),
            fmt_s(tt["stoker"]["median"]["ttft_s"]),
            fmt_x(r["ttft"]),
        ),
        (
            f"decode, 1 stream × {c1['run']['output_len']} tokens: tok/s end to end (n={c1['stoker']['n']})",
            tps(c1["vllm"]["median"]["stream_tokens_per_s"]),
            tps(c1["stoker"]["median"]["stream_tokens_per_s"]),
            fmt_x(r["c1_stream_tokens_per_s"]),
        ),
        (
            "decode, 1 stream: tok/s after the first token (1/TPOT)",
            tps(c1["vllm"]["median"]["decode_tokens_per_s"]),
            tps(c1["stoker"]["median"]["decode_tokens_per_s"]),
            fmt_x(r["c1_decode_tokens_per_s"]),
        ),
        (
            f"decode, {n} streams × {cn['run']['output_len']} tokens: aggregate tok/s "
            f"({cn['run']['prompts']} requests)",
            tps(cn["vllm"]["aggregate_tokens_per_s"]),
            tps(cn["stoker"]["aggregate_tokens_per_s"]),
            fmt_x(r["many_aggregate_tokens_per_s"]),
        ),
        (
            f"decode, {n} streams: tok/s per stream after the first token (1/TPOT)",
            tps(cn["vllm"]["median"]["decode_tokens_per_s"]),
            tps(cn["stoker"]["median"]["decode_tokens_per_s"]),
            fmt_x(r["many_decode_tokens_per_s"]),
        ),
    ]
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    m, ve = res["machine"], res["machine"]["vllm_env"]
    cache = ", ".join(
        f"{k} {st[k]['samples'][0]['phases'].get('compile_cache')}" for k in ("vllm_first", "vllm_later")
    )
    load = ", ".join(f"{k} {v['others_cores']:.2f}" for k, v in res["conditions"]["sections"].items())
    lines.append("")
    lines.append(
        f"{m['usable_cpus']} × {m['cpu_model']}; vllm-cpu {ve['vllm-cpu']} (torch {ve['torch']}, transformers "
        f"{ve['transformers']}); Stoker on torch {m['torch']}, transformers {m['transformers']}. Medians; "
        f"ratios from the same run (above 1×: vLLM takes longer, or makes more tokens/s); Stoker's engine "
        f"has no compile cache: both start rows hold its same {s['n']} starts. vLLM's compile "
        f"cache: {cache}. TTFT and decode measured by `vllm bench serve` (streamed /v1/completions, random "
        f"prompts, ignore_eos, temperature 0). Load average {m['loadavg_start'][0]:.2f} at the start, "
        f"{m['loadavg_end'][0]:.2f} at the end; CPU cores used by other processes: {load}."
    )
    return "\n".join(lines)


# ---- main --------------------------------------------------------------------------------------------


def vllm_env_versions() -> dict:
    code = (
        "import json; from importlib.metadata import version as v; "
        "print(json.dumps({d: v(d) for d in ('vllm-cpu', 'torch', 'transformers')}))"
    )
    out = subprocess.run([str(VLLM_PY), "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def fresh_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def warm_page_cache(snapshot: Path, env: dict) -> None:
    """The snapshot and both engines' imports read once, so that no start pays the disk for them."""
    dd_read(snapshot / "model.safetensors")
    for cmd in (
        [sys.executable, "-c", "import stoker.engine.app, stoker.engine.core, uvicorn"],
        [str(VLLM_PY), "-c", "import vllm.entrypoints.openai.api_server, vllm.benchmarks.serve"],
    ):
        subprocess.run(cmd, env={**env, **OFFLINE}, capture_output=True, timeout=300, check=True)


async def run_all(plan: Plan, procs: Processes, cpu: CpuShare, snapshot: Path, work: Path, env: dict) -> dict:
    logs = fresh_dir(work / "logs")
    with cpu.section("starts"):
        starts, servers = await bench_starts(plan, procs, snapshot, work / "vllm-cache", logs, env)
    out = {
        "engines": {e: {"argv": list(s.spec.argv), "env": dict(s.spec.env)} for e, s in servers.items()},
        "starts": starts,
    }
    try:
        out["serving"] = await bench_serving(plan, procs, servers, snapshot, logs, cpu)
    finally:
        for s in servers.values():
            s.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one start round, few requests (a smoke run)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "engines.json")
    ap.add_argument(
        "--home", type=Path, default=Path("~/.cache/stoker-bench").expanduser(), help="STOKER_HOME"
    )
    args = ap.parse_args(argv)
    plan = QUICK if args.quick else FULL
    if not VLLM.exists():
        print(f"{VLLM} is missing: `make vllm` builds it", file=sys.stderr)
        return 2

    signal.signal(signal.SIGTERM, _interrupt)
    env = {**os.environ, "STOKER_HOME": str(args.home)}
    procs = Processes(stop_all_timeout=30.0)
    cpu = CpuShare(procs)
    t_start = time.perf_counter()
    results: dict = {
        "machine": machine_info(
            ("torch", "transformers", "httpx"), mem_total=True, vllm_env=vllm_env_versions()
        ),
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv),
        "plan": asdict(plan),
    }
    try:
        record = import_builtin_snapshot(args.home, MODEL)
        snapshot = Path(record["path"])
        results["snapshot"] = {k: record.get(k) for k in ("id", "name", "path", "bytes", "dtype")}
        say("reading the snapshot and both engines' imports into the page cache")
        warm_page_cache(snapshot, env)
        results.update(asyncio.run(run_all(plan, procs, cpu, snapshot, args.home / "engines-bench", env)))
    except KeyboardInterrupt:
        say("interrupted; stopping every process started")
        return 130
    finally:
        procs.stop_all()

    results["machine"]["loadavg_end"] = os.getloadavg()
    results["elapsed_s"] = time.perf_counter() - t_start
    results["ratios"] = ratios(results)
    results["conditions"] = {
        "what": " ".join(CpuShare.__doc__.split("\n\n")[1].split()),
        "sections": cpu.sections,
    }
    write_results(args.out, results, table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
