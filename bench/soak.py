"""An hour of a real trace through the whole platform, with scale-to-zero churn, revision switches,
recycles, plain and streamed requests: every request classified, the platform's processes watched.

    python bench/soak.py [--minutes 60] [--trace code] [--keep-every 5] [--switch-every 10]
                         [--idle-timeout 10s] [--max-instance-age 30s] [--sample-every 30]
                         [--out bench/results/soak.json]

One `stoker up` on loopback with its defaults (the real CPU engine, one warm runtime, the 120 s
hold deadline), its own `STOKER_HOME` in a temporary directory. Two tiny random Llamas
(tests/conftest.py build_tiny_model, seeds 1 and 2: on 2 shared cores the 135M SmolLM2 serves
a few requests a second at best, where a trace's bursts ask for many more) are deployed in turn as
`soak` (`--max 2 --idle-timeout 10s --max-instance-age 30s`): every `--switch-every` minutes the
other model is deployed (a new revision; traffic moves to it once it is warm).

The load: an Azure LLM inference trace from ../shared/traces (beside the repository) (`code`: bursts separated by idle
gaps of 16 s to 3 min, so the deployment goes to zero between bursts with the 10 s idle timeout),
thinned to every `--keep-every`-th request and looped (the file covers 29 minutes; loop n starts
29 min × n after the first). Each request is sent at its own time (open loop: nothing waits for an
earlier answer), on its own connection, in turn a plain completion, a streamed completion, a plain
chat and a streamed chat (tests/platform/reliability_support.request_body), with `max_tokens` the
trace's GeneratedTokens capped at 32 (`ignore_eos`, so every answer is that long) and a prompt of
ContextTokens / 256 + 1 repetitions of a four-word phrase (capped at 16). An instance READY in
one burst longer than the maximum age is recycled (a replacement READY first, then it is drained).

Every request is classified by reliability_support.send, unchanged: complete, refused (a clean
429/503 with Retry-After, or an SSE error event), or lost (anything else, including no end within
`--bound` s). Every `--sample-every` seconds bench/soak_probe.py reads the process tree of
`stoker up`: process count, open fds, RSS and PSS of `stoker up` and of the whole tree; every 2 s
the admin API's instance counts (for the zero periods). Fitted per hour: a least-squares slope
over all samples and over those taken with no instance (none starting, READY, asleep or
draining: the platform at rest, where engines coming and going are not in the count). After the load, `stoker up` gets SIGTERM alone and
whatever of its tree or session outlives it is counted (`left_after_stop`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import datetime
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import soak_probe
from common import (
    HOST,
    REPO,
    Processes,
    _interrupt,
    free_port,
    machine_info,
    say,
    stoker_command,
    write_results,
)

sys.path.insert(0, str(REPO))
from tests.conftest import build_tiny_model
from tests.platform.reliability_support import COMPLETE, LOST, REFUSED, request_body, send

TRACES = REPO.parent / "shared" / "traces"  # the shared traces, beside the repository
TRACE_FILES = {
    "code": "azure-llm-code-2023-first29min.csv",
    "conv": "azure-llm-conv-2023-first29min.csv",
}
NAME = "soak"
PHRASE = "the quick brown fox "
MAX_TOKENS_CAP, PROMPT_REPEAT_CAP = 32, 16
LOOP_S = 29 * 60.0
GONE = ("STOPPED", "FAILED")  # states the admin API counts that hold no process
METRICS = (
    "procs",
    "session_procs",
    "fds_up",
    "fds_tree",
    "rss_up_mib",
    "pss_up_mib",
    "rss_tree_mib",
    "pss_tree_mib",
)


# ---- the trace ---------------------------------------------------------------------------------------


def schedule(path: Path, keep_every: int, seconds: float) -> list[tuple[float, int, int]]:
    """(send at, in seconds from the start; context tokens; generated tokens), every `keep_every`-th
    row of the trace, looped every LOOP_S until `seconds`."""
    rows = []
    with path.open() as f:
        for i, row in enumerate(csv.DictReader(f)):
            if i % keep_every == 0:
                at = datetime.datetime.fromisoformat(row["TIMESTAMP"][:26]).timestamp()
                rows.append((at, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
    t0 = rows[0][0]
    out, loop = [], 0
    while loop * LOOP_S < seconds:
        for at, ctx, gen in rows:
            t = at - t0 + loop * LOOP_S
            if t < seconds and at - t0 < LOOP_S:
                out.append((t, ctx, gen))
        loop += 1
    return out


def body_for(i: int, ctx: int, gen: int) -> tuple[str, dict, bool]:
    path, body, stream = request_body(i, NAME, min(max(gen, 1), MAX_TOKENS_CAP))
    prompt = PHRASE * min(ctx // 256 + 1, PROMPT_REPEAT_CAP)
    if "prompt" in body:
        body["prompt"] = prompt
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
    return path, body, stream


# ---- the platform ------------------------------------------------------------------------------------


class Platform:
    def __init__(self, procs: Processes, home: Path) -> None:
        self.port = free_port()
        self.base = f"http://{HOST}:{self.port}"
        self.env = {**os.environ, "STOKER_HOME": str(home), "STOKER_URL": self.base, "HF_HUB_OFFLINE": "1"}
        self.env.pop("STOKER_ADMIN_KEY", None)
        home.mkdir(parents=True, exist_ok=True)
        self.log = home / "up.log"
        self.command = [*stoker_command(), "up", "--host", HOST, "--port", str(self.port)]
        with self.log.open("ab") as out:
            self.proc = procs.spawn(
                self.command, env=self.env, stdin=subprocess.DEVNULL, stdout=out, stderr=out
            )
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"stoker up exited {self.proc.returncode}:\n{self.tail()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.base + "/healthz", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"stoker up not healthy within 180 s:\n{self.tail()}")

    def settle(self, timeout: float = 300.0) -> float:
        """Until its warm runtime has done its imports (`stoker_warm_runtimes`), so that the first
        sample is of the platform at rest and not of its start; seconds waited."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            with contextlib.suppress(httpx.HTTPError):
                if sum(self.metric("stoker_warm_runtimes").values()) >= 1:
                    return time.monotonic() - t0
            time.sleep(0.5)
        raise RuntimeError(f"no warm runtime ready within {timeout:.0f} s:\n{self.tail()}")

    def tail(self, chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-chars:]
        return ""

    async def cli(self, *args: str) -> tuple[int, str, float]:
        t0 = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *stoker_command(),
            *args,
            env=self.env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        text = (out if proc.returncode == 0 else err).decode(errors="replace").strip()
        return proc.returncode, text, time.monotonic() - t0

    def metric(self, name: str, **labels: str) -> dict[str, float]:
        """Every series of `name` with these labels: the label text -> value."""
        out = {}
        for line in httpx.get(self.base + "/metrics", timeout=30).text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                key, value = line.rsplit(" ", 1)
                out[key[len(name) :]] = float(value)
        return out

    def stop_alone(self, timeout: float = 90.0) -> dict:
        """SIGTERM to `stoker up` only, as a supervisor stops it: what of its tree outlived it."""
        members = {m for m in soak_probe.members(self.proc.pid) if m[0] != self.proc.pid}
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - t0
        time.sleep(2.0)  # children get their own SIGTERM from it; give them a moment past its exit
        left = soak_probe.alive(members)
        return {"exit_code": code, "stop_s": took, "tree_at_stop": len(members), "left_after_stop": left}


