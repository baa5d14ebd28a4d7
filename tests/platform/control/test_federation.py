"""`GET /metrics/engines`: every READY instance's engine metrics, labelled and merged at scrape time
(`stoker.control.federate`). The merge as a pure function; the scrape against loopback instances that are
fast, slow, dead, refusing, oversized or not Prometheus; the real platform with two deployments."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time

import httpx
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from stoker.control.federate import EngineFederation, FederationLimits, Target, federate, revision_of
from tests.activator.conftest import closed_port, running
from tests.conftest import promtool
from tests.deadlines import CLI, deadline

A = Target("chat", "0123456789ab", "chat-1", "http://a")
B = Target("chat", "0123456789ab", "chat-2", "http://b")
C = Target("code", "ba9876543210", "code-1", "http://c")

PAGE_A = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="chat"} 2.0
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.0",model_name="chat"} 1.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="chat"} 2.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="chat"} 2.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="chat"} 3.5
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="chat"} 40.0
"""
PAGE_B = PAGE_A.replace(" 2.0\n", " 5.0\n", 1).replace('model_name="chat"} 40.0', 'model_name="chat"} 7.0')
# Another engine version that types a family otherwise, and sets a label named like one of ours.
PAGE_C = """# HELP vllm:num_requests_running Something else.
# TYPE vllm:num_requests_running counter
vllm:num_requests_running_total{model_name="code"} 9.0
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{instance="pod-7",model_name="code"} 1.0
"""


def parsed(body: bytes) -> dict:
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def samples(body: bytes, name: str) -> dict[tuple, float]:
    """sample name → {(deployment, instance): value} of the one family holding it."""
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if s.name == name:
                out[(s.labels.get("deployment"), s.labels.get("instance"), s.labels.get("le"))] = s.value
    return out


def test_instances_merge_under_one_help_and_type_with_their_labels_added():
    body, unparsable = federate([(A, PAGE_A), (B, PAGE_B)])
    assert unparsable == {}
    text = body.decode()
    assert text.count("# TYPE vllm:num_requests_running gauge") == 1
    assert text.count("# HELP vllm:e2e_request_latency_seconds ") == 1
    assert samples(body, "vllm:num_requests_running") == {
        ("chat", "chat-1", None): 2.0,
        ("chat", "chat-2", None): 5.0,
    }
    assert samples(body, "vllm:prompt_tokens_total") == {
        ("chat", "chat-1", None): 40.0,
        ("chat", "chat-2", None): 7.0,
    }
    buckets = samples(body, "vllm:e2e_request_latency_seconds_bucket")
    assert buckets[("chat", "chat-2", "+Inf")] == 2.0 and len(buckets) == 4
    labels = next(iter(parsed(body)["vllm:num_requests_running"].samples)).labels
    assert labels == {
        "engine": "0",
        "model_name": "chat",
        "deployment": "chat",
        "revision": "0123456789ab",
        "instance": "chat-1",
    }
    assert samples(body, "stoker_engine_scrape_up") == {
        ("chat", "chat-1", None): 1.0,
        ("chat", "chat-2", None): 1.0,
    }


def test_a_family_typed_otherwise_is_left_out_and_a_clashing_label_is_kept_as_exported():
    body, _ = federate([(A, PAGE_A), (C, PAGE_C)])
    running = parsed(body)["vllm:num_requests_running"]
    assert running.type == "gauge" and {s.labels["instance"] for s in running.samples} == {"chat-1"}
    code = [s for s in parsed(body)["vllm:prompt_tokens"].samples if s.labels["deployment"] == "code"]
    assert [(s.labels["instance"], s.labels["exported_instance"]) for s in code] == [("code-1", "pod-7")]


def test_unparsable_and_down_instances_are_up_0_and_the_rest_still_served():
    body, unparsable = federate([(A, PAGE_A), (B, "vllm:x{ 1\n")], down=[C])
    assert list(unparsable) == [B]
    assert samples(body, "stoker_engine_scrape_up") == {
        ("chat", "chat-1", None): 1.0,
        ("chat", "chat-2", None): 0.0,
        ("code", "code-1", None): 0.0,
    }
    assert samples(body, "vllm:num_requests_running") == {("chat", "chat-1", None): 2.0}


def test_no_instances_is_an_empty_but_valid_exposition():
    body, _ = federate([])
    assert parsed(body)["stoker_engine_scrape_up"].samples == []


def test_the_revision_is_the_snapshot_ids_prefix():
    assert revision_of("0123456789abcdef" * 4) == "0123456789ab"


class Engine:
    """A /metrics stand-in: `page` to a caller with the key; with a `gate`, only once it is set."""

    def __init__(
        self, page: str, key: str = "k", gate: asyncio.Event | None = None, status: int = 200
    ) -> None:
        self.page, self.key, self.gate, self.status = page, key, gate, status
        self.asked = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        self.asked += 1
        if self.gate is not None:
            await self.gate.wait()
        ok = dict(scope["headers"]).get(b"authorization") == f"Bearer {self.key}".encode()
        status = self.status if ok else 401
        await send(
            {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"text/plain")]}
        )
        await send({"type": "http.response.body", "body": self.page.encode()})


def target(name: str, url: str, key: str = "k") -> Target:
    return Target("d", "rev", name, url, {"authorization": f"Bearer {key}"})


