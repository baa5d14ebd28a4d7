"""The CPU engine's Prometheus metrics, named as vLLM names them so one dashboard serves both engines.

vLLM's names (`vllm:` prefix, label `model_name`) where vLLM has the metric; `stoker_engine_` for
what only this engine reports (sleep state, rejections, start-up phases). One registry per engine,
built by the composition root, never a module-level global.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Buckets follow vLLM's so that quantiles of the two engines compare bucket for bucket.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r, labels = self.registry, ["model_name"]

        def one(metric):
            return metric.labels(model_name=model_name)

        self.running = one(
            Gauge("vllm:num_requests_running", "Requests being generated.", labels, registry=r)
        )
        self.waiting = one(
            Gauge("vllm:num_requests_waiting", "Requests waiting for a slot.", labels, registry=r)
        )
        self.prompt_tokens = one(
            Counter("vllm:prompt_tokens", "Prompt tokens processed.", labels, registry=r)
        )
        self.generation_tokens = one(
            Counter("vllm:generation_tokens", "Tokens generated.", labels, registry=r)
        )
        self.ttft = one(
            Histogram(
                "vllm:time_to_first_token_seconds",
                "Time from arrival to the first generated token.",
                labels,
                buckets=TTFT_BUCKETS,
                registry=r,
            )
        )
        self.itl = one(
            Histogram(
                "vllm:inter_token_latency_seconds",
                "Time between consecutive generated tokens.",
                labels,
                buckets=ITL_BUCKETS,
                registry=r,
            )
        )
        self.e2e = one(
            Histogram(
                "vllm:e2e_request_latency_seconds",
                "Time from arrival to the last token.",
                labels,
                buckets=E2E_BUCKETS,
                registry=r,
            )
        )
        self._success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason.",
            [*labels, "finished_reason"],
            registry=r,
        )
        self._model = model_name
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

    def finished(self, reason: str) -> None:
        self._success.labels(model_name=self._model, finished_reason=reason).inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(model_name=self._model, reason=reason).inc()

    def phase(self, name: str, seconds: float) -> None:
        self._phase.labels(model_name=self._model, phase=name).set(seconds)
