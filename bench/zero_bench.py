"""From zero to the first token, side by side in one interleaved run: Stoker's cold process start,
Stoker through a warm runtime, Stoker's wake from SLEEPING, and Ray Serve 2.60 from zero replicas.

    python bench/zero_bench.py [--quick] [--rounds N] [--warm-runtime] [--no-ray] [--out FILE]

Same model (the SmolLM2 snapshot, `stoker snapshot import --builtin smollm2`), same streaming
client (scale_bench.stream_chat: a ~20-token chat message with a fresh opening each time,
`max_tokens` 16, temperature 0, `stream: true`), timed from the request sent to its first content
chunk (TTFT). Every kind is measured from a settled state: nothing of this benchmark starting,
stopping or importing in the background when a request goes out (`settle`). Each platform has a data
dir of its own under `--home` (default ~/.cache/stoker-bench/zero: its own copy of the snapshot,
which other benchmarks' engines do not map).

    cold       `stoker up --stable-window 1 --warm-runtimes 0`, deployment `zero-cold`
               (`--idle-timeout 3`): a request at zero instances starts a fresh engine process
               (imports, weights, warm-up)
    runtime    (`--warm-runtime`) a second `stoker up ... --warm-runtimes 1` (its own data dir, the
               same snapshot store), deployment `zero-rt` (`--idle-timeout 3`): the start is handed
               to an engine process that imported ahead; the runtime is refilled before each request
    wake       a third `stoker up` with its own copy of the snapshot, deployment `zero-sleep`
               (`--idle-timeout 600`): the predictive policy puts its idle instance to sleep
               (level 1); the request wakes it
    ray        Ray Serve 2.60 in its own virtualenv (.venv-ray, `make .venv-ray`), bench/ray_serve_app.py:
               `min_replicas=0`, `initial_replicas=0`, `upscale_delay_s=0`, `metrics_interval_s=0.5`,
               `look_back_period_s=1`, `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`; the replica loads the
               same snapshot with transformers and streams each token
    imports    the floor a fresh process pays: `python -c "import torch, transformers"` (Stoker's
               venv), timed per round as the issue's goal for the warm runtime compares with it

Each round measures every kind twice: page cache warm, then page cache dropped for the snapshot's
files (`snapshots.pagecache.drop`: fsync, then `posix_fadvise(DONTNEED)` per file, the snapshot
only, so the interpreters' own files stay cached for every kind alike; the residency left is
recorded with `mincore`). Ray's replica loads the very same files, so the same drop applies to it.
The order of the kinds rotates from round to round. Reported: medians per kind and cache state,
and the ratios Ray / each Stoker kind (goal: Ray / runtime ≥ 3 from zero) and runtime / imports
(goal: ≤ 0.5). JSON to bench/results/zero.json, the table beside it (`.md`) and on stdout.
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
from scale_bench import InstanceWatch, StokerUp, stream_chat

sys.path.insert(0, str(REPO))
from snapshots import pagecache

RAY_PY = REPO / ".venv-ray" / "bin" / "python"
RAY_APP = REPO / "bench" / "ray_serve_app.py"
SNAPSHOT = "smollm2"
COLD, RUNTIME, SLEEP = "zero-cold", "zero-rt", "zero-sleep"
KINDS = ("cold", "runtime", "wake", "ray")
CACHES = ("warm", "dropped")
SETTLE_S = 180.0


# ---- the platforms -----------------------------------------------------------------------------------


def start_platform(procs: Processes, env: dict, log: Path, extra: tuple[str, ...]) -> StokerUp:
    up = StokerUp(procs, env, log)
    cmd = [*stoker_command(), "up", "--host", HOST, "--port", str(up.port), "--stable-window", "1"]
    cmd += ["--log-level", "info", *extra]
    with log.open("ab") as out:
        up.proc = procs.spawn(cmd, env=up.env, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if up.proc.poll() is not None:
            raise RuntimeError(f"stoker up exited with {up.proc.returncode}:\n{up.log_tail()}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(up.base + "/healthz", timeout=2).status_code == 200:
                return up
        time.sleep(0.1)
    raise RuntimeError(f"stoker up not healthy within 120 s:\n{up.log_tail()}")


def has_warm_runtimes() -> bool:
    out = subprocess.run([*stoker_command(), "up", "--help"], capture_output=True, text=True, timeout=120)
    return "--warm-runtimes" in out.stdout


def states(up: StokerUp, name: str) -> dict[str, int]:
    data = json.loads(up.cli("ls", "--json").stdout)
    return next((d["instances"] for d in data if d["name"] == name), {})


def wait_state(up: StokerUp, name: str, ok, what: str, timeout: float = SETTLE_S) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if ok(states(up, name)):
            return time.monotonic() - t0
        time.sleep(0.3)
    raise RuntimeError(f"{name}: not {what} within {timeout:.0f} s: {states(up, name)}")


def at_zero(s: dict) -> bool:
    return not any(s.values())


def asleep(s: dict) -> bool:
    return s.get("SLEEPING", 0) == 1 and not any(v for k, v in s.items() if k != "SLEEPING")


def runtimes_ready(up: StokerUp) -> bool:
    """The platform's warm runtimes are all up (imports done): from its /metrics."""
    text = httpx.get(up.base + "/metrics", timeout=10).text
    ready = 0.0
    for line in text.splitlines():
        if line.startswith('stoker_warm_runtimes{engine="cpu"}'):
            ready += float(line.rsplit(" ", 1)[1])
    return ready >= 1


