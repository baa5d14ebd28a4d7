"""The warm-runtime handoff: how the pool hands a started instance to a runtime that waits for one.

A warm runtime (ARCHITECTURE.md, "Tiers") is an engine process started ahead of need: its imports
are done (on a GPU, its CUDA context too), it holds no model, and it waits on a unix socket. A start
connects, sends one message, and the runtime becomes that engine in-process: it runs the engine's
command line with the arguments it was sent, so the engine binds its port, maps the snapshot and
serves, with the runtime's PID. The message is engine-agnostic; each engine kind provides its own
runtime entry (`stoker runtime` for the CPU engine) around `serve_one`, and the pool's side is
`hand_off`. Nothing here imports more than the standard library, so an engine's own environment
(vLLM's virtualenv) can serve the same handoff.

The message, one line of JSON of at most `MAX_MESSAGE_BYTES`, with the instance's log file sent
along as a file descriptor (SCM_RIGHTS), which the runtime makes its stdout and stderr::

    {"argv": ["engine", "--snapshot", "/store/ab12…", "--port", "41234", …],
     "env": {"STOKER_ENGINE_API_KEY": "…", "PYTHONUNBUFFERED": "1"},
     "cwd": null, "token": "…"}

    ← {"ok": true, "pid": 4242}            (then the socket is closed and the engine runs)
    ← {"ok": false, "error": "bad token"}  (then the runtime exits 2; the pool starts another)

A runtime that can fork (the CPU engine's; not one holding a CUDA context, which a fork does not
carry) is also sent its successor: `"next": {"dir": "/tmp/stoker-rt-…/cpu-9f8e", "token": "…"}` and a
second descriptor, the successor's log. Before it becomes the engine it forks the runtime that will
take the next start (`warm_pool.succession`), imports and all, so a burst of starts each finds a
runtime at a fork's cost instead of a fresh interpreter's; the answer then names it:
`{"ok": true, "pid": 4242, "next_pid": 4250}`. A runtime that does not fork answers without
`next_pid`, and the pool starts a replacement itself.

Who may hand off: the socket lies in a private directory (0700) and is itself 0600; the runtime
checks the peer's uid (SO_PEERCRED) is its own, and the message must carry the runtime's token,
which the pool put in its environment (`TOKEN_ENV`, never on argv, where every local user reads
it); the runtime drops it from its environment before it becomes the engine. The pool in turn
checks that the process answering is the runtime it started (the peer's PID). A runtime takes one
handoff in its life: anything wrong (bad token, oversized or malformed message, a stranger) ends it
after one error reply, and the pool replaces it.

Readiness: the runtime binds its socket under a temporary name and renames it into place once it
listens, so the socket's path exists exactly when a connection would be accepted.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import signal
import socket
import stat
import struct
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

MAX_MESSAGE_BYTES = 64 * 1024  # argv and env of an engine are a few KiB; more is not a launch
MAX_ARGS = 512
MAX_ENV = 256
MAX_ITEM_CHARS = 8192
MAX_TOKEN_CHARS = 256
TOKEN_ENV = "STOKER_RUNTIME_TOKEN"
KEEPER_ENV = "STOKER_RUNTIME_KEEPER"  # the keeper's PID: a waiting runtime dies with it
PR_SET_PDEATHSIG = 1  # linux/prctl.h
SOCKET_NAME = "handoff.sock"
READ_TIMEOUT_S = 10.0  # a connected peer must send its whole message within this
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
# Variables read once, at start or at import (the loader, the interpreter, OpenMP, CUDA, the Hugging
# Face libraries' offline switches): a runtime already started cannot take a new value of these, so
# a launch that sets one differently starts a fresh process instead (`fits`).
START_ONLY_ENV = frozenset(
    {
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
        "PYTHONPATH",
        "PYTHONHASHSEED",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "CUDA_VISIBLE_DEVICES",
        "HF_HOME",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
    }
)


class HandoffError(Exception):
    """A handoff refused or failed; the message says why in one line (never the token)."""


@dataclass(frozen=True)
class Successor:
    """The runtime a runtime forks before it becomes an engine: the private directory it listens in
    and the token it takes its own handoff with (the keeper's), the descriptor of its log (set on
    the runtime's side, from the second descriptor sent; never in the message), and the keeper's
    PID (set on the runtime's side, from the connection's peer: the process that will reap it)."""

    dir: str
    token: str = field(repr=False)
    log_fd: int | None = None
    keeper_pid: int | None = None


@dataclass(frozen=True)
class Handoff:
    """What a runtime is asked to become: the engine's arguments (its program's own name left out),
    additions to its environment, the directory to run in (None: where it is), and the successor it
    forks first (None: it forks none)."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    successor: Successor | None = None


