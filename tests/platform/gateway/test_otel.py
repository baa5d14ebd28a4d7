"""OpenTelemetry, optional: off (and not imported) without an OTLP endpoint; with one, a real
`stoker up` sends each request's spans to a tiny OTLP/HTTP receiver on loopback (a real HTTP
server here, decoding the protobuf with opentelemetry-proto), under the GenAI conventions' names."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from stoker.gateway import otel
from tests.deadlines import COLD_ANSWER, WAIT, deadline

trace_service = pytest.importorskip(
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2",
    reason="opentelemetry-proto is not installed (pip install 'stoker[otel]' opentelemetry-proto)",
)
metrics_service = pytest.importorskip("opentelemetry.proto.collector.metrics.v1.metrics_service_pb2")
pytest.importorskip(
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    reason="the OTLP/HTTP exporter is not installed (pip install 'stoker[otel]')",
)


def test_off_without_an_endpoint_and_nothing_imported():
    assert (
        otel.tracing_from_env({}) is None
        and otel.tracing_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": " "}) is None
    )
    code = (
        "import sys, argparse\n"
        "from prometheus_client import CollectorRegistry\n"
        "import stoker.serve.up, stoker.cli.up as s\n"
        "from stoker.serve.common import observer_of\n"
        "p = argparse.ArgumentParser(); s.add_request_log_args(p)\n"
        "o = observer_of(s.request_logging(p.parse_args([]))); o.register(CollectorRegistry())\n"
        "assert o.tracing is None\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]"


def test_an_endpoint_without_the_packages_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)
    with pytest.raises(otel.TracingUnavailable, match=r"pip install 'stoker\[otel\]'"):
        otel.tracing_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"})


class Receiver(http.server.ThreadingHTTPServer):
    """OTLP/HTTP's trace and metric routes: protobuf in, each span kept as a dict, metrics by name."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.metrics: set[str] = set()
        super().__init__(("127.0.0.1", 0), Handler)


class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        data = self.rfile.read(int(self.headers["content-length"]))
        if self.path == "/v1/traces":
            request = trace_service.ExportTraceServiceRequest.FromString(data)
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    for span in scope.spans:
                        self.server.spans.append(_span(span))
            reply = trace_service.ExportTraceServiceResponse().SerializeToString()
        else:
            request = metrics_service.ExportMetricsServiceRequest.FromString(data)
            for resource in request.resource_metrics:
                for scope in resource.scope_metrics:
                    self.server.metrics.update(m.name for m in scope.metrics if m.histogram.data_points)
            reply = metrics_service.ExportMetricsServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


def _span(span) -> dict:
    attributes = {}
    for kv in span.attributes:
        kind = kv.value.WhichOneof("value")
        value = getattr(kv.value, kind)
        attributes[kv.key] = [v.string_value for v in value.values] if kind == "array_value" else value
    return {
        "name": span.name,
        "kind": span.kind,
        "trace": span.trace_id.hex(),
        "id": span.span_id.hex(),
        "parent": span.parent_span_id.hex(),
        "start": span.start_time_unix_nano,
        "end": span.end_time_unix_nano,
        "attributes": attributes,
    }


@pytest.fixture
def receiver():
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_spans_arrive_with_the_gen_ai_names(receiver, platform_factory, tiny_model_dir):
    # `receiver` first: torn down after the platform, whose exporter flushes to it as it stops
    endpoint = f"http://127.0.0.1:{receiver.server_address[1]}"
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_METRIC_EXPORT_INTERVAL": "200",
    }
    p = platform_factory(env=env)
    p.deploy("tiny", tiny_model_dir, "--max", "1", "--idle-timeout", "600")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
    answered = httpx.post(f"{p.url}/v1/chat/completions", json=body, timeout=COLD_ANSWER)
    assert answered.status_code == 200, answered.text
    end = time.monotonic() + WAIT
    while time.monotonic() < end and not any(s["name"] == "chat tiny" for s in receiver.spans):
        time.sleep(0.1)
    roots = [s for s in receiver.spans if s["name"] == "chat tiny"]
    assert len(roots) == 1, receiver.spans
    root = roots[0]
    a = root["attributes"]
    usage = answered.json()["usage"]
    assert root["kind"] == 2 and root["parent"] == ""  # SPAN_KIND_SERVER, a trace of its own
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "tiny"
    assert a["gen_ai.provider.name"] == "stoker"
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert a["gen_ai.response.finish_reasons"] == [answered.json()["choices"][0]["finish_reason"]]
    assert 0 <= a["gen_ai.server.time_to_first_token"] <= a["gen_ai.server.request.duration"]
    if usage["completion_tokens"] > 1:
        assert a["gen_ai.server.time_per_output_token"] >= 0
    assert a["stoker.revision"] == int(answered.headers["x-stoker-revision"])
    assert a["stoker.cold_start"] == (answered.headers["x-stoker-cold-start"] == "true")
    assert a["http.response.status_code"] == 200 and "gen_ai.client.token.usage" not in a
    assert root["end"] - root["start"] == pytest.approx(a["gen_ai.server.request.duration"] * 1e9, abs=1e3)
    end = time.monotonic() + deadline(30)
    while time.monotonic() < end and not any(s["name"] == "stoker.instance" for s in receiver.spans):
        time.sleep(0.1)
    (instance,) = [s for s in receiver.spans if s["name"] == "stoker.instance"]
    assert instance["trace"] == root["trace"] and instance["parent"] == root["id"]
    assert (
        instance["kind"] == 3
        and instance["attributes"]["stoker.instance"] == answered.headers["x-stoker-instance"]
    )
    assert root["start"] <= instance["start"] <= instance["end"] <= root["end"]
    holds = [s for s in receiver.spans if s["name"] == "stoker.hold"]  # when the activator says how long
    for hold in holds:
        assert (
            hold["parent"] == root["id"]
            and root["start"] == hold["start"] <= hold["end"] == instance["start"]
        )
    names = {"gen_ai.server.request.duration", "gen_ai.server.time_to_first_token"}
    if usage["completion_tokens"] > 1:
        names.add("gen_ai.server.time_per_output_token")
    end = time.monotonic() + deadline(30)
    while time.monotonic() < end and not names <= receiver.metrics:
        time.sleep(0.1)
    assert names <= receiver.metrics and "gen_ai.client.token.usage" not in receiver.metrics
