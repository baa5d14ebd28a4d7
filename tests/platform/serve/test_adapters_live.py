"""LoRA adapters as deployments on `stoker up` with the CPU engine, end to end with real parts: a
base deployed at zero, two adapters deployed on it from local PEFT directories, and the official
`openai` client calling `model="a1"`.

The adapter's answer is its own (greedy, it differs from the base's and from the other adapter's);
a request for an adapter of a base at zero is held while the base starts, then the adapter loads;
both adapters and the base answer from the one instance, which keeps one adapter loaded at a time
(`--max-adapters 1`): an adapter it evicted is loaded again at its next request; `/v1/models` lists each adapter with its
base as `parent`; a tenant key scoped to one adapter calls it and not its base; an adapter made for
another base is refused at deploy, naming both."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import build_tiny_adapter, build_tiny_model
from tests.deadlines import COLD_ANSWER, HTTP_READ
from tests.deadlines import deadline as deadline_s
from tests.platform.conftest import PlatformProcess
from tests.platform.engine.conftest import free_port

ADMIN = "admin-key-adapters"
H = {"authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    out = {}
    for name, seed in (("a1", 1), ("a2", 2)):
        build_tiny_adapter(tiny_model_dir, root / name, seed=seed)
        out[name] = root / name
    return out


def greedy(client: openai.OpenAI, model: str) -> str:
    answer = client.completions.create(model=model, prompt="the quick brown fox", max_tokens=8, temperature=0)
    return answer.choices[0].text


def test_adapters_on_a_base_at_zero(
    platform_factory, tiny_model_dir: Path, adapter_dirs, tmp_path: Path
) -> None:
    p: PlatformProcess = platform_factory("--stable-window", "2", env={"STOKER_ADMIN_KEY": ADMIN})
    # One adapter loaded at a time on each instance: the second evicts the first.
    p.deploy("base", tiny_model_dir, "--max", "1", "--idle-timeout", "600", "--max-adapters", "1")
    for name, path in adapter_dirs.items():
        out = json.loads(p.cli("deploy", name, "--adapter", str(path), "--base", "base", "--json").stdout)
        assert out["kind"] == "adapter" and out["base"] == "base" and out["revision"] == 1
    client = openai.OpenAI(base_url=f"{p.url}/v1", api_key=ADMIN, timeout=COLD_ANSWER, max_retries=0)

    # The base is at zero: the adapter's request is held while it starts, then a1 loads and answers.
    first = greedy(client, "a1")
    assert p.metric("stoker_adapter_loads_total", deployment="a1", base="base") == 1
    assert greedy(client, "a1") == first  # greedy: the same again, with no second load
    assert p.metric("stoker_adapter_loads_total", deployment="a1", base="base") == 1
    base, second = greedy(client, "base"), greedy(client, "a2")
    assert len({first, base, second}) == 3, (first, base, second)  # each its own weights
    [instance] = p.deployments()["base"]["instance_list"]  # all three on the base's one instance
    assert p.metric("stoker_adapter_loads_total", deployment="a2", base="base") == 1
    # a2's load evicted a1 from the engine: its next request finds it gone (404), loads it again.
    assert greedy(client, "a1") == first
    assert p.metric("stoker_adapter_loads_total", deployment="a1", base="base") == 2
    # A new revision of a1 with other bytes (a2's) takes the name on the engine: loaded in place,
    # so a1 now answers as a2 does, never with the weights its name held before.
    p.cli("deploy", "a1", "--adapter", str(adapter_dirs["a2"]), "--base", "base")
    assert greedy(client, "a1") == second
    assert p.metric("stoker_adapter_loads_total", deployment="a1", base="base") == 3

    models = {m.id: m for m in client.models.list().data}
    assert models["a1"].model_extra["parent"] == "base" and "parent" not in (models["base"].model_extra or {})

    # A tenant scoped to a1 calls a1, and its base is the same 404 as a model that does not exist.
    made = json.loads(p.cli("keys", "create", "--tenant", "acme", "--deployment", "a1", "--json").stdout)
    tenant = openai.OpenAI(base_url=f"{p.url}/v1", api_key=made["key"], timeout=COLD_ANSWER, max_retries=0)
    assert greedy(tenant, "a1") == second  # a1 revision 2: a2's bytes
    with pytest.raises(openai.NotFoundError):
        greedy(tenant, "base")
    assert {m.id for m in tenant.models.list().data} == {"a1"}

    # Cost: each adapter's share of the base's, by tokens, plus its loads; the rows add up.
    p.wait_for(lambda: cost_rows(p)["base"]["cost_usd"] > 0, what="the base's instance-seconds priced")
    rows = cost_rows(p)
    a1, a2, b = rows["a1"], rows["a2"], rows["base"]
    assert a1["base"] == a2["base"] == "base" and "base" not in b
    assert a1["requests"] == 5 and a2["requests"] == 1 and a1["tokens_out"] > 0
    assert a1["load_seconds"] > 0 and a1["load_usd"] > 0 and a1["base_share_usd"] > 0
    devices = sum(r["cost_usd"] for r in b["revisions"])  # what the base's instances cost
    assert b["adapters_usd"] == pytest.approx(a1["cost_usd"] + a2["cost_usd"], abs=1e-8)
    assert b["cost_usd"] + a1["cost_usd"] + a2["cost_usd"] == pytest.approx(devices, abs=1e-8)

    # An adapter made for another base model: refused at deploy, naming both.
    other = build_tiny_model(tmp_path / "wide", head_dim=32)  # its attention projections are wider
    p.deploy("wide", other, "--max", "1")
    r = httpx.post(
        f"{p.url}/admin/v1/deployments",
        json={"name": "a3", "adapter": str(adapter_dirs["a1"]), "base": "wide"},
        headers=H,
        timeout=HTTP_READ,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "adapter_base_mismatch", r.text
    assert "'wide'" in r.json()["error"]["message"]

    # A rank above the base's largest (64 by default) is refused, naming the setting that takes it;
    # a base deployed with it serves the adapter, and keeps it: a new revision that would not is 409.
    build_tiny_adapter(tiny_model_dir, tmp_path / "r128", seed=3, rank=128)
    r = httpx.post(
        f"{p.url}/admin/v1/deployments",
        json={"name": "a4", "adapter": str(tmp_path / "r128"), "base": "base"},
        headers=H,
        timeout=HTTP_READ,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "adapter_rank", r.text
    assert (
        "rank 128" in r.json()["error"]["message"]
        and "--max-adapter-rank 128" in r.json()["error"]["message"]
    )
    p.deploy("big", tiny_model_dir, "--max", "1", "--max-adapter-rank", "128")
    p.cli("deploy", "a4", "--adapter", str(tmp_path / "r128"), "--base", "big")
    assert greedy(client, "a4") not in (first, second)  # the CPU engine took --max-lora-rank 128
    body = {"name": "big", "model": str(tiny_model_dir), "max": 1, "max_adapter_rank": 64}
    r = httpx.post(f"{p.url}/admin/v1/deployments", json=body, headers=H, timeout=HTTP_READ)
    assert r.status_code == 409 and r.json()["error"]["param"] == "max_adapter_rank", r.text
    assert "a4 (rank 128)" in r.json()["error"]["message"]

    # A base with adapters on it is not removed from under them.
    r = httpx.delete(f"{p.url}/admin/v1/deployments/base", headers=H, timeout=HTTP_READ)
    assert r.status_code == 409 and "a1, a2" in r.json()["error"]["message"], r.text
    # Nor redeployed on vLLM without max_adapters, which would serve none of them.
    body = {"name": "base", "model": str(tiny_model_dir), "engine": "vllm"}
    r = httpx.post(f"{p.url}/admin/v1/deployments", json=body, headers=H, timeout=HTTP_READ)
    assert r.status_code == 409 and r.json()["error"]["code"] == "base_in_use", r.text
    assert "a1, a2" in r.json()["error"]["message"] and "--max-adapters" in r.json()["error"]["message"]
    assert p.deployments()["base"]["revision"] == 1
    assert instance["state"] == "READY"

    # Restarted on its data dir: the adapters come back with their bases, a1 at its revision 2.
    p.stop()
    p.start()
    assert greedy(client, "a1") == second and greedy(client, "a2") == second
    assert p.deployments()["a1"]["revision"] == 2


def test_adapters_through_a_gateway_of_its_own(tiny_model_dir: Path, adapter_dirs, tmp_path: Path) -> None:
    """The split planes: the controller lists the adapter deployments in its routing table; a
    `stoker gateway` serves them on its own activator for the base, loading each adapter there."""
    env = {"STOKER_ADMIN_KEY": ADMIN}
    # A controller leaves its engines running when it exits (for the next leader to adopt): told
    # to stop them, it leaves no engine behind the test (each run left the base's, idle, parent 1).
    controller = PlatformProcess(
        tmp_path / "ctl",
        free_port(),
        ("--stable-window", "2", "--stop-instances-on-exit"),
        extra_env=env,
        command="controller",
    )
    started = [controller.start()]
    try:
        args = ("--controller", controller.url, "--report-interval", "0.2s", "--gateway-id", "g0")
        gateway = PlatformProcess(
            tmp_path / "g0", free_port(), args, extra_env=env, command="gateway"
        ).start()
        started.append(gateway)
        gateway.deploy("base", tiny_model_dir, "--max", "1", "--idle-timeout", "600")
        out = json.loads(
            gateway.cli(
                "deploy", "a1", "--adapter", str(adapter_dirs["a1"]), "--base", "base", "--json"
            ).stdout
        )
        assert out["kind"] == "adapter"
        client = openai.OpenAI(
            base_url=f"{gateway.url}/v1", api_key=ADMIN, timeout=COLD_ANSWER, max_retries=0
        )

        def listed() -> bool:
            return "a1" in {m.id for m in client.models.list().data}

        deadline = time.monotonic() + deadline_s(30)
        while not listed():  # the gateway's table follows the controller's
            assert time.monotonic() < deadline, "a1 never reached the gateway's table"
            time.sleep(0.1)
        adapted, base = greedy(client, "a1"), greedy(client, "base")
        assert adapted != base
        assert gateway.metric("stoker_adapter_loads_total", deployment="a1", base="base") == 1
        models = {m.id: m for m in client.models.list().data}
        assert models["a1"].model_extra["parent"] == "base"
        # The controller meters what the gateway answered: a1's request and its load are a1's.
        controller.wait_for(
            lambda: cost_rows(controller).get("a1", {}).get("load_seconds", 0) > 0,
            what="a1's load in the controller's cost",
        )
        a1 = cost_rows(controller)["a1"]
        assert a1["base"] == "base" and a1["requests"] == 1 and a1["tokens_out"] > 0
    finally:
        for p in started:
            p.stop()


def cost_rows(p) -> dict[str, dict]:
    return {row["deployment"]: row for row in json.loads(p.cli("cost", "--json").stdout)}
