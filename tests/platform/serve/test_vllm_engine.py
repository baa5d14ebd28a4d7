"""`--engine vllm` end to end with real vLLM: its CPU build (`make vllm` → .venv-vllm/bin/vllm).

The real `stoker up`, a real vLLM process tree per instance, the official client. vLLM runs with
`--enforce-eager` here: without it every start compiles the model with torch.compile (~50 s of a
~90 s start on this machine), and what these tests check (held at zero, served, streamed, drained,
stopped with nothing left behind, what the engine reported) is the same with or without compiling.
The tiny model has a head size of 32: vLLM's CPU attention has no kernel for the usual 16.

A vLLM start is the slowest thing the suite does (a minute on a busy 2-core machine), so each test
here starts vLLM once: a fresh start (held, served, streamed, drained on `rm`), and a start through
a warm runtime (the tier, the forked engine core, and an idle stop instead of a sleep). The guard's
tests share one more, started as the pool launches vLLM (`vllm_spec` with an instance key) and in
vLLM's dev mode, which GPU instances run in: every route vLLM logged, asked with and without the
key, and its real `/server_info` read as the pool reads it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import threading
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import REPO, build_tiny_encoder, build_tiny_model
from tests.deadlines import HTTP_READ, STOP, VLLM_START, deadline, wait_healthy
from tests.platform.serve.vllm_adapters import check_adapters_on
from warm_pool.backends.local import free_port
from warm_pool.engine_calls import EngineCapabilities, HttpEngines
from warm_pool.engine_settings import EngineSettings
from warm_pool.launch import vllm_spec
from warm_pool.reconcile import Observed

VLLM = REPO / ".venv-vllm" / "bin" / "vllm"
needs_vllm = pytest.mark.skipif(
    not VLLM.exists() and not os.environ.get("CI"),  # in CI `make test` builds it: there it must run
    reason="vLLM's CPU build is not installed: `make vllm`",
)


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("vllm-model") / "tiny-llama", head_dim=32)


# A request at zero is held while vLLM starts: the platform's default hold (120 s) is shorter than a
# start on a loaded machine, and the hold is a bound here, not what is tested. The client waits longer.
VLLM_HOLD = ("--hold-deadline", f"{VLLM_START:g}s")


def client(p) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{p.url}/v1", api_key="unused", max_retries=0, timeout=VLLM_START + HTTP_READ
    )


def group_members(pgid: int) -> list[int]:
    """Live processes in process group `pgid`: the engine and every process vLLM spawned."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            out.append(int(entry.name))
    return out