@dataclass(frozen=True)
class Answer:
    """A runtime's answer to a handoff: the PID it runs the engine as, and its successor's (None:
    it forked none)."""

    pid: int
    successor_pid: int | None = None


def encode(handoff: Handoff, token: str) -> bytes:
    """The message for `handoff`, newline-terminated; `HandoffError` if it would be refused for its
    size (so the pool starts a fresh process instead of wasting the runtime)."""
    body = {"argv": list(handoff.argv), "env": dict(handoff.env), "cwd": handoff.cwd, "token": token}
    if handoff.successor is not None:
        body["next"] = {"dir": handoff.successor.dir, "token": handoff.successor.token}
    data = json.dumps(body, separators=(",", ":")).encode() + b"\n"
    if len(data) > MAX_MESSAGE_BYTES:
        raise HandoffError(f"handoff message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return data


def decode(data: bytes, token: str) -> Handoff:
    """The handoff in one message (without its newline), checked: its token first, then its shape.
    `HandoffError` names what is wrong.

    >>> decode(b'{"argv": ["engine"], "env": {}, "token": "t"}', "t").argv
    ('engine',)
    """
    if len(data) > MAX_MESSAGE_BYTES:
        raise HandoffError(f"message exceeds {MAX_MESSAGE_BYTES} bytes")
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise HandoffError("message is not JSON") from None
    if not isinstance(body, dict):
        raise HandoffError("message must be a JSON object")
    sent = body.get("token")
    if not isinstance(sent, str) or not hmac.compare_digest(sent.encode(), token.encode()):
        raise HandoffError("bad token")
    unknown = set(body) - {"argv", "env", "cwd", "token", "next"}
    if unknown:
        raise HandoffError(f"unknown fields {sorted(unknown)}")
    argv, env, cwd = body.get("argv"), body.get("env", {}), body.get("cwd")
    if not isinstance(argv, list) or not argv or len(argv) > MAX_ARGS:
        raise HandoffError(f"argv must be a list of 1..{MAX_ARGS} strings")
    if not all(isinstance(a, str) and len(a) <= MAX_ITEM_CHARS and "\0" not in a for a in argv):
        raise HandoffError(f"argv must hold strings of at most {MAX_ITEM_CHARS} characters")
    if not isinstance(env, dict) or len(env) > MAX_ENV:
        raise HandoffError(f"env must be an object of at most {MAX_ENV} strings")
    for k, v in env.items():
        if not (isinstance(v, str) and k and "=" not in k and "\0" not in k + v):
            raise HandoffError(f"env {k[:40]!r} must be a name (no '=') with a string value")
        if len(k) + len(v) > MAX_ITEM_CHARS:
            raise HandoffError(f"env {k[:40]!r} is longer than {MAX_ITEM_CHARS} characters")
    if cwd is not None and not (isinstance(cwd, str) and os.path.isabs(cwd) and "\0" not in cwd):
        raise HandoffError("cwd must be an absolute path or null")
    return Handoff(tuple(argv), dict(env), cwd, _successor(body.get("next")))


def _successor(value: object) -> Successor | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"dir", "token"}:
        raise HandoffError('next must be an object of "dir" and "token"')
    directory, token = value["dir"], value["token"]
    if not (isinstance(directory, str) and os.path.isabs(directory) and "\0" not in directory):
        raise HandoffError("next.dir must be an absolute path")
    if len(directory) > MAX_ITEM_CHARS:
        raise HandoffError(f"next.dir is longer than {MAX_ITEM_CHARS} characters")
    if not (isinstance(token, str) and 16 <= len(token) <= MAX_TOKEN_CHARS):
        raise HandoffError(f"next.token must be a string of 16..{MAX_TOKEN_CHARS} characters")
    return Successor(directory, token)


