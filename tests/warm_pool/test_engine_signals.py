"""The engines' own load figures: the parser on vLLM's exposition (and the CPU engine's), and the
scraper against real HTTP servers on loopback, its rate limit moved on a fake clock."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web
from prometheus_client import generate_latest

from stoker.engine.metrics import EngineMetrics
from warm_pool.engine_signals import (
    EngineLoad,
    EngineMetricsError,
    EngineScraper,
    EngineTotals,
    engine_totals,
    parse_engine_metrics,
)
from warm_pool.errors import InvalidConfig

# What vLLM v1 serves at /metrics, cut down: two data-parallel ranks of one engine serving one model,
# with the counters, histograms and info gauges around the three figures read here.
VLLM_V1 = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 18234.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 14.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 16.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.81
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.97
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:num_preemptions_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.824301e+06
vllm:prompt_tokens_created{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7383317e+09
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 912.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1490.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1523.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1523.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 212.7
# HELP vllm:cache_config_info Information of the LLMCache Cache Config
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",num_gpu_blocks="27306"} 1.0
"""

# vLLM before v1 (0.6-0.7): one engine, two served names for one cache, the older KV name; its
# CPU-swap gauge is not the KV cache and must not be read as one.
VLLM_V0 = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="llama"} 5.0
vllm:num_requests_running{model_name="llama-alias"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="llama"} 1.0
vllm:num_requests_waiting{model_name="llama-alias"} 1.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="llama"} 0.42
vllm:gpu_cache_usage_perc{model_name="llama-alias"} 0.42
# HELP vllm:cpu_cache_usage_perc CPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:cpu_cache_usage_perc gauge
vllm:cpu_cache_usage_perc{model_name="llama"} 0.99
"""


def test_vllm_v1_waiting_and_running_are_summed_over_ranks_and_kv_usage_averaged():
    assert parse_engine_metrics(VLLM_V1) == EngineLoad(
        waiting=3, running=30, kv_cache_usage=pytest.approx(0.89)
    )


def test_the_older_kv_name_is_read_and_the_cpu_swap_gauge_is_not():
    assert parse_engine_metrics(VLLM_V0) == EngineLoad(
        waiting=2, running=7, kv_cache_usage=pytest.approx(0.42)
    )


def test_the_newer_kv_name_wins_when_both_are_there():
    both = VLLM_V0 + 'vllm:kv_cache_usage_perc{model_name="llama"} 0.6\n'
    assert parse_engine_metrics(both).kv_cache_usage == pytest.approx(0.6)


def test_the_cpu_engines_own_exposition_has_the_counts_and_its_kv_figure():
    metrics = EngineMetrics("tiny")
    metrics.running.set(2)
    metrics.waiting.set(5)
    metrics.kv_blocks(used=64, total=128)
    text = generate_latest(metrics.registry).decode()
    assert parse_engine_metrics(text) == EngineLoad(waiting=5, running=2, kv_cache_usage=0.5)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("vllm:num_requests_waiting 2\nvllm:kv_cache_usage_perc 1.7\n", EngineLoad(2, 0, 1.0)),  # clamped
        ("vllm:num_requests_waiting -1\nvllm:kv_cache_usage_perc -0.1\n", EngineLoad(0, 0, 0.0)),
        ("vllm:num_requests_waiting NaN\nvllm:num_requests_running 4\n", EngineLoad(0, 4, None)),
        ("vllm:num_requests_running 2.6\n", EngineLoad(0, 3, None)),  # a gauge is a float: rounded
    ],
)
def test_odd_values_are_bounded(text, expected):
    assert parse_engine_metrics(text) == expected


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("<html><body>Not Found</body></html>", "neither"),
        ('vllm:num_requests_waiting{model_name="x" 3\n', "not Prometheus text"),
        ("# TYPE vllm:num_requests_waiting sometimes\n", "not Prometheus text"),
        ("", "neither"),
        ('# TYPE up gauge\nup{job="x"} 1\n', "neither"),
    ],
)
def test_garbage_is_our_error_never_the_parsers(text, why):
    with pytest.raises(EngineMetricsError, match=why):
        parse_engine_metrics(text)


def test_totals_sum_waiting_and_average_kv_usage_over_the_instances_that_report_it():
    loads = [EngineLoad(2, 8, 1.0), EngineLoad(0, 3, 0.2), EngineLoad(1, 4, None)]
    assert engine_totals(loads) == EngineTotals(waiting=3, kv_cache_usage=pytest.approx(0.6))
    assert engine_totals([]) == EngineTotals(0, None)


def test_scraper_settings_are_validated_with_the_value():
    with pytest.raises(InvalidConfig, match="interval_s must be a finite number > 0, got 0"):
        EngineScraper(lambda: 0.0, interval_s=0)
    with pytest.raises(InvalidConfig, match="concurrency must be ≥ 1, got 0"):
        EngineScraper(lambda: 0.0, concurrency=0)


# ---- the scraper, over HTTP ---------------------------------------------------------------------------

BIG = 3 * 1024 * 1024  # over the 2 MiB cap


@dataclass
class Engines:
    """One loopback server playing several engines, each under its own path prefix."""

    base: str
    hits: dict[str, int] = field(default_factory=dict)
    bodies: dict[str, str] = field(default_factory=dict)
    in_flight: int = 0
    most_in_flight: int = 0
    release: asyncio.Event = field(default_factory=asyncio.Event)

    def url(self, name: str) -> str:
        return f"{self.base}/{name}"


@pytest.fixture
async def engines() -> AsyncIterator[Engines]:
    state = Engines(base="")

    async def metrics(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        state.hits[name] = state.hits.get(name, 0) + 1
        state.in_flight += 1
        state.most_in_flight = max(state.most_in_flight, state.in_flight)
        try:
            if name.startswith("slow"):
                await state.release.wait()  # answers only when the test ends
            elif name.startswith("busy"):
                await asyncio.sleep(0.02)  # long enough for the other scrapes to pile up
            if name.startswith("error"):
                return web.Response(status=503, text="engine asleep")
            if name == "huge-declared":
                return web.Response(body=b"#" * BIG)
            if name == "huge-chunked":  # no Content-Length: the scraper must count
                response = web.StreamResponse()
                await response.prepare(request)
                try:
                    for _ in range(BIG // 65536):
                        await response.write(b"#" * 65536)
                except (ConnectionResetError, OSError):
                    pass  # the scraper hung up at its cap, as it should
                return response
            return web.Response(text=state.bodies.get(name, VLLM_V1))
        finally:
            state.in_flight -= 1

    app = web.Application()
    app.router.add_get("/{name}/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    state.base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield state
    state.release.set()
    await runner.cleanup()


async def test_each_instance_is_read_at_most_once_per_interval_on_the_pools_clock(engines: Engines):
    clock = [100.0]
    scraper = EngineScraper(lambda: clock[0], interval_s=5.0)
    targets = {"i-1": engines.url("a"), "i-2": engines.url("b")}
    try:
        assert scraper.due(targets)
        loads = await scraper.scrape(targets)
        assert loads == {"i-1": parse_engine_metrics(VLLM_V1), "i-2": parse_engine_metrics(VLLM_V1)}
        assert engines.hits == {"a": 1, "b": 1}
        clock[0] = 104.9
        assert not scraper.due(targets)
        await scraper.scrape(targets)
        assert engines.hits == {"a": 1, "b": 1}  # not due: nothing asked, the last figures kept
        assert set(scraper.latest) == {"i-1", "i-2"}
        # a new instance is due at once, the others at their own interval
        targets["i-3"] = engines.url("c")
        await scraper.scrape(targets)
        assert engines.hits == {"a": 1, "b": 1, "c": 1}
        clock[0] = 105.0
        engines.bodies["a"] = "vllm:num_requests_waiting 0\nvllm:num_requests_running 1\n"
        await scraper.scrape(targets)
        assert engines.hits == {"a": 2, "b": 2, "c": 1}
        assert scraper.latest["i-1"] == EngineLoad(0, 1, None)
        # instances gone (or no longer READY) are forgotten, and read again at once if they return
        await scraper.scrape({"i-1": engines.url("a")})
        assert set(scraper.latest) == {"i-1"}
        scraper.retain([])
        assert scraper.latest == {}
        assert scraper.due({"i-2": engines.url("b")})
    finally:
        await scraper.aclose()


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("slow", "no answer within 0.2s"),
        ("error", "answered 503"),
        ("huge-declared", f"{BIG} bytes, over {2 * 1024 * 1024}"),
        ("huge-chunked", f"over {2 * 1024 * 1024} bytes"),  # counted as it arrives
        ("garbage", "neither"),  # an HTML page has no engine gauge
    ],
)
async def test_an_engine_that_cannot_be_read_contributes_nothing(
    engines: Engines, name: str, why: str, caplog
):
    clock = [0.0]
    engines.bodies["garbage"] = "<html>oops</html>"
    scraper = EngineScraper(lambda: clock[0], timeout_s=0.2)
    targets = {"good": engines.url("a"), "bad": engines.url(name)}
    try:
        with caplog.at_level("DEBUG", logger="stoker.pool.engines"):
            loads = await scraper.scrape(targets)
        assert set(loads) == {"good"}
        assert engines.hits[name] == 1
        [record] = [r for r in caplog.records if r.name == "stoker.pool.engines"]
        assert record.levelname == "DEBUG" and record.exc_info is None  # one quiet line, no stack trace
        assert "instance bad: no engine load" in record.getMessage() and why in record.getMessage()
        assert not scraper.due(targets)  # a failure waits its interval too: no retry storm
    finally:
        await scraper.aclose()


async def test_an_engine_that_stops_answering_drops_its_last_figures(engines: Engines):
    clock = [0.0]
    scraper = EngineScraper(lambda: clock[0])
    try:
        await scraper.scrape({"i": engines.url("a")})
        assert "i" in scraper.latest
        engines.bodies["a"] = "not metrics at all {"
        clock[0] = 5.0
        await scraper.scrape({"i": engines.url("a")})
        assert scraper.latest == {}
        # nobody listening at all
        await scraper.scrape({"gone": "http://127.0.0.1:9"})
        assert scraper.latest == {}
    finally:
        await scraper.aclose()


async def test_scrapes_in_flight_are_bounded(engines: Engines):
    scraper = EngineScraper(lambda: 0.0, concurrency=2)
    targets = {f"i-{n}": engines.url(f"busy-{n}") for n in range(6)}
    try:
        assert len(await scraper.scrape(targets)) == 6
        assert engines.most_in_flight <= 2
    finally:
        await scraper.aclose()


async def test_a_closed_scraper_reads_nothing(engines: Engines):
    scraper = EngineScraper(lambda: 0.0)
    await scraper.aclose()
    assert not scraper.due({"i": engines.url("a")})
    assert await scraper.scrape({"i": engines.url("a")}) == {}
    assert engines.hits == {}