# ---- the run -----------------------------------------------------------------------------------------


class Soak:
    def __init__(self, up: Platform, args: argparse.Namespace, models: list[Path]) -> None:
        self.up, self.args, self.models = up, args, models
        self.t0 = 0.0
        self.outcomes: list[dict] = []
        self.samples: list[dict] = []
        self.switches: list[dict] = []
        self.instances: list[tuple[float, int]] = []
        self.revision = 0
        self.seen: set[tuple[int, int]] = set()  # every process met in the tree (soak_probe.sample)
        self.done = asyncio.Event()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def deploy_args(self, model: Path) -> list[str]:
        a = self.args
        return [
            "deploy",
            NAME,
            "--model",
            str(model),
            "--max",
            "2",
            "--idle-timeout",
            a.idle_timeout,
            "--max-instance-age",
            a.max_instance_age,
            "--json",
        ]

    async def one(self, client: httpx.AsyncClient, i: int, ctx: int, gen: int) -> None:
        path, body, stream = body_for(i, ctx, gen)
        at, revision = self.now(), self.revision
        o = await send(client, self.up.base, path, body, stream, self.args.bound)
        self.outcomes.append(
            {
                "i": i,
                "at_s": at,
                "seconds": o.seconds,
                "kind": o.kind,
                "stream": o.stream,
                "status": o.status,
                "reason": o.reason,
                "revision_at_send": revision,
                "max_tokens": body["max_tokens"],
            }
        )

    async def load(self, plan: list[tuple[float, int, int]]) -> None:
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.args.bound), limits=limits) as client:
            tasks = []
            for i, (at, ctx, gen) in enumerate(plan):
                await asyncio.sleep(max(0.0, at - self.now()))
                tasks.append(asyncio.create_task(self.one(client, i, ctx, gen)))
                if i % 500 == 0:
                    done = Counter(o["kind"] for o in self.outcomes)
                    say(f"{self.now() / 60:.1f} min: {i} of {len(plan)} sent; {dict(done)}")
            await asyncio.gather(*tasks)
        await asyncio.sleep(max(0.0, self.args.minutes * 60 - self.now()))  # the whole span sampled

    async def switcher(self) -> None:
        every = self.args.switch_every * 60
        while not self.done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.done.wait(), every - self.now() % every)
                return
            self.revision += 1
            model = self.models[self.revision % len(self.models)]
            at = self.now()
            code, text, took = await self.up.cli(*self.deploy_args(model))
            revision = json.loads(text).get("deployed", {}).get("revision") if code == 0 else None
            self.switches.append(
                {"at_s": at, "model": model.name, "rc": code, "seconds": took, "revision": revision}
            )
            say(f"switch {self.revision} to {model.name}: rc {code} in {took:.1f} s (revision {revision})")
            if code != 0:
                say(f"deploy failed: {text[-500:]}")

    async def sampler(self) -> None:
        next_at = 0.0
        async with httpx.AsyncClient(base_url=self.up.base, timeout=30) as client:
            while not self.done.is_set():
                running, states = None, None
                with contextlib.suppress(httpx.HTTPError, KeyError, StopIteration, ValueError):
                    data = (await client.get("/admin/v1/deployments")).json()["data"]
                    states = next(d for d in data if d["name"] == NAME)["instances"]
                    running = sum(n for state, n in states.items() if state not in GONE)
                    self.instances.append((self.now(), running))
                if self.now() >= next_at:
                    s = await asyncio.to_thread(soak_probe.sample, self.up.proc.pid, self.seen)
                    self.samples.append({"at_s": self.now(), "instances": running, "states": states, **s})
                    done = dict(Counter(o["kind"] for o in self.outcomes))
                    say(
                        f"{self.now() / 60:.1f} min: {done}; instances {running}, procs {s['procs']}, "
                        f"fds {s['fds_tree']}, rss {s['rss_tree_mib']:.0f} MiB, escaped {len(s['escaped'])}"
                    )
                    next_at += self.args.sample_every
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.done.wait(), 2.0)

    async def run(self, plan: list[tuple[float, int, int]]) -> None:
        code, text, _ = await self.up.cli(*self.deploy_args(self.models[0]))
        if code != 0:
            raise RuntimeError(f"first deploy failed: {text}")
        self.t0 = time.monotonic()
        side = [asyncio.create_task(self.switcher()), asyncio.create_task(self.sampler())]
        try:
            await self.load(plan)
        finally:
            self.done.set()
            await asyncio.gather(*side, return_exceptions=True)
        self.samples.append({"at_s": self.now(), **await asyncio.to_thread(self.final_sample)})

    def final_sample(self) -> dict:
        return {"instances": None, **soak_probe.sample(self.up.proc.pid, self.seen)}


