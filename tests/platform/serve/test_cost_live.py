"""Live cost end to end: a real `stoker up --prices`, the tiny model deployed, four requests (plain,
streamed with and without usage), the deployment removed so its counters stop, then `stoker cost
--json`: every figure must follow from the platform's own metrics, the answers' usage and the
price table, exactly (float rounding aside). Nothing here depends on how long anything took."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stoker.control.prices import STATE_PRICE
from tests.deadlines import COLD_ANSWER

PRICES = {
    "ready_hour": {"cpu": 3.6, "vllm": 36},
    "starting_hour": 7.2,
    "sleeping_hour": 0.36,
    "snapshot_gb_month": 1000,
}
PER_SECOND = {"ready_hour": 0.001, "starting_hour": 0.002, "sleeping_hour": 0.0001}


def _post(url: str, body: dict) -> tuple[bytes, httpx.Response, int]:
    raw = json.dumps(body).encode()
    response = httpx.post(url, content=raw, headers={"content-type": "application/json"}, timeout=COLD_ANSWER)
    assert response.status_code == 200, response.text
    return response.content, response, len(raw)


def test_cost_follows_from_the_metrics_the_usage_and_the_prices(platform_factory, tiny_model_dir, tmp_path):
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps(PRICES))
    p = platform_factory("--prices", str(prices), "--stable-window", "2")
    p.deploy("tiny", tiny_model_dir, "--max", "1", "--idle-timeout", "600")
    chat = f"{p.url}/v1/chat/completions"
    messages = [{"role": "user", "content": "hello there"}]
    tokens_in = tokens_out = 0
    # Plain answers: their usage.
    for n in (3, 5):
        body, _, _ = _post(chat, {"model": "tiny", "messages": messages, "max_tokens": n})
        usage = json.loads(body)["usage"]
        tokens_in, tokens_out = tokens_in + usage["prompt_tokens"], tokens_out + usage["completion_tokens"]
    # A stream that asks for usage: its last event's.
    stream = {"model": "tiny", "messages": messages, "max_tokens": 4, "stream": True}
    body, _, _ = _post(chat, stream | {"stream_options": {"include_usage": True}})
    events = [json.loads(e[6:]) for e in body.decode().split("\n\n") if e.startswith("data: {")]
    usage = events[-1]["usage"]
    tokens_in, tokens_out = tokens_in + usage["prompt_tokens"], tokens_out + usage["completion_tokens"]
    # A stream without usage: the prompt's estimate (body bytes / 4 + 1) in, one token an event out.
    body, _, size = _post(chat, stream)
    tokens_in, tokens_out = tokens_in + size // 4 + 1, tokens_out + body.count(b"data: ") - 1

    bad = httpx.get(f"{p.url}/admin/v1/cost", params={"since": "25h"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "since"

    p.cli("rm", "tiny")  # drained and stopped: from here every counter stands still
    [row] = json.loads(p.cli("cost", "--json").stdout)
    assert row["deployment"] == "tiny"
    assert (row["requests"], row["tokens_in"], row["tokens_out"]) == (4, tokens_in, tokens_out)
    assert p.metric("stoker_tokens_total", deployment="tiny", revision="1", direction="in") == tokens_in
    assert p.metric("stoker_tokens_total", deployment="tiny", revision="1", direction="out") == tokens_out

    # Instance-seconds: the pools' own counter, state by state; priced by the table.
    seconds = {
        state: p.metric("stoker_instance_seconds_total", deployment="tiny", state=state)
        for state in STATE_PRICE
    }
    seconds = {state: s for state, s in seconds.items() if s}
    assert row["instance_seconds"] == pytest.approx(seconds, abs=1e-5)
    assert seconds["READY"] > 0 and seconds["STARTING"] > 0
    usage_cost = sum(s * PER_SECOND[STATE_PRICE[state]] for state, s in seconds.items())
    assert row["storage_usd"] > 0  # the tiny snapshot's bytes, for as long as its pool ran
    assert row["cost_usd"] == pytest.approx(usage_cost + row["storage_usd"], abs=1e-8)
    assert p.metric("stoker_cost_usd_total", deployment="tiny") == pytest.approx(row["cost_usd"], abs=1e-8)
    assert row["cost_per_1k_tokens"] == pytest.approx(
        row["cost_usd"] / (tokens_in + tokens_out) * 1000, abs=1e-6
    )  # the report rounds per-1k figures to 6 decimals
    assert row["cost_per_1k_requests"] == pytest.approx(row["cost_usd"] / 4 * 1000, abs=1e-6)
    # Idle: READY or asleep with nothing in flight; every request was in flight on a READY instance
    # for a while, so strictly less than all of those seconds.
    awake_or_asleep = seconds["READY"] + seconds.get("SLEEPING", 0.0)
    assert 0 <= row["idle_seconds"] < awake_or_asleep
    assert row["idle_share"] == pytest.approx(row["idle_seconds"] / sum(seconds.values()), abs=1e-6)
    [revision] = row["revisions"]
    assert revision["revision"] == 1 and revision["cost_usd"] == pytest.approx(row["cost_usd"], abs=1e-9)
    # All of it happened within the last hour.
    assert json.loads(p.cli("cost", "--since", "1h", "--json").stdout) == [row]
    table = p.cli("cost").stdout
    assert "tiny" in table and "$/1K TOKENS" in table

    # The arrival log has the four, with the same tokens, and replays.
    log = p.home / "arrivals" / "arrivals.jsonl"
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["deployment"] for x in lines] == ["tiny"] * 4
    assert (sum(x["in"] for x in lines), sum(x["out"] for x in lines)) == (tokens_in, tokens_out)
    replay = p.cli("simulate", "--from-log", str(log), "--prices", str(prices), "--profile", "cpu", "--json")
    assert {json.loads(x)["requests"] for x in replay.stdout.splitlines()} == {4}
    # ... with this deployment's own start times, as the platform measured them (its settings count).
    measured = p.cli(
        "simulate", "--from-log", str(log), "--deployment", "tiny", "--measured-starts", "--url", p.url,
        "--policy", "kpa", "--profile", "cpu", "--json",
    )  # fmt: skip
    [again] = [json.loads(x) for x in measured.stdout.splitlines()]
    starts = again["measured_starts"]
    assert starts and set(starts) <= {"wake", "runtime", "page_cache", "disk", "object_storage"}
    sums, counts = {}, {}
    for family in text_string_to_metric_families(httpx.get(f"{p.url}/metrics").text):
        for sample in family.samples if family.name == "stoker_instance_startup_seconds" else ():
            if sample.labels.get("deployment") == "tiny" and sample.name.endswith(("_sum", "_count")):
                into = sums if sample.name.endswith("_sum") else counts
                into[sample.labels["tier"]] = sample.value
    assert starts == pytest.approx({t: sums[t] / counts[t] for t in starts})
