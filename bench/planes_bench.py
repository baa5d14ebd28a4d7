"""The two planes, measured: the data plane's scale-out and the control plane's restart.

    python bench/planes_bench.py [--quick] [--out bench/results/planes.json]

**Scale-out.** Requests/s at concurrency 32 through 1, 2 and 4 `stoker gateway` processes, beside
the upstream called directly, in one run. The upstream is `proxy_bench`'s trivially fast one
(a fixed OpenAI completion, no model), so the figure is the gateways' own ceiling. The routing
table comes from a stand-in controller (this file, `StaticController`): one deployment, the
upstream as its one READY endpoint with 1024 slots; it answers the gateways' reports and nothing
else. The controller is off the request path, and a real one would need a real engine behind it,
whose own ceiling (a few requests/s on these cores) would hide the gateways'. Load is `wrk` with
the 32 connections split evenly over the gateways (one wrk per gateway, run at once; their req/s
summed). Rounds interleave the configurations; every figure is the median over rounds.

**Restart.** A real `stoker controller` with the embedded SmolLM2 snapshot (imported once into
`--home`, default `~/.cache/stoker-bench`, and shared as the snapshot store) deployed at
`--min-warm 1`, behind one real gateway. The controller is SIGKILLed and started again
on the same data dir: (a) as it is now, adopting the running engine; (b) as before adoption
existed, with its instance records removed first, so the restarted controller finds the engine
unrecorded, stops it, and cold-starts a new one (what `stoker up` did until now). Measured from
the restart: until the controller answers `/healthz`, until the deployment has a READY instance,
and until a request through the gateway is answered.

Needs `wrk` (apt-get install -y wrk). Writes JSON and a markdown table (`.md`) next to it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import common
import httpx
from common import HOST, free_port, machine_info, med, say, write_results
from proxy_bench import MODEL, lua_script, serve_upstream, wrk

ADMIN = secrets.token_urlsafe(16)
H = {"authorization": f"Bearer {ADMIN}"}


def serve_static_controller(port: str, upstream: str) -> None:
    """A controller stand-in: one deployment, the upstream its only endpoint."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    table = {
        "epoch": "bench",
        "version": 1,
        "gateways": 1,
        "deployments": {
            MODEL: {
                "snapshot_id": "0" * 64,
                "revision": "0" * 12,
                "unavailable": None,
                "endpoints": [{"id": "up-1", "url": upstream, "key": "k", "max_concurrency": 1024}],
            }
        },
        "keys": [],
    }

    async def routes(request):
        if request.query_params.get("epoch") == "bench":
            await _forever()
        return JSONResponse(table)

    async def load(request):
        await request.body()
        return JSONResponse({"version": 1})

    app = Starlette(
        routes=[Route("/cluster/v1/routes", routes), Route("/cluster/v1/load", load, methods=["POST"])]
    )
    uvicorn.run(app, host=HOST, port=int(port), log_level="warning", access_log=False)


async def _forever() -> None:
    import asyncio

    await asyncio.sleep(3600)


