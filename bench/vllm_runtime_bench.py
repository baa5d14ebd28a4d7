"""Where a vLLM start goes on the CPU build, and what a pre-imported runtime saves: side by side.

    python bench/vllm_runtime_bench.py [--quick] [--rounds N] [--enforce-eager] [--out FILE]

Each start serves the SmolLM2 snapshot with the pool's own launch (warm_pool.launch.vllm_spec: the
engine core's worker in-process, `--max-model-len 2048`, a 1 GiB CPU KV cache, an API key, and a
compile cache kept under the bench's home that the first start fills, as the pool keeps one per
snapshot), and is timed from "go" to the first token of a streamed completion. Three kinds,
interleaved per round:

    fresh        `vllm serve` spawned (.venv-vllm/bin/vllm), as the pool starts vLLM today
    rt-spawn     infra/vllm-cpu/runtime.py started ahead (vLLM imported), handed the same launch
                 over its socket (warm_pool.handoff.hand_off, the pool's call); its engine core is
                 spawned as vLLM's CPU build does (STOKER_VLLM_RUNTIME_SPAWN=1): a fresh interpreter
                 that imports everything again
    rt-fork      the same runtime with its default: the engine core forked from the runtime, so it
                 inherits the imports

Phases come from the engine's own output, every line time-stamped as it arrives (pipes, unbuffered):
`api_up` the API server's first vLLM log line (its imports done), `core_up` the engine core's first
line (its process up: for a spawned core, its imports done), `weights` "Loading weights took",
`engine_init` "init engine (profile, create kv cache, warmup model)" (compile or cache load,
profiling, KV cache, warm-up), `listening` "Starting vLLM server", `healthy` /health 200, and
`first_token`. A runtime's own import time (started → socket ready) is recorded apart: it is paid
ahead, off the start's path. Also measured once: `-X importtime` of the API server's and of the
engine core's imports, top modules by cumulative time. JSON to bench/results/vllm_runtime.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
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
from warm_pool.handoff import SOCKET_NAME, TOKEN_ENV, Handoff, hand_off
from warm_pool.launch import VLLM_GUARD_DIR, vllm_spec, with_python_path
from warm_pool.vllm import snapshot_shape

BENCH_HOME = Path.home() / ".cache" / "stoker-bench"
VLLM = REPO / ".venv-vllm" / "bin" / "vllm"
VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"
RUNTIME = REPO / "infra" / "vllm-cpu" / "runtime.py"
KINDS = ("fresh", "rt-spawn", "rt-fork")
MARKS = {
    "api_up": re.compile(r"^(\(APIServer pid=\d+\) )?INFO .*\] "),
    "core_up": re.compile(r"^\(EngineCore\w* pid=\d+\) "),
    "weights": re.compile(r"Loading weights took"),
    "engine_init": re.compile(r"init engine \(profile, create kv cache, warmup model\) took"),
    "listening": re.compile(r"Starting vLLM (API )?server on"),
}
PHASES = ("api_up", "core_up", "weights", "engine_init", "listening", "healthy", "first_token")
IMPORT_PARENT = (
    "vllm.entrypoints.cli.main",
    "vllm.entrypoints.cli.serve",
    "vllm.entrypoints.launchers.api_server.entry",
    "vllm.v1.engine.async_llm",
)
PACKAGES = (
    "torch",
    "torch._dynamo",
    "torch._inductor",
    "transformers",
    "numpy",
    "fastapi",
    "pydantic",
    "openai",
    "zmq",
    "tokenizers",
    "triton",
)
IMPORT_CHILD = ("vllm.v1.engine.core", "vllm.v1.worker.cpu_worker", "vllm.model_executor.models.llama")


class Lines:
    """Every line read from `fd`, stamped with perf_counter on arrival; kept in memory and in `log`."""

    def __init__(self, fd: int, log: Path) -> None:
        self.lines: list[tuple[float, str]] = []
        self._file = os.fdopen(fd, "rb", buffering=0)
        self._log = log.open("a")
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        buf = b""
        while chunk := self._file.read(65536):
            now = time.perf_counter()
            buf += chunk
            *whole, buf = buf.split(b"\n")
            for raw in whole:
                line = raw.decode("utf-8", "replace")
                self.lines.append((now, line))
                self._log.write(line + "\n")
        self._log.flush()

    def marks(self, t0: float) -> dict[str, float]:
        found: dict[str, float] = {}
        for t, line in list(self.lines):
            for name, pattern in MARKS.items():
                if name not in found and t >= t0 and pattern.search(line):
                    found[name] = t - t0
        return found


def wait_healthy(base: str, proc_alive, limit_s: float = 900) -> None:
    """Poll /health every 0.1 s through one client (a client per poll costs the start being timed
    CPU: this machine has two cores)."""
    deadline = time.perf_counter() + limit_s
    with httpx.Client(timeout=2) as client:
        while time.perf_counter() < deadline:
            if not proc_alive():
                raise RuntimeError("vLLM exited before it was healthy")
            try:
                if client.get(f"{base}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
    raise RuntimeError(f"vLLM not healthy within {limit_s:.0f} s")


def first_token(base: str, key: str) -> tuple[float, str]:
    body = {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    body["stream"] = True
    t0, text = time.perf_counter(), ""
    headers = {"authorization": f"Bearer {key}"}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=headers, timeout=300) as r:
        r.raise_for_status()
        first = None
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                piece = json.loads(line[6:])["choices"][0].get("text") or ""
                if piece and first is None:
                    first = time.perf_counter()
                text += piece
    if first is None:
        raise RuntimeError("the stream produced no text")
    return first - t0, text


def launch(snapshot: Path, cache_root: Path, enforce_eager: bool):
    shape = snapshot_shape(
        json.loads((snapshot / "manifest.json").read_text())["dtype"],
        json.loads((snapshot / "config.json").read_text()),
    )
    port, key = free_port(), secrets.token_urlsafe(16)
    spec = vllm_spec(
        snapshot,
        port,
        "smollm2",
        [],
        dtype=shape.dtype,
        max_model_len=2048,
        sleep_mode=False,
        cache_root=cache_root,
        extra_args=("--enforce-eager",) if enforce_eager else (),
        vllm_command=(str(VLLM),),
        api_key=key,
    )
    return spec, f"http://{HOST}:{port}", key


def start_runtime(procs: Processes, work: Path, spawn: bool, log: Path):
    """A runtime started ahead; returns (process, socket dir, token, seconds until its socket appeared)."""
    sock_dir = Path(tempfile.mkdtemp(prefix="rt-", dir=work))
    token = secrets.token_urlsafe(32)
    # As the pool's keeper starts vLLM's runtimes: the guard's directory on their path (the launch has a key).
    env = with_python_path(os.environ, [str(VLLM_GUARD_DIR)])
    env.update({TOKEN_ENV: token, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"})
    env["VLLM_NO_USAGE_STATS"] = env["VLLM_DO_NOT_TRACK"] = "1"
    if spawn:
        env["STOKER_VLLM_RUNTIME_SPAWN"] = "1"
    t0 = time.perf_counter()
    proc = procs.spawn(
        [str(VLLM_PY), str(RUNTIME), "--socket-dir", str(sock_dir)],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )
    while not (sock_dir / SOCKET_NAME).exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the runtime exited {proc.returncode}: see {log}")
        if time.perf_counter() - t0 > 600:
            raise RuntimeError("the runtime did not listen within 600 s")
        time.sleep(0.05)
    return proc, sock_dir, token, time.perf_counter() - t0


def one_start(kind: str, procs: Processes, snapshot: Path, cache_root: Path, work: Path, eager: bool) -> dict:
    spec, base, key = launch(snapshot, cache_root, eager)
    log = work / f"{kind}-{time.monotonic_ns()}.log"
    out: dict = {}
    if kind != "fresh":
        rt, sock_dir, token, ready_s = start_runtime(procs, work, kind == "rt-spawn", log)
        out["runtime_imports_s"] = ready_s
        time.sleep(1.0)  # settled: nothing of the runtime's start still running
    read_fd, write_fd = os.pipe()
    lines = Lines(read_fd, log)
    t0 = time.perf_counter()
    if kind == "fresh":
        env = {**spec.environ(os.environ), "HF_HUB_OFFLINE": "1"}
        proc = procs.spawn(list(spec.argv), cwd=spec.cwd, env=env, stdout=write_fd, stderr=write_fd)
    else:
        handoff = Handoff(spec.args, dict(spec.env), str(spec.cwd))
        hand_off(sock_dir / SOCKET_NAME, handoff, token, expect_pid=rt.pid, log_fd=write_fd, timeout_s=30)
        proc = rt
    os.close(write_fd)
    try:
        wait_healthy(base, lambda: proc.poll() is None)
        healthy = time.perf_counter() - t0
        ttft, text = first_token(base, key)
        out.update(lines.marks(t0))
        out.update({"healthy": healthy, "first_token": time.perf_counter() - t0, "request_ttft_s": ttft})
        out["text"] = text
    finally:
        procs.stop(proc, timeout=60)
    return out


def importtime(modules: tuple[str, ...]) -> dict:
    """`-X importtime` of `modules` in vLLM's venv: total and the top-level modules by cumulative time."""
    code = "import " + ", ".join(modules)
    t0 = time.perf_counter()
    out = subprocess.run([str(VLLM_PY), "-X", "importtime", "-c", code], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    rows = []
    for line in out.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if m:
            rows.append((int(m[2]) / 1e6, len(m[3]), m[4]))
    # second-level packages (torch, transformers, vllm.config …) say where the time goes
    top: dict[str, float] = {}
    for cum, depth, name in rows:
        if depth <= 3:
            top[name] = max(top.get(name, 0.0), cum)
    biggest = sorted(top.items(), key=lambda kv: -kv[1])[:15]
    # Where the packages vLLM stands on were first imported (cumulative: with what they import).
    packages = {name: cum for cum, _, name in rows if name in PACKAGES}
    return {"wall_s": wall, "modules": len(rows), "top": dict(biggest), "packages": packages}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 round")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--enforce-eager", action="store_true", help="no torch.compile (and no compile cache)")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "vllm_runtime.json")
    ap.add_argument("--keep-logs", action="store_true", help="keep the engines' logs (their path is printed)")
    args = ap.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 3)
    kinds = [k for k in args.kinds.split(",") if k in KINDS]
    if not VLLM.exists():
        raise SystemExit(f"{VLLM} is missing: run `make vllm`")
    started = time.perf_counter()
    procs = Processes(stop_all_timeout=60)
    BENCH_HOME.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="stoker-vllmrt-", dir=str(BENCH_HOME)))
    os.chmod(work, 0o700)
    cache_root = BENCH_HOME / ("vllm-runtime-cache-eager" if args.enforce_eager else "vllm-runtime-cache")
    results: dict = {
        "machine": machine_info(),
        "command": " ".join([sys.executable, *sys.argv]) if argv is None else " ".join(argv),
        "rounds": rounds,
        "enforce_eager": args.enforce_eager,
    }
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    try:
        snapshot = Path(import_builtin_snapshot(BENCH_HOME)["path"])
        say("-X importtime: the API server's imports, then the engine core's")
        results["importtime"] = {
            "api_server": importtime(IMPORT_PARENT),
            "engine_core": importtime(IMPORT_CHILD),
        }
        if not (cache_root / ".filled").exists():
            say("first start: fills the compile cache (not measured)")
            cache_root.mkdir(parents=True, exist_ok=True)
            one_start("fresh", procs, snapshot, cache_root, work, args.enforce_eager)
            (cache_root / ".filled").touch()
        for r in range(rounds):
            order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]
            for kind in order:
                got = one_start(kind, procs, snapshot, cache_root, work, args.enforce_eager)
                runs[kind].append(got)
                shown = " ".join(f"{p} {got[p]:.1f}" for p in PHASES if p in got)
                say(
                    f"round {r + 1}/{rounds} {kind:>8}: {shown} ({got.get('runtime_imports_s', 0):.1f} s ahead)"
                )
    finally:
        procs.stop_all()
        if args.keep_logs:
            say(f"logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    results["runs"] = runs
    results["median"] = {
        k: {p: med([x.get(p) for x in v]) for p in (*PHASES, "runtime_imports_s", "request_ttft_s")}
        for k, v in runs.items()
    }
    if "fresh" in runs:
        fresh = results["median"]["fresh"]["first_token"]
        results["ratio_fresh_over"] = {k: ratio(fresh, results["median"][k]["first_token"]) for k in kinds}
    results["elapsed_s"] = time.perf_counter() - started
    write_results(args.out, results, table(results))
    return 0


def table(res: dict) -> str:
    m = res["median"]
    head = "| vLLM start (SmolLM2, CPU build) | " + " | ".join(PHASES) + " | imported ahead | fresh ÷ this |"
    rows = [head, "|---" * (len(PHASES) + 3) + "|"]
    for k, ph in m.items():
        cells = [fmt_s(ph.get(p)) for p in PHASES]
        ahead = fmt_s(ph.get("runtime_imports_s")) if k != "fresh" else "–"
        rows.append(
            f"| {k} | "
            + " | ".join(cells)
            + f" | {ahead} | {fmt_x(res.get('ratio_fresh_over', {}).get(k))} |"
        )
    rows.append("")
    imp = res["importtime"]
    for side in ("api_server", "engine_core"):
        top = ", ".join(f"{n} {s:.2f} s" for n, s in list(imp[side]["top"].items())[:6])
        pkgs = ", ".join(f"{n} {s:.2f} s" for n, s in imp[side].get("packages", {}).items())
        rows.append(
            f"- `-X importtime`, {side}: {imp[side]['wall_s']:.1f} s wall; top: {top}; packages: {pkgs}"
        )
    rows.append(
        f"\nMedians of {res['rounds']} interleaved round(s); every phase is seconds from go (spawn or "
        "handoff); enforce-eager: " + str(res["enforce_eager"]) + "."
    )
    return "\n".join(rows)


if __name__ == "__main__":
    raise SystemExit(main())
