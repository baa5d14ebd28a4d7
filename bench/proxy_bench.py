"""Benchmark the latency Stoker's hot path (gateway + activator) adds, beside nginx and vLLM's router.

    python bench/proxy_bench.py [--quick] [--out bench/results/proxy.json] [--router PATH]

One trivially fast upstream (a pure ASGI app under uvicorn, httptools, one worker) answers
`POST /v1/chat/completions` with a fixed OpenAI completion, or with 20 SSE chunks and
`data: [DONE]` when the body says `"stream": true`, without delay. In front of it, each in its own
process on a free 127.0.0.1 port:

- **stoker**: the real gateway (`stoker.serve.up.build_gateway`) and a real `Activator`, whose
  `InstanceSource` is one static endpoint (the upstream, `max_concurrency` 1024 so the limit never
  binds), with the shared aiohttp session configured as in `stoker.control.platform.Platform.start`, under
  uvicorn (httptools, uvloop, access log off). The warm pool is not on the hot path and is left out;
  this harness stands in for `Platform` (the duck type `build_gateway` reads) and nothing else.
- **stoker+keys**: the same, with keys and limits on: an admin key set, a tenant key (in a real
  `KeyStore`) with every limit set (requests/s, tokens/min, concurrency) far above what the run
  sends, so every request is authenticated, admitted by three buckets and settled through a
  `UsageTap`, and none is refused. wrk sends that key. Its cost is this row against `stoker`.
- **nginx** (Debian package): one worker process, upstream keep-alive 32, HTTP/1.1 to the upstream,
  `proxy_buffering off`, logs in a temp dir.
- **router**: vLLM's Rust router (`pip install vllm-router`), `--policy round_robin`.
- **direct**: the upstream itself, the reference every "added" figure is measured against.

Load is `wrk` (a C load generator: on 2 shared cores a Python one would measure itself) with a Lua
script for the POST body: for each target × (plain JSON, 20-chunk stream) × (concurrency 1 with
`-t1`, 32 with `-t2`), p50 and p99 latency (`--latency`) and requests/s. Targets are interleaved
(each round visits every target for each cell, the order rotating between rounds) and every figure
is the median over rounds, so machine noise hits all alike. Reported: added p50/p99 = target −
direct, and requests/s at concurrency 32 as a ratio to direct. All samples go to the JSON file; a
markdown table goes to stdout and next to the JSON (`.md`). A baseline that cannot be found or
started is reported as such, and the run goes on without it.

Needs: `apt-get install -y nginx wrk`, and vllm-router in a separate virtualenv (found via
`--router`, `$VLLM_ROUTER`, `~/.cache/stoker-bench/router-venv/bin/vllm-router`, or `PATH`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import common
import httpx
from common import CLK_TCK, HOST, REPO, _interrupt, free_port, machine_info, med, say, write_results

MODEL = "bench"
PATH = "/v1/chat/completions"
CHUNKS = 20
TARGETS = ("direct", "stoker", "stoker+keys", "nginx", "router")
TENANT_KEY_ENV = "STOKER_BENCH_TENANT_KEY"  # the tenant key the keyed target's clients send
MODES = ("json", "stream")
CONCURRENCY = (1, 32)


@dataclass(frozen=True)
class Plan:
    rounds: int
    duration_s: int  # each measured wrk run
    warmup_s: int  # a wrk run just before it, not recorded (pools filled, caches warm)


FULL = Plan(rounds=3, duration_s=5, warmup_s=1)
QUICK = Plan(rounds=1, duration_s=2, warmup_s=1)


# ---- the upstream: a minimal ASGI app ----------------------------------------------------------------


def _completion() -> bytes:
    return json.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 1700000000,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "Hello! How can I help you today?"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 12, "completion_tokens": 9, "total_tokens": 21},
        }
    ).encode()


def _text_completion() -> bytes:
    return json.dumps(
        {
            "id": "cmpl-bench",
            "object": "text_completion",
            "created": 1700000000,
            "model": MODEL,
            "choices": [{"index": 0, "text": " Hello!", "finish_reason": "stop", "logprobs": None}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
        }
    ).encode()


def _sse_chunks(chat: bool) -> list[bytes]:
    out = []
    for i in range(CHUNKS):
        if chat:
            delta = {"role": "assistant", "content": f" tok{i}"} if i == 0 else {"content": f" tok{i}"}
            choice = {"index": 0, "delta": delta, "finish_reason": "stop" if i == CHUNKS - 1 else None}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": f" tok{i}", "finish_reason": "stop" if i == CHUNKS - 1 else None}
            obj = "text_completion"
        body = {"id": "chatcmpl-bench", "object": obj, "created": 1700000000, "model": MODEL}
        out.append(f"data: {json.dumps({**body, 'choices': [choice]})}\n\n".encode())
    return out


UP_JSON = {"/v1/chat/completions": _completion(), "/v1/completions": _text_completion()}
UP_SSE = {"/v1/chat/completions": _sse_chunks(True), "/v1/completions": _sse_chunks(False)}
UP_DONE = b"data: [DONE]\n\n"
UP_MODELS = json.dumps(
    {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "bench"}]}
).encode()


async def upstream_app(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    path, method = scope["path"], scope["method"]
    if method == "POST" and path in UP_JSON:
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        try:
            stream = json.loads(b"".join(chunks)).get("stream") is True
        except (ValueError, AttributeError):
            await _plain(send, 400, b'{"error": {"message": "bad json"}}')
            return
        if not stream:
            await _plain(send, 200, UP_JSON[path])
            return
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for chunk in UP_SSE[path]:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": UP_DONE, "more_body": False})
    elif method == "GET" and path in ("/health", "/healthz"):
        await _plain(send, 200, b"{}")
    elif method == "GET" and path == "/v1/models":
        await _plain(send, 200, UP_MODELS)
    else:
        await _plain(send, 404, b'{"error": {"message": "not found"}}')


async def _plain(send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def serve_upstream(port: int) -> None:
    import uvicorn

    # A long keep-alive so idle pooled connections of the proxies are not closed between rounds
    # (uvicorn's default is 5 s): every target then starts its runs with warm connections.
    uvicorn.run(
        upstream_app,
        host=HOST,
        port=port,
        http="httptools",
        loop="uvloop",
        access_log=False,
        log_level="warning",
        timeout_keep_alive=300,
    )


# ---- Stoker's hot path: the real gateway and activator, one static instance -------------------------


@dataclass(frozen=True)
class StaticEndpoint:
    id: str
    url: str
    max_concurrency: int
    auth_headers: dict = field(default_factory=dict)  # no key


class StaticSource:
    """An `InstanceSource` with one READY instance that never changes (no warm pool)."""

    def __init__(self, url: str) -> None:
        self._endpoints = (StaticEndpoint("upstream-0", url, 1024),)
        self.pokes = 0
        self.failures = 0

    def endpoints(self):
        return self._endpoints

    def poke(self) -> None:
        self.pokes += 1

    def report_failure(self, endpoint_id: str) -> None:
        self.failures += 1

    def request_arrived(self) -> None:
        pass

    def request_finished(self, service_s: float | None, cold_on: str | None) -> None:
        pass


class BenchPlatform:
    """What `build_gateway` reads of `stoker.control.platform.Platform`, for one static deployment: the
    session is built as `Platform.start` builds it; the activator and its metrics are the real ones."""

    def __init__(self, upstream: str) -> None:
        from prometheus_client import CollectorRegistry

        from activator import ActivatorConfig, ActivatorMetrics

        self.metrics_registry = CollectorRegistry()
        self._metrics = ActivatorMetrics(self.metrics_registry)
        self._config = ActivatorConfig()
        self.source = StaticSource(upstream)
        self._session = None
        self._deployment = None

    async def start(self) -> None:
        import aiohttp

        from activator import Activator

        # As in Platform.start: one pool, no connection limit, no total timeout.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False
        )
        activator = Activator(MODEL, self.source, self._config, self._session, self._metrics)
        spec = SimpleNamespace(name=MODEL, snapshot_id="none", to_dict=lambda: {"name": MODEL})
        pool = SimpleNamespace(counts=lambda: {"READY": 1}, unavailable=None)
        self._deployment = SimpleNamespace(spec=spec, pool=pool, activator=activator)

    async def shutdown(self) -> None:
        if self._session is not None:
            await self._session.close()

    def get(self, name: str):
        return self._deployment if name == MODEL else None

    def list(self) -> list:
        return [self._deployment] if self._deployment is not None else []


def serve_stoker(port: int, upstream: str, keys_db: Path | None) -> None:
    """The gateway, open (no keys), or with the admin key from $STOKER_ADMIN_KEY and the tenant keys
    in `keys_db`."""
    import uvicorn

    from stoker.control.keys import KeyStore
    from stoker.gateway.keys import Access
    from stoker.serve.up import build_gateway

    access = None
    if keys_db is not None:
        access = Access(os.environ["STOKER_ADMIN_KEY"], KeyStore(keys_db), frozenset())
    app = build_gateway(BenchPlatform(upstream), access=access)
    uvicorn.run(
        app,
        host=HOST,
        port=port,
        http="httptools",
        loop="uvloop",
        access_log=False,
        log_level="warning",
    )


def make_keys(tmp: Path) -> tuple[str, str, Path]:
    """An admin key, and a tenant key for the bench model with every limit on and none binding:
    (admin key, tenant key, the key store's path)."""
    import asyncio
    import secrets

    from stoker.control.keys import KeyStore
    from stoker.spec.keys import Limits

    path = tmp / "keys.db"
    store = KeyStore(path)
    limits = Limits(rps=1e6, tpm=10**12, max_concurrent=1_000_000)
    _, tenant_key = asyncio.run(store.create("bench", (MODEL,), limits))
    store.close()
    return secrets.token_urlsafe(32), tenant_key, path


# ---- processes ---------------------------------------------------------------------------------------


class Processes(common.Processes):
    """common.Processes, but stop() always signals the whole group, even after its leader exited."""

    def stop(self, proc: subprocess.Popen, timeout: float = 10.0) -> None:
        # The whole group: nginx's master forks its worker, which must go too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
        if proc in self._live:
            self._live.remove(proc)


def body(stream: bool) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello in one short sentence, please."}],
        "max_tokens": 16,
        "temperature": 0,
        "stream": stream,
    }