def spawn(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    out = log.open("wb")
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def spawn_py(fn: str, *args: str, log: Path) -> subprocess.Popen:
    """`fn(*args)` of this file in a process of its own (ports as strings)."""
    here = str(Path(__file__).parent)
    code = f"import sys; sys.path.insert(0, {here!r}); import planes_bench as b; b.{fn}(*sys.argv[1:])"
    return spawn([sys.executable, "-c", code, *args], log)


def run_upstream(port: str) -> None:
    serve_upstream(int(port))


def wait_http(url: str, timeout: float = 60, headers: dict | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url, timeout=1, headers=headers).status_code < 500:
                return
        time.sleep(0.05)
    raise TimeoutError(url)


def stop(p: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, sig)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def gateway_env() -> dict:
    return {**os.environ, "STOKER_ADMIN_KEY": ADMIN}


def scale_out(tmp: Path, rounds: int, duration_s: int) -> dict:
    procs: list[subprocess.Popen] = []
    try:
        up_port, ctl_port = free_port(), free_port()
        procs.append(spawn_py("run_upstream", str(up_port), log=tmp / "upstream.log"))
        upstream = f"http://{HOST}:{up_port}"
        procs.append(spawn_py("serve_static_controller", str(ctl_port), upstream, log=tmp / "ctl.log"))
        wait_http(f"http://{HOST}:{ctl_port}/cluster/v1/routes")
        wait_http(upstream + "/health")
        gateways = []
        for i in range(4):
            port = free_port()
            cmd = [*common.stoker_command(), "gateway", "--port", str(port), "--controller"]
            cmd += [f"http://{HOST}:{ctl_port}", "--gateway-id", f"g{i}", "--log-level", "warning"]
            procs.append(spawn(cmd, tmp / f"gw{i}.log", gateway_env()))
            gateways.append(f"http://{HOST}:{port}")
        for g in gateways:
            wait_http(g + "/healthz")
            deadline = time.monotonic() + 30
            while httpx.get(g + "/v1/models", headers=H).json()["data"] == [] and time.monotonic() < deadline:
                time.sleep(0.05)
        script = tmp / "plain.lua"
        script.write_text(lua_script(False, H))
        direct_script = tmp / "direct.lua"
        direct_script.write_text(lua_script(False, {}))
        configs = {
            "direct": [upstream],
            "1 gateway": gateways[:1],
            "2 gateways": gateways[:2],
            "4 gateways": gateways,
        }
        samples: dict[str, list[float]] = {k: [] for k in configs}
        errors: dict[str, int] = dict.fromkeys(configs, 0)
        for r in range(rounds):
            order = list(configs)[r % len(configs) :] + list(configs)[: r % len(configs)]
            for name in order:
                targets = configs[name]
                conc = 32 // len(targets)
                sc = direct_script if name == "direct" else script
                with ThreadPoolExecutor(len(targets)) as pool:  # one wrk per gateway, at once
                    results = list(
                        pool.map(lambda t, sc=sc, conc=conc: wrk(t, sc, conc, duration_s), targets)
                    )
                samples[name].append(sum(x["rps"] for x in results))
                errors[name] += sum(x["non_2xx"] + x["socket_errors"] for x in results)
                say(f"round {r + 1}: {name}: {samples[name][-1]:.0f} req/s")
        direct = med(samples["direct"])
        return {
            name: {
                "rps": med(xs),
                "ratio_to_direct": (med(xs) / direct) if direct else None,
                "samples": xs,
                "errors": errors[name],
            }
            for name, xs in samples.items()
        }
    finally:
        for p in procs:
            stop(p)


def restart(tmp: Path, store: Path, adopt: bool) -> dict:
    home = tmp / ("adopt" if adopt else "cold")
    home.mkdir(parents=True)
    env = {
        **gateway_env(),
        "STOKER_HOME": str(home),
        "STOKER_SNAPSHOT_STORE": str(store),
        "HF_HUB_OFFLINE": "1",
    }
    ctl_port, gw_port = free_port(), free_port()
    ctl_url, gw_url = f"http://{HOST}:{ctl_port}", f"http://{HOST}:{gw_port}"
    ctl_cmd = [*common.stoker_command(), "controller", "--port", str(ctl_port), "--log-level", "warning"]
    ctl_cmd.append("--stop-instances-on-exit")  # a SIGKILL leaves the engine; the final SIGTERM does not
    procs = [spawn(ctl_cmd, home / "ctl1.log", env)]
    try:
        wait_http(ctl_url + "/healthz")
        gw_cmd = [*common.stoker_command(), "gateway", "--port", str(gw_port), "--controller", ctl_url]
        procs.append(spawn([*gw_cmd, "--log-level", "warning"], home / "gw.log", env))
        wait_http(gw_url + "/healthz")
        subprocess.run(
            [*common.stoker_command(), "deploy", "smollm2", "--model", "smollm2", "--min-warm", "1"],
            env={**env, "STOKER_URL": gw_url},
            check=True,
            capture_output=True,
        )
        body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = httpx.post(gw_url + "/v1/chat/completions", json=body, headers=H, timeout=300)
        r.raise_for_status()
        stop(procs[0], signal.SIGKILL)
        if not adopt:
            shutil.rmtree(home / "instances")  # what a run before adoption had no use for
        t0 = time.monotonic()
        procs[0] = spawn(ctl_cmd, home / "ctl2.log", env)
        wait_http(ctl_url + "/healthz", timeout=120)
        healthy = time.monotonic() - t0
        while True:
            d = httpx.get(ctl_url + "/admin/v1/deployments/smollm2", headers=H, timeout=10).json()
            if d.get("instances", {}).get("READY", 0) >= 1:
                break
            time.sleep(0.02)
        ready = time.monotonic() - t0
        while True:  # through the gateway, once it has the restarted controller's table
            r = httpx.post(gw_url + "/v1/chat/completions", json=body, headers=H, timeout=300)
            if r.status_code == 200:
                break
            time.sleep(0.02)
        answered = time.monotonic() - t0
        starts = sum(
            float(line.split()[-1])
            for line in httpx.get(ctl_url + "/metrics", headers=H).text.splitlines()
            if line.startswith("stoker_instance_starts_total{") and 'outcome="ready"' in line
        )
        return {
            "healthy_s": healthy,
            "ready_s": ready,
            "answered_s": answered,
            "starts_after_restart": starts,
        }
    finally:
        with contextlib.suppress(Exception):
            httpx.delete(ctl_url + "/admin/v1/deployments/smollm2", headers=H, timeout=120)
        for p in procs:
            stop(p)


def table(res: dict) -> str:
    out = ["| gateways | req/s at c=32 | × direct | errors |", "|---|---|---|---|"]
    for name, r in res["scale_out"].items():
        out.append(f"| {name} | {r['rps']:.0f} | {r['ratio_to_direct']:.2f} | {r['errors']} |")
    out += [
        "",
        "| controller restart | to /healthz | to READY | to first answer | starts |",
        "|---|---|---|---|---|",
    ]
    for name, r in res["restart"].items():
        out.append(
            f"| {name} | {r['healthy_s']:.2f} s | {r['ready_s']:.2f} s | {r['answered_s']:.2f} s "
            f"| {r['starts_after_restart']:.0f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round of 3 s each, one restart each")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "planes.json")
    parser.add_argument(
        "--home",
        type=Path,
        default=Path("~/.cache/stoker-bench").expanduser(),
        help="where SmolLM2 is imported",
    )
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None:
        print("planes_bench: needs wrk (apt-get install -y wrk)", file=sys.stderr)
        return 1
    rounds, duration_s, restarts = (1, 3, 1) if args.quick else (5, 5, 3)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="stoker-planes-") as tmp:
        tmp = Path(tmp)
        res = {
            "machine": machine_info(),
            "command": "python bench/planes_bench.py" + (" --quick" if args.quick else ""),
        }
        res["scale_out"] = scale_out(tmp, rounds, duration_s)
        common.import_builtin_snapshot(args.home)
        store = args.home / "snapshots"
        runs = {"adopt": [], "kill and cold start": []}
        for i in range(restarts):
            for name, adopt in (("adopt", True), ("kill and cold start", False)):
                runs[name].append(restart(tmp / f"r{i}", store, adopt))
                say(f"restart {i + 1}, {name}: {json.dumps(runs[name][-1])}")
        res["restart"] = {
            name: {k: med([x[k] for x in xs]) for k in xs[0]} | {"samples": xs} for name, xs in runs.items()
        }
    res["elapsed_s"] = time.perf_counter() - t_start
    md = table(res)
    print(md)
    write_results(args.out, res, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