@needs_vllm
def test_vllm_from_zero_served_streamed_and_drained_on_rm(platform_factory, vllm_model_dir, tmp_path):
    # A long stable window: the policy holds the idle instance READY (it cannot sleep) for the whole
    # test, so the stream `rm` drains runs on the instance that served the first request.
    p = platform_factory(
        "--stable-window",
        "600",
        "--vllm",
        str(VLLM),
        "--vllm-args=--enforce-eager --max-num-seqs 8",
        *VLLM_HOLD,
    )
    deployed = p.deploy(
        "tiny", vllm_model_dir, "--engine", "vllm", "--idle-timeout", "600", "--max-adapters", "1",
        "--tool-call-parser", "hermes",
    )  # fmt: skip
    assert deployed["engine"] == "vllm"
    assert p.deployments()["tiny"]["instances"]["READY"] == 0

    # Held at zero while vLLM starts, then answered by it.
    raw = client(p).completions.with_raw_response.create(
        model="tiny", prompt="The quick", max_tokens=5, temperature=0
    )
    assert raw.headers["x-stoker-cold-start"] == "true"
    answer = raw.parse()
    assert answer.system_fingerprint.startswith("vllm-")  # vLLM's own answer, relayed
    assert answer.usage.completion_tokens == 5
    chunks = list(
        client(p).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=6, stream=True
        )
    )
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # The Responses API and tool calls go to vLLM's own routes; `tool_choice: auto` is served because
    # the deployment named its tool-call parser (vLLM refuses it with a 400 otherwise).
    response = client(p).responses.create(model="tiny", input="Hello", max_output_tokens=5, temperature=0)
    assert response.status in ("completed", "incomplete") and response.usage.output_tokens >= 1
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    auto = client(p).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hello"}],
        tools=[tool],
        tool_choice="auto",
        max_tokens=5,
    )
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # LoRA adapters on this instance (`vllm_adapters`: vLLM's run-time LoRA API, one start shared).
    check_adapters_on(p, "tiny", vllm_model_dir, tmp_path)

    # What the pool learned from the engine: its start phases (parsed from vLLM's log) ...
    assert p.metric("stoker_cold_start_seconds_count", deployment="tiny", phase="engine_init") == 1
    assert p.metric("stoker_cold_start_seconds_count", deployment="tiny", phase="model_load") == 1
    # ... its compile cache, kept beside the snapshot, keyed by this vLLM's version ...
    snapshot_id = deployed["snapshot_id"]
    infos = list((p.home / "snapshots" / "compile" / snapshot_id).glob("*/cache.json"))
    assert len(infos) == 1
    key = json.loads(infos[0].read_text())
    assert key["version"].endswith("+cpu") and key["snapshot"] == snapshot_id

    # `stoker rm` while a long stream is in flight: the stream finishes whole, then nothing is left.
    got: dict = {}

    def stream() -> None:
        tokens, finish = 0, None
        for chunk in client(p).completions.create(
            model="tiny", prompt="x", max_tokens=150, stream=True, extra_body={"ignore_eos": True}
        ):
            if chunk.choices:
                tokens += 1
                finish = chunk.choices[0].finish_reason or finish
                got.setdefault("first", threading.Event()).set()
        got.update(tokens=tokens, finish=finish)

    got["first"] = threading.Event()
    reader = threading.Thread(target=stream)
    reader.start()
    assert got["first"].wait(300), "the stream never started"
    pgids = list(p.engine_pids().values())
    assert len(pgids) == 1 and group_members(pgids[0])  # the instance that answered the first request
    assert p.metric("stoker_cold_start_seconds_count", deployment="tiny", phase="engine_init") == 1
    p.cli("rm", "tiny")
    reader.join(60)
    assert got.get("finish") == "length"
    assert got["tokens"] >= 100  # vLLM may merge a few tokens into one chunk; none were cut
    assert not p.engine_pids() and all(group_members(g) == [] for g in pgids)


@needs_vllm
def test_a_vllm_start_through_its_warm_runtime(platform_factory, vllm_model_dir):
    """`--vllm-warm-runtimes 1`: the first vLLM deployment brings a vLLM runtime (vLLM imported in
    vLLM's own venv, `infra/vllm-cpu/runtime.py`); once it is ready, a start at zero takes it: the
    engine's process is the runtime's, the start counted as tier `runtime`, vLLM's answer relayed,
    its engine core a fork of the runtime (imports inherited) and its output in the instance's log.
    And vLLM cannot sleep: idle, the instance stops (the short stable window ends the policy's READY
    hold after 2 s) instead of going to sleep, and leaves no process behind."""
    p = platform_factory(
        "--stable-window", "2", "--vllm", str(VLLM), "--vllm-args=--enforce-eager --max-num-seqs 8",
        "--vllm-warm-runtimes", "1", *VLLM_HOLD,
    )  # fmt: skip
    p.deploy("tiny", vllm_model_dir, "--engine", "vllm", "--idle-timeout", "600", "--min-warm", "0")
    p.wait_for(
        lambda: p.metric("stoker_warm_runtimes", engine="vllm") == 1,
        timeout=VLLM_START,
        what="a vLLM runtime",
    )
    runtime_pids = {int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and _is_vllm_runtime(e)}
    assert runtime_pids
    raw = client(p).completions.with_raw_response.create(
        model="tiny", prompt="The quick", max_tokens=5, temperature=0
    )
    assert raw.headers["x-stoker-cold-start"] == "true"
    assert raw.parse().system_fingerprint.startswith("vllm-")
    assert p.metric("stoker_instance_startup_seconds_count", deployment="tiny", tier="runtime") == 1
    [(instance, pid)] = p.engine_pids().items()  # the engine is the runtime it was handed to
    assert pid in runtime_pids and group_members(pid)
    log = (p.home / "logs" / f"{instance}.log").read_text()
    assert "becoming `vllm serve`" in log and "Loading weights took" in log
    cores = {int(m) for m in re.findall(r"\(EngineCore\w* pid=(\d+)\)", log)}
    forked = {int(m) for m in re.findall(r"vllm runtime: forked pid (\d+)", log)}
    assert cores and cores <= forked, (cores, forked)

    p.wait_for(lambda: not p.engine_pids(), timeout=deadline(120), what="the idle vLLM instance stopped")
    assert group_members(pid) == []
    assert p.metric("stoker_instance_sleep_wake_total", deployment="tiny") == 0
    assert p.metric("stoker_scaler_desired_instances", deployment="tiny", state="SLEEPING") == 0
    p.cli("rm", "tiny")
    assert not p.engine_pids()


