"""Prefix affinity against least-outstanding on vLLM's CPU build: the same traffic, one run.

    python bench/affinity_bench.py [--instances 2] [--prompts 4] [--questions 16] [--concurrency 8]
                                   [--kv-blocks N] [--seeds 14,18] [--out bench/results/affinity.json]
    python bench/affinity_bench.py --instances 3 --prompts 3 --seeds 14,11 --out bench/results/affinity.3x3.json

`--instances` vLLM servers (`.venv-vllm/bin/vllm serve`, launched as the pool launches vLLM's CPU
build: `warm_pool.launch.vllm_spec`, through `engines_bench.Server`) on the embedded SmolLM2-135M
snapshot, with `--enforce-eager` (no torch.compile: a start takes ~35 s instead of ~90 s, and
what is measured here, the prefix cache, is the same), vLLM V1's prefix caching (on by default)
and dev mode (for `POST /reset_prefix_cache`). In front of them, a real `Activator` whose
`InstanceSource` is the static list of servers; the requests go through `Activator.serve` in this
process, as the gateway calls it.

A workload: `--prompts` long system prompts (seeded pseudo-English, `--system-blocks` of vLLM's
128-token KV blocks each, counted with the snapshot's tokenizer) × `--questions` short user
questions each, every request a distinct (system, question) pair, in one seeded shuffled order, at
`--concurrency`, `max_tokens` 4. Each workload (one per seed) is replayed twice: least-outstanding,
then prefix mode (`Balance("prefix", --bound)`); before each replay every server's prefix cache is
reset, and its counters `vllm:prefix_cache_hits_total` and `vllm:prefix_cache_queries_total`
(tokens) are read before and after: hit rate = Δhits / Δqueries over all servers. The default
seeds: 14 (the issue's number), whose 4 prompts the ring splits 3/1 between the 2 instances, the
commonest case (probability 1/2); and 18, the first seed of 10-19 that splits 2/2 (probability
3/8): the best case for affinity. On 3 instances with 3 prompts, seed 11 is the first of 10-19
whose prompts the ring sends one to each instance.

Each server's KV cache is `--kv-blocks` blocks (`--num-gpu-blocks-override`), by default its share
of the prompts (prompts / instances × system blocks) plus one block for each request it runs.
Prefix affinity pays when the prompts' working set overflows one instance's cache but fits in the
fleet's: least-outstanding makes every instance cache every prompt, affinity only its share. With
a cache that holds every prompt both modes hit alike. And with n instances affinity's gain is at
most about n×: it hits on every request only if each instance's cache holds its share, 1/n of the
prompts; the same cache under least-outstanding, sent every prompt in random order, still holds
the 1/n most recently used (LRU), so a request finds its prompt there at least 1/n of the time.
On 2 instances, then, at most 2×, less affinity's own misses: the first request of each prompt,
and requests the bound sends away from their instance (which also push its prompts out there).

The bound: every grant's capacity is ceil(bound × (outstanding + 1) / instances) ≤ ceil(bound ×
concurrency / instances); the activator's outstanding count per instance is sampled every 2 ms and
its maximum reported against that figure. Also reported: requests per instance and per prompt.
Results: bench/results/affinity.json (and `.md`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
from common import (
    HOST,
    REPO,
    Processes,
    import_builtin_snapshot,
    machine_info,
    ratio,
    say,
    write_results,
)
from engines_bench import MODEL, VLLM, Server
from prometheus_client import CollectorRegistry

from activator import Activator, ActivatorConfig, ActivatorMetrics, Balance
from activator.affinity import request_key
from activator.balancer import pick_by_prefix
from warm_pool.launch import vllm_spec

BENCH_HOME = Path.home() / ".cache" / "stoker-bench"
BLOCK = 128  # vLLM's KV block on CPU, in tokens (its /metrics: vllm:cache_config_info block_size)
MODES = ("least-outstanding", "prefix")
WORDS = (
    "account billing customer invoice payment refund policy support ticket order shipment "
    "warehouse delivery address contract renewal discount tax receipt balance credit debit "
    "transfer schedule report quarter revenue forecast budget audit compliance security access "
    "password login profile setting notification email message reply escalate manager team "
    "review approve reject pending complete cancel update record history detail summary answer "
    "clearly politely briefly always never only when if then because therefore however also"
).split()


@dataclass(frozen=True)
class Ep:
    id: str
    url: str
    max_concurrency: int
    auth_headers: dict = field(default_factory=dict)


@dataclass
class StaticSource:
    """The activator's view of a fixed set of servers: no pool, nothing to start."""

    eps: list[Ep]

    def endpoints(self) -> list[Ep]:
        return self.eps

    def poke(self) -> None: ...
    def report_failure(self, endpoint_id: str) -> None: ...
    def report_unhealthy(self, endpoint_id: str, reason: str) -> None: ...
    def request_arrived(self) -> None: ...
    def request_finished(self, service_s: float | None, cold_on: str | None) -> None: ...


