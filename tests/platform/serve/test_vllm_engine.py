"""`--engine vllm` end to end with real vLLM: its CPU build (`make vllm` → .venv-vllm/bin/vllm).

The real `stoker up`, a real vLLM process tree per instance, the official client. vLLM runs with
`--enforce-eager` here: without it every start compiles the model with torch.compile (~50 s of a
~90 s start on this machine), and what these tests check (held at zero, served, streamed, drained,
stopped with nothing left behind, what the engine reported) is the same with or without compiling.
The tiny model has a head size of 32: vLLM's CPU attention has no kernel for the usual 16.

A vLLM start is the slowest thing the suite does (a minute on a busy 2-core machine), so each test
here starts vLLM once: a fresh start (held, served, streamed, drained on `rm`), and a start through
a warm runtime (the tier, the forked engine core, and an idle stop instead of a sleep).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import threading
from pathlib import Path

import openai
import pytest

from tests.conftest import REPO, build_tiny_model
from tests.deadlines import HTTP_READ, VLLM_START, deadline

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
def test_vllm_from_zero_served_streamed_and_drained_on_rm(platform_factory, vllm_model_dir):
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
    deployed = p.deploy("tiny", vllm_model_dir, "--engine", "vllm", "--idle-timeout", "600")
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
