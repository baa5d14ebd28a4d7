"""Every "give up after" bound the suite waits on, from one place, scaled by one factor.

A test waits for something to start (a platform, an engine, moto, a vLLM runtime) or to answer (an
HTTP request, a CLI run). On a loaded machine (CI's 2 cores running two files at once, a laptop
building something) all of these take several times longer than on an idle one, while what the tests
check stays the same. So the bounds are written here once, in seconds for an unloaded 2-core
machine, and multiplied by `STOKER_TEST_TIMEOUT_FACTOR`:

    STOKER_TEST_TIMEOUT_FACTOR=3 make test    # every deadline below, and every deadline(n), x3

Only bounds scale. An interval that is the subject of a test (a 2 s idle timeout that must fire, a
0.2 s hold deadline that must refuse, "answered in under 5 s, not the 60 s deadline") is written
where it is tested and never passes through here. A bound that passes is free: raising it costs
nothing unless the test was going to fail anyway, and then it fails later, saying what it waited for.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable


def _factor(text: str) -> float:
    try:
        factor = float(text)
    except ValueError:
        factor = float("nan")
    if not factor > 0 or factor == float("inf"):  # NaN, zero, negative, infinite
        raise ValueError(
            f"STOKER_TEST_TIMEOUT_FACTOR must be a finite number > 0 (e.g. 1, 2.5), got {text!r}"
        )
    return factor


FACTOR = _factor(os.environ.get("STOKER_TEST_TIMEOUT_FACTOR", "1"))


def deadline(seconds: float) -> float:
    """`seconds` (a bound for an unloaded machine) times the factor: 60 -> 180 at a factor of 3."""
    return seconds * FACTOR


def flag(seconds: float) -> str:
    """`deadline(seconds)` spelled for a duration flag (`--hold-deadline`): 120 -> "360s" at 3."""
    return f"{deadline(seconds):g}s"


# --- starting ------------------------------------------------------------------------------------
PLATFORM_START = deadline(60)  # `stoker up` / controller / gateway: process start until /healthz is 200
ENGINE_START = deadline(120)  # a CPU `stoker engine` on the tiny model: launch until /health is 200,
#                               or an instance READY in a platform (the import of torch dominates)
VLLM_START = deadline(600)  # a real vLLM engine or warm runtime on CPU, started and serving
S3_SERVER_START = deadline(60)  # `python -m moto.server` importing its services until it answers
SERVER_START = deadline(30)  # a test's own server in its process (uvicorn, aiohttp) serving

# --- answering -----------------------------------------------------------------------------------
HTTP_READ = deadline(60)  # one HTTP request to a running server: admin API, /metrics, a warm answer
COLD_ANSWER = deadline(120)  # a request held at zero while an engine starts, then answered
CLI = deadline(60)  # one `stoker …` CLI process run to its exit (imports included)

# --- waiting for a state -------------------------------------------------------------------------
WAIT = deadline(60)  # polling for a state the system reaches on its own (scaled to zero, a record)
STOP = deadline(90)  # a process exiting after SIGTERM, draining included

# --- bounds handed to the platform ---------------------------------------------------------------
HOLD = deadline(120)  # `--hold-deadline` where it is a give-up bound, not the thing tested (the
#                       product's default: 120 s, longer than any start on an unloaded machine)


def wait_healthy(
    proc: subprocess.Popen,
    url: str,
    timeout: float,
    name: str,
    log_tail: Callable[[], str],
    poll_s: float = 0.1,
) -> None:
    """Until GET `url` is 200, within `timeout` (a bound from here): a process that exits first, or a
    wait that runs out, fails saying what it waited for, for how long, what it last saw, and the
    tail of the process's log (`name` says whose)."""
    import httpx

    end = time.monotonic() + timeout
    last = "no answer yet"
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited {proc.returncode} before {url} answered 200:\n{log_tail()}")
        try:
            r = httpx.get(url, timeout=1)
            if r.status_code == 200:
                return
            last = f"status {r.status_code}: {r.text[:200]}"
        except httpx.TransportError as exc:
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(poll_s)
    raise TimeoutError(f"{name}: {url} not 200 within {timeout:g} s (last: {last}); its log:\n{log_tail()}")
