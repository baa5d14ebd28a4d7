"""The warm-runtime handoff (`warm_pool.handoff`): the message's checks as tables, and the protocol
between real processes: a minimal runtime of another engine kind (a Python program that serves one
handoff and prints what it became), and the real `stoker runtime` refusing a bad token."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stoker.cli.runtime import refuse
from tests.deadlines import deadline
from warm_pool.handoff import (
    MAX_MESSAGE_BYTES,
    SOCKET_NAME,
    TOKEN_ENV,
    Handoff,
    HandoffError,
    Successor,
    decode,
    encode,
    fits,
    hand_off,
    private_dir,
)

from .support import pid_gone

if sys.platform != "linux":  # pragma: no cover
    pytest.skip("the handoff needs Linux's SO_PEERCRED", allow_module_level=True)

TOKEN = "s3cret-token"


def body(**fields) -> bytes:
    return json.dumps({"argv": ["engine", "--port", "1"], "env": {}, "token": TOKEN} | fields).encode()


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (body(token="wrong"), "bad token"),
        (json.dumps({"argv": ["engine"]}).encode(), "bad token"),  # no token
        (body(token=None), "bad token"),
        (b"not json", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (body(extra=1), "unknown fields"),
        (body(argv=[]), "argv must be a list"),
        (body(argv="engine"), "argv must be a list"),
        (body(argv=["engine", 7]), "argv must hold strings"),
        (body(argv=["a"] * 513), "argv must be a list"),
        (body(argv=["x\0y"]), "argv must hold strings"),
        (body(env=["A=1"]), "env must be an object"),
        (body(env={"A=B": "1"}), "must be a name"),
        (body(env={"A": 1}), "must be a name"),
        (body(env={"A": "x" * 9000}), "longer than"),
        (body(cwd="relative/dir"), "cwd must be an absolute path"),
        (b"x" * (MAX_MESSAGE_BYTES + 1), "exceeds"),
        (body(next="/d"), "next must be an object"),
        (body(next={"dir": "/d"}), "next must be an object"),
        (body(next={"dir": "/d", "token": "t" * 32, "pid": 1}), "next must be an object"),
        (body(next={"dir": "relative", "token": "t" * 32}), "next.dir must be an absolute path"),
        (body(next={"dir": "/d", "token": "short"}), "next.token must be a string of 16"),
        (body(next={"dir": "/d", "token": "t" * 257}), "next.token must be a string of 16"),
        (body(next={"dir": "/d", "token": 7}), "next.token must be a string of 16"),
    ],
)
def test_a_bad_message_is_refused_naming_why(data, error):
    with pytest.raises(HandoffError, match=error):
        decode(data, TOKEN)


def test_a_good_message_round_trips():
    sent = Handoff(("engine", "--snapshot", "/s"), {"STOKER_ENGINE_API_KEY": "k"}, "/tmp")
    data = encode(sent, TOKEN)
    assert data.endswith(b"\n") and data.count(b"\n") == 1
    assert decode(data[:-1], TOKEN) == sent


def test_a_successor_rides_in_the_message_but_its_log_and_keeper_never_do():
    sent = Handoff(("engine",), successor=Successor("/run/rt/cpu-1", "t" * 43, log_fd=9, keeper_pid=7))
    body = json.loads(encode(sent, TOKEN))
    assert body["next"] == {"dir": "/run/rt/cpu-1", "token": "t" * 43}
    assert decode(encode(sent, TOKEN)[:-1], TOKEN).successor == Successor("/run/rt/cpu-1", "t" * 43)


def test_an_oversized_handoff_is_refused_before_it_is_sent():
    with pytest.raises(HandoffError, match="exceeds"):
        encode(Handoff(("engine", "x" * MAX_MESSAGE_BYTES)), TOKEN)


@pytest.mark.parametrize(
    ("env", "runtime_env", "fits_it"),
    [
        ({"STOKER_ENGINE_API_KEY": "k", "PYTHONUNBUFFERED": "1"}, {}, True),
        ({"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "0"}, True),
        ({"CUDA_VISIBLE_DEVICES": "1"}, {"CUDA_VISIBLE_DEVICES": "0"}, False),
        ({"HF_HUB_OFFLINE": "1"}, {}, False),
        ({"LD_PRELOAD": "/x.so"}, {}, False),
    ],
)
def test_a_launch_fits_a_runtime_unless_it_changes_what_is_read_at_start(env, runtime_env, fits_it):
    assert (fits(env, runtime_env) is None) == fits_it


@pytest.mark.parametrize(
    ("argv", "refused"),
    [(("engine", "--snapshot", "/s"), False), (("up",), True), (("snapshot", "rm", "x"), True)],
)
def test_the_stoker_runtime_becomes_an_engine_and_nothing_else(argv, refused):
    assert (refuse(argv) is not None) == refused


def test_the_socket_directory_must_be_private(tmp_path):
    d = private_dir(tmp_path / "rt")
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    open_dir.chmod(0o755)
    with pytest.raises(HandoffError, match="0700"):
        private_dir(open_dir)
    link = tmp_path / "link"
    link.symlink_to(d)
    with pytest.raises(HandoffError, match="0700"):
        private_dir(link)


# A runtime of another engine kind, as small as one can be: it serves one handoff with the shared
# protocol and, as "its engine", prints what it became (argv, an env addition, its token's absence).
MINIMAL_RUNTIME = """
import json, os, sys
from pathlib import Path
from warm_pool.handoff import TOKEN_ENV, HandoffError, listen, serve_one, take_over
token = os.environ.pop(TOKEN_ENV)
listener = listen(Path(sys.argv[1]))
try:
    handoff, conn, log_fd = serve_one(listener, token)