# ---- the workload ------------------------------------------------------------------------------------


def system_prompts(count: int, blocks: int, tokenizer_json: Path, seed: int) -> list[str]:
    """`count` system prompts of pseudo-English, each as long as `blocks` KV blocks once laid out
    by the chat template (ChatML's header takes a few tokens), plus a few tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        words = [f"You are assistant {i} of the company's service desk."]
        while len(tok.encode(" ".join(words)).ids) < blocks * BLOCK:
            sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14)))
            words.append(sentence.capitalize() + ".")
        prompts.append(" ".join(words))
    return prompts


def workload(prompts: list[str], questions: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    bodies = []
    for p, system in enumerate(prompts):
        for q in range(questions):
            a, b = rng.randint(2, 999), rng.randint(2, 999)
            user = f"Customer {p}-{q} asks: what is {a} plus {b}, and when is my invoice {a * b} due?"
            bodies.append(
                {
                    "model": MODEL,
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
                    "max_tokens": 4,
                    "temperature": 0,
                }
            )
    rng.shuffle(bodies)
    return bodies


# ---- one request through the activator ---------------------------------------------------------------


SCOPE = {
    "type": "http",
    "method": "POST",
    "path": "/v1/chat/completions",
    "query_string": b"",
    "headers": [(b"content-type", b"application/json")],
}


async def through(activator: Activator, body: dict) -> tuple[int, str, dict]:
    """POST `body` through `activator.serve` as the gateway does: status, instance, answer."""
    got: dict = {"status": 0, "headers": {}, "body": b""}
    never = asyncio.Event()

    async def receive() -> dict:
        await never.wait()  # the client never leaves
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            got["status"], got["headers"] = message["status"], dict(message["headers"])
        else:
            got["body"] += message.get("body", b"")

    await activator.serve(dict(SCOPE), receive, send, json.dumps(body).encode(), False, "bench", parsed=body)
    instance = got["headers"].get(b"x-stoker-instance", b"").decode()
    return got["status"], instance, json.loads(got["body"] or b"{}")


# ---- vLLM's counters ---------------------------------------------------------------------------------


def counter(text: str, name: str) -> float:
    """The sum of a counter's samples over its labels in a Prometheus text page."""
    pattern = rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+(\S+)$"
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))


async def cache_counters(client: httpx.AsyncClient, servers: list[Server]) -> dict[str, dict[str, float]]:
    out = {}
    for i, server in enumerate(servers):
        text = (await client.get(f"{server.base}/metrics")).text
        out[f"i{i}"] = {
            "hits": counter(text, "vllm:prefix_cache_hits_total"),
            "queries": counter(text, "vllm:prefix_cache_queries_total"),
        }
    return out


async def reset_caches(client: httpx.AsyncClient, servers: list[Server]) -> None:
    for server in servers:
        r = await client.post(f"{server.base}/reset_prefix_cache")
        r.raise_for_status()


# ---- one replay --------------------------------------------------------------------------------------


async def replay(
    activator: Activator, bodies: list[dict], concurrency: int, eps: list[Ep]
) -> tuple[dict, list[dict]]:
    """Send every body through the activator, `concurrency` at a time; the per-instance peak of
    outstanding requests (sampled every 2 ms) and each request's outcome."""
    peak = dict.fromkeys((e.id for e in eps), 0)
    done = asyncio.Event()

    async def sample() -> None:
        while not done.is_set():
            for id_, n in activator.load().outstanding.items():
                peak[id_] = max(peak[id_], n)
            await asyncio.sleep(0.002)

    gate = asyncio.Semaphore(concurrency)
    results: list[dict] = []

    async def one(i: int, body: dict) -> None:
        async with gate:
            t0 = time.perf_counter()
            status, instance, answer = await through(activator, body)
            results.append(
                {
                    "i": i,
                    "status": status,
                    "instance": instance,
                    "seconds": time.perf_counter() - t0,
                    "prompt_tokens": answer.get("usage", {}).get("prompt_tokens"),
                    "cached_tokens": ((answer.get("usage") or {}).get("prompt_tokens_details") or {}).get(
                        "cached_tokens"
                    ),
                }
            )

    sampler = asyncio.ensure_future(sample())
    try:
        await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))
    finally:
        done.set()
        await sampler
    return peak, sorted(results, key=lambda r: r["i"])


def prompt_homes(eps: list[Ep], prompts: list[str], bodies: list[dict], bound: float) -> list[str]:
    """Where each system prompt's requests go while its instance is below the bound."""
    balance = Balance("prefix", bound=bound)
    firsts = [next(b for b in bodies if b["messages"][0]["content"] == p) for p in prompts]
    return [pick_by_prefix(eps, {}, request_key(b"", balance, body), bound).id for body in firsts]