def wait_runtimes(up: StokerUp, timeout: float = SETTLE_S) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        with contextlib.suppress(httpx.HTTPError):
            if runtimes_ready(up):
                return time.monotonic() - t0
        time.sleep(0.3)
    raise RuntimeError(f"warm runtimes not ready within {timeout:.0f} s")


# ---- Ray Serve ---------------------------------------------------------------------------------------


class RayServe:
    """bench/ray_serve_app.py in .venv-ray, driven over its stdin/stdout control lines."""

    def __init__(self, procs: Processes, snapshot: Path, log: Path) -> None:
        self.port = free_port()
        self.base = f"http://{HOST}:{self.port}"
        env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
        env.pop("VIRTUAL_ENV", None)
        cmd = [str(RAY_PY), str(RAY_APP), "--snapshot", str(snapshot), "--port", str(self.port)]
        self.command = shlex.join(cmd)
        self.proc = procs.spawn(
            cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("ab"), text=True
        )
        self.procs = procs
        line = self.proc.stdout.readline().strip()  # blocks until READY or exit
        if line != "READY":
            raise RuntimeError(f"Ray Serve did not come up ({line!r}): see {log}")

    def replicas(self) -> int:
        self.proc.stdin.write("replicas\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def wait_zero(self, timeout: float = SETTLE_S) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.replicas() == 0:
                return time.monotonic() - t0
            time.sleep(0.3)
        raise RuntimeError(f"Ray Serve did not scale to zero within {timeout:.0f} s")

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        self.procs.stop(self.proc, timeout=30)


# ---- one measurement ---------------------------------------------------------------------------------


def import_floor() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, transformers"], check=True, timeout=300)
    return time.perf_counter() - t0


async def request(base: str, model: str) -> dict:
    async with httpx.AsyncClient(base_url=base, timeout=600.0) as client:
        return (await stream_chat(client, model=model)).summary()


def drop(snapshot: Path) -> float:
    pagecache.drop(snapshot)
    return pagecache.residency(snapshot)


def settle(ctx: dict) -> None:
    """Every kind at rest: no instance of the cold or runtime deployments, the runtimes refilled, the
    sleeping instance asleep, Ray at zero replicas (a replica still stopping holds the snapshot's
    pages mapped, and they could not be dropped)."""
    wait_state(ctx["up"], COLD, at_zero, "at zero")
    if "rt" in ctx:
        wait_state(ctx["rt"], RUNTIME, at_zero, "at zero")
        wait_runtimes(ctx["rt"])
    if "wake" in ctx:
        wait_state(ctx["wake"], SLEEP, asleep, "asleep")
    if "ray" in ctx:
        ctx["ray"].wait_zero()


def measure(kind: str, cache: str, ctx: dict) -> dict:
    """Settle everything, drop the page cache if asked, send one streamed request."""
    settle(ctx)
    snapshot: Path = ctx["snapshot"]
    if kind == "ray":
        base, model = ctx["ray"].base, SNAPSHOT
    elif kind == "cold":
        base, model = ctx["up"].base, COLD
    elif kind == "wake":
        base, model = ctx["wake"].base, SLEEP
        snapshot = ctx["wake_snapshot"]  # its own copy, mapped by the sleeping instance
    else:
        base, model = ctx["rt"].base, RUNTIME
    resident = drop(snapshot) if cache == "dropped" else pagecache.residency(snapshot)
    got = asyncio.run(request(base, model))
    got["snapshot_resident"] = resident
    if kind != "ray" and got["cold_start_header"] != "true":
        raise RuntimeError(f"{kind}: the request was not a cold start (x-stoker-cold-start missing)")
    return got


# ---- the run -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 round instead of 5 (while developing)")
    ap.add_argument("--rounds", type=int, help="rounds (each: every kind, cache warm and dropped)")
    ap.add_argument("--warm-runtime", action="store_true", help="add the warm-runtime column")
    ap.add_argument("--no-ray", action="store_true", help="leave Ray Serve out")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "zero.json")
    # A home of its own, its own copy of the snapshot: an engine of another benchmark mapping the
    # shared bench home's copy would keep its pages cached whatever this one drops.
    ap.add_argument("--home", type=Path, default=Path("~/.cache/stoker-bench/zero").expanduser())
    args = ap.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 5)
    kinds = [k for k in KINDS if (k != "runtime" or args.warm_runtime) and (k != "ray" or not args.no_ray)]
    if "runtime" in kinds and not has_warm_runtimes():
        raise SystemExit("this Stoker has no `stoker up --warm-runtimes`: run without --warm-runtime")
    if "ray" in kinds and not RAY_PY.exists():
        raise SystemExit(f"{RAY_PY} is missing: run `make .venv-ray` (or pass --no-ray)")

    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    env = {**os.environ, "STOKER_HOME": str(args.home)}
    args.home.mkdir(parents=True, exist_ok=True)
    procs = Processes(stop_all_timeout=60.0)
    homes = (args.home, args.home / "zero-wake-home", args.home / "zero-rt-home")
    watches = [InstanceWatch(h) for h in homes]
    t_start = time.perf_counter()
    results: dict = {
        "machine": machine_info(("torch", "transformers")),
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv),
        "rounds": rounds,
        "kinds": kinds,
        "page_cache_drop": "snapshots.pagecache.drop: fsync + posix_fadvise(DONTNEED) on each snapshot file",
    }
    samples: dict[str, dict[str, list[dict]]] = {k: {c: [] for c in CACHES} for k in kinds}
    floors: list[float] = []
    ctx: dict = {}
    logs = Path(tempfile.mkdtemp(prefix="zero-bench-logs-", dir=args.home))  # kept if the run fails
    ok = False
    try:
        say("importing the builtin snapshot (the first time converts the GGUF, ~1 min)")
        record = run_json([*stoker_command(), "snapshot", "import", "--builtin", SNAPSHOT, "--json"], env)
        ctx["snapshot"] = snapshot = Path(record["path"])
        results["snapshot"] = {"id": record.get("id"), "path": str(snapshot)}
        snap_id = record["id"]
        # Each platform has a data dir of its own (a platform adopts or stops the engines its data dir
        # records). The cold column is a fresh process: no warm runtime on its platform (where the
        # flag exists). The runtime platform shares the snapshot store; the sleeping instance's
        # platform has its own copy of the snapshot, as the instance keeps its copy's pages mapped
        # and a mapped page cannot be dropped: the others' "dropped" rounds drop theirs.
        plain = ("--warm-runtimes", "0") if has_warm_runtimes() else ()
        ctx["up"] = up = start_platform(procs, env, logs / "up.log", plain)
        up.cli("deploy", COLD, "--model", snap_id, "--min-warm", "0", "--idle-timeout", "3")
        if "wake" in kinds:
            wake_env = {**env, "STOKER_HOME": str(args.home / "zero-wake-home")}
            say("the sleeping instance's own copy of the snapshot (converted once)")
            wake_record = run_json(
                [*stoker_command(), "snapshot", "import", "--builtin", SNAPSHOT, "--json"], wake_env
            )
            ctx["wake_snapshot"] = Path(wake_record["path"])
            ctx["wake"] = wk = start_platform(procs, wake_env, logs / "up-wake.log", plain)
            wk.cli("deploy", SLEEP, "--model", wake_record["id"], "--min-warm", "0", "--idle-timeout", "600")
            asyncio.run(request(wk.base, SLEEP))  # its first start: from here on it sleeps and wakes
        if "runtime" in kinds:
            rt_env = {
                **env,
                "STOKER_HOME": str(args.home / "zero-rt-home"),
                "STOKER_SNAPSHOT_STORE": str(snapshot.parent),
            }
            ctx["rt"] = rt = start_platform(procs, rt_env, logs / "up-rt.log", ("--warm-runtimes", "1"))
            rt.cli("deploy", RUNTIME, "--model", snap_id, "--min-warm", "0", "--idle-timeout", "3")
        if "ray" in kinds:
            say("starting Ray Serve (its own virtualenv)")
            ctx["ray"] = RayServe(procs, snapshot, logs / "ray.log")
            results["ray_command"] = ctx["ray"].command
        for r in range(rounds):
            floors.append(import_floor())
            order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]
            for cache in CACHES:
                for kind in order:
                    got = measure(kind, cache, ctx)
                    for watch in watches:
                        watch.scan()
                    samples[kind][cache].append(got)
                    say(f"round {r + 1}/{rounds} {cache:>7} {kind:>7}: TTFT {got['ttft_s']:.2f} s")
            say(f"round {r + 1}: import torch, transformers {floors[-1]:.2f} s")
        ok = True
    except KeyboardInterrupt:
        say("interrupted; stopping every process started")
        return 130
    except Exception:
        for name in ("up", "wake", "rt"):
            if name in ctx and (tail := ctx[name].log_tail()):
                print(f"--- stoker up ({name}) log (tail) ---\n{tail}", file=sys.stderr)
        raise
    finally:
        if "ray" in ctx:
            ctx["ray"].stop()
        for name in ("up", "wake", "rt"):
            if name in ctx:
                with contextlib.suppress(Exception):
                    ctx[name].stop()
        procs.stop_all()
        for watch in watches:
            watch.scan()
            watch.kill_leftovers()
        if ok:
            shutil.rmtree(logs, ignore_errors=True)
        else:
            say(f"logs kept in {logs}")

    results["samples"] = samples
    results["import_floor_s"] = {"median": med(floors), "samples": floors}
    results["median_ttft_s"] = {
        k: {c: med([s["ttft_s"] for s in samples[k][c]]) for c in CACHES} for k in kinds
    }
    m = results["median_ttft_s"]
    results["ratios"] = {
        c: {
            **{f"ray_over_{k}": ratio(m["ray"][c], m[k][c]) for k in kinds if "ray" in m and k != "ray"},
            **({"runtime_over_imports": ratio(m["runtime"][c], med(floors))} if "runtime" in m else {}),
        }
        for c in CACHES
    }
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["elapsed_s"] = time.perf_counter() - t_start
    write_results(args.out, results, table(results))
    return 0