@needs_vllm
def test_vllm_embeddings_through_its_pooling_runner_match_stokers_engine(platform_factory, tmp_path):
    """`--task embed` on vLLM: its pooling runner (`--runner pooling`) serves `/v1/embeddings`, held
    at zero like chat, and the vectors are those Stoker's engine computes for the same encoder (whose
    own are checked against a direct forward pass in tests/platform/engine/test_embeddings.py): the
    model's CLS pooling, normalised. A chat to it is refused. One more vLLM start, with no compile."""
    encoder = build_tiny_encoder(tmp_path / "tiny-bert", hidden=64)  # head size 32 for vLLM's CPU attention
    p = platform_factory("--vllm", str(VLLM), "--vllm-args=--enforce-eager", *VLLM_HOLD)
    p.deploy("on-vllm", encoder, "--engine", "vllm", "--task", "embed", "--idle-timeout", "600")
    p.deploy("on-cpu", encoder, "--task", "embed", "--idle-timeout", "600")
    texts = ["the quick brown fox", "hello there"]
    got = client(p).embeddings.with_raw_response.create(model="on-vllm", input=texts)
    assert got.headers["x-stoker-cold-start"] == "true"
    on_vllm = got.parse()
    on_cpu = client(p).embeddings.create(model="on-cpu", input=texts)
    assert on_vllm.usage.prompt_tokens == on_cpu.usage.prompt_tokens > 0
    for a, b in zip(on_vllm.data, on_cpu.data, strict=True):
        assert len(a.embedding) == len(b.embedding) == 64
        assert abs(sum(x * x for x in a.embedding) - 1) < 1e-4  # normalised
        assert sum(x * y for x, y in zip(a.embedding, b.embedding, strict=True)) > 0.9999
    with pytest.raises(openai.APIStatusError) as refused:
        client(p).chat.completions.create(model="on-vllm", messages=[{"role": "user", "content": "hi"}])
    assert refused.value.status_code in (400, 404)
    p.cli("rm", "on-vllm")
    assert len(p.engine_pids()) == 1  # the CPU engine's instance is left; vLLM's stopped


def _is_vllm_runtime(proc: Path) -> bool:
    try:
        return (
            b"runtime.py" in (proc / "cmdline").read_bytes()
            and b"vllm-cpu" in (proc / "cmdline").read_bytes()
        )
    except OSError:
        return False