except HandoffError as exc:
    print("refused:", exc, flush=True)
    sys.exit(2)
take_over(handoff, conn, log_fd, listener)
print(json.dumps({"argv": handoff.argv, "added": os.environ.get("ADDED"), "cwd": os.getcwd(),
                  "token": os.environ.get(TOKEN_ENV)}), flush=True)
"""


def start_runtime(
    tmp_path: Path, command: list[str], token: str = TOKEN
) -> tuple[subprocess.Popen, Path, Path]:
    sock_dir, log = tmp_path / "sock", tmp_path / "runtime.log"
    env = {**os.environ, TOKEN_ENV: token, "HF_HUB_OFFLINE": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen([*command, str(sock_dir)], env=env, stdout=out, stderr=subprocess.STDOUT)
    end = time.monotonic() + deadline(300)
    while not (sock_dir / SOCKET_NAME).exists():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < end, f"the runtime never listened (within {deadline(300):g} s)"
        time.sleep(0.02)
    return proc, sock_dir, log


def test_a_handoff_makes_the_runtime_the_engine_with_its_pid_env_and_log(tmp_path):
    proc, sock_dir, _ = start_runtime(tmp_path, [sys.executable, "-c", MINIMAL_RUNTIME])
    try:
        sock = sock_dir / SOCKET_NAME
        assert stat.S_IMODE(os.stat(sock_dir).st_mode) == 0o700
        assert stat.S_IMODE(os.lstat(sock).st_mode) == 0o600
        engine_log = tmp_path / "engine.log"
        fd = os.open(engine_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            pid = hand_off(
                sock,
                Handoff(("engine", "--port", "1"), {"ADDED": "yes"}, str(tmp_path)),
                TOKEN,
                expect_pid=proc.pid,
                log_fd=fd,
            )
        finally:
            os.close(fd)
        assert pid.pid == proc.pid and pid.successor_pid is None
        assert proc.wait(timeout=deadline(30)) == 0
    finally:
        proc.kill()
    became = json.loads(engine_log.read_text())  # its output went to the log sent along
    assert became == {"argv": ["engine", "--port", "1"], "added": "yes", "cwd": str(tmp_path), "token": None}
    assert not sock.exists()  # one handoff in a runtime's life


def test_a_bad_token_is_answered_and_ends_the_runtime(tmp_path):
    proc, sock_dir, log = start_runtime(tmp_path, [sys.executable, "-c", MINIMAL_RUNTIME])
    try:
        with pytest.raises(HandoffError, match="refused the handoff: bad token"):
            hand_off(sock_dir / SOCKET_NAME, Handoff(("engine",)), "not-the-token", expect_pid=proc.pid)
        assert proc.wait(timeout=deadline(30)) == 2
    finally:
        proc.kill()
    assert "refused: bad token" in log.read_text()
    assert "not-the-token" not in log.read_text()


def test_an_oversized_message_is_answered_and_ends_the_runtime(tmp_path):
    proc, sock_dir, log = start_runtime(tmp_path, [sys.executable, "-c", MINIMAL_RUNTIME])
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(30)
            conn.connect(str(sock_dir / SOCKET_NAME))
            conn.sendall(b"x" * (MAX_MESSAGE_BYTES + 100))  # no newline: it stops reading at the limit
            answer = json.loads(conn.makefile("rb").readline())
        assert answer["ok"] is False and "exceeds" in answer["error"]
        assert proc.wait(timeout=deadline(30)) == 2
    finally:
        proc.kill()
    assert "exceeds" in log.read_text()


def test_a_successor_is_sent_with_both_logs_or_refused(tmp_path):
    proc, sock_dir, _ = start_runtime(tmp_path, [sys.executable, "-c", MINIMAL_RUNTIME])
    try:
        with pytest.raises(HandoffError, match="sends both logs"):  # refused before it is sent
            hand_off(
                sock_dir / SOCKET_NAME,
                Handoff(("engine",), successor=Successor(str(tmp_path), "t" * 32)),
                TOKEN,
                expect_pid=proc.pid,
                log_fd=1,
            )
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:  # one log only: refused there
            conn.settimeout(30)
            conn.connect(str(sock_dir / SOCKET_NAME))
            message = encode(Handoff(("engine",), successor=Successor(str(tmp_path), "t" * 32)), TOKEN)
            socket.send_fds(conn, [message], [1])
            answer = json.loads(conn.makefile("rb").readline())
        assert answer == {
            "ok": False,
            "error": "a handoff with a successor sends two file descriptors (the logs)",
        }
        assert proc.wait(timeout=deadline(30)) == 2
    finally:
        proc.kill()


def test_the_pool_refuses_a_socket_served_by_another_process(tmp_path):
    proc, sock_dir, _ = start_runtime(tmp_path, [sys.executable, "-c", MINIMAL_RUNTIME])
    try:
        with pytest.raises(HandoffError, match="not runtime"):
            hand_off(sock_dir / SOCKET_NAME, Handoff(("engine",)), TOKEN, expect_pid=proc.pid + 1)
        assert proc.wait(timeout=deadline(30)) == 2  # the connection closed without a message
    finally:
        proc.kill()


def test_the_stoker_runtime_refuses_a_bad_token_and_exits(tmp_path, stoker_env):
    stoker = str(Path(sys.executable).with_name("stoker"))
    proc, sock_dir, log = start_runtime(tmp_path, [stoker, "runtime", "--socket-dir"])
    try:
        text = log.read_text()
        assert f"runtime pid {proc.pid}: imports done" in text
        environ = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert TOKEN.encode() not in environ  # the token is never on argv
        with pytest.raises(HandoffError, match="bad token"):
            hand_off(sock_dir / SOCKET_NAME, Handoff(("engine",)), "wrong", expect_pid=proc.pid)
        assert proc.wait(timeout=deadline(60)) == 2
    finally:
        proc.kill()
    assert pid_gone(proc.pid)
    assert "handoff refused: bad token" in log.read_text()
