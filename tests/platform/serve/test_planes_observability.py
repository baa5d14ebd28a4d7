"""Cost, the arrival log, the dashboard's history, the request log and drift with the planes apart:
`stoker controller --prices` and `stoker gateway --request-log`, real processes on loopback, the
CPU engine with the tiny model. The gateway reports each answer's tokens to the controller, which
counts and prices them (one writer of `stoker_tokens_total`, `stoker_cost_usd_total` and the arrival
log); the gateway keeps its own request log and drift; the controller's dashboard history adds the
gateway's request figures to its own. One test: process starts are the cost.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from stoker.control.arrival_log import LOG_DIR as ARRIVALS_DIR
from stoker.gateway.request_log import LOG_DIR, LOG_FILE
from tests.deadlines import HTTP_READ, deadline, flag
from tests.platform.conftest import PlatformProcess
from tests.platform.engine.conftest import free_port

ADMIN = "admin-key-for-planes-observability"
H = {"authorization": f"Bearer {ADMIN}"}
ENV = {"STOKER_ADMIN_KEY": ADMIN, "STOKER_HISTORY_INTERVAL": "0.5"}
PRICES = {"ready_hour": {"default": 3.6}, "starting_hour": 3.6, "sleeping_hour": 0.36}


def chat(p: PlatformProcess, content: str, **extra) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 3, **extra}
    return httpx.post(f"{p.url}/v1/chat/completions", json=body, headers=H, timeout=deadline(180))


def admin(p: PlatformProcess, method: str, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.request(method, p.url + path, json=body, headers=H, timeout=HTTP_READ)


def test_the_controller_meters_what_its_gateway_answers(tmp_path: Path, tiny_model_dir: Path) -> None:
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps(PRICES))
    controller_args = ("--stop-instances-on-exit", "--prices", str(prices))
    controller = PlatformProcess(
        tmp_path / "home", free_port(), controller_args, extra_env=ENV, command="controller"
    ).start()
    started = [controller]
    try:
        gw_args = (
            "--controller", controller.url, "--gateway-id", "gw-0", "--hold-deadline", flag(150),
            "--request-log", "--drift-window", "1h", "--drift-min-requests", "2",
            "--data-dir", str(tmp_path / "gw-data"),
        )  # fmt: skip
        gateway = PlatformProcess(tmp_path / "gw", free_port(), gw_args, extra_env=ENV, command="gateway")
        started.append(gateway.start())
        deploy = {"name": "tiny", "model": str(tiny_model_dir), "min_warm": 1, "idle_timeout_s": 600}
        assert admin(gateway, "POST", "/admin/v1/deployments", deploy).status_code == 201

        tokens_in = tokens_out = 0
        for content in ("hello there", "what is the weather", "tell me a story"):
            answer = chat(gateway, content)
            assert answer.status_code == 200, answer.text
            usage = answer.json()["usage"]
            tokens_in, tokens_out = (
                tokens_in + usage["prompt_tokens"],
                tokens_out + usage["completion_tokens"],
            )
        streamed = chat(gateway, "and a stream", stream=True, stream_options={"include_usage": True})
        assert streamed.status_code == 200
        events = [json.loads(e[6:]) for e in streamed.text.split("\n\n") if e.startswith("data: {")]
        usage = events[-1]["usage"]
        tokens_in, tokens_out = tokens_in + usage["prompt_tokens"], tokens_out + usage["completion_tokens"]

        # Cost: counted at the controller from the gateway's reports; asked through the gateway.
        def row() -> dict | None:
            rows = admin(gateway, "GET", "/admin/v1/cost").json()["data"]
            return next((r for r in rows if r["deployment"] == "tiny" and r["requests"] == 4), None)

        gateway.wait_for(lambda: row() is not None, what="the four answers in the controller's cost")
        got = row()
        assert (got["tokens_in"], got["tokens_out"]) == (tokens_in, tokens_out)
        assert got["cost_usd"] > 0 and got["cost_per_1k_tokens"] > 0
        assert controller.metric("stoker_tokens_total", deployment="tiny", direction="in") == tokens_in
        assert controller.metric("stoker_tokens_total", deployment="tiny", direction="out") == tokens_out
        assert gateway.metric("stoker_tokens_total") == 0  # one writer: a sum over jobs counts once

        # The arrival log is the controller's, and replays.
        log = controller.home / ARRIVALS_DIR / "arrivals.jsonl"
        lines = [json.loads(x) for x in log.read_text().splitlines()]
        assert [(x["deployment"], x["status"]) for x in lines] == [("tiny", 200)] * 4
        assert (sum(x["in"] for x in lines), sum(x["out"] for x in lines)) == (tokens_in, tokens_out)

        # The request log and drift are the gateway's own.
        records = [
            json.loads(x) for x in (tmp_path / "gw-data" / LOG_DIR / LOG_FILE).read_text().splitlines()
        ]
        assert [(r["deployment"], r["revision"], r["status"]) for r in records] == [("tiny", 1, 200)] * 4
        assert "hello there" not in json.dumps(records)  # no content unless the deployment asks
        drift = admin(gateway, "GET", "/admin/v1/deployments/tiny/drift")
        assert drift.status_code == 200 and drift.json()["current"]["requests"] == 4
        assert gateway.metric("stoker_drift_window_requests", deployment="tiny", window="current") == 4
        assert admin(gateway, "GET", "/admin/v1/deployments/nope/drift").status_code == 404
        assert httpx.get(f"{gateway.url}/admin/v1/deployments/tiny/drift").status_code == 401

        # The dashboard: the page from the gateway; its history from the controller, with the
        # gateway's answers and the arrivals the scaler heard of.
        page = httpx.get(f"{gateway.url}/dashboard")
        assert page.status_code == 200 and "<script" in page.text

        def seen(field: str) -> float:
            points = admin(gateway, "GET", "/admin/v1/history").json()["points"]
            return sum(p["deployments"].get("tiny", {}).get(field, 0) * p["dt"] for p in points)

        gateway.wait_for(lambda: round(seen("requests_per_s")) == 4, what="four answers in the history")
        gateway.wait_for(lambda: round(seen("arrivals_per_s")) == 4, what="four arrivals in the history")
        assert controller.metric("stoker_scaler_arrivals_total", deployment="tiny") == 4
        assert controller.metric("stoker_requests_total") == 0  # the gateway's, scraped from it
    finally:
        for p in reversed(started):
            p.stop()
