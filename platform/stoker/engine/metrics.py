"""The CPU engine's Prometheus metrics: vLLM 0.32's families, label sets and buckets, so one
dashboard, one alert and one federated scrape (`stoker.control.federate`) serve both engines.

Every `vllm:` family here is one vLLM 0.32 exports (vllm/v1/metrics/loggers.py), with its name, type,
HELP text, labels (`model_name`, and `engine`, vLLM's data-parallel rank: always "0" here) and
buckets (vllm/v1/metrics/buckets.py). The request-phase histograms mean what vLLM's mean, on this
engine's own timeline:

    arrival ──queue── admitted ──prefill── first token ──decode── last token
    (POST read)       (a slot of --max-num-seqs)             e2e: arrival → end
                      inference: admitted → last token

vLLM families this engine does not export, because it measures nothing they could hold:
multi-modal and external cache queries and hits, preemptions, prompt tokens by source or cached,
tokens per engine step (`iteration_tokens_total`), waiting by reason, admission rejections (its own
are `stoker_engine_rejected_requests_total{reason}`), FLOPs estimates, `cache_config_info`.
`stoker_engine_` names what only this engine reports: rejections, start-up phases, a plain 0/1
sleep gauge (`vllm:engine_sleep_state` says the same by level), the prefix blocks kept across sleep
and stop (`stoker.engine.kv_keep`: kept, restored, and files refused by reason), and LoRA adapter
loads, their seconds, evictions and the number loaded (vLLM's one LoRA family, `vllm:lora_requests_info`, an
info gauge whose label values are adapter names, is not exported).

One registry per engine, built by the composition root, never a module-level global.
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LABELS = ("model_name", "engine")
ENGINE = "0"  # vLLM's `engine` label: the data-parallel rank; this engine is one rank

# vLLM 0.32's bucket families (vllm/v1/metrics/buckets.py), so quantiles of the two engines compare
# bucket for bucket: sub-second to a 40-minute TTFT, 10 ms to 80 s between tokens, 0.3 s to the
# two hours of a long batch request for the request phases.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
LORA_LOAD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FinishReason, all shown
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")  # awake; asleep at level 1; at level 2


def request_tokens_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, … up to the context length (2048 → … 1000, 2000)."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(out)
            out.append(float(mantissa * scale))
        scale *= 10


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._model = model_name
        r, labels = self.registry, list(LABELS)

        def one(metric):
            return metric.labels(model_name=model_name, engine=ENGINE)

        def gauge(name: str, help: str):
            return one(Gauge(name, help, labels, registry=r, multiprocess_mode="mostrecent"))

        def counter(name: str, help: str):
            return one(Counter(name, help, labels, registry=r))

        def histogram(name: str, help: str, buckets):
            return one(Histogram(name, help, labels, buckets=buckets, registry=r))

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        sleep = Gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            [*labels, "sleep_state"],
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self._sleep_state = {
            s: sleep.labels(model_name=model_name, engine=ENGINE, sleep_state=s) for s in SLEEP_STATES
        }
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self._prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self._prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=r,
        )
        self._success = {
            reason: success.labels(model_name=model_name, engine=ENGINE, finished_reason=reason)
            for reason in FINISH_REASONS
        }
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self._tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self._e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._inference = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._prefill = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._decode = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", REQUEST_PARAMS_N_BUCKETS
        )
        # The token-count histograms' buckets run to the context length, known once the model is
        # loaded (`sized`); until then they are not registered, as vLLM serves no /metrics before.
        self._prompt_len = self._generation_len = self._max_tokens = self._max_generation = None
        self.sleeping = one(
            Gauge("stoker_engine_sleeping", "1 while the engine is asleep.", labels, registry=r)
        )
        self._rejected = Counter(
            "stoker_engine_rejected_requests",
            "Requests refused with 503, by reason.",
            [*labels, "reason"],
            registry=r,
        )
        self._phase = Gauge(
            "stoker_engine_startup_phase_seconds",
            "Duration of each phase of the last start or wake-up.",
            [*labels, "phase"],
            registry=r,
        )
        # LoRA adapters (`stoker.engine.adapters`). vLLM exports only `vllm:lora_requests_info`
        # (adapter names as label values); loads, their time and evictions are this engine's own.
        self._lora_loads = Counter(
            "stoker_engine_lora_adapter_loads",
            "LoRA adapter loads, by result: ok, refused (a 4xx) or failed.",
            [*labels, "result"],
            registry=r,
        )
        self._lora_load_seconds = histogram(
            "stoker_engine_lora_adapter_load_seconds",
            "Histogram of the time to read, check and add one LoRA adapter, in seconds.",
            LORA_LOAD_BUCKETS,
        )
        self._lora_evictions = counter(
            "stoker_engine_lora_adapter_evictions", "LoRA adapters evicted to make room (--max-adapters)."
        )
        self._lora_loaded = gauge("stoker_engine_lora_adapters_loaded", "LoRA adapters loaded now.")
        # Prefix blocks kept across sleep and stop (`stoker.engine.kv_keep`).
        self._kv_kept = counter(
            "stoker_engine_kv_kept_blocks", "Prefix KV blocks written to the store on sleep or stop."
        )
        self._kv_restored = counter(
            "stoker_engine_kv_restored_blocks",
            "Kept prefix KV blocks mapped back into the cache on start or wake.",
        )
        self._kv_rejected = Counter(
            "stoker_engine_kv_restore_rejected",
            "Kept-KV files ignored on start or wake, by reason (corrupt, foreign, oversize, ...).",
            [*labels, "reason"],
            registry=r,
        )
        self.asleep(None)

    def lora_load(self, result: str, seconds: float | None = None) -> None:
        self._lora_loads.labels(model_name=self._model, engine=ENGINE, result=result).inc()
        if seconds is not None:
            self._lora_load_seconds.observe(seconds)

    def lora_evicted(self) -> None:
        self._lora_evictions.inc()

    def lora_adapters(self, loaded: int) -> None:
        self._lora_loaded.set(loaded)

    def prefix_cache(self, queried: int, hit: int) -> None:
        self._prefix_queries.inc(queried)
        if hit:
            self._prefix_hits.inc(hit)

    def kv_kept(self, blocks: int) -> None:
        self._kv_kept.inc(blocks)

    def kv_restored(self, blocks: int) -> None:
        self._kv_restored.inc(blocks)

    def kv_rejected(self, reason: str) -> None:
        self._kv_rejected.labels(model_name=self._model, engine=ENGINE, reason=reason).inc()

    def sized(self, max_model_len: int) -> None:
        """Register the token-count histograms, whose buckets end at the context length (once)."""
        if self._prompt_len is not None:
            return
        buckets = request_tokens_buckets(max_model_len)

        def histogram(name: str, help: str):
            metric = Histogram(name, help, list(LABELS), buckets=buckets, registry=self.registry)
            return metric.labels(model_name=self._model, engine=ENGINE)

        self._prompt_len = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.")
        self._generation_len = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed."
        )
        self._max_generation = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
        )
        self._max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter."
        )

    def asleep(self, level: int | None) -> None:
        """The engine went to sleep at `level` (1 or 2), or woke (None)."""
        self.sleeping.set(0 if level is None else 1)
        self._sleep_state["awake"].set(1 if level is None else 0)
        self._sleep_state["weights_offloaded"].set(1 if level == 1 else 0)
        self._sleep_state["discard_all"].set(1 if level == 2 else 0)

    def request_done(
        self,
        reason: str,
        *,
        arrival: float,
        admitted: float,
        first_token: float | None,
        last_token: float | None,
        now: float,
        prompt_tokens: int,
        generation_tokens: int,
        max_tokens: int | None,
        max_new_tokens: int,
        n: int = 1,
    ) -> None:
        """One request ended (`reason`: one of `FINISH_REASONS`), as vLLM records a finished request.

        Times are on the engine's clock. One the client left (abort) or that failed (error) is
        counted, not timed: its phases ended early and would pull the latency histograms down
        (vLLM records no request stats for one its client aborts).
        """
        self._success[reason].inc()
        if reason not in ("stop", "length"):
            return
        first = first_token if first_token is not None else admitted
        last = last_token if last_token is not None else first
        self._e2e.observe(now - arrival)
        self._queue.observe(admitted - arrival)
        self._prefill.observe(first - admitted)
        self._decode.observe(last - first)
        self._inference.observe(last - admitted)
        # vLLM: the decode time over the tokens after the first; 0 for a request of one token or none
        self._tpot.observe((last - first) / (generation_tokens - 1) if generation_tokens > 1 else 0.0)
        if n:  # a request's `n`, once: by its first choice (the others pass 0)
            self._n.observe(n)
        if self._prompt_len is not None:
            self._prompt_len.observe(prompt_tokens)
            self._generation_len.observe(generation_tokens)
            self._max_generation.observe(max_new_tokens)
            if max_tokens:
                self._max_tokens.observe(max_tokens)

    def kv_blocks(self, used: int, total: int) -> None:
        """Blocks of the KV cache the running requests' tokens occupy, of `total`."""
        self.kv_cache_usage.set(min(used / total, 1.0) if total > 0 else 0.0)

    def rejected(self, reason: str) -> None:
        self._rejected.labels(model_name=self._model, engine=ENGINE, reason=reason).inc()

    def phase(self, name: str, seconds: float) -> None:
        self._phase.labels(model_name=self._model, engine=ENGINE, phase=name).set(seconds)


def blocks(tokens: int, block_size: int) -> int:
    """KV blocks of `block_size` tokens that `tokens` tokens fill (the last one partly)."""
    return math.ceil(tokens / block_size)