async def one_workload(
    args: argparse.Namespace,
    seed: int,
    prompts: list[str],
    activator: Activator,
    client: httpx.AsyncClient,
    servers: list[Server],
    eps: list[Ep],
) -> dict:
    """Replay one workload in each mode, from reset caches: hit rates, requests, peaks."""
    bodies = workload(prompts, args.questions, seed)
    which = {p: k for k, p in enumerate(prompts)}
    limit = math.ceil(args.bound * args.concurrency / args.instances)
    homes = prompt_homes(eps, prompts, bodies, args.bound)
    say(f"workload seed {seed}: the ring sends the {len(prompts)} system prompts to {homes}")
    modes: dict[str, dict] = {}
    for mode in MODES:
        activator.set_balance(Balance(mode, bound=args.bound))  # prefix_chars: the default, 512
        await reset_caches(client, servers)
        before = await cache_counters(client, servers)
        t0 = time.perf_counter()
        peak, results = await replay(activator, bodies, args.concurrency, eps)
        wall = time.perf_counter() - t0
        after = await cache_counters(client, servers)
        for r in results:
            r["prompt"] = which[bodies[r["i"]]["messages"][0]["content"]]
        per = {k: {c: after[k][c] - before[k][c] for c in ("hits", "queries")} for k in after}
        hits = sum(v["hits"] for v in per.values())
        queries = sum(v["queries"] for v in per.values())
        counts = Counter(r["instance"] for r in results)
        spread = {
            p: dict(sorted(Counter(r["instance"] for r in results if r["prompt"] == p).items()))
            for p in range(len(prompts))
        }
        modes[mode] = {
            "hit_rate": ratio(hits, queries),
            "hits_tokens": hits,
            "queries_tokens": queries,
            "per_instance": {
                e.id: {**per[e.id], "requests": counts.get(e.id, 0), "peak_outstanding": peak[e.id]}
                for e in eps
            },
            "requests_by_prompt": spread,
            "max_share_over_mean": max(counts.values()) / (len(results) / args.instances),
            "peak_outstanding": max(peak.values()),
            "errors": sum(r["status"] != 200 for r in results),
            "wall_s": wall,
            "requests": results,
        }
        say(
            f"  {mode}: hit rate {modes[mode]['hit_rate']:.3f} ({hits:.0f}/{queries:.0f} tokens), "
            f"requests {dict(sorted(counts.items()))}, by prompt {spread}, "
            f"peak outstanding {peak} (bound {limit}), {wall:.0f} s"
        )
    lo, px = modes["least-outstanding"], modes["prefix"]
    hit_ratio = ratio(px["hit_rate"], lo["hit_rate"])
    prompt_tokens = [r["prompt_tokens"] for r in lo["requests"] if r["prompt_tokens"]]
    return {
        "seed": seed,
        "prompt_homes": homes,
        "requests_per_mode": len(bodies),
        "prompt_tokens_mean": sum(prompt_tokens) / len(prompt_tokens) if prompt_tokens else None,
        "modes": modes,
        "hit_rate_ratio": hit_ratio,
        "within_bound": px["peak_outstanding"] <= limit,
        "goal_met": bool(hit_ratio and hit_ratio >= 2.0 and px["peak_outstanding"] <= limit),
    }


async def run(args: argparse.Namespace, procs: Processes, work: Path) -> dict:
    snapshot = Path(import_builtin_snapshot(args.home)["path"])
    servers = []
    for i in range(args.instances):
        server = Server(procs, "vllm", snapshot, work / f"cache-{i}", work / f"vllm-{i}.log")
        server.spec = vllm_spec(  # as engines_bench launches it, with the prefix cache sized here
            snapshot,
            server.port,
            MODEL,
            [],
            host=HOST,
            dtype="float32",
            max_model_len=args.max_model_len,
            sleep_mode=False,
            cache_root=work / f"cache-{i}",
            vllm_command=(str(VLLM),),
            extra_args=(
                "--enforce-eager",
                "--num-gpu-blocks-override",
                str(args.kv_blocks),
                "--max-num-seqs",
                str(args.max_num_seqs),
                "--enable-prompt-tokens-details",  # each answer's usage says how many tokens hit
            ),
        )
        servers.append(server)
    say(f"starting {args.instances} vLLM servers ({args.kv_blocks} KV blocks of {BLOCK} tokens each)")
    t0 = time.perf_counter()
    for server in servers:
        server.spawn({**os.environ, "VLLM_SERVER_DEV_MODE": "1"})  # dev mode: /reset_prefix_cache
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=5.0)) as client:
        for server in servers:
            async with httpx.AsyncClient(base_url=server.base, timeout=5.0) as c:
                await server.wait_health(c, 600)
        started_s = time.perf_counter() - t0
        say(f"  healthy after {started_s:.0f} s")
        eps = [Ep(f"i{i}", s.base, args.max_num_seqs) for i, s in enumerate(servers)]
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
            metrics = ActivatorMetrics(CollectorRegistry())
            activator = Activator(MODEL, StaticSource(eps), ActivatorConfig(), session, metrics)
            workloads = []
            for seed in args.seeds:
                prompts = system_prompts(args.prompts, args.system_blocks, snapshot / "tokenizer.json", seed)
                workloads.append(await one_workload(args, seed, prompts, activator, client, servers, eps))
    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"},
        "block_tokens": BLOCK,
        "start_s": started_s,
        "bound_outstanding": math.ceil(args.bound * args.concurrency / args.instances),
        "workloads": workloads,
    }