async def test_a_scrape_is_bounded_skips_what_fails_and_counts_why():
    never = asyncio.Event()  # set only after the scrape: the slow instance answers too late
    engines = {
        "fast": Engine(PAGE_A),
        "slow": Engine(PAGE_A, gate=never),
        "big": Engine(PAGE_A * 200),  # ~170 kB, over the 64 kB cap below
        "broken": Engine("<html>not metrics</html>{"),
        "refusing": Engine(PAGE_A, status=503),
        "other_key": Engine(PAGE_A, key="other"),
    }
    registry = CollectorRegistry()
    federation = EngineFederation(registry, FederationLimits(timeout_s=0.5, max_instance_bytes=64 << 10))
    try:
        async with running(*engines.values()) as urls:
            targets = [target(name, url) for name, url in zip(engines, urls, strict=True)]
            targets.append(target("dead", f"http://127.0.0.1:{closed_port()}"))
            started = time.monotonic()
            body = await federation.scrape(targets)
            took = time.monotonic() - started
            never.set()
    finally:
        await federation.aclose()
    assert took < 0.5 + 1.0  # the slow one did not hold the scrape past its deadline (0.5 s)
    up = {instance: v for (_, instance, _), v in samples(body, "stoker_engine_scrape_up").items()}
    assert up == {"fast": 1, "slow": 0, "big": 0, "broken": 0, "refusing": 0, "other_key": 0, "dead": 0}
    assert samples(body, "vllm:num_requests_running") == {("d", "fast", None): 2.0}
    skipped = {
        reason: registry.get_sample_value(
            "stoker_engine_scrapes_skipped_total", {"deployment": "d", "reason": reason}
        )
        for reason in ("timeout", "too_big", "unparsable", "status", "unreachable")
    }
    assert skipped == {"timeout": 1, "too_big": 1, "unparsable": 1, "status": 2, "unreachable": 1}
    assert engines["fast"].asked == 1


async def test_the_total_size_is_bounded_in_target_order():
    registry = CollectorRegistry()
    size = len(PAGE_A.encode())
    federation = EngineFederation(registry, FederationLimits(max_total_bytes=2 * size + 1))
    try:
        async with running(Engine(PAGE_A), Engine(PAGE_B), Engine(PAGE_A)) as urls:
            body = await federation.scrape([target(f"i{n}", url) for n, url in enumerate(urls)])
    finally:
        await federation.aclose()
    up = {instance: v for (_, instance, _), v in samples(body, "stoker_engine_scrape_up").items()}
    assert up == {"i0": 1, "i1": 1, "i2": 0}
    assert (
        registry.get_sample_value(
            "stoker_engine_scrapes_skipped_total", {"deployment": "d", "reason": "over_budget"}
        )
        == 1
    )


ADMIN = "admin-key-for-the-federation-test"


def test_the_gateway_federates_every_ready_instance(platform_factory, tiny_model_dir):
    """Two deployments at one instance each, behind a platform with an admin key: one scrape of the
    gateway shows both engines' vLLM-named families, labelled with the ids and revisions the admin
    API shows, under one HELP and TYPE each."""
    p = platform_factory("--stable-window", "600", env={"STOKER_ADMIN_KEY": ADMIN})
    admin = {"authorization": f"Bearer {ADMIN}"}
    for name in ("chat", "code"):
        p.deploy(name, tiny_model_dir, "--idle-timeout", "600")

    async def call_both() -> None:
        async with httpx.AsyncClient(base_url=p.url, headers=admin, timeout=deadline(120)) as client:
            answers = await asyncio.gather(
                *(
                    client.post(
                        "/v1/completions",
                        json={"model": name, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True},
                    )
                    for name in ("chat", "code")
                )
            )
        assert [a.status_code for a in answers] == [200, 200]

    asyncio.run(call_both())
    expected = {}
    for name in ("chat", "code"):
        described = httpx.get(f"{p.url}/admin/v1/deployments/{name}", headers=admin).json()
        (instance,) = [i for i in described["instance_list"] if i["state"] == "READY"]
        assert instance["url"].startswith("http://127.0.0.1:")  # the admin API lists where it is
        expected[(name, instance["id"])] = str(described["revision"])  # the revision it serves

    assert httpx.get(f"{p.url}/metrics/engines").status_code == 401  # admin-only, as /metrics
    response = httpx.get(f"{p.url}/metrics/engines", headers=admin, timeout=deadline(30))
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    body = response.content
    families = parsed(body)
    success = families["vllm:request_success"]
    assert {(s.labels["deployment"], s.labels["instance"]) for s in success.samples} == set(expected)
    for s in success.samples:
        assert s.labels["revision"] == expected[(s.labels["deployment"], s.labels["instance"])]
        assert s.labels["model_name"] in ("chat", "code") and s.labels["engine"] == "0"
    generated = samples(body, "vllm:generation_tokens_total")
    assert {key[:2]: v for key, v in generated.items()} == {key: 3.0 for key in expected}
    assert body.decode().count("# TYPE vllm:time_to_first_token_seconds histogram") == 1
    assert {v for v in samples(body, "stoker_engine_scrape_up").values()} == {1.0}
    checker = promtool()
    # In CI `make test` fetches promtool: there the check must run, not be passed over.
    assert checker is not None or not os.environ.get("CI"), "promtool not found: `make test` fetches it"
    if checker is not None:
        check = subprocess.run([checker, "check", "metrics"], input=body, capture_output=True, timeout=CLI)
        # vLLM's names hold ':', which promtool's lint flags (it does so for vLLM's own server too).
        problems = [
            line
            for line in (check.stdout + check.stderr).decode().splitlines()
            if line and "should not contain ':'" not in line
        ]
        assert problems == [], problems