def fits(env: Mapping[str, str], runtime_env: Mapping[str, str]) -> str | None:
    """Why a launch with additions `env` cannot run in a runtime started with `runtime_env`, or None.

    >>> fits({"CUDA_VISIBLE_DEVICES": "1"}, {"CUDA_VISIBLE_DEVICES": "0"})
    "CUDA_VISIBLE_DEVICES differs from the runtime's (read only at start)"
    >>> fits({"STOKER_ENGINE_API_KEY": "k"}, {}) is None
    True
    """
    for name in sorted(START_ONLY_ENV & env.keys()):
        if runtime_env.get(name) != env[name]:
            return f"{name} differs from the runtime's (read only at start)"
    return None


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a unix socket, as the kernel tells it."""
    return _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))


# ---- the runtime's side ---------------------------------------------------------------------------


def private_dir(path: Path) -> Path:
    """`path` as a directory only its owner may enter (0700), created if need be; refused if it is a
    link, someone else's, or open to others (then whoever else can write there could swap the socket)."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700, parents=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise HandoffError(f"{path} must be a directory of this user's, mode 0700")
    return path


def listen(directory: Path) -> socket.socket:
    """A listening socket at `directory/SOCKET_NAME`, mode 0600, in a private directory; the path
    appears only once it listens (bound under a temporary name, then renamed into place)."""
    private_dir(directory)
    final, temporary = directory / SOCKET_NAME, directory / f".{SOCKET_NAME}.{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        temporary.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # created 0600: no moment when others could connect
    try:
        listener.bind(str(temporary))
    finally:
        os.umask(old)
    listener.listen(1)
    os.rename(temporary, final)
    return listener


def receive(conn: socket.socket, timeout_s: float = READ_TIMEOUT_S) -> tuple[bytes, list[int]]:
    """One message (up to its newline) and the file descriptors sent with it. `HandoffError` if it
    runs past `MAX_MESSAGE_BYTES`, ends early or takes longer than `timeout_s`."""
    conn.settimeout(timeout_s)
    data, fds = b"", []
    try:
        while b"\n" not in data:
            chunk, got, _, _ = socket.recv_fds(conn, MAX_MESSAGE_BYTES + 1, 2)
            fds += got
            if not chunk:
                raise HandoffError("connection closed before a whole message")
            data += chunk
            if len(data) > MAX_MESSAGE_BYTES:
                raise HandoffError(f"message exceeds {MAX_MESSAGE_BYTES} bytes")
    except (TimeoutError, OSError) as exc:
        _close_fds(fds)
        raise HandoffError(f"reading the message failed: {exc}") from None
    except HandoffError:
        _close_fds(fds)
        raise
    message, _, rest = data.partition(b"\n")
    if rest:
        _close_fds(fds)
        raise HandoffError("data after the message")
    return message, fds


def serve_one(listener: socket.socket, token: str) -> tuple[Handoff, socket.socket, int | None]:
    """Wait for the one handoff: (what to become, the connection to answer on, the log descriptor
    sent, if any). With a successor, exactly two descriptors come (the engine's log, then the
    successor's), and the successor's log and the keeper's PID are set on it. On anything wrong it
    answers the error and raises `HandoffError`: the caller exits. Success is answered by
    `take_over`, once the caller has checked the handoff."""
    conn, _ = listener.accept()
    fds: list[int] = []
    try:
        peer, uid, _ = peer_credentials(conn)
        if uid != os.getuid():
            raise HandoffError(f"peer uid {uid} is not this process's {os.getuid()}")
        message, fds = receive(conn)
        handoff = decode(message, token)
        if handoff.successor is not None:
            if len(fds) != 2:
                raise HandoffError("a handoff with a successor sends two file descriptors (the logs)")
            successor = replace(handoff.successor, log_fd=fds.pop(), keeper_pid=peer)
            handoff = replace(handoff, successor=successor)
        elif len(fds) > 1:
            raise HandoffError("at most one file descriptor (the log) may be sent")
    except HandoffError as exc:
        _close_fds(fds)
        reply(conn, {"ok": False, "error": str(exc)})
        conn.close()
        raise
    return handoff, conn, fds[0] if fds else None


