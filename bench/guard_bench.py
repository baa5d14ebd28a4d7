"""What Stoker's guard inside vLLM's server (`warm_pool/vllm_guard/stoker_vllm_guard.py`) adds to a
request, beside the same server without it.

    python bench/guard_bench.py [--quick] [--out bench/results/guard.json]

Two processes on free 127.0.0.1 ports, each one uvicorn worker (httptools, uvloop, access log off)
serving the same trivially fast pure-ASGI app: a fixed OpenAI completion for
`POST /v1/chat/completions`, or 20 SSE chunks and `data: [DONE]` when the body asks to stream.
**guarded** wraps it in `EngineGuard` exactly as vLLM's `--middleware` does (the outermost ASGI
layer, the key from `VLLM_API_KEY`); **bare** does not. One keep-alive client (httpx, in this
process) sends each request with the instance's key, alternating between the two in rounds (the
order rotating between rounds), so the machine's noise and the client's own cost hit both alike;
per cell (plain, stream) the figure is the median latency of each, the guard's added microseconds
(guarded − bare) and the ratio. A real vLLM answers in milliseconds at the least (its CPU build:
tens of ms for a few tokens, bench/engines_bench.py), so the added figure is what matters.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import common
import httpx
from common import HOST, REPO, free_port, machine_info, med, say, write_results

KEY = "sk-bench-guard-0123456789abcdef"
APP = r"""
import json, os, sys
import uvicorn
sys.path.insert(0, os.environ["GUARD_DIR"])
from stoker_vllm_guard import EngineGuard

ANSWER = json.dumps({"id": "x", "object": "chat.completion", "choices": [{"index": 0,
    "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}).encode()
CHUNK = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            m = await receive()
            if m["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"}); return
    body = b""
    while True:
        m = await receive(); body += m.get("body", b"")
        if not m.get("more_body"):
            break
    if b'"stream": true' in body:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for _ in range(20):
            await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
    else:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": ANSWER})

served = EngineGuard(app) if sys.argv[2] == "guarded" else app
uvicorn.run(served, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False,
            http="httptools", loop="uvloop")
"""


def start(kind: str, procs: common.Processes) -> str:
    port = free_port()
    env = {**os.environ, "VLLM_API_KEY": KEY, "GUARD_DIR": str(REPO / "warm_pool" / "vllm_guard")}
    procs.spawn([sys.executable, "-c", APP, str(port), kind], env=env)
    url = f"http://{HOST}:{port}"
    end = time.monotonic() + 60
    while time.monotonic() < end:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code in (200, 404):
                return url
        except httpx.HTTPError:
            time.sleep(0.1)
    raise SystemExit(f"the {kind} server did not start")


def one(client: httpx.Client, url: str, stream: bool) -> float:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    t0 = time.perf_counter()
    r = client.post(f"{url}/v1/chat/completions", json=body)
    r.read()
    elapsed = time.perf_counter() - t0
    if r.status_code != 200:
        raise SystemExit(f"{url} answered {r.status_code}")
    return elapsed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds (a smoke test)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "guard.json")
    args = p.parse_args()
    rounds, per_round = (5, 50) if args.quick else (20, 200)
    t_start = time.monotonic()
    procs = common.Processes()
    try:
        urls = {kind: start(kind, procs) for kind in ("bare", "guarded")}
        headers = {"authorization": f"Bearer {KEY}"}
        # The guard's own answers, for the record: unkeyed is 401, a dev route with the key 403.
        with httpx.Client(headers=headers, timeout=30) as client:
            assert httpx.post(f"{urls['guarded']}/collective_rpc").status_code == 401
            assert client.post(f"{urls['guarded']}/collective_rpc").status_code == 403
            samples: dict[str, dict[str, list[float]]] = {
                cell: {kind: [] for kind in urls} for cell in ("plain", "stream")
            }
            for r in range(rounds):
                order = list(urls) if r % 2 == 0 else list(reversed(urls))
                for cell in samples:
                    for kind in order:
                        for _ in range(10):  # warm the connection and the server's code paths
                            one(client, urls[kind], cell == "stream")
                        samples[cell][kind] += [
                            one(client, urls[kind], cell == "stream") for _ in range(per_round)
                        ]
                say(f"round {r + 1}/{rounds}")
    finally:
        procs.stop_all()
    cells = {}
    for cell, by_kind in samples.items():
        bare, guarded = med(by_kind["bare"]), med(by_kind["guarded"])
        cells[cell] = {
            "bare_p50_us": bare * 1e6,
            "guarded_p50_us": guarded * 1e6,
            "added_p50_us": (guarded - bare) * 1e6,
            "ratio": guarded / bare,
            "requests_each": len(by_kind["bare"]),
        }
    results = {
        "bench": "guard",
        "command": "python bench/guard_bench.py" + (" --quick" if args.quick else ""),
        "machine": machine_info(("httpx", "uvicorn")),
        "cells": cells,
        "elapsed_s": time.monotonic() - t_start,
    }
    rows = [
        f"| {cell} | {c['bare_p50_us']:.0f} | {c['guarded_p50_us']:.0f} | {c['added_p50_us']:+.0f} | {c['ratio']:.3f} |"
        for cell, c in cells.items()
    ]
    md = "\n".join(
        [
            "| request | bare p50 µs | guarded p50 µs | added µs | guarded / bare |",
            "|---|---|---|---|---|",
            *rows,
        ]
    )
    write_results(args.out, results, md)
    print(json.dumps({cell: round(c["added_p50_us"], 1) for cell, c in cells.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
