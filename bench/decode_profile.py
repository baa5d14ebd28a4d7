"""Where the CPU engine's decode time goes: each generation step's CPU time, phase by phase.

    python bench/decode_profile.py [--streams 1 8] [--tokens 32] [--threads 1] [--out bench/results/decode_profile.json]

One engine (`stoker.engine.core.Engine`, the pool's defaults but `--threads`) is loaded in this
process on the embedded SmolLM2-135M-Instruct (fp32, imported into `--home` as the other
benchmarks do) and decodes `--tokens` tokens per stream, greedy with `ignore_eos` after a 32-token
prompt, as `bench/engines_bench.py`'s decode rows do (without HTTP: the engines bench shows what
streaming adds). The manager's methods are wrapped to time each phase of its steps on the
generation thread:

- schedule: `prepare_next_batch` (the scheduler, the step's input tensors, the processors' arguments);
- forward: the model's forward pass; the step's ops are split by torch's profiler (a separate
  window of steps, which the profiler itself slows: shares, not times) into matrix products,
  attention, the KV cache's reads and writes, and the other ops (the processors' included);
- logits processors (ours: `draw.py`'s Shape and Draw; transformers' when it builds any) and its
  sampler (`_sample`: an argmax, or a softmax and multinomial when it samples);
- update: `update_batch` (request states, outputs handed to the event loop);

and the event loop's own CPU time (deltas, detokenisation) while the streams run.

CPU time of the thread (`time.thread_time`), not wall time: the machine is shared, and on 2 cores
another process's work stretches wall time by whatever it takes; with one torch thread
(`--threads 1`, the default here) the generation thread does all of a step's work itself, so its
CPU time is the step's work whatever else runs. Two threads split it (and spin at their barriers),
which this does not see: the wall-clock comparison with vLLM is `engines_bench.py`'s.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import time
from pathlib import Path

import torch
from common import import_builtin_snapshot, machine_info, write_results

from stoker.engine.core import Engine, EngineConfig
from stoker.engine.metrics import EngineMetrics
from stoker.engine.protocol import SamplingParams

PROMPT_TOKENS = 32
OPS = {  # torch profiler op → category of the forward
    "aten::mm": "matmul",
    "aten::addmm": "matmul",
    "aten::bmm": "matmul",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "aten::index_select": "kv_cache",
    "aten::index_copy_": "kv_cache",
}


class Phases:
    """CPU seconds per phase on the thread that runs it, and how often it ran."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter = collections.Counter()

    def wrap(self, obj, attr: str, phase: str) -> None:
        inner = getattr(obj, attr)

        def timed(*args, **kwargs):
            t = time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.cpu[phase] += time.thread_time() - t
                self.calls[phase] += 1

        setattr(obj, attr, timed)

    def clear(self) -> None:
        self.cpu.clear()
        self.calls.clear()