def probe(base: str, stream: bool, headers: dict[str, str]) -> str | None:
    """One request through `base`; None if the answer is what the upstream sends, else why not."""
    try:
        r = httpx.post(base + PATH, json=body(stream), headers=headers, timeout=5.0)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    if r.status_code != 200:
        return f"HTTP {r.status_code}: {r.text[:200]}"
    if stream:
        events = [ln for ln in r.text.splitlines() if ln.startswith("data: ")]
        if len(events) != CHUNKS + 1 or events[-1] != "data: [DONE]":
            return f"stream of {len(events)} events, expected {CHUNKS + 1}: {r.text[:200]!r}"
    elif r.json().get("choices", [{}])[0].get("message", {}).get("content") is None:
        return f"unexpected body: {r.text[:200]}"
    return None


@dataclass
class Target:
    name: str
    base: str | None = None
    proc: subprocess.Popen | None = None
    log: Path | None = None
    status: str = "ok"  # or why it is not measured
    version: str | None = None
    command: str | None = None
    headers: dict[str, str] = field(default_factory=dict)  # what its clients send besides the body

    def log_tail(self, n: int = 2000) -> str:
        with contextlib.suppress(OSError, TypeError):
            return self.log.read_text(errors="replace")[-n:]
        return ""


def start(procs: Processes, t: Target, cmd: list[str], tmp: Path, timeout: float = 60.0) -> Target:
    """Spawn `cmd` (logs to tmp/NAME.log) and wait until a plain and a streamed request go through."""
    t.log = tmp / f"{t.name}.log"
    t.command = shlex.join(cmd)
    with t.log.open("ab") as log:
        t.proc = procs.spawn(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    deadline = time.monotonic() + timeout
    why = "no answer"
    while time.monotonic() < deadline:
        if t.proc.poll() is not None:
            raise RuntimeError(f"exited with {t.proc.returncode}: {t.log_tail(600)}")
        why = probe(t.base, False, t.headers)
        if why is None:
            why = probe(t.base, True, t.headers)
            if why is None:
                return t
            raise RuntimeError(f"streamed probe failed: {why}")
        time.sleep(0.1)
    raise RuntimeError(f"not answering within {timeout:.0f} s ({why}): {t.log_tail(600)}")


def start_optional(procs: Processes, t: Target, cmd_of, tmp: Path, timeout: float = 60.0) -> Target:
    try:
        cmd = cmd_of()
        start(procs, t, cmd, tmp, timeout)
    except Exception as exc:  # a baseline that cannot run is reported, not fatal
        t.status = f"not available: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__}"
        if t.proc is not None:
            procs.stop(t.proc)
            t.proc = None
        say(f"{t.name}: {t.status}")
    return t


# ---- nginx and the router ---------------------------------------------------------------------------

NGINX_CONF = """\
worker_processes 1;
daemon off;
master_process on;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/nginx-body;
    proxy_temp_path {tmp}/nginx-proxy;
    fastcgi_temp_path {tmp}/nginx-fastcgi;
    uwsgi_temp_path {tmp}/nginx-uwsgi;
    scgi_temp_path {tmp}/nginx-scgi;
    keepalive_requests 1000000;
    upstream bench_upstream {{
        server {host}:{up_port};
        keepalive 32;
        keepalive_requests 1000000;
    }}
    server {{
        listen {host}:{port};
        location / {{
            proxy_pass http://bench_upstream;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


def nginx_command(tmp: Path, port: int, up_port: int) -> list[str]:
    nginx = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).exists()), None
    )
    if nginx is None:
        raise RuntimeError("nginx not installed (apt-get install -y nginx)")
    conf = tmp / "nginx.conf"
    conf.write_text(NGINX_CONF.format(tmp=tmp, host=HOST, port=port, up_port=up_port))
    return [nginx, "-p", str(tmp), "-e", str(tmp / "nginx-error.log"), "-c", str(conf)]


def find_router(explicit: str | None) -> str | None:
    if explicit:  # named on the command line: that one or none
        return explicit if Path(explicit).is_file() and os.access(explicit, os.X_OK) else None
    candidates = [
        os.environ.get("VLLM_ROUTER"),
        str(Path("~/.cache/stoker-bench/router-venv/bin/vllm-router").expanduser()),
        shutil.which("vllm-router"),
        "/tmp/router-venv/bin/vllm-router",
    ]
    return next((c for c in candidates if c and Path(c).is_file() and os.access(c, os.X_OK)), None)


def router_command(router: str | None, port: int, up_port: int) -> list[str]:
    if router is None:
        raise RuntimeError(
            "vllm-router not found (pip install vllm-router into a separate venv; --router PATH)"
        )
    return [
        router,
        "--host",
        HOST,
        "--port",
        str(port),
        "--worker-urls",
        f"http://{HOST}:{up_port}",
        "--policy",
        "round_robin",
        # Its Prometheus exporter stays on loopback, on a port of its own; worker health checks
        # (loopback too) are left at their defaults, the first one done within a second.
        "--prometheus-host",
        HOST,
        "--prometheus-port",
        str(free_port()),
        "--worker-startup-check-interval",
        "1",
        "--log-level",
        "warning",
    ]


def router_version(router: str | None) -> str | None:
    if router is None:
        return None
    py = Path(router).parent / "python"
    if not py.exists():
        return None
    out = subprocess.run(
        [str(py), "-c", "import importlib.metadata as m; print(m.version('vllm-router'))"],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() or None


def tool_version(cmd: list[str]) -> str | None:
    with contextlib.suppress(OSError):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
        text = (out.stdout + out.stderr).strip()
        return text.splitlines()[0] if text else None
    return None


# ---- wrk ---------------------------------------------------------------------------------------------

UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}


def lua_script(stream: bool, headers: dict[str, str]) -> str:
    payload = json.dumps(body(stream), separators=(",", ":"))
    lines = ['wrk.method = "POST"', 'wrk.headers["Content-Type"] = "application/json"']
    lines += [f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}" for k, v in headers.items()]
    return "\n".join([*lines, f"wrk.body = [[{payload}]]", ""])


def wrk(base: str, script: Path, conc: int, duration_s: int) -> dict:
    threads = 1 if conc == 1 else 2
    cmd = [
        "wrk",
        f"-t{threads}",
        f"-c{conc}",
        f"-d{duration_s}s",
        "--timeout",
        "10s",
        "--latency",
        "-s",
        str(script),
        base + PATH,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=duration_s + 60)
    text = out.stdout
    if out.returncode != 0 or "Requests/sec" not in text:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({out.returncode}): {out.stderr[-500:]}{text[-500:]}")
    pct = {
        int(m.group(1)): float(m.group(2)) * UNITS[m.group(3)]
        for m in re.finditer(r"^\s+(\d+)%\s+([\d.]+)(us|ms|s|m)\s*$", text, re.M)
    }
    requests = int(re.search(r"(\d+) requests in", text).group(1))
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    return {
        "p50_s": pct.get(50),
        "p75_s": pct.get(75),
        "p90_s": pct.get(90),
        "p99_s": pct.get(99),
        "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1)),
        "requests": requests,
        "non_2xx": int(bad.group(1)) if bad else 0,
        "socket_errors": sum(int(x) for x in sock.groups()) if sock else 0,
    }


# ---- CPU time ----------------------------------------------------------------------------------------


def group_cpu_s(pgid: int) -> float:
    """User + system CPU seconds of every live process in process group `pgid` (all threads)."""
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                ticks += int(fields[11]) + int(fields[12])
    return ticks / CLK_TCK


# ---- the run -----------------------------------------------------------------------------------------


def cell_key(mode: str, conc: int) -> str:
    return f"{mode}_c{conc}"


def measure(plan: Plan, targets: dict[str, Target], scripts: dict[tuple[str, str], Path]) -> dict:
    live = [t for t in TARGETS if targets[t].status == "ok"]
    up_pgid = targets["direct"].proc.pid
    samples: dict[str, dict[str, list]] = {
        cell_key(m, c): {t: [] for t in live} for m in MODES for c in CONCURRENCY
    }
    for r in range(plan.rounds):
        order = live[r % len(live) :] + live[: r % len(live)]  # rotate who goes first
        for mode in MODES:
            for conc in CONCURRENCY:
                key = cell_key(mode, conc)
                for name in order:
                    base = targets[name].base
                    script = scripts[name, mode]
                    wrk(base, script, conc, plan.warmup_s)
                    up0, px0 = group_cpu_s(up_pgid), group_cpu_s(targets[name].proc.pid)
                    s = wrk(base, script, conc, plan.duration_s)
                    up1, px1 = group_cpu_s(up_pgid), group_cpu_s(targets[name].proc.pid)
                    s["round"] = r
                    # CPU per request: robust to a busy machine, unlike latency (10 ms ticks).
                    s["upstream_cpu_us_per_req"] = (
                        (up1 - up0) / s["requests"] * 1e6 if s["requests"] else None
                    )
                    s["proxy_cpu_us_per_req"] = (
                        (px1 - px0) / s["requests"] * 1e6 if s["requests"] and name != "direct" else None
                    )
                    samples[key][name].append(s)
                    say(
                        f"round {r + 1}/{plan.rounds} {key:<10} {name:<11} p50 {s['p50_s'] * 1e3:7.3f} ms "
                        f"p99 {s['p99_s'] * 1e3:7.3f} ms {s['rps']:8.0f} req/s"
                        + (
                            f"  ({s['non_2xx']} non-2xx, {s['socket_errors']} socket errors)"
                            if s["non_2xx"] or s["socket_errors"]
                            else ""
                        )
                    )
    cells = {}
    for key, per_target in samples.items():
        medians = {
            name: {
                k: med([s[k] for s in ss])
                for k in ("p50_s", "p99_s", "rps", "proxy_cpu_us_per_req", "upstream_cpu_us_per_req")
            }
            | {"non_2xx": sum(s["non_2xx"] for s in ss), "socket_errors": sum(s["socket_errors"] for s in ss)}
            for name, ss in per_target.items()
        }
        direct = medians.get("direct")
        added = {}
        for name, m in medians.items():
            if name == "direct" or direct is None:
                continue
            added[name] = {
                "added_p50_s": m["p50_s"] - direct["p50_s"],
                "added_p99_s": m["p99_s"] - direct["p99_s"],
                "rps_ratio_to_direct": m["rps"] / direct["rps"] if direct["rps"] else None,
                # Per round, too: the same difference taken within one round, then the median.
                "added_p50_s_paired_median": med(
                    [
                        a["p50_s"] - b["p50_s"]
                        for a, b in zip(per_target[name], per_target["direct"], strict=True)
                    ]
                ),
            }
        cells[key] = {"median": medians, "vs_direct": added, "samples": per_target}
        if "stoker" in per_target and "stoker+keys" in per_target:
            on, off = per_target["stoker+keys"], per_target["stoker"]
            cells[key]["keys_cost"] = {
                # Taken within each round, then the median: both ran minutes apart at most.
                "added_p50_s": med([a["p50_s"] - b["p50_s"] for a, b in zip(on, off, strict=True)]),
                "added_p99_s": med([a["p99_s"] - b["p99_s"] for a, b in zip(on, off, strict=True)]),
                "added_cpu_us_per_req": med(
                    [
                        a["proxy_cpu_us_per_req"] - b["proxy_cpu_us_per_req"]
                        for a, b in zip(on, off, strict=True)
                    ]
                ),
            }
    return cells


def fmt_ms(x: float | None, signed: bool = False) -> str:
    if x is None:
        return "–"
    return f"{x * 1e3:+.3f} ms" if signed else f"{x * 1e3:.3f} ms"


def fmt_us(x: float | None) -> str:
    return "–" if x is None else f"{x:.0f}"


def table(res: dict) -> str:
    cells, targets = res["cells"], res["targets"]
    head = (
        "target",
        "added p50, c=1",
        "added p99, c=1",
        "added p50, c=32",
        "added p99, c=32",
        "req/s c=32 (÷ direct)",
        "CPU µs/request, c=32",
    )
    lines = []
    for mode, label in (("json", "plain JSON response"), ("stream", f"SSE stream, {CHUNKS} chunks + [DONE]")):
        lines += [f"**{label}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for name in TARGETS:
            info = targets[name]
            if info["status"] != "ok":
                lines.append(f"| {name} | {info['status']} |" + " |" * (len(head) - 2))
                continue
            c1, c32 = cells[cell_key(mode, 1)], cells[cell_key(mode, 32)]
            if name == "direct":
                d1, d32 = c1["median"]["direct"], c32["median"]["direct"]
                row = (
                    "direct (upstream itself)",
                    f"p50 {fmt_ms(d1['p50_s'])}",
                    f"p99 {fmt_ms(d1['p99_s'])}",
                    f"p50 {fmt_ms(d32['p50_s'])}",
                    f"p99 {fmt_ms(d32['p99_s'])}",
                    f"{d32['rps']:.0f} (1.00)",
                    f"{fmt_us(d32['upstream_cpu_us_per_req'])} (the upstream)",
                )
            else:
                a1, a32 = c1["vs_direct"][name], c32["vs_direct"][name]
                errs = sum(cells[cell_key(mode, c)]["median"][name]["non_2xx"] for c in CONCURRENCY)
                errs += sum(cells[cell_key(mode, c)]["median"][name]["socket_errors"] for c in CONCURRENCY)
                row = (
                    name + (f" ({errs} errors)" if errs else ""),
                    fmt_ms(a1["added_p50_s"], True),
                    fmt_ms(a1["added_p99_s"], True),
                    fmt_ms(a32["added_p50_s"], True),
                    fmt_ms(a32["added_p99_s"], True),
                    f"{c32['median'][name]['rps']:.0f} ({a32['rps_ratio_to_direct']:.2f})",
                    fmt_us(c32["median"][name]["proxy_cpu_us_per_req"]),
                )
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    costs = [
        f"{mode} c={c}: p50 {cost['added_p50_s'] * 1e6:+.0f} µs, CPU {cost['added_cpu_us_per_req']:+.0f} µs/request"
        for mode in MODES
        for c in CONCURRENCY
        if (cost := cells[cell_key(mode, c)].get("keys_cost")) is not None
    ]
    if costs:
        lines += [f"Keys and limits on (stoker+keys − stoker, paired per round): {'; '.join(costs)}.", ""]
    p = res["plan"]
    lines.append(
        f"wrk {p['duration_s']} s per run (-t1 at c=1, -t2 at c=32), medians of {p['rounds']} interleaved "
        f"round(s); added = target − direct; CPU = user + system time of the proxy's processes "
        f"(all threads) over the run ÷ requests; load average at start {res['machine']['loadavg_start'][0]:.2f}, "
        f"end {res['machine']['loadavg_end'][0]:.2f}."
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    plan = QUICK if args.quick else FULL
    if shutil.which("wrk") is None:
        say("wrk is not installed (apt-get install -y wrk): nothing to measure with")
        return 1
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with SIGINT ignored
    procs = Processes()
    t_start = time.perf_counter()
    results: dict = {
        "machine": machine_info(
            ("uvicorn", "httptools", "uvloop", "starlette", "aiohttp", "prometheus-client"),
            wrk=tool_version(["wrk", "-v"]),
        ),
        "command": shlex.join([sys.executable, *sys.argv]),
        "plan": plan.__dict__,
        "what": (
            "wrk --latency, POST /v1/chat/completions with a fixed ~170-byte JSON body, through each "
            "target to one minimal ASGI upstream (uvicorn, httptools, uvloop) answering a fixed "
            f"completion or {CHUNKS} SSE chunks + [DONE] without delay; -t1 at concurrency 1, -t2 at "
            "32; before each measured run a short warm-up run (not recorded); targets interleaved "
            "per cell, order rotated per round; medians over rounds; added = median(target) − "
            "median(direct); all processes share the machine's cores"
        ),
    }
    me = [sys.executable, str(Path(__file__).resolve())]
    try:
        with tempfile.TemporaryDirectory(prefix="stoker-proxy-bench-") as tmp_name:
            tmp = Path(tmp_name)
            admin_key, tenant_key, keys_db = make_keys(tmp)
            keyed = {"Authorization": f"Bearer {tenant_key}"}
            scripts = {}
            for name in TARGETS:
                for m in MODES:
                    scripts[name, m] = tmp / f"{name}-{m}.lua"
                    scripts[name, m].write_text(
                        lua_script(m == "stream", keyed if name == "stoker+keys" else {})
                    )
            up_port = free_port()
            direct = Target("direct", base=f"http://{HOST}:{up_port}")
            start(procs, direct, [*me, "--serve", "upstream", "--port", str(up_port)], tmp)
            direct.version = "pure ASGI app, uvicorn " + (results["machine"]["uvicorn"] or "?")
            targets = {"direct": direct}

            port = free_port()
            stoker = Target("stoker", base=f"http://{HOST}:{port}", version="working tree")
            cmd = [*me, "--serve", "stoker", "--port", str(port), "--upstream", direct.base]
            start(procs, stoker, cmd, tmp)
            targets["stoker"] = stoker

            port = free_port()
            keys = Target("stoker+keys", base=f"http://{HOST}:{port}", version="working tree", headers=keyed)
            cmd = [
                *me,
                "--serve",
                "stoker",
                "--port",
                str(port),
                "--upstream",
                direct.base,
                "--keys-db",
                str(keys_db),
            ]
            os.environ["STOKER_ADMIN_KEY"] = admin_key  # inherited by that process only: set just before
            try:
                start(procs, keys, cmd, tmp)
            finally:
                del os.environ["STOKER_ADMIN_KEY"]
            targets["stoker+keys"] = keys

            port = free_port()
            nginx = Target("nginx", base=f"http://{HOST}:{port}", version=tool_version(["nginx", "-v"]))
            targets["nginx"] = start_optional(
                procs, nginx, lambda p=port: nginx_command(tmp, p, up_port), tmp
            )

            port = free_port()
            router_bin = find_router(args.router)
            router = Target("router", base=f"http://{HOST}:{port}", version=router_version(router_bin))
            targets["router"] = start_optional(
                procs, router, lambda p=port: router_command(router_bin, p, up_port), tmp, timeout=90
            )
            say(
                "targets: "
                + ", ".join(
                    f"{t.name} ({t.base})" if t.status == "ok" else f"{t.name} ({t.status})"
                    for t in targets.values()
                )
            )
            results["targets"] = {
                name: {"status": t.status, "base": t.base, "version": t.version, "command": t.command}
                for name, t in targets.items()
            }
            results["cells"] = measure(plan, targets, scripts)
            for name, t in targets.items():  # every process still alive at the end?
                if t.proc is not None and t.proc.poll() is not None:
                    raise RuntimeError(f"{name} exited during the run: {t.log_tail()}")
            if stoker.proc is not None:
                with contextlib.suppress(httpx.HTTPError):
                    text = httpx.get(stoker.base + "/metrics", timeout=5.0).text
                    results["stoker_requests_by_code"] = {
                        m.group(1): float(m.group(2))
                        for m in re.finditer(
                            r'^stoker_requests_total\{[^}]*code="(\d+)"[^}]*\}\s+(\S+)$', text, re.M
                        )
                    }
    except KeyboardInterrupt:
        say("interrupted; stopping every process started")
        return 130
    finally:
        procs.stop_all()

    results["machine"]["loadavg_end"] = os.getloadavg()
    results["elapsed_s"] = time.perf_counter() - t_start
    write_results(args.out, results, table(results), 7)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one round of 2 s runs (about a minute)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "proxy.json")
    ap.add_argument("--router", help="the vllm-router executable (default: see the module docstring)")
    ap.add_argument("--serve", choices=["upstream", "stoker"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--upstream", help=argparse.SUPPRESS)
    ap.add_argument("--keys-db", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve == "upstream":
        serve_upstream(args.port)
        return 0
    if args.serve == "stoker":
        serve_stoker(args.port, args.upstream, args.keys_db)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
