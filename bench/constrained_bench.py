"""Benchmark structured output on the CPU engine: decode tokens/s with a `json_schema` response_format
against free text, side by side on one engine with the embedded model (SmolLM2-135M-Instruct, fp32).

    python bench/constrained_bench.py [--quick] [--threads N] [--out bench/results/constrained.json]
                                      [--home DIR]

One `stoker engine` process (`--threads 1` by default) serves both kinds of request, alternated
(free, constrained, free, ...; the order flips every other round against drift), so both see the
same machine. Every request streams a story prompt with `max_tokens` N and `ignore_eos`, so each
produces exactly N tokens; the constrained one asks for `{"title": ..., "story": ...}` with a long
`minLength` on the story, so every one of its N tokens is drawn under the grammar (none after it is
complete). Measured per request: decode tokens/s = (N - 1) / (last event - first content chunk) and
time to first token; per round, the engine process's CPU time per generated token, which another
process on the machine does not change. At 1 stream (the issue's bar: constrained at most 10 %
slower) and at 4 concurrent streams (all free, then all constrained: per-request masks in one batch).
Decode rates are compared as a ratio of medians and as the median of each round's own ratio (its
constrained and free halves ran back to back, so a slow phase of the machine hits both).

Before the measured rounds one constrained request builds llguidance's view of the tokenizer (the
engine does that on its first structured request, not at start); its TTFT is reported apart.

The machine is shared and noisy: figures are medians of several repetitions, comparisons ratios from
this run. All samples go to the JSON file; a markdown table goes to stdout and next to the JSON
(`.md`). The snapshot is imported once into `--home` (default `~/.cache/stoker-bench`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from common import (
    CLK_TCK,
    HOST,
    REPO,
    CpuShare,
    Processes,
    _interrupt,
    fmt_s,
    fmt_x,
    import_builtin_snapshot,
    machine_info,
    med,
    ratio,
    say,
    stoker_command,
    write_results,
)
from engine_bench import MODEL, TOPICS, EngineProcess, nonce_system

BAR = 0.90  # constrained decode at least 90 % of free text's: "at most 10 % slower"

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "story": {"type": "string", "minLength": 2000},  # never complete within N tokens
    },
    "required": ["title", "story"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "story", "schema": SCHEMA, "strict": True}}


@dataclass(frozen=True)
class Plan:
    reps: int  # rounds at 1 stream, each one free and one constrained request
    batch_reps: int  # rounds at `streams` concurrent streams, each one free batch and one constrained
    tokens: int  # max_tokens of every request
    streams: int = 4


FULL = Plan(reps=8, batch_reps=4, tokens=128)
QUICK = Plan(reps=3, batch_reps=1, tokens=32)


def body(i: int, tokens: int, constrained: bool) -> dict:
    # The same prompt either way (so TTFT compares like with like): only response_format differs.
    user = f"Write a long story about {TOPICS[i % len(TOPICS)]}, as JSON with a title and the story."
    out = {
        "model": MODEL,
        "messages": [nonce_system(), {"role": "user", "content": user}],
        "max_tokens": tokens,
        "temperature": 0.7,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if constrained:
        out["response_format"] = RESPONSE_FORMAT
    return out


async def one(client: httpx.AsyncClient, payload: dict) -> dict:
    """Stream one request: TTFT, decode tokens/s, the text (checked by the caller)."""
    sent = time.perf_counter()
    first = last = None
    tokens, text, finish = None, "", None
    async with client.stream("POST", "/v1/chat/completions", json=payload) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            obj = json.loads(line[len("data: ") :])
            if "error" in obj:
                raise RuntimeError(f"stream error: {obj['error']}")
            if obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
            for choice in obj.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    first = first or now
                    text += content
                if content or choice.get("finish_reason"):
                    last = now
                finish = choice.get("finish_reason") or finish
    if first is None or tokens is None:
        raise RuntimeError(f"no content or no usage (finish_reason={finish})")
    return {
        "ttft_s": first - sent,
        "decode_tokens_per_s": (tokens - 1) / (last - first) if last > first else None,
        "completion_tokens": tokens,
        "finish_reason": finish,
        "text": text,
    }


def check_constrained(sample: dict, tokens: int) -> None:
    """A constrained answer cut at N tokens begins as the schema says ({"title": "...): never free text."""
    text = sample["text"]
    if not re.match(r'\s*\{\s*"title"\s*:\s*"', text) or sample["completion_tokens"] != tokens:
        raise RuntimeError(f"not a constrained answer of {tokens} tokens: {text[:120]!r}")


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


async def round_of(
    client: httpx.AsyncClient, plan: Plan, i: int, conc: int, constrained: bool, pid: int
) -> dict:
    cpu0 = cpu_seconds(pid)
    samples = await asyncio.gather(
        *(one(client, body(i * conc + k, plan.tokens, constrained)) for k in range(conc))
    )
    cpu = cpu_seconds(pid) - cpu0
    for s in samples:
        if constrained:
            check_constrained(s, plan.tokens)
        elif s["completion_tokens"] != plan.tokens:
            raise RuntimeError(f"free text of {s['completion_tokens']} tokens, not {plan.tokens}")
    return {
        "decode_tokens_per_s": [s["decode_tokens_per_s"] for s in samples],
        "ttft_s": [s["ttft_s"] for s in samples],
        # The engine's own CPU time per generated token (prefill included): what the grammar costs,
        # whatever else runs on the machine.
        "engine_cpu_ms_per_token": cpu * 1000 / sum(s["completion_tokens"] for s in samples),
        "text_head": samples[0]["text"][:80],
    }


def summary(rounds: list[dict]) -> dict:
    return {
        "decode_tokens_per_s": med([x for r in rounds for x in r["decode_tokens_per_s"]]),
        "ttft_s": med([x for r in rounds for x in r["ttft_s"]]),
        "engine_cpu_ms_per_token": med([r["engine_cpu_ms_per_token"] for r in rounds]),
        "n": sum(len(r["ttft_s"]) for r in rounds),
    }


async def bench(plan: Plan, engine: EngineProcess, cond: CpuShare) -> dict:
    pid = engine.pid()
    limits = httpx.Limits(max_connections=plan.streams + 2, max_keepalive_connections=plan.streams + 2)
    async with httpx.AsyncClient(base_url=engine.base, timeout=600.0, limits=limits) as client:
        with cond.section("first_structured"):
            first = await one(client, body(0, 4, constrained=True))
            warm = await one(client, body(1, 4, constrained=True))
        out: dict = {
            "first_structured_request": {
                "what": "TTFT of the engine's first json_schema request (builds llguidance's tokenizer) "
                "and of the next one",
                "first_ttft_s": first["ttft_s"],
                "second_ttft_s": warm["ttft_s"],
            }
        }
        for conc, reps, name in ((1, plan.reps, "c1"), (plan.streams, plan.batch_reps, f"c{plan.streams}")):
            free, constrained, pairs = [], [], []
            with cond.section(name):
                for i in range(reps):
                    for kind in ("free", "constrained") if i % 2 == 0 else ("constrained", "free"):
                        target = constrained if kind == "constrained" else free
                        target.append(await round_of(client, plan, i, conc, kind == "constrained", pid))
                    # A round's two halves ran back to back: their ratio cancels the slow phases of
                    # this shared machine, which a ratio of the section's medians does not.
                    c_tps, f_tps = constrained[-1]["decode_tokens_per_s"], free[-1]["decode_tokens_per_s"]
                    pairs.append(ratio(med(c_tps), med(f_tps)))
            f, c = summary(free), summary(constrained)
            out[name] = {
                "streams": conc,
                "free": {"median": f, "samples": free},
                "constrained": {"median": c, "samples": constrained},
                "ratios": {
                    "constrained_over_free_decode": ratio(c["decode_tokens_per_s"], f["decode_tokens_per_s"]),
                    "constrained_over_free_decode_paired": med(pairs),
                    "constrained_over_free_ttft": ratio(c["ttft_s"], f["ttft_s"]),
                    "constrained_over_free_cpu_per_token": ratio(
                        c["engine_cpu_ms_per_token"], f["engine_cpu_ms_per_token"]
                    ),
                },
                "paired_ratios": pairs,
            }
            r = out[name]["ratios"]
            say(
                f"{name}: free {f['decode_tokens_per_s']:.2f} tok/s, constrained "
                f"{c['decode_tokens_per_s']:.2f} tok/s per stream ({fmt_x(r['constrained_over_free_decode'])}; "
                f"paired rounds {fmt_x(r['constrained_over_free_decode_paired'])})"
            )
    return out


def table(res: dict) -> str:
    plan, n = res["plan"], res["plan"]["tokens"]
    what = f"what (SmolLM2-135M fp32, {res['threads']} thread{'s' if res['threads'] > 1 else ''})"
    rows = [(what, "json_schema", "free text, same run", "ratio")]
    for name in ("c1", f"c{plan['streams']}"):
        s = res[name]
        f, c = s["free"]["median"], s["constrained"]["median"]
        r = s["ratios"]
        paired = r["constrained_over_free_decode_paired"]
        verdict = ""
        if name == "c1":
            verdict = (
                f"; {'meets' if paired is not None and paired >= BAR else 'misses'} the bar ≥ {BAR:.2f}×"
            )
        rows.append(
            (
                f"decode tok/s per stream, {s['streams']} stream(s) × {n} tokens (n={c['n']} each)",
                f"{c['decode_tokens_per_s']:.2f}",
                f"{f['decode_tokens_per_s']:.2f}",
                f"{fmt_x(r['constrained_over_free_decode'])} (paired rounds {fmt_x(paired)}{verdict})",
            )
        )
        rows.append(
            (
                f"engine CPU per token, {s['streams']} stream(s)",
                f"{c['engine_cpu_ms_per_token']:.1f} ms",
                f"{f['engine_cpu_ms_per_token']:.1f} ms",
                fmt_x(r["constrained_over_free_cpu_per_token"]),
            )
        )
        rows.append(
            (
                f"TTFT, {s['streams']} stream(s)",
                fmt_s(c["ttft_s"]),
                fmt_s(f["ttft_s"]),
                fmt_x(r["constrained_over_free_ttft"]),
            )
        )
    fs = res["first_structured_request"]
    rows.append(
        (
            "TTFT of the first json_schema request (builds the tokenizer's grammar view)",
            fmt_s(fs["first_ttft_s"]),
            f"the next one {fmt_s(fs['second_ttft_s'])}",
            fmt_x(ratio(fs["first_ttft_s"], fs["second_ttft_s"])),
        )
    )
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    m = res["machine"]
    load = ", ".join(f"{k} {v['others_cores']:.2f}" for k, v in res["conditions"]["sections"].items())
    lines += [
        "",
        f"{m['usable_cpus']} × {m['cpu_model']}, torch {m['torch']}, transformers {m['transformers']}, "
        f"llguidance {m['llguidance']}. Medians; ratios from the same run, requests alternated; paired "
        f"rounds: the median over rounds of each round's constrained/free ratio (its halves back to "
        f"back). CPU cores used by other processes during each section: {load}.",
    ]
    return "\n".join(lines)


class Engine(EngineProcess):
    """engine_bench's engine process, with the thread count of this run."""

    def __init__(self, *args, threads: int) -> None:
        super().__init__(*args)
        self.threads = threads

    def spawn(self) -> None:
        cmd = [*stoker_command(), "engine", "--snapshot", str(self.snapshot), "--host", HOST,
               "--port", str(self.port), "--served-model-name", MODEL, "--threads", str(self.threads),
               "--log-level", "warning"]  # fmt: skip
        log = self.log_path.open("ab")
        self.proc = self.procs.spawn(cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        log.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer, shorter requests (under a minute)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "constrained.json")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="the engine's torch threads (default 1: on a shared 2-core machine, 2 threads stall "
        "whenever another process takes a core, and wall-clock figures swing tenfold)",
    )
    ap.add_argument(
        "--home", type=Path, default=Path("~/.cache/stoker-bench").expanduser(), help="STOKER_HOME"
    )
    args = ap.parse_args(argv)
    plan = QUICK if args.quick else FULL

    signal.signal(signal.SIGTERM, _interrupt)
    env = {**os.environ, "STOKER_HOME": str(args.home)}
    procs = Processes()
    cond = CpuShare(procs)
    t_start = time.perf_counter()
    results: dict = {
        "machine": machine_info(("torch", "transformers", "llguidance"), mem_total=True),
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv),
        "plan": plan.__dict__,
        "threads": args.threads,
        "schema": SCHEMA,
    }
    try:
        with tempfile.TemporaryDirectory(prefix="stoker-bench-") as tmp:
            snapshot = Path(import_builtin_snapshot(args.home, MODEL)["path"])
            engine = Engine(procs, snapshot, env, Path(tmp) / "engine.log", threads=args.threads)
            try:
                engine.spawn()
                engine.wait_ready()
                results.update(asyncio.run(bench(plan, engine, cond)))
            except Exception:
                print(f"--- engine log (tail) ---\n{engine.log_tail()}", file=sys.stderr)
                raise
            finally:
                engine.stop()
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
    write_results(args.out, results, table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