# ---- the figures -------------------------------------------------------------------------------------


def zero_periods(instances: list[tuple[float, int]]) -> int:
    """How many times the deployment went from some instances to none (2 s polls)."""
    return sum(1 for (_, a), (_, b) in itertools.pairwise(instances) if a and not b)


def summarise(soak: Soak) -> dict:
    outcomes = soak.outcomes
    kinds = {k: sum(o["kind"] == k for o in outcomes) for k in (COMPLETE, REFUSED, LOST)}
    by_mode = {
        mode: {k: sum(o["kind"] == k and o["stream"] == s for o in outcomes) for k in kinds}
        for mode, s in (("plain", False), ("streamed", True))
    }
    reasons = Counter(f"{o['kind']}: {o['reason']}" for o in outcomes if o["kind"] != COMPLETE)
    done = sorted(o["seconds"] for o in outcomes if o["kind"] == COMPLETE)

    def pct(p: float) -> float | None:
        return done[min(len(done) - 1, round(p / 100 * (len(done) - 1)))] if done else None

    growth = {}
    for key in METRICS:
        rows = [(s["at_s"] / 3600, s[key]) for s in soak.samples]
        rest = [(s["at_s"] / 3600, s[key]) for s in soak.samples if s.get("instances") == 0]
        growth[key] = {
            "all": soak_probe.fit([h for h, _ in rows], [v for _, v in rows]),
            "at_zero": soak_probe.fit([h for h, _ in rest], [v for _, v in rest]),
        }
    return {
        "requests": len(outcomes),
        **kinds,
        "by_mode": by_mode,
        "non_complete_reasons": dict(reasons.most_common()),
        "complete_latency_p50_s": pct(50),
        "complete_latency_p99_s": pct(99),
        "zero_periods": zero_periods(soak.instances),
        "switches": len(soak.switches),
        "switches_failed": sum(s["rc"] != 0 for s in soak.switches),
        "samples": len(soak.samples),
        "failed_instances_max": max(
            (s["states"].get("FAILED", 0) for s in soak.samples if s.get("states")), default=0
        ),
        "escaped": sorted({pid for s in soak.samples for pid in s["escaped"]}),
        "processes_seen": len(soak.seen),
        "growth": growth,
    }


