"""The web dashboard (`stoker.api.dashboard`) on a real `stoker up` with the tiny model: the page and its
script served to anyone and holding nothing, the history behind the admin key, and the page in
headless Chromium (Debian's `chromium`, driven over the DevTools protocol with aiohttp's websocket
client): the key taken from the fragment and wiped from the address, a wrong key refused, and the
charts drawn with data, checked on a screenshot."""

from __future__ import annotations

import asyncio
import base64
import io
import itertools
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import aiohttp
import httpx
import pytest

from tests.deadlines import HTTP_READ, WAIT, deadline

ADMIN = "sk-admin-dashboard-test"
AUTH = {"authorization": f"Bearer {ADMIN}"}
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir):
    """A platform sampling its history every 0.5 s, the tiny model started from zero and answering."""
    from tests.platform.conftest import PlatformProcess
    from tests.platform.engine.conftest import free_port

    env = {"STOKER_ADMIN_KEY": ADMIN, "STOKER_HISTORY_INTERVAL": "0.5"}
    p = PlatformProcess(
        tmp_path_factory.mktemp("dashboard") / "home", free_port(), ("--stable-window", "2"), extra_env=env
    )
    p.start()
    try:
        p.deploy("tiny", tiny_model_dir, "--idle-timeout", "600")
        body = {"model": "tiny", "prompt": "The quick", "max_tokens": 4}
        p.served = []  # (instance, cold start?) of each answer, as its headers say
        for _ in range(6):  # the first one waits for the cold start
            answer = httpx.post(f"{p.url}/v1/completions", json=body, headers=AUTH, timeout=deadline(300))
            assert answer.status_code == 200, answer.text
            p.served.append(
                (answer.headers["x-stoker-instance"], answer.headers["x-stoker-cold-start"] == "true")
            )
            time.sleep(0.2)  # spread over a few of the history's points
        p.wait_for(lambda: busy_points(p) >= 2, timeout=WAIT, what="two points with requests")
        yield p
    finally:
        p.stop()


def history(p) -> dict:
    return httpx.get(f"{p.url}/admin/v1/history", headers=AUTH, timeout=HTTP_READ).json()


def busy_points(p) -> int:
    return sum(1 for pt in history(p)["points"] if pt["deployments"].get("tiny", {}).get("requests_per_s"))


