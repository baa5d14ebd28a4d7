"""Wakes at the floor and starts without waste: the CPU engine's first token, side by side, in one run.

    python bench/wake_bench.py [--reps 7] [--start-reps 3] [--threads 1] [--base DIR] [--home DIR]
                               [--out bench/results/wake.json]

Part 1, wakes. Three `stoker engine` processes on the SmolLM2 snapshot, page cache warm: one that
never sleeps, one put to sleep at level 1 and woken each repetition, one at level 2. In each of
`--reps` interleaved repetitions (their order rotated) each engine gets the same streamed completion
(5-token prompt, 2 tokens at temperature 0: no prompt block is full, so no prefix cache helps the
awake engine) and we record its time to first token (request sent → first SSE chunk) and, for the
sleepers, the wake (`POST /wake_up` sent → 200) and wake → first token. The goal (issue 16): the
first token after a level-1 wake within 50 ms of the never-slept engine's.

Part 2, starts. `--start-reps` fresh processes each: spawn → `/health` 200, the engine's own phases
(`/metrics`: imports, weight_load, warm_up), the first request's time to first token, and spawn →
first token. With `--base DIR` (a checkout of the code before the change, e.g. `git worktree add
/tmp/base <commit>`) every measurement of parts 1 and 2 is taken for that code too, in the same
run, interleaved, and ratios printed; its packages come first on PYTHONPATH.

Part 3, imports. `-X importtime` of what the engine imports, top-level cumulative times for torch,
transformers and stoker.engine.* (and where torch._dynamo comes in), for each code; and the
reference the warm-runtime goal compares with: a fresh `python -c "import torch, transformers"`.

Runs with `--threads 1` by default: on a loaded 2-core machine two intra-op threads that wait on
each other turn a 0.1 s first token into seconds of noise. Medians of all repetitions; the JSON
(`--out`) has every sample.
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

PROMPT = "The capital of France is"
MODEL = "smollm2"
LEVELS = (1, 2)


class Engine:
    """One `stoker engine` process of one code (`pythonpath` first on PYTHONPATH, "" for this checkout)."""

    def __init__(self, procs: Processes, snapshot: Path, env: dict, code: str, pythonpath: str, threads: int):
        self.procs, self.code, self.threads = procs, code, threads
        self.port = free_port()
        self.base = f"http://{HOST}:{self.port}"
        env = dict(env)
        if pythonpath:
            env["PYTHONPATH"] = os.pathsep.join([pythonpath, env.get("PYTHONPATH", "")]).strip(os.pathsep)
        cmd = [sys.executable, "-m", "stoker.cli.main", "engine", "--snapshot", str(snapshot), "--host", HOST]
        cmd += ["--port", str(self.port), "--served-model-name", MODEL, "--threads", str(threads)]
        cmd += ["--device", "cpu", "--log-level", "warning"]
        self.log = tempfile.NamedTemporaryFile(prefix="wake-bench-", suffix=".log", delete=False)
        self.spawned = time.perf_counter()
        self.proc = procs.spawn(cmd, env=env, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log)
        self.client = httpx.Client(base_url=self.base, timeout=120.0)

    def wait_ready(self, timeout: float = 300.0) -> float:
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"engine exited {self.proc.returncode}: {Path(self.log.name).read_text()[-2000:]}"
                )
            with contextlib.suppress(httpx.TransportError):
                if self.client.get("/health", timeout=2.0).status_code == 200:
                    return time.perf_counter()
            time.sleep(0.01)
        raise RuntimeError(f"engine not ready in {timeout:.0f} s")

    def first_token(self) -> tuple[float, float, str]:
        """(sent, first chunk, text) of one streamed completion."""
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "stream": True}
        sent, first, text = time.perf_counter(), None, ""
        with self.client.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    first = first or time.perf_counter()
                    text += chunk["choices"][0].get("text", "")
        return sent, first, text

    def phases(self) -> dict[str, float]:
        text = self.client.get("/metrics").text
        pattern = r'^stoker_engine_startup_phase_seconds\{[^}]*phase="(\w+)"[^}]*\}\s+(\S+)$'
        return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text, re.M)}

    def stop(self) -> None:
        self.client.close()
        self.procs.stop(self.proc)
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)


def bench_wakes(procs, snapshot, env, codes, reps, threads) -> dict:
    engines = {
        (code, role): Engine(procs, snapshot, env, code, path, threads)
        for code, path in codes.items()
        for role in ("awake", "level1", "level2")
    }
    for e in engines.values():
        e.wait_ready()
    for e in engines.values():  # each engine has served once before the first measurement
        e.first_token()
    samples: dict = {f"{code}/{role}": [] for code, role in engines}
    keys = list(engines)
    for rep in range(reps):
        order = keys[rep % len(keys) :] + keys[: rep % len(keys)]
        for code, role in order:
            e, row = engines[(code, role)], {}
            if role != "awake":
                e.client.post(f"/sleep?level={role[-1]}").raise_for_status()
                t0 = time.perf_counter()
                e.client.post("/wake_up").raise_for_status()
                row["wake_s"] = time.perf_counter() - t0
            sent, first, text = e.first_token()
            row["ttft_s"] = first - sent
            if role != "awake":
                row["wake_to_first_token_s"] = first - t0
            row["text"] = text
            samples[f"{code}/{role}"].append(row)
        say(f"wakes: repetition {rep + 1}/{reps}")
    for e in engines.values():
        e.stop()
    out: dict = {"samples": samples, "median": {}}
    for name, rows in samples.items():
        out["median"][name] = {
            k: med([r.get(k) for r in rows]) for k in ("ttft_s", "wake_s", "wake_to_first_token_s")
        }
    for code in codes:
        awake = out["median"][f"{code}/awake"]["ttft_s"]
        ref_text = samples[f"{code}/awake"][0]["text"]
        for level in LEVELS:
            m = out["median"][f"{code}/level{level}"]
            m["ttft_over_awake_ms"] = (m["ttft_s"] - awake) * 1000
            # Paired: each repetition's sleeper against the never-slept engine measured next to it,
            # so load that changes over the run (other jobs on the machine) cancels out.
            pairs = zip(samples[f"{code}/level{level}"], samples[f"{code}/awake"], strict=True)
            m["paired_ttft_over_awake_ms"] = med([(s["ttft_s"] - a["ttft_s"]) * 1000 for s, a in pairs])
            m["ttft_ratio_to_awake"] = ratio(m["ttft_s"], awake)
            m["same_text_as_awake"] = all(r["text"] == ref_text for r in samples[f"{code}/level{level}"])
    return out


def bench_starts(procs, snapshot, env, codes, reps, threads) -> dict:
    samples: dict = {code: [] for code in codes}
    for rep in range(reps):
        for code, path in list(codes.items()) if rep % 2 == 0 else list(codes.items())[::-1]:
            e = Engine(procs, snapshot, env, code, path, threads)
            try:
                ready = e.wait_ready()
                sent, first, _ = e.first_token()
                row = {"spawn_to_ready_s": ready - e.spawned, "first_ttft_s": first - sent}
                row["spawn_to_first_token_s"] = first - e.spawned
                row.update({f"phase_{k}_s": v for k, v in e.phases().items()})
            finally:
                e.stop()
            samples[code].append(row)
        say(f"starts: repetition {rep + 1}/{reps}")
    out: dict = {"samples": samples, "median": {}}
    for code, rows in samples.items():
        out["median"][code] = {k: med([r.get(k) for r in rows]) for k in sorted({k for r in rows for k in r})}
    return out


IMPORT_ENGINE = (
    "import torch, transformers; from stoker.engine import weights; from stoker.engine.app import build_app; "
    "from stoker.engine.core import Engine; from stoker.engine.metrics import EngineMetrics; "
    "from stoker.http import make_server"
)


def importtime(env: dict, pythonpath: str) -> dict:
    """Top-level cumulative seconds of torch, transformers and stoker.engine.* in `-X importtime`
    of the engine's serving imports, where torch._dynamo first comes in and what it costs."""
    env = dict(env)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", IMPORT_ENGINE], env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - t0
    rows = []
    for line in proc.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if m:
            rows.append((len(m.group(3)) // 2, m.group(4), int(m.group(2)) / 1e6))
    top = {}
    for depth, name, cum in rows:
        if depth == 0 and (name in ("torch", "transformers") or name.startswith("stoker.engine")):
            top[name] = top.get(name, 0.0) + cum
    # torch._dynamo's modules where they first come in (the outermost of them), summed: the package
    # itself is imported through torch's module `__getattr__` and gets no line of its own.
    dynamo, stack = 0.0, []  # stack: the names of the current row's ancestors, in reverse order
    for depth, name, cum in reversed(rows):
        del stack[depth:]
        if name.startswith("torch._dynamo") and not any(a.startswith("torch._dynamo") for a in stack):
            dynamo += cum
        stack.append(name)
    out = {"wall_s": wall, "top_level_cumulative_s": top, "modules": len(rows)}
    out["torch._dynamo_s"] = dynamo or None
    out["llguidance_imported"] = any(n == "llguidance" for _, n, _ in rows)
    return out


def fresh_import_s(env: dict) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, transformers"], env=env, check=True)
    return time.perf_counter() - t0


def bench_imports(env, codes, reps) -> dict:
    out: dict = {"reference_import_torch_transformers_s": [], "engine": {code: [] for code in codes}}
    for _ in range(reps):
        out["reference_import_torch_transformers_s"].append(fresh_import_s(env))
        for code, path in codes.items():
            out["engine"][code].append(importtime(env, path))
    out["median"] = {
        "reference_import_torch_transformers_s": med(out["reference_import_torch_transformers_s"])
    }
    for code, rows in out["engine"].items():
        names = sorted({k for r in rows for k in r["top_level_cumulative_s"]})
        out["median"][code] = {
            "wall_s": med([r["wall_s"] for r in rows]),
            "torch._dynamo_s": med([r["torch._dynamo_s"] for r in rows]),
            "top_level_cumulative_s": {
                n: med([r["top_level_cumulative_s"].get(n) for r in rows]) for n in names
            },
        }
    return out


def fmt(x, unit="s") -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.0f} ms" if unit == "s" else f"{x:.2f}{unit}"


def table(res: dict) -> str:
    codes = list(res["codes"])
    lines = ["## Wakes (median time to first token of a 2-token streamed completion)", ""]
    lines += ["(- awake: difference of the medians; paired: median of each repetition's difference)", ""]
    lines += [
        "| code | awake TTFT | L1 wake | L1 TTFT | L1 - awake | paired | L2 wake | L2 TTFT | L2 - awake | paired "
        "| same text |"
    ]
    lines += ["|---|---|---|---|---|---|---|---|---|---|---|"]
    w = res["wakes"]["median"]
    for code in codes:
        a, l1, l2 = w[f"{code}/awake"], w[f"{code}/level1"], w[f"{code}/level2"]
        lines.append(
            f"| {code} | {fmt(a['ttft_s'])} | {fmt(l1['wake_s'])} | {fmt(l1['ttft_s'])} | "
            f"{l1['ttft_over_awake_ms']:+.0f} ms | {l1['paired_ttft_over_awake_ms']:+.0f} ms | "
            f"{fmt(l2['wake_s'])} | {fmt(l2['ttft_s'])} | {l2['ttft_over_awake_ms']:+.0f} ms | "
            f"{l2['paired_ttft_over_awake_ms']:+.0f} ms | {l1['same_text_as_awake'] and l2['same_text_as_awake']} |"
        )
    if "starts" in res:
        s = res["starts"]["median"]
        lines += ["", "## Starts (median of fresh processes)", ""]
        lines += ["| code | imports | weights | warm-up | spawn → READY | first TTFT | spawn → first token |"]
        lines += ["|---|---|---|---|---|---|---|"]
        for code in codes:
            m = s[code]
            lines.append(
                f"| {code} | {fmt(m.get('phase_imports_s'))} | {fmt(m.get('phase_weight_load_s'))} | "
                f"{fmt(m.get('phase_warm_up_s'))} | {fmt(m['spawn_to_ready_s'])} | {fmt(m['first_ttft_s'])} | "
                f"{fmt(m['spawn_to_first_token_s'])} |"
            )
    if "imports" in res:
        i = res["imports"]["median"]
        lines += ["", "## Imports (`-X importtime`, top-level cumulative, median)", ""]
        lines.append(
            f'Reference, fresh `python -c "import torch, transformers"`: {fmt(i["reference_import_torch_transformers_s"])}'
        )
        lines += [
            "",
            "| code | wall | torch | transformers | stoker.engine.* | torch._dynamo (nested) |",
            "|---|---|---|---|---|---|",
        ]
        for code in codes:
            m = i[code]
            top = m["top_level_cumulative_s"]
            engine = sum(v for k, v in top.items() if k.startswith("stoker.engine") and v)
            lines.append(
                f"| {code} | {fmt(m['wall_s'])} | {fmt(top.get('torch'))} | {fmt(top.get('transformers'))} | "
                f"{fmt(engine)} | {fmt(m['torch._dynamo_s'])} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=7, help="interleaved wake repetitions")
    p.add_argument("--start-reps", type=int, default=3, help="fresh starts per code (0: skip)")
    p.add_argument("--import-reps", type=int, default=3, help="-X importtime runs per code (0: skip)")
    p.add_argument("--threads", type=int, default=1, help="each engine's --threads")
    p.add_argument("--base", type=Path, help="a checkout of the code before the change, measured beside it")
    p.add_argument(
        "--home", type=Path, default=Path("~/.cache/stoker-bench").expanduser(), help="STOKER_HOME"
    )
    p.add_argument("--out", type=Path, default=REPO / "bench/results/wake.json")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    started = time.perf_counter()
    env = {**os.environ, "STOKER_HOME": str(args.home)}
    snapshot = Path(import_builtin_snapshot(args.home, MODEL)["path"])
    codes = {"new": ""}
    if args.base:
        base = args.base.resolve()
        codes = {"base": os.pathsep.join([str(base / "platform"), str(base)]), "new": ""}
    res: dict = {"codes": codes, "threads": args.threads, "prompt": PROMPT}
    res["machine"] = machine_info(("torch", "transformers"))
    if args.base:
        with contextlib.suppress(subprocess.CalledProcessError):
            res["base_commit"] = subprocess.run(
                ["git", "-C", str(base), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
            ).stdout.strip()
    procs = Processes()
    try:
        res["wakes"] = bench_wakes(procs, snapshot, env, codes, args.reps, args.threads)
        if args.start_reps:
            res["starts"] = bench_starts(procs, snapshot, env, codes, args.start_reps, args.threads)
        if args.import_reps:
            res["imports"] = bench_imports(env, codes, args.import_reps)
    finally:
        procs.stop_all()
    if args.base:
        res["ratios_base_over_new"] = ratios(res)
    res["elapsed_s"] = time.perf_counter() - started
    write_results(args.out, res, table(res))
    return 0


def ratios(res: dict) -> dict:
    w = res["wakes"]["median"]
    out = {
        f"level{lv}_ttft": ratio(w[f"base/level{lv}"]["ttft_s"], w[f"new/level{lv}"]["ttft_s"])
        for lv in LEVELS
    }
    out.update(
        {
            f"level{lv}_wake_to_first_token": ratio(
                w[f"base/level{lv}"]["wake_to_first_token_s"], w[f"new/level{lv}"]["wake_to_first_token_s"]
            )
            for lv in LEVELS
        }
    )
    if "starts" in res:
        s = res["starts"]["median"]
        for k in ("spawn_to_ready_s", "spawn_to_first_token_s", "phase_warm_up_s", "phase_imports_s"):
            out[f"start_{k}"] = ratio(s["base"].get(k), s["new"].get(k))
    if "imports" in res:
        i = res["imports"]["median"]
        out["imports_wall"] = ratio(i["base"]["wall_s"], i["new"]["wall_s"])
    return out


if __name__ == "__main__":
    sys.exit(main())
