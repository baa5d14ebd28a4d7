"""Ray Serve 2.60 serving the same snapshot from zero: the baseline of bench/zero_bench.py.

Runs in its own virtualenv (`make .venv-ray`: torch 2.13 CPU, `ray[serve]==2.60.*`, transformers),
never in Stoker's:

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 .venv-ray/bin/python bench/ray_serve_app.py \\
        --snapshot DIR --port P

It starts a local Ray cluster (loopback only: without `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` Ray
rebinds 127.0.0.1 to the machine's external address), Serve's HTTP proxy on 127.0.0.1:P, and one
deployment at zero replicas with Ray's fastest scale-up settings:

    min_replicas=0, initial_replicas=0, max_replicas=1, upscale_delay_s=0,
    metrics_interval_s=0.5, look_back_period_s=1 (downscale_delay_s=1: back to zero between runs)

The replica loads the snapshot with transformers (`AutoModelForCausalLM.from_pretrained`, fp32, as
the snapshot is) and answers `POST /v1/chat/completions` with `stream: true` as OpenAI's SSE: the
chat template applied, greedy decoding, each token sent as it is generated (transformers'
TextIteratorStreamer), a usage chunk, then `data: [DONE]`. The same streaming client measures it
and Stoker.

Control on stdin/stdout, one line each: the script prints `READY` once the deployment is up at zero
replicas; `replicas` answers with the number of replicas in any state; `quit` (or EOF, or SIGTERM) shuts
Serve and Ray down.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import uuid

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report from a benchmark

import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

APP = "zero"
DEPLOYMENT = "Chat"
AUTOSCALING = {
    "min_replicas": 0,
    "initial_replicas": 0,
    "max_replicas": 1,
    "upscale_delay_s": 0,
    "metrics_interval_s": 0.5,
    "look_back_period_s": 1,
    "downscale_delay_s": 1,
    "target_ongoing_requests": 1,
}
MAX_TOKENS_LIMIT = 512


def _sse(obj: dict) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


@serve.deployment(name=DEPLOYMENT, autoscaling_config=AUTOSCALING, max_ongoing_requests=8)
class Chat:
    def __init__(self, snapshot: str, served_name: str, threads: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        self.torch = torch
        self.served_name = served_name
        self.tokenizer = AutoTokenizer.from_pretrained(snapshot)
        self.model = AutoModelForCausalLM.from_pretrained(snapshot, dtype=torch.float32)
        self.model.eval()

    def _stream(self, ids, max_tokens: int):
        from transformers import TextIteratorStreamer

        rid = f"chatcmpl-{uuid.uuid4().hex[:12]}"
        base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time())}
        base["model"] = self.served_name
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        input_ids = self.torch.tensor([ids])
        done: dict = {}

        def generate() -> None:
            with self.torch.inference_mode():
                out = self.model.generate(
                    input_ids=input_ids,
                    attention_mask=self.torch.ones_like(input_ids),
                    max_new_tokens=max_tokens,
                    do_sample=False,
                    streamer=streamer,
                    pad_token_id=self.tokenizer.eos_token_id,
                )
            done["completion_tokens"] = int(out.shape[1] - input_ids.shape[1])

        worker = threading.Thread(target=generate, daemon=True)
        worker.start()
        yield _sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
        for text in streamer:
            if text:
                yield _sse(
                    {**base, "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
                )
        worker.join()
        completion = done.get("completion_tokens", 0)
        finish = "length" if completion >= max_tokens else "stop"
        yield _sse({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
        usage = {"prompt_tokens": len(ids), "completion_tokens": completion}
        usage["total_tokens"] = len(ids) + completion
        yield _sse({**base, "choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"

    async def __call__(self, request: Request):
        if request.url.path.rstrip("/") != "/v1/chat/completions" or request.method != "POST":
            return JSONResponse({"error": {"message": "not found", "type": "invalid_request_error"}}, 404)
        try:
            body = await request.json()
            messages = body["messages"]
            max_tokens = int(body.get("max_tokens") or 16)
            if not isinstance(messages, list) or not 0 < max_tokens <= MAX_TOKENS_LIMIT:
                raise ValueError("messages must be a list and max_tokens in 1..512")
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        except (ValueError, KeyError, TypeError) as exc:
            return JSONResponse({"error": {"message": str(exc), "type": "invalid_request_error"}}, 400)
        return StreamingResponse(self._stream(ids, max_tokens), media_type="text/event-stream")


def live_replicas() -> int:
    """Replicas in any state (starting, running, stopping): zero only once the last replica's process
    is gone, with the snapshot's pages it mapped."""
    status = serve.status()
    app = status.applications.get(APP)
    if app is None or DEPLOYMENT not in app.deployments:
        return 0
    return int(sum(app.deployments[DEPLOYMENT].replica_states.values()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--snapshot", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--served-model-name", default="smollm2")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    cpus = os.cpu_count() or 1
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        app = Chat.options(ray_actor_options={"num_cpus": cpus}).bind(
            args.snapshot, args.served_model_name, args.threads
        )
        serve.run(app, name=APP, route_prefix="/", blocking=False)
        print("READY", flush=True)
        for line in sys.stdin:
            cmd = line.strip()
            if cmd == "replicas":
                print(live_replicas(), flush=True)
            elif cmd == "quit":
                break
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