def instrument(engine: Engine, phases: Phases) -> dict:
    """Wrap the manager's phases; returns the switch for the profiled window of the forward."""
    processor = engine._manager.batch_processor
    runner = processor.model_runner
    phases.wrap(processor, "prepare_next_batch", "schedule")
    phases.wrap(processor, "update_batch", "update")
    phases.wrap(engine._model, "forward", "forward")
    phases.wrap(runner, "_sample", "sampler")
    processors = runner.logit_processor
    inner_call = type(processors).__call__

    def call(ids, scores, args):
        t = time.thread_time()
        try:
            return inner_call(processors, ids, scores, args)
        finally:
            phases.cpu["logits_processors"] += time.thread_time() - t
            phases.calls["logits_processors"] += 1

    runner.logit_processor = _Calls(processors, call)  # `processors(...)` calls the class's __call__
    window = {"steps": 0, "profile": None, "ops": None}
    step = processor._generation_step

    def profiled_step(model):
        if window["steps"] > 0:
            window["steps"] -= 1
            if window["profile"] is None:
                window["profile"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                window["profile"].__enter__()
            elif window["steps"] == 0:
                window["profile"].__exit__(None, None, None)
                window["ops"] = window["profile"].key_averages()
        return step(model)

    processor._generation_step = profiled_step
    return window


class _Calls:
    """The manager's processor list with its call timed, everything else its own."""

    def __init__(self, inner, call) -> None:
        self._inner, self._call = inner, call

    def __call__(self, ids, scores, args):
        return self._call(ids, scores, args)

    def __getattr__(self, name):
        return getattr(self._inner, name)


async def one(engine: Engine, ids: list[int], tokens: int) -> int:
    params = SamplingParams(
        max_tokens=tokens, temperature=0.0, top_p=1.0, stop=(), seed=None, ignore_eos=True
    )
    generation = await engine.start(ids, params, tokens)
    count = 0
    async with generation:
        async for delta in generation:
            count = delta.completion_tokens
    return count


async def run(engine: Engine, phases: Phases, window: dict, streams: int, tokens: int) -> dict:
    prompts = [list(range(1000 + 40 * i, 1000 + 40 * i + PROMPT_TOKENS)) for i in range(streams)]
    await one(engine, prompts[0], 4)  # warm: the first step's lazy set-up is not decode
    phases.clear()
    loop_cpu, t = time.thread_time(), time.perf_counter()
    counts = await asyncio.gather(*(one(engine, ids, tokens) for ids in prompts))
    wall, loop_cpu = time.perf_counter() - t, time.thread_time() - loop_cpu
    steps = phases.calls["forward"]
    per_step = {k: 1000 * v / steps for k, v in phases.cpu.items()}
    per_step["event_loop"] = 1000 * loop_cpu / steps
    window.update(steps=12, profile=None, ops=None)  # then a profiled window, for the forward's shares
    await asyncio.gather(*(one(engine, ids, 14) for ids in prompts))
    return {
        "streams": streams,
        "tokens": sum(counts),
        "steps": steps,
        "wall_s": wall,
        "cpu_ms_per_step": per_step,
        "forward_shares": forward_shares(window["ops"], per_step["forward"]),
    }


def forward_shares(ops, forward_ms: float) -> dict:
    """Each category's share of the profiled window's op time (the step's, processors included)."""
    if ops is None:
        return {}
    spent: dict[str, float] = collections.defaultdict(float)
    for op in ops:
        spent[OPS.get(op.key, "other_ops")] += op.self_cpu_time_total
    total_ops = sum(spent.values())  # the step's other ops (processors, sampler) are a few % of it
    shares = {k: v / total_ops for k, v in spent.items()}
    return {k: round(v, 3) for k, v in shares.items()} | {"forward_ms_unprofiled": round(forward_ms, 2)}


def table(runs: list[dict], threads: int) -> str:
    rows = [
        ("schedule", "schedule: scheduler, input tensors, processors' arguments"),
        ("forward", "model forward"),
        ("logits_processors", "logits processors (Shape, Draw: temperature, top-p, the draw)"),
        (
            "sampler",
            "transformers' sampler (softmax + multinomial; argmax since the draw step owns sampling)",
        ),
        ("update", "update: request states, outputs to the event loop"),
        ("event_loop", "event loop: deltas, detokenisation (other thread)"),
    ]
    head = "| CPU ms per decode step, SmolLM2-135M fp32, " + f"{threads} torch thread(s) | "
    head += " | ".join(f"{r['streams']} stream(s)" for r in runs) + " |"
    lines = [head, "|---|" + "---|" * len(runs)]
    for key, label in rows:
        cells = []
        for r in runs:
            ms = r["cpu_ms_per_step"].get(key, 0.0)
            total = sum(v for k, v in r["cpu_ms_per_step"].items() if k != "event_loop")
            cells.append(f"{ms:.2f} ({100 * ms / total:.1f} %)" if key != "event_loop" else f"{ms:.2f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for cat in ("matmul", "attention", "kv_cache", "other_ops"):
        cells = [f"{100 * r['forward_shares'].get(cat, 0.0):.0f} %" for r in runs]
        lines.append(f"| share of the step's profiled op time: {cat} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "decode_profile.json")
    ap.add_argument("--home", type=Path, default=Path("~/.cache/stoker-bench").expanduser())
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    snapshot = Path(import_builtin_snapshot(args.home)["path"])
    engine = Engine(
        EngineConfig(snapshot, "smollm2", max_num_seqs=max(8, *args.streams)), EngineMetrics("smollm2")
    )
    engine.load()
    phases = Phases()
    window = instrument(engine, phases)
    t0 = time.perf_counter()

    async def all_runs() -> list[dict]:
        return [await run(engine, phases, window, s, args.tokens) for s in args.streams]

    try:
        runs = asyncio.run(all_runs())
    finally:
        engine.shutdown()
    md = table(runs, args.threads)
    results = {
        "machine": machine_info(("torch", "transformers")),
        "command": " ".join(sys.argv),
        "runs": runs,
    }
    write_results(args.out, {**results, "elapsed_s": time.perf_counter() - t0}, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
