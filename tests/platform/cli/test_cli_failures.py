"""Reasons you can see, through the real `stoker up` and CLI: a deployment whose engine cannot load
its snapshot (transformers refuses a config that does not match the weights) answers a held request
with a 503 that says why once `--unavailable-after` starts in a row have failed, long before the
hold deadline; `stoker ls`, `stoker describe` and the admin API show the last failure; `stoker logs`
reads the instances' logs (admin key only), and follows one until it is gone.

One platform for the module, with an admin key: `broken` (fails every start), `tiny` (one instance
kept READY), and a deployment made from a Hugging Face repo id in a local cache.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import STOKER
from tests.deadlines import CLI, ENGINE_START, HTTP_READ, deadline
from tests.platform.conftest import PlatformProcess
from tests.platform.engine.conftest import free_port
from tests.snapshots.support import assert_one_line_error
from tests.snapshots.test_hf_cache import cache_model

ADMIN = "sk-admin-for-the-failure-tests"
HOLD_DEADLINE_S = deadline(300)  # far beyond the two failed starts (about 12 s here) the 503 must come after
# An age as `stoker describe` prints it (`format_duration`, whole seconds): 0s, 59s, 1m14s, 2h3m, 1d5s.
AGE = r"(?:\d+[dhms])+ ago"


@pytest.fixture(scope="module")
def platform(tmp_path_factory, tiny_model_dir: Path):
    root = tmp_path_factory.mktemp("failures")
    broken = root / "broken"
    shutil.copytree(tiny_model_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    config["intermediate_size"] = 96  # the weights say 128: the engine exits 1 while loading
    (broken / "config.json").write_text(json.dumps(config))
    cache_model(root / "hf" / "hub", "acme/tiny", tiny_model_dir)
    p = PlatformProcess(
        root / "home",
        free_port(),
        ("--unavailable-after", "2", "--hold-deadline", f"{HOLD_DEADLINE_S:g}s", "--stable-window", "2s"),
        extra_env={"STOKER_ADMIN_KEY": ADMIN, "HF_HOME": str(root / "hf")},
    ).start()
    try:
        p.deploy("tiny", tiny_model_dir, "--min-warm", "1", "--idle-timeout", "10m")
        p.deploy("broken", broken, "--idle-timeout", "10m")
        yield p
    finally:
        p.stop()


def describe(p: PlatformProcess, name: str) -> dict:
    return json.loads(p.cli("describe", name, "--json").stdout)


def test_failed_starts_are_a_503_that_says_why_before_the_hold_deadline(platform: PlatformProcess):
    p = platform
    headers = {"authorization": f"Bearer {ADMIN}"}
    started = time.monotonic()
    r = httpx.post(
        f"{p.url}/v1/completions",
        json={"model": "broken", "prompt": "x", "max_tokens": 2},
        headers=headers,
        timeout=HOLD_DEADLINE_S + HTTP_READ,
    )
    assert time.monotonic() - started < HOLD_DEADLINE_S / 2
    assert r.status_code == 503 and "retry-after" in r.headers
    error = r.json()["error"]
    assert error["code"] == "deployment_unavailable"
    assert re.search(
        r"instance failed to start \(\d+ in a row\): (process_start|model_load), exit code 1: ",
        error["message"],
    )
    assert "stoker: error: cannot load" in error["message"]

    # The admin API: the last failure, bounded and whole. (`unavailable` itself may be lifted by
    # now: with nobody calling, the pool stops starting, and the next request tries once more.)
    d = describe(p, "broken")
    failure = d["last_failure"]
    assert d["failed_starts"] >= 2
    assert failure["phase"] in ("process_start", "model_load") and failure["exit_code"] == 1
    assert re.fullmatch(r"broken-[0-9a-f]{8}", failure["instance"])
    assert 1 <= len(failure["log_tail"]) <= 20 and "cannot load" in failure["log_tail"][-1]
    assert "exited with status 1 before it was ready" in failure["message"]

    # `stoker ls` (all, and one) and `stoker describe`, for people: one line under the row says why,
    # `unavailable:` while requests are refused, `failing:` while starts fail short of that.
    listing = p.cli("ls").stdout
    assert listing.count("\ntiny ") == 1 and listing.count("\nbroken ") == 1
    one = p.cli("ls", "broken").stdout.splitlines()
    assert len(one) == 3 and one[1].startswith("broken ")
    assert re.match(
        r"  (unavailable: instance failed to start \(|failing: \d+ failed start\(s\) in a row)", one[2]
    )
    assert "stoker: error: cannot load" in one[2]
    text = p.cli("describe", "broken").stdout
    assert f"instance {failure['instance']}" in text and "exit code 1" in text
    assert f"stoker logs broken --instance {failure['instance']}" in text
    assert_one_line_error(p.cli("describe", "nope", check=False), "No deployment named 'nope'")

    # Its log, by instance, bounded by --tail; the admin key is required.
    log = p.cli("logs", "broken", "--instance", failure["instance"]).stdout
    assert "stoker: error: cannot load" in log and "Started server process" in log
    # transformers drew "Loading weights: 100%|███…|" bars into the log file: not into a file any more.
    assert "it/s]" not in log and "%|" not in log
    assert (
        len(p.cli("logs", "broken", "--instance", failure["instance"], "--tail", "1").stdout.splitlines())
        == 1
    )
    url = f"{p.url}/admin/v1/deployments/broken/logs"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, params={"instance": failure["instance"]}, headers=headers).status_code == 200
    assert_one_line_error(
        p.cli("logs", "broken", "--instance", "broken-xyz", check=False), "'instance' must be"
    )

    # Following a failed instance's log ends, that instance being gone, with its reason in it. (Not
    # "the newest": by now the pool may have begun another start, whose log is still empty.)
    follow = p.cli("logs", "broken", "--instance", failure["instance"], "--follow", "--tail", "1000")
    assert follow.returncode == 0 and "cannot load" in follow.stdout.splitlines()[-1]


def test_a_ready_deployment_shows_its_instances_and_a_follow_runs_until_the_client_leaves(
    platform: PlatformProcess,
):
    p = platform
    p.wait_for(lambda: p.deployments()["tiny"]["instances"]["READY"] == 1, ENGINE_START, "tiny READY")
    d = describe(p, "tiny")
    [inst] = d["instance_list"]
    assert (
        inst["state"] == "READY"
        and inst["url"].startswith("http://127.0.0.1:")
        and inst["since"] <= time.time()
    )
    assert d["last_failure"] is None and d["unavailable"] is None
    text = p.cli("describe", "tiny").stdout
    # DEVICE is "-": no shared device (`stoker up --device-memory`).
    assert re.search(rf"\n  {inst['id']} +READY +{AGE} +- +{inst['url']}\n", text), text
    assert "Last failure:    none" in text

    with subprocess.Popen(
        [STOKER, "logs", "tiny", "--follow", "--tail", "1"], env=p.env, stdout=subprocess.PIPE, text=True
    ) as follow:
        assert "ready: serving 'tiny'" in follow.stdout.readline()  # the tail, streamed at once
        time.sleep(0.5)
        assert follow.poll() is None  # the instance lives: the follow goes on
        follow.terminate()  # the client leaves
        follow.wait(timeout=deadline(10))
    assert httpx.get(f"{p.url}/healthz").status_code == 200
    # --url wins over $STOKER_URL.
    moved = {**p.env, "STOKER_URL": "http://127.0.0.1:1"}
    ls = subprocess.run(
        [STOKER, "ls", "tiny", "--url", p.url], env=moved, capture_output=True, text=True, timeout=CLI
    )
    assert ls.returncode == 0 and ls.stdout.splitlines()[1].startswith("tiny ")


def test_deploy_by_hugging_face_repo_id_and_durations(platform: PlatformProcess, tiny_model_dir: Path):
    p = platform
    out = p.deploy("hf", "acme/tiny", "--idle-timeout", "1h30m", "--grace-period", "1m")
    assert (out["model"], out["snapshot_id"]) == ("acme/tiny", p.deployments()["tiny"]["snapshot_id"])
    assert (out["idle_timeout_s"], out["grace_period_s"]) == (5400.0, 60.0)
    absent = p.cli("deploy", "x", "--model", "acme/absent", check=False)
    assert_one_line_error(
        absent, "acme/absent is not in the local Hugging Face cache", "models--acme--absent"
    )
    # The snapshot a deployment serves cannot be removed from under it.
    busy = p.cli("snapshot", "rm", out["snapshot_id"][:12], check=False)
    assert_one_line_error(busy, "is used by deployment")
    assert p.cli("rm", "hf").returncode == 0