def table(res: dict) -> str:
    cfg = res["config"]
    rows = [
        "| workload | ring's split of the prompts | balance | prefix-cache hit rate | hit / queried tokens | "
        "requests per instance | peak outstanding per instance | errors | wall |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for w in res["workloads"]:
        split = "/".join(str(n) for n in sorted(Counter(w["prompt_homes"]).values(), reverse=True))
        for mode in MODES:
            m = w["modes"][mode]
            per = m["per_instance"].values()
            rows.append(
                f"| seed {w['seed']} | {split} | {mode} | {m['hit_rate']:.1%} | "
                f"{m['hits_tokens']:.0f} / {m['queries_tokens']:.0f} | "
                f"{' / '.join(str(v['requests']) for v in per)} | "
                f"{' / '.join(str(v['peak_outstanding']) for v in per)} | {m['errors']} | {m['wall_s']:.0f} s |"
            )
    rows.append("")
    w0 = res["workloads"][0]
    rows.append(
        f"{cfg['instances']} vLLM CPU instances (SmolLM2-135M, `--enforce-eager`, {cfg['kv_blocks']} KV blocks "
        f"of {res['block_tokens']} tokens each), {cfg['prompts']} system prompts of {cfg['system_blocks']} "
        f"blocks × {cfg['questions']} questions = {w0['requests_per_mode']} requests per mode (mean prompt "
        f"{w0['prompt_tokens_mean']:.0f} tokens, max_tokens 4), concurrency {cfg['concurrency']}, bound "
        f"{cfg['bound']} (at most {res['bound_outstanding']} outstanding per instance)."
    )
    for w in res["workloads"]:
        goal = "met" if w["goal_met"] else "not met"
        rows.append(
            f"Seed {w['seed']}: prefix / least-outstanding hit rate {w['hit_rate_ratio']:.2f}×, "
            f"peak within the bound: {w['within_bound']}; goal (≥ 2× within the bound): {goal}."
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4, help="shared system prompts")
    ap.add_argument("--system-blocks", type=int, default=5, help="each system prompt's length, in KV blocks")
    ap.add_argument("--questions", type=int, default=16, help="user questions per system prompt")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--bound", type=float, default=1.25)
    ap.add_argument(
        "--kv-blocks",
        type=int,
        help="each server's KV cache, in blocks (default: the prompts' share of one instance, "
        "prompts / instances × system blocks, plus one block for each request it runs)",
    )
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=896)  # 7 blocks: a prompt is ~690 tokens
    ap.add_argument(
        "--seeds",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[14, 18],
        help="one workload per seed, each replayed in both modes (comma-separated)",
    )
    ap.add_argument("--home", type=Path, default=BENCH_HOME)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "affinity.json")
    args = ap.parse_args(argv)
    if args.kv_blocks is None:
        share = math.ceil(args.prompts / args.instances) * args.system_blocks
        args.kv_blocks = share + math.ceil(args.concurrency / args.instances)
    # vLLM refuses a cache that cannot hold one request of --max-model-len (plus its null block).
    args.kv_blocks = max(args.kv_blocks, math.ceil(args.max_model_len / BLOCK) + 1)
    if not VLLM.exists():
        raise SystemExit(f"{VLLM} is missing: run `make vllm`")
    started = time.perf_counter()
    procs = Processes()
    args.home.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="stoker-affinity-", dir=str(args.home)))
    try:
        results = asyncio.run(run(args, procs, work))
        results["machine"] = machine_info()
        results["elapsed_s"] = time.perf_counter() - started
        write_results(args.out, results, table(results))
    finally:
        procs.stop_all()
        with contextlib.suppress(OSError):
            for log in work.glob("*.log"):
                shutil.copy(log, Path(tempfile.gettempdir()) / f"affinity-{log.name}")
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
