"""Cascade routes in the split planes: `stoker controller` owns them (its SQLite, its admin API) and
publishes them in the routing table with the small deployment's context; `stoker gateway` serves
its synced copy. Real processes on loopback, the CPU engine, two tiny random models (`small` with a
64-token context, `big`), the route made through the gateway's admin API (passed through to the
controller). One test: process starts are the cost. No timing asserts: the random models' mean
token logprob is about -6, so a threshold of -100 keeps every fitting answer small.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.conftest import build_tiny_model
from tests.deadlines import HTTP_READ, deadline, flag
from tests.platform.conftest import PlatformProcess
from tests.platform.engine.conftest import free_port

ADMIN = "admin-key-for-cascade-planes"
ENV = {"STOKER_ADMIN_KEY": ADMIN}
H = {"authorization": f"Bearer {ADMIN}"}
# As in test_cascade_live.py: far more than 64 tokens, yet under the cheap estimate (bytes / 8 ≈
# 37), so the small one is asked and answers its 400; and so long that the estimate alone says so.
TOO_LONG = "zqxj vkw " * 33
FAR_TOO_LONG = TOO_LONG * 3


def admin(p: PlatformProcess, method: str, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.request(method, p.url + path, json=body, headers=H, timeout=HTTP_READ)


def chat(p: PlatformProcess, model: str, content: str = "Hello", **extra) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}
    return httpx.post(f"{p.url}/v1/chat/completions", json=body, headers=H, timeout=deadline(180))


def test_a_gateway_serves_the_controllers_routes(tmp_path: Path, tiny_model_dir: Path) -> None:
    small_model = build_tiny_model(tmp_path / "small-llama", max_positions=64)
    controller = PlatformProcess(
        tmp_path / "home", free_port(), ("--stop-instances-on-exit",), extra_env=ENV, command="controller"
    ).start()
    started = [controller]
    try:
        gw_args = ("--controller", controller.url, "--gateway-id", "gw-0", "--hold-deadline", flag(150))
        gateway = PlatformProcess(tmp_path / "gw", free_port(), gw_args, extra_env=ENV, command="gateway")
        started.append(gateway.start())

        # Everything admin goes through the gateway, to the controller, which owns the routes.
        for name, model in (("small", small_model), ("big", tiny_model_dir)):
            deploy = {"name": name, "model": str(model), "min_warm": 1, "idle_timeout_s": 600}
            assert admin(gateway, "POST", "/admin/v1/deployments", deploy).status_code == 201
        route = {"name": "assist", "small": "small", "large": "big", "min_mean_logprob": -100}
        made = admin(gateway, "POST", "/admin/v1/routes", route)
        assert made.status_code == 201, made.text
        taken = admin(gateway, "POST", "/admin/v1/deployments", {"name": "assist", "model": str(small_model)})
        assert (taken.status_code, taken.json()["error"]["code"]) == (409, "name_taken")
        assert [r["name"] for r in admin(gateway, "GET", "/admin/v1/routes").json()["data"]] == ["assist"]

        # The routing table carries the route with the small one's context, for the pre-check.
        table = httpx.get(
            f"{controller.url}/cluster/v1/routes", params={"gateway": "gw-0"}, headers=H, timeout=deadline(30)
        ).json()
        assert table["cascades"] == [{**route, "escalate_on_context": True, "small_context": 64}]

        # Served by the gateway from its copy: held while both instances start, then answered.
        gateway.wait_for(
            lambda: chat(gateway, "assist").status_code == 200, timeout=deadline(240), what="a first answer"
        )
        sure = chat(gateway, "assist", temperature=0)
        assert sure.status_code == 200, sure.text
        assert (sure.headers["x-stoker-cascade"], sure.json()["model"]) == ("small", "small")
        assert sure.json()["choices"][0]["logprobs"] is None  # asked of small, taken out again

        refused = chat(gateway, "assist", TOO_LONG)  # under the estimate: small is asked, says 400
        assert refused.status_code == 200, refused.text
        assert (refused.headers["x-stoker-cascade"], refused.json()["model"]) == ("escalated-context", "big")
        small_400s = gateway.metric("stoker_requests_total", deployment="small", code="400")
        assert small_400s == 1
        estimated = chat(gateway, "assist", FAR_TOO_LONG)  # the published context: small not asked
        assert (estimated.headers["x-stoker-cascade"], estimated.json()["model"]) == ("escalated-context", "big")  # fmt: skip
        assert gateway.metric("stoker_requests_total", deployment="small", code="400") == small_400s
        assert gateway.metric("stoker_cascade_requests_total", route="assist", outcome="escalated_context") == 2  # fmt: skip

        # Removed at the controller: the gateway stops answering it.
        assert admin(gateway, "DELETE", "/admin/v1/routes/assist").status_code == 200
        gateway.wait_for(lambda: chat(gateway, "assist").status_code == 404, what="the route leaving")
        assert gateway.metric("stoker_cascade_requests_total", route="assist") == 0  # forgotten
    finally:
        for p in reversed(started):
            p.stop()
