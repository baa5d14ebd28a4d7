"""OpenTelemetry traces of inference requests, optional: on only when `OTEL_EXPORTER_OTLP_ENDPOINT`
(or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, exported over OTLP/HTTP (protobuf) by the SDK's
batch processor, off the event loop. Needs the `otel` extra (`pip install 'stoker[otel]'`).

Nothing here is imported unless tracing is on: the gateway's request path checks one attribute
(`Observer.tracing is None`) and `stoker up` imports this module only when the variable is set.

Each request is one trace, written when it ends, with the times the request log's tap measured:

    chat tiny                 SERVER  arrival at the gateway → the answer's end
    ├── stoker.hold           INTERNAL arrival → an instance took it (only when it was held and the
    │                                  activator says how long: scope["stoker.held_s"])
    └── stoker.instance       CLIENT  after the hold → the answer's end (x-stoker-instance)

The root span carries the GenAI semantic conventions' names: `gen_ai.operation.name` (`chat`,
`text_completion`), `gen_ai.provider.name` (`stoker`), `gen_ai.request.model`,
`gen_ai.usage.input_tokens`, `gen_ai.usage.output_tokens`, `gen_ai.response.finish_reasons`, and
the server timings under the names the conventions give their metrics:
`gen_ai.server.request.duration`, `gen_ai.server.time_to_first_token` and
`gen_ai.server.time_per_output_token` (seconds; TPOT = (end − first byte) / (output tokens − 1)).
Also `http.response.status_code`, `error.type` for 4xx/5xx, `stoker.control.deployment`,
`stoker.revision`, `stoker.cold_start`. Never the key, the prompt or the answer.

The same three timings are exported as the conventions' metrics too (histograms in seconds, by
`gen_ai.operation.name`, `gen_ai.provider.name`, `gen_ai.request.model` and `error.type`), over
OTLP every `OTEL_METRIC_EXPORT_INTERVAL` ms (60 s by default).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


class TracingUnavailable(Exception):
    """Tracing was asked for, but the OpenTelemetry packages are not installed."""


def wanted(environ: Mapping[str, str] = os.environ) -> bool:
    return any(environ.get(name, "").strip() for name in ENDPOINT_VARIABLES)


def tracing_from_env(environ: Mapping[str, str] = os.environ) -> Tracing | None:
    """A `Tracing` when an OTLP endpoint is set, else None; `TracingUnavailable` when one is set
    and the packages are missing."""
    if not wanted(environ):
        return None
    try:
        return Tracing(environ.get("OTEL_SERVICE_NAME") or "stoker")
    except ImportError as exc:
        raise TracingUnavailable(
            f"OTEL_EXPORTER_OTLP_ENDPOINT is set but OpenTelemetry is not installed ({exc.name}): "
            "pip install 'stoker[otel]', or unset the variable"
        ) from None


class Tracing:
    """A tracer and a meter provider of our own (the global ones are left alone), with OTLP/HTTP
    exporters (the SDK reads the usual OTEL_* variables: endpoint, headers, timeouts, intervals)."""

    def __init__(self, service_name: str = "stoker") -> None:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        resource = Resource.create({"service.name": service_name})
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        self.tracer = self.provider.get_tracer("stoker")
        reader = PeriodicExportingMetricReader(OTLPMetricExporter())
        self.meters = MeterProvider(resource=resource, metric_readers=[reader])
        meter = self.meters.get_meter("stoker")
        self.histograms = {
            name: meter.create_histogram(name, unit="s", description=description)
            for name, description in METRICS.items()
        }

    def request(self, record: Any, tap: Any, scope: Mapping[str, Any]) -> None:
        """One request's spans, from the request log's `record` and its `tap`'s times."""
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind, Status, StatusCode

        start = int(tap.meta["wall"] * 1e9)
        end = start + int(record.e2e_s * 1e9)
        operation = "chat" if tap.meta["chat"] else "text_completion"
        attributes = gen_ai_attributes(record, operation, tap.meta.get("model"))
        root = self.tracer.start_span(
            f"{operation} {record.deployment}", kind=SpanKind.SERVER, start_time=start, attributes=attributes
        )
        if record.status >= 500:
            root.set_status(Status(StatusCode.ERROR))
        parent = trace.set_span_in_context(root)
        dispatched = start
        held = scope.get("stoker.held_s")
        if isinstance(held, int | float) and held >= 0:
            dispatched = min(end, start + int(held * 1e9))
            hold = self.tracer.start_span("stoker.hold", context=parent, start_time=start)
            hold.end(end_time=dispatched)
        if tap.instance is not None or record.status == 200:  # an instance answered
            where = {"stoker.instance": tap.instance} if tap.instance else {}
            instance = self.tracer.start_span(
                "stoker.instance",
                context=parent,
                kind=SpanKind.CLIENT,
                start_time=dispatched,
                attributes=where,
            )
            instance.end(end_time=end)
        root.end(end_time=end)
        self._measure(attributes)

    def _measure(self, attributes: Mapping[str, Any]) -> None:
        labels = {k: attributes[k] for k in METRIC_ATTRIBUTES if k in attributes}
        for name, histogram in self.histograms.items():
            if name in attributes:
                histogram.record(attributes[name], labels)

    def close(self) -> None:
        self.provider.shutdown()  # exports what is batched, within the exporters' timeouts
        self.meters.shutdown()


METRICS = {
    "gen_ai.server.request.duration": "Generative AI server request duration",
    "gen_ai.server.time_to_first_token": "Time to generate the first token for successful responses",
    "gen_ai.server.time_per_output_token": "Time per output token generated after the first token",
}
METRIC_ATTRIBUTES = ("gen_ai.operation.name", "gen_ai.provider.name", "gen_ai.request.model", "error.type")


def gen_ai_attributes(record: Any, operation: str, model: str | None) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": "stoker",
        "gen_ai.request.model": model or record.deployment,
        "gen_ai.server.request.duration": record.e2e_s,
        "http.response.status_code": record.status,
        "stoker.deployment": record.deployment,
    }
    if record.ttft_s is not None:
        attributes["gen_ai.server.time_to_first_token"] = record.ttft_s
        out = record.completion_tokens
        if out is not None and out > 1:
            attributes["gen_ai.server.time_per_output_token"] = (record.e2e_s - record.ttft_s) / (out - 1)
    if record.prompt_tokens is not None:
        attributes["gen_ai.usage.input_tokens"] = record.prompt_tokens
    if record.completion_tokens is not None:
        attributes["gen_ai.usage.output_tokens"] = record.completion_tokens
    if record.finish_reason is not None:
        attributes["gen_ai.response.finish_reasons"] = [record.finish_reason]
    if record.revision is not None:
        attributes["stoker.revision"] = record.revision
    if record.cold_start is not None:
        attributes["stoker.cold_start"] = record.cold_start
    if record.status >= 400:
        attributes["error.type"] = str(record.status)
    return attributes