NAMES = {
    "cold": "Stoker, cold process start",
    "runtime": "Stoker, through a warm runtime",
    "wake": "Stoker, wake from SLEEPING",
    "ray": "Ray Serve 2.60, zero replicas",
}


def table(res: dict) -> str:
    m, rt = res["median_ttft_s"], res["ratios"]
    rows = [
        "| from zero → first token (SmolLM2, CPU) | page cache warm | dropped (resident after the drop) | Ray ÷ this (warm / dropped) |"
    ]
    rows.append("|---|---|---|---|")
    for k in res["kinds"]:
        vs = (
            "–" if k == "ray" or "ray" not in m else " / ".join(fmt_x(rt[c][f"ray_over_{k}"]) for c in CACHES)
        )
        left = med([x["snapshot_resident"] for x in res["samples"][k]["dropped"]])
        dropped = f"{fmt_s(m[k]['dropped'])} ({left:.0%})" if left is not None else "–"
        rows.append(f"| {NAMES[k]} | {fmt_s(m[k]['warm'])} | {dropped} | {vs} |")
    floor = res["import_floor_s"]["median"]
    rows.append(f'| `python -c "import torch, transformers"` (the floor) | {fmt_s(floor)} | – | – |')
    rows.append("")
    notes = [f"Median of {res['rounds']} interleaved round(s), one request per kind and cache state each"]
    if "runtime" in m:
        goal3 = (rt["warm"].get("ray_over_runtime") or 0) >= 3
        half = (rt["warm"].get("runtime_over_imports") or 9) <= 0.5
        notes.append(
            f"goals: Ray ÷ runtime ≥ 3× {'met' if goal3 else 'not met'}; runtime ≤ ½ of the import floor "
            f"{'met' if half else 'not met'} ({fmt_x(rt['warm'].get('runtime_over_imports'))})"
        )
    else:
        notes.append("the warm-runtime column was not run (`--warm-runtime`)")
    notes.append(
        f"load average at start {res['machine']['loadavg_start'][0]:.2f}, end {res['machine']['loadavg_end'][0]:.2f}"
    )
    rows.append("; ".join(notes) + ".")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