def test_the_page_is_open_and_holds_no_data_the_history_takes_the_admin_key(served):
    page = httpx.get(f"{served.url}/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "connect-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert page.headers["referrer-policy"] == "no-referrer" and page.headers["cache-control"] == "no-store"
    assert "tiny" not in page.text and ADMIN not in page.text and "<script>" not in page.text
    script = httpx.get(f"{served.url}/dashboard/app.js")
    assert script.status_code == 200 and "sessionStorage" in script.text
    assert script.headers["content-type"].startswith("text/javascript")

    assert httpx.get(f"{served.url}/admin/v1/history").status_code == 401
    wrong = {"authorization": "Bearer sk-not-it"}
    assert httpx.get(f"{served.url}/admin/v1/history", headers=wrong).status_code == 401
    bad = httpx.get(f"{served.url}/admin/v1/history?since=soon", headers=AUTH)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "since"


def test_the_history_holds_the_requests_the_instances_and_the_cold_start(served):
    h = history(served)
    assert h["interval_s"] == 0.5 and h["window_s"] == 3600
    tiny = [pt["deployments"]["tiny"] for pt in h["points"] if "tiny" in pt["deployments"]]
    assert any(t["requests_per_s"] > 0 for t in tiny)
    assert tiny[-1]["instances"].get("READY", 0) >= 1
    cold = [t for t in tiny if t["cold_starts"]]
    # The first request's, and any other an instance that came up later served (one replaced under
    # load): as many as the answers' headers said.
    assert served.served[0][1], served.served
    told = sum(c for _, c in served.served)
    assert sum(sum(t["cold_starts"].values()) for t in cold) == told, served.served
    starts = [s for t in tiny for s in t["start_s"].values()]  # the start, in the point it finished
    assert starts and all(s > 0 for s in starts)
    assert any(t["hold_s"] is not None and t["hold_s"] > 0 for t in tiny)  # the held request's wait
    later = httpx.get(f"{served.url}/admin/v1/history?since={h['points'][-1]['t']}", headers=AUTH).json()
    assert all(pt["t"] > h["points"][-1]["t"] for pt in later["points"])


# ---- in a browser --------------------------------------------------------------------------------


class DevTools:
    """The least of the Chrome DevTools protocol: one page's websocket, commands by id."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.ids = itertools.count(1)

    async def call(self, method: str, **params) -> dict:
        n = next(self.ids)
        await self.ws.send_json({"id": n, "method": method, "params": params})
        async for msg in self.ws:
            data = json.loads(msg.data)
            if data.get("id") == n:
                if "error" in data:
                    raise RuntimeError(f"{method}: {data['error']}")
                return data["result"]
        raise RuntimeError("the browser closed the connection")

    async def js(self, expression: str):
        result = await self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        return result["result"].get("value")

    async def until(self, expression: str, within_s: float = WAIT) -> None:
        end = time.monotonic() + within_s
        while not await self.js(expression):
            if time.monotonic() > end:
                state = await self.js("document.body && document.body.outerHTML.slice(0, 2000)")
                raise TimeoutError(f"{expression} not true in {within_s}s: {state}")
            await asyncio.sleep(0.1)

    async def open(self, url: str) -> None:
        await self.call("Page.navigate", url="about:blank")
        await self.call("Page.navigate", url=url)
        await self.until("document.readyState === 'complete' && !!document.body.dataset.state")


@pytest.fixture
async def browser(tmp_path: Path):
    if CHROMIUM is None:
        why = "chromium not found: `make test` installs Debian's package where apt may (root)"
        if os.environ.get("CI"):  # in CI `make test` installs it: there the test must run
            pytest.fail(why)
        pytest.skip(why)
    profile = tmp_path / "chromium"
    proc = await asyncio.create_subprocess_exec(
        *[
            CHROMIUM,
            "--headless=new",
            "--no-sandbox",  # root in a container has no user namespace sandbox
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--remote-debugging-port=0",
            f"--user-data-dir={profile}",
            "--window-size=1400,1800",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        active = profile / "DevToolsActivePort"
        end = time.monotonic() + deadline(60)
        while not (active.exists() and active.read_text().strip()):
            if proc.returncode is not None or time.monotonic() > end:
                pytest.fail(
                    f"chromium did not write its DevTools port to {active} within {deadline(60):g} s "
                    f"(exit status {proc.returncode}; its output went to /dev/null)"
                )
            await asyncio.sleep(0.1)
        port = int(active.read_text().split()[0])
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/json/list") as r:
                target = next(t for t in await r.json() if t["type"] == "page")
            async with session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=64 << 20) as ws:
                tools = DevTools(ws)
                await tools.call("Page.enable")
                await tools.call("Runtime.enable")
                yield tools
    finally:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), deadline(30))
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def screenshot_of(tools: DevTools, element_id: str):
    from PIL import Image

    box = await tools.js(f"JSON.stringify(document.getElementById('{element_id}').getBoundingClientRect())")
    box = json.loads(box)
    clip = {"x": box["x"], "y": box["y"], "width": box["width"], "height": box["height"], "scale": 1}
    shot = await tools.call("Page.captureScreenshot", format="png", clip=clip, captureBeyondViewport=True)
    return Image.open(io.BytesIO(base64.b64decode(shot["data"]))).convert("RGB")


def coloured(image) -> int:
    """Pixels of a colour, not the white background, nor the grey of grid lines and labels."""
    raw = image.tobytes()  # RGB, a byte each
    return sum(1 for i in range(0, len(raw), 3) if max(raw[i : i + 3]) - min(raw[i : i + 3]) > 40)


async def test_the_page_draws_the_charts_with_data_in_a_browser(served, browser):
    # A wrong key: refused, said so, nothing drawn.
    await browser.open(f"{served.url}/dashboard#key=sk-wrong")
    await browser.until("document.body.dataset.state === 'need-key'")
    assert "refused" in await browser.js("document.getElementById('status').textContent")

    await browser.open(f"{served.url}/dashboard#key={ADMIN}")
    await browser.until("document.body.dataset.ready === 'true'")
    # The key left the address at once, and lives in this tab's sessionStorage only.
    assert ADMIN not in await browser.js("location.href")
    assert await browser.js("sessionStorage.getItem('stoker.adminKey')") == ADMIN
    assert await browser.js("localStorage.length") == 0
    # Everything the page loaded came from the platform.
    loaded = "[...performance.getEntriesByType('navigation'), ...performance.getEntriesByType('resource')]"
    origins = await browser.js(f"[...new Set({loaded}.map(e => new URL(e.name).origin))]")
    assert set(origins) == {served.url}
    assert "tiny" in await browser.js("document.getElementById('deployments').textContent")
    assert int(await browser.js("document.getElementById('chart-instances').dataset.points")) >= 2

    instances = await screenshot_of(browser, "chart-instances")
    requests = await screenshot_of(browser, "chart-requests")
    area = instances.width * instances.height
    # The READY instance fills the stacked chart's height from its first point on; requests/s is a line.
    assert coloured(instances) > area // 10, (coloured(instances), area)
    assert coloured(requests) > 300, coloured(requests)
    # Cost: the cost API's rows where the platform has one (`stoker.api.cost`), else a note.
    cost = await browser.js("document.getElementById('cost-body').textContent")
    async with httpx.AsyncClient() as client:
        has_cost_api = (await client.get(f"{served.url}/admin/v1/cost", headers=AUTH)).status_code == 200
    assert ("tiny" in cost) if has_cost_api else ("No cost API" in cost), cost
    if shots := os.environ.get("STOKER_DASHBOARD_SCREENSHOT"):  # a look at the whole page, by hand
        full = await browser.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        await asyncio.to_thread(Path(shots).write_bytes, base64.b64decode(full["data"]))