def _n(x, digits: int = 1) -> str:
    if x is None:
        return "–"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def table(res: dict) -> str:
    s = res["summary"]
    lines = [
        f"| {res['minutes']:g} min of `{res['trace']}` (every {res['keep_every']}th request) | plain | streamed | all |",
        "|---|---|---|---|",
    ]
    for k in (COMPLETE, REFUSED, LOST):
        lines.append(f"| {k} | {s['by_mode']['plain'][k]} | {s['by_mode']['streamed'][k]} | {s[k]} |")
    lines.append(
        f"| | | | zero periods {s['zero_periods']}, switches {s['switches']} "
        f"({s['switches_failed']} failed), recycles replaced {res['recycles'].get('replaced', 0):g} |"
    )
    for reason, n in s["non_complete_reasons"].items():
        lines.append(f"| {reason} | | | {n} |")
    lines += [
        "",
        "| sampled every ~30 s | first | last | min | max | slope / h (all) | ± se | slope / h (at zero) | ± se |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, g in s["growth"].items():
        a, z = g["all"], g["at_zero"]
        lines.append(
            f"| {key} | {_n(a.get('first'))} | {_n(a.get('last'))} | {_n(a.get('min'))} | {_n(a.get('max'))} "
            f"| {_n(a.get('slope_per_h'))} | {_n(a.get('slope_se_per_h'))} "
            f"| {_n(z.get('slope_per_h'))} | {_n(z.get('slope_se_per_h'))} |"
        )
    stop = res["stop"]
    lines.append(
        f"\nAfter SIGTERM to `stoker up` ({_n(stop['stop_s'])} s to exit, code {stop['exit_code']}): "
        f"{len(stop['left_after_stop'])} of its {stop['tree_at_stop']} processes still running. "
        f"Processes seen in its tree over the run: {s['processes_seen']}; "
        f"seen running outside it (re-parented) while it ran: {len(s['escaped'])}."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0, help="how long the trace is replayed")
    ap.add_argument("--trace", choices=sorted(TRACE_FILES), default="code")
    ap.add_argument("--keep-every", type=int, default=5, help="thin the trace: every k-th request")
    ap.add_argument("--switch-every", type=float, default=10.0, help="minutes between revision switches")
    ap.add_argument("--idle-timeout", default="10s")
    ap.add_argument("--max-instance-age", default="30s")
    ap.add_argument("--sample-every", type=float, default=30.0, help="seconds between process samples")
    ap.add_argument("--bound", type=float, default=300.0, help="seconds a request may take before it is lost")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "soak.json")
    args = ap.parse_args(argv)
    if args.minutes <= 0 or args.keep_every < 1 or args.switch_every <= 0 or args.sample_every <= 0:
        ap.error("--minutes, --switch-every and --sample-every must be > 0, --keep-every >= 1")
    signal.signal(signal.SIGTERM, _interrupt)
    plan = schedule(TRACES / TRACE_FILES[args.trace], args.keep_every, args.minutes * 60)
    say(f"{len(plan)} requests over {args.minutes:g} min")
    procs = Processes(stop_all_timeout=60.0)
    t0 = time.perf_counter()
    results: dict = {
        "machine": machine_info(("torch", "transformers"), mem_total=True),
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv),
        **{k: v for k, v in vars(args).items() if k != "out"},
        "planned_requests": len(plan),
    }
    try:
        with tempfile.TemporaryDirectory(prefix="stoker-soak-") as tmp:
            home = Path(tmp)
            models = [build_tiny_model(home / f"tiny-seed{seed}", seed=seed) for seed in (1, 2)]
            up = Platform(procs, home / "home")
            results["settle_s"] = up.settle()
            results["platform_command"] = shlex.join(up.command)
            soak = Soak(up, args, models)
            results["deploy"] = "stoker " + shlex.join(soak.deploy_args(Path("<model>"))[:-1])
            try:
                asyncio.run(soak.run(plan))
            finally:
                results["log_tail"] = up.tail(1500)
            results["recycles"] = up.metric("stoker_instance_recycles_total", deployment=NAME)
            results["stop"] = up.stop_alone()
            results["summary"] = summarise(soak)
            results["switches"] = soak.switches
            results["samples"] = soak.samples
            results["not_complete"] = [o for o in soak.outcomes if o["kind"] != COMPLETE]
            results["requests"] = {  # every request, compact: one row each
                "columns": ["at_s", "kind", "stream", "status", "seconds", "max_tokens"],
                "rows": [
                    [o["at_s"], o["kind"], int(o["stream"]), o["status"], o["seconds"], o["max_tokens"]]
                    for o in sorted(soak.outcomes, key=lambda o: o["i"])
                ],
            }
    finally:
        procs.stop_all()
    results["recycles"] = {
        re.search(r'outcome="([^"]*)"', k).group(1): v for k, v in results["recycles"].items()
    }
    results["elapsed_s"] = time.perf_counter() - t0
    write_results(args.out, results, table(results))
    return 0 if results["summary"][LOST] == 0 else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    print(json.dumps({"interrupted": True}), file=sys.stderr)