def die_with_keeper() -> bool:
    """A runtime waiting for its handoff dies with the process that keeps it (`KEEPER_ENV`): the
    kernel sends it SIGTERM when its parent ends, however the parent ends (SIGKILL included), so
    no runtime outlives a platform holding its memory with no one to hand it a start (four did,
    355 MiB each, for over an hour). The pool starts runtimes from its event loop's thread, which
    lives as long as the keeper (the signal follows the parent thread). False when the keeper is
    already gone (it died before the signal was armed): the caller exits. On a system without
    `prctl` (not Linux), nothing is armed. `take_over` disarms it: the engine a runtime becomes
    outlives a killed platform, as every engine does, to be adopted by the next one."""
    keeper = os.environ.pop(KEEPER_ENV, "")
    if not keeper.isdigit():
        return True  # started by hand, not by a pool
    death_signal(signal.SIGTERM)
    return os.getppid() == int(keeper)


def death_signal(sig: int) -> None:
    """Have the kernel send `sig` to this process when its parent ends (0: none)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def take_over(
    handoff: Handoff,
    conn: socket.socket,
    log_fd: int | None,
    listener: socket.socket,
    *,
    successor_pid: int | None = None,
) -> None:
    """Make this process the one `handoff` describes, up to running its program (the caller's part):
    no longer tied to its keeper's life (`die_with_keeper`), its environment added, its directory
    entered, the log sent made stdout and stderr, the socket closed and removed (no second
    handoff), and then the success answered with this PID (and its successor's, if it forked one)."""
    if handoff.successor is not None and handoff.successor.log_fd is not None:
        with contextlib.suppress(OSError):
            os.close(handoff.successor.log_fd)  # the successor's own, if not closed already
    death_signal(0)
    os.environ.update(handoff.env)
    if handoff.cwd is not None:
        os.chdir(handoff.cwd)
    if log_fd is not None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
    path = Path(listener.getsockname()).with_name(SOCKET_NAME)  # bound under the temporary name
    listener.close()
    with contextlib.suppress(OSError):
        path.unlink()  # before the answer: once the pool hears success, nothing can connect again
    answer: dict = {"ok": True, "pid": os.getpid()}
    if successor_pid is not None:
        answer["next_pid"] = successor_pid
    reply(conn, answer)
    conn.close()


def reply(conn: socket.socket, body: dict) -> None:
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps(body).encode() + b"\n")


def _close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


# ---- the pool's side ------------------------------------------------------------------------------


def hand_off(
    socket_path: Path,
    handoff: Handoff,
    token: str,
    *,
    expect_pid: int,
    log_fd: int | None = None,
    successor_log_fd: int | None = None,
    timeout_s: float = READ_TIMEOUT_S,
) -> Answer:
    """Hand `handoff` to the runtime listening at `socket_path`: the PID it now runs the engine as
    and its successor's, if it forked one (`successor_log_fd` goes with a handoff that names a
    successor). Blocking (the pool runs it on a thread). `HandoffError` if the process answering is
    not the runtime `expect_pid` of this user, or it refuses."""
    data = encode(handoff, token)
    fds = [log_fd] if log_fd is not None else []
    if handoff.successor is not None:
        if log_fd is None or successor_log_fd is None:
            raise HandoffError("a handoff with a successor sends both logs")
        fds.append(successor_log_fd)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout_s)
        try:
            conn.connect(str(socket_path))
            pid, uid, _ = peer_credentials(conn)
            if uid != os.getuid() or pid != expect_pid:
                raise HandoffError(
                    f"{socket_path} is served by pid {pid} uid {uid}, not runtime {expect_pid}"
                )
            socket.send_fds(conn, [data], fds)
            answer = b""
            while b"\n" not in answer and len(answer) <= 4096:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                answer += chunk
        except (TimeoutError, OSError) as exc:
            raise HandoffError(f"handoff to {socket_path} failed: {exc}") from None
    try:
        body = json.loads(answer.partition(b"\n")[0])
    except ValueError:
        raise HandoffError(f"runtime {expect_pid} gave no answer") from None
    if not isinstance(body, dict) or body.get("ok") is not True:
        why = body.get("error") if isinstance(body, dict) else None
        raise HandoffError(f"runtime {expect_pid} refused the handoff: {why if why else repr(body)}")
    if body.get("pid") != expect_pid:
        raise HandoffError(f"runtime {expect_pid} answered as pid {body.get('pid')!r}")
    successor = body.get("next_pid")
    if successor is not None and (type(successor) is not int or successor <= 1 or handoff.successor is None):
        raise HandoffError(
            f"runtime {expect_pid} answered a successor pid {successor!r} it was not asked for"
        )
    return Answer(expect_pid, successor)