def _fake_vllm(tmp_path: Path, version: str) -> Path:
    """A stand-in for `vllm --version` only: the refusals below never start an engine."""
    script = tmp_path / "vllm"
    script.write_text(f"#!/bin/sh\necho '{version}'\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


@pytest.mark.parametrize(
    ("vllm", "model", "reason"),
    [
        ("missing", "tiny", "the vLLM command '/nonexistent/vllm' is not an executable file"),
        ("0.32.0", "tiny", "vLLM 0.32.0 is a GPU build and no GPU was found"),
        ("0.32.0+cpu", "no-architectures", "vLLM cannot load snapshot"),
    ],
)
def test_vllm_where_it_cannot_run_is_refused_in_one_line(
    platform_factory, tiny_model_dir, tmp_path, vllm, model, reason
):
    command = "/nonexistent/vllm" if vllm == "missing" else str(_fake_vllm(tmp_path, vllm))
    if model == "tiny":
        source = tiny_model_dir
    else:  # a model directory Stoker imports but vLLM could not load: its config names no architecture
        source = tmp_path / "model"
        shutil.copytree(tiny_model_dir, source)
        config = json.loads((source / "config.json").read_text())
        del config["architectures"]
        (source / "config.json").write_text(json.dumps(config))
    p = platform_factory("--vllm", command)
    out = p.cli("deploy", "m", "--model", str(source), "--engine", "vllm", check=False)
    assert out.returncode != 0
    assert reason in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert p.deployments() == {}


# --- the guard, in a real vLLM -------------------------------------------------------------------

KEY = "sk-instance-guard-test-0123456789"
KEYED = {"authorization": f"Bearer {KEY}"}
SERVER_INFO = REPO / "tests" / "data" / "vllm-0.32.0-cpu-server-info.json"
# What the guard lets through with the key: the routes Stoker calls (warm_pool/vllm_guard).
PASSED = {"/health", "/metrics", "/server_info", "/sleep", "/wake_up", "/is_sleeping"}
# Routes vLLM serves only in dev mode, among them what the issue named: these must be in the table.
DEV_ROUTES = {
    "/collective_rpc", "/sleep", "/wake_up", "/is_sleeping", "/server_info", "/reset_prefix_cache",
    "/reset_mm_cache", "/pause", "/resume", "/update_weights", "/release_kv_cache_memory",
}  # fmt: skip
_ROUTE = re.compile(r"Route: (/\S*), Methods: (.+)$")


class GuardedVllm:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log

    def routes(self) -> list[tuple[str, str]]:
        """(method, path) of every route vLLM logged as it started, path parameters filled in."""
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            if m := _ROUTE.search(line):
                path = re.sub(r"\{[^}]*\}", "x", m[1])
                out += [(method.strip(), path) for method in m[2].split(",")]
        return sorted(set(out))


# A deployment's `scheduling_policy: priority`, as the launch passes it (`EngineSettings.vllm_args`).
PRIORITY_POLICY = EngineSettings(scheduling_policy="priority").vllm_args()


@pytest.fixture(scope="module")
def guarded_vllm(vllm_model_dir, tmp_path_factory):
    """vLLM's CPU build as the pool starts it with an instance key (the guard on), plus dev mode."""
    port = free_port()
    spec = vllm_spec(
        vllm_model_dir, port, "tiny", [], sleep_mode=False, dtype="float32", max_model_len=512,
        extra_args=("--enforce-eager", "--max-num-seqs", "4", *PRIORITY_POLICY), vllm_command=(str(VLLM),),
        api_key=KEY,
    )  # fmt: skip
    env = {**spec.environ(os.environ), "VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1"}
    log = tmp_path_factory.mktemp("guarded-vllm") / "vllm.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            spec.argv, env=env, cwd=spec.cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(
            proc, url + "/health", VLLM_START, "vLLM", lambda: log.read_text(errors="replace")[-3000:]
        )
        yield GuardedVllm(proc, url, log)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(STOP)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(STOP)


@needs_vllm
def test_vllm_loaded_the_guard_and_serves_dev_mode(guarded_vllm):
    paths = {path for _, path in guarded_vllm.routes()}
    assert DEV_ROUTES <= paths, sorted(DEV_ROUTES - paths)
    assert {"/health", "/v1/models", "/v1/completions", "/metrics"} <= paths
    # vLLM's own key check guards /v1 only: a 401 on /metrics is the guard's.
    assert httpx.get(guarded_vllm.url + "/metrics", timeout=HTTP_READ).status_code == 401
    assert KEY not in guarded_vllm.log.read_text(errors="replace")  # neither vLLM nor the guard logged it


