"""vLLM's own benchmark client (`vllm bench serve`, from the CPU build in .venv-vllm) against held
streams: a deployment at zero, every request held while its first instance starts, many keep-alive
intervals long.

Why this client: it reads a stream one network read at a time and strips each read before looking
for the blank line that ends an SSE event (vllm/benchmarks/lib/endpoint_request_func.py,
`StreamedResponseHandler`). A keep-alive comment (`: waiting for capacity\\n\\n`) arriving alone is
stripped to a comment with no end, and every data line after it joins that comment: such streams
were counted failed ("Never received a valid chunk") or garbled. The server here is the CPU engine
(its start takes seconds; vLLM's takes a minute and would test nothing more): what is under test
is the activator's held stream, which is the same in front of either engine.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import openai
import pytest

from tests.conftest import REPO
from tests.deadlines import HTTP_READ, deadline, flag

VLLM = REPO / ".venv-vllm" / "bin" / "vllm"
needs_vllm = pytest.mark.skipif(
    not VLLM.exists() and not os.environ.get("CI"),  # in CI `make test` builds it: there it must run
    reason="vLLM's CPU build is not installed: `make vllm`",
)

KEEPALIVE_S = 0.1
PROMPTS = 6


ENDPOINTS = {"openai-chat": "/v1/chat/completions", "openai": "/v1/completions"}


def bench(url: str, backend: str, tokenizer: Path, out: Path) -> subprocess.Popen:
    """`vllm bench serve`: every prompt sent at once (rate inf), streamed, results saved as JSON."""
    return subprocess.Popen(
        [
            str(VLLM),
            "bench",
            "serve",
            "--backend",
            backend,
            "--endpoint",
            ENDPOINTS[backend],
            "--base-url",
            url,
            "--model",
            "tiny",
            "--tokenizer",
            str(tokenizer),
            "--dataset-name",
            "random",
            "--random-input-len",
            "16",
            "--random-output-len",
            "8",
            "--num-prompts",
            str(PROMPTS),
            "--request-rate",
            "inf",
            "--disable-tqdm",
            "--save-result",
            "--save-detailed",
            "--result-dir",
            str(out.parent),
            "--result-filename",
            out.name,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OPENAI_API_KEY": "unused", "HF_HUB_OFFLINE": "1"},
    )


@needs_vllm
def test_vllm_bench_serve_completes_every_held_stream(platform_factory, tiny_model_dir, tmp_path):
    # No warm runtime: the streams are to be held across many keep-alive intervals, and a fresh
    # process start (the interpreter and torch's imports, seconds) is far longer than five of them.
    p = platform_factory(
        "--keepalive-interval", f"{KEEPALIVE_S}s", "--hold-deadline", flag(300), "--warm-runtimes", "0"
    )
    p.deploy("tiny", tiny_model_dir, "--max", "2", "--idle-timeout", "600")
    assert p.deployments()["tiny"]["instances"]["READY"] == 0

    # Both of the client's OpenAI backends at once: chat completions and completions.
    runs = {
        backend: (out := tmp_path / f"{backend}.json", bench(p.url, backend, tiny_model_dir, out))
        for backend in ENDPOINTS
    }
    for backend, (out, proc) in runs.items():
        log, _ = proc.communicate(timeout=deadline(300))
        assert proc.returncode == 0, log[-3000:]
        result = json.loads(out.read_text())
        errors = [e for e in result.get("errors", []) if e]
        assert (result["completed"], result["failed"]) == (PROMPTS, 0), (backend, errors[:2])
        assert result["total_output_tokens"] > 0, backend
        # Each stream was held for many keep-alive intervals (its TTFT includes the hold): read from
        # the client's own figures, not assumed from how long an instance takes to start.
        assert min(result["ttfts"]) > 5 * KEEPALIVE_S, (backend, min(result["ttfts"]))
    assert p.metric("stoker_requests_total", deployment="tiny", code="200") == 2 * PROMPTS

    # The official client closes its connection at `data: [DONE]`, before the body's last frame:
    # streams it read to the end are answers (200), not clients that left (499).
    client = openai.OpenAI(base_url=f"{p.url}/v1", api_key="unused", max_retries=0, timeout=HTTP_READ)
    for _ in range(8):
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=4, stream=True
        )
        assert [c for c in stream][-1].choices[0].finish_reason in ("stop", "length")
    p.wait_for(
        lambda: p.metric("stoker_requests_total", deployment="tiny", code="200") == 2 * PROMPTS + 8,
        timeout=deadline(10),
        what="8 more streams counted",
    )
    assert p.metric("stoker_requests_total", deployment="tiny", code="499") == 0
