"""Three deployments on one device budget that fits a single awake instance take turns (`stoker up
--device-memory`): a request to a deployment without an awake instance is held, the idle awake
one is put to sleep for it, and it starts or wakes and answers. Real engine processes; nothing is
refused or cut, and no sample ever sees two awake at once."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from tests.deadlines import deadline
from tests.platform.conftest import PlatformProcess

MIB = 1 << 20


def ask(p: PlatformProcess, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "hello", "max_tokens": 3}
    return httpx.post(f"{p.url}/v1/completions", json=body, timeout=deadline(180))


class Watch:
    """Samples every instance's state across the deployments while the test runs."""

    def __init__(self, p: PlatformProcess) -> None:
        self.p, self.most_awake, self.samples = p, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = httpx.get(f"{self.p.url}/admin/v1/deployments", timeout=deadline(5)).json()["data"]
            except httpx.HTTPError:
                continue
            awake = sum(
                1
                for d in data
                for i in d["instance_list"]
                if i["state"] in ("STARTING", "READY") and i["phase"] != "falling_asleep"
            )
            self.most_awake, self.samples = max(self.most_awake, awake), self.samples + 1
            time.sleep(0.05)


def instances(p: PlatformProcess) -> dict[str, list[dict]]:
    return {name: d["instance_list"] for name, d in p.deployments().items()}


def test_three_deployments_take_turns_on_one_device(platform_factory, tiny_model_dir: Path) -> None:
    # Awake: the tiny weights + 512 MiB of KV; asleep: the CPU engine's 160 MiB. 900 MiB holds one
    # awake and two asleep, never two awake. (No warm runtime: its memory would count there too.)
    p = platform_factory(
        "--device-memory", "900MiB", "--instance-kv", "512MiB", "--stable-window", "1", "--warm-runtimes", "0"
    )
    for name in ("a", "b", "c"):
        p.deploy(name, tiny_model_dir, "--min-warm", "0", "--max", "1", "--idle-timeout", "600")
    with Watch(p) as watch:
        served = {}
        for name in ("a", "b", "c", "a"):
            r = ask(p, name)
            assert r.status_code == 200, r.text
            served.setdefault(name, []).append(r.headers["x-stoker-instance"])
    assert watch.samples > 10 and watch.most_awake == 1
    assert served["a"][0] == served["a"][1]  # a was put to sleep for b, and woken, not restarted
    now = instances(p)
    assert [i["state"] for i in now["a"]] == ["READY"]
    assert {i["state"] for i in now["b"] + now["c"]} == {"SLEEPING"}
    [a] = now["a"]
    assert a["device"] == "cpu0" and 512 * MIB < a["reserved_bytes"] < 520 * MIB
    assert p.metric("stoker_instance_starts_total", deployment="a", outcome="ready") == 1
    assert p.metric("stoker_instance_sleep_wake_total", deployment="a", action="wake", outcome="ok") >= 1
    assert 512 * MIB < p.metric("stoker_device_memory_bytes", device="cpu0", state="awake") < 520 * MIB
    assert p.metric("stoker_device_memory_bytes", device="cpu0", state="asleep") == 2 * 160 * MIB
    described = p.cli("describe", "a").stdout
    assert "cpu0" in described