@needs_vllm
@pytest.mark.parametrize("auth", [None, "Bearer wrong", f"Bearer {KEY}x", KEY])
def test_without_the_key_every_route_vllm_serves_but_health_is_a_401(guarded_vllm, auth):
    headers = {"authorization": auth} if auth else {}
    answers = {}
    with httpx.Client(base_url=guarded_vllm.url, timeout=HTTP_READ) as http:
        for method, path in guarded_vllm.routes():
            answers[method, path] = http.request(method, path, headers=headers).status_code
    assert answers.pop(("GET", "/health")) == 200
    assert {route: code for route, code in answers.items() if code != 401} == {}


@needs_vllm
def test_with_the_key_only_the_routes_stoker_calls_pass(guarded_vllm):
    refused = {}
    with httpx.Client(base_url=guarded_vllm.url, timeout=HTTP_READ, headers=KEYED) as http:
        for method, path in guarded_vllm.routes():
            if path in PASSED or path.startswith("/v1/"):
                continue  # passed on to vLLM: asked below, the safe ones only
            refused[method, path] = http.request(method, path).status_code
        assert set(refused.values()) == {403}, refused
        assert ("POST", "/collective_rpc") in refused and ("POST", "/reset_prefix_cache") in refused
        assert http.post("/collective_rpc", json={"method": "get_model"}).status_code == 403
        assert http.get("/v1/models").json()["data"][0]["id"] == "tiny"
        assert http.get("/metrics").status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        done = http.post("/v1/completions", json={"model": "tiny", "prompt": "The quick", "max_tokens": 2})
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 2
        assert httpx.get(guarded_vllm.url + "/health").status_code == 200  # no key at all


@needs_vllm
def test_under_the_priority_policy_vllm_takes_a_requests_priority(guarded_vllm):
    with httpx.Client(base_url=guarded_vllm.url, timeout=HTTP_READ, headers=KEYED) as http:
        config = http.get("/server_info", params={"config_format": "json"}).json()["vllm_config"]
        assert config["scheduler_config"]["policy"] == "priority"
        body = {"model": "tiny", "prompt": "The quick", "max_tokens": 2, "priority": -5}
        done = http.post("/v1/completions", json=body)  # under fcfs, vLLM refuses any but 0
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 2


def trimmed(answer: dict) -> dict:
    """vLLM's /server_info answer as tests/data keeps it: the config (its random instance id
    blanked), the environment sections emptied (this machine's paths, packages, CPU)."""
    return {"vllm_config": {**answer["vllm_config"], "instance_id": ""}, "vllm_env": {}, "system_env": {}}


@needs_vllm
async def test_the_real_server_info_says_no_sleep_in_the_shape_the_fixture_keeps(guarded_vllm):
    url = guarded_vllm.url
    async with httpx.AsyncClient(timeout=HTTP_READ) as http:
        r = await http.get(url + "/server_info", params={"config_format": "json"}, headers=KEYED)
        assert (await http.get(url + "/server_info", params={"config_format": "json"})).status_code == 401
    assert r.status_code == 200 and KEY not in r.text  # vLLM leaves out its variables named *KEY*
    answer = r.json()
    assert isinstance(answer["vllm_env"], dict) and isinstance(answer["system_env"], dict)
    real, kept = trimmed(answer), json.loads(SERVER_INFO.read_text())
    assert real.keys() == kept.keys()
    assert real["vllm_config"].keys() == kept["vllm_config"].keys()
    assert real["vllm_config"]["model_config"].keys() == kept["vllm_config"]["model_config"].keys()
    assert real["vllm_config"]["model_config"]["enable_sleep_mode"] is False  # the CPU build has none
    assert EngineCapabilities.parse(r.content) == EngineCapabilities.parse(SERVER_INFO.read_bytes())
    # What the pool reads at READY and asks every few seconds, with the instance's key and without.
    engines = HttpEngines(backend=None)
    assert await engines.read_capabilities(url, KEYED) == EngineCapabilities(())
    assert await engines.observe_sleep(url, KEYED) is Observed.AWAKE
    assert await engines.observe_sleep(url) is Observed.UNAUTHORIZED
