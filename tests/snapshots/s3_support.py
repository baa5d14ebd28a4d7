"""Test support for object storage: a real moto S3 server process, and a counting, throttling proxy.

Both are real processes on loopback. The proxy stands in front of moto so a test can see what
crossed the wire (every request: method, path, Range, status, body bytes; the most requests in
flight at once) and can slow the bytes down (a shared rate in bytes/s) so a transfer is still
running when the test acts on it. It is test equipment, not a mock: requests reach the real server.

    python -m tests.snapshots.s3_support --upstream http://127.0.0.1:PORT [--rate BYTES_PER_S]

prints `PORT <n>` once it listens. Its own routes, under `/__proxy/`: `GET stats`, `POST reset`,
`POST rate` (body: bytes/s, 0 for unlimited), `POST hold` / `POST release` (park the requests whose
path contains the body), `POST fail` (answer the next few matching requests with an S3 error).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.deadlines import HTTP_READ, S3_SERVER_START

REPO = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
ACCESS_KEY, SECRET_KEY = "testing", "testing"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _tail(log: Path | None, chars: int = 3000) -> str:
    if log is None or not log.exists():
        return "(no log)"
    return log.read_text(errors="replace")[-chars:] or "(empty log)"


def _wait_http(
    url: str, proc: subprocess.Popen, timeout: float = S3_SERVER_START, log: Path | None = None
) -> None:
    """Until `url` answers (any status); `timeout` is a bound from tests/deadlines.py."""
    end = time.monotonic() + timeout
    last = "no answer yet"
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{proc.args} exited with {proc.returncode} before {url} answered; its log:\n{_tail(log)}"
            )
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError as exc:
            last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.05)
    raise RuntimeError(
        f"{url} did not answer within {timeout:g} s (last: {last}); {proc.args[:3]}'s log:\n{_tail(log)}"
    )


def aws_env(
    base: dict[str, str], tmp: Path, key: str = ACCESS_KEY, secret: str = SECRET_KEY
) -> dict[str, str]:
    """`base` with these credentials and nothing of the user's AWS config (files, profile, IMDS)."""
    env = {k: v for k, v in base.items() if not k.startswith("AWS_")}
    env.update(
        AWS_ACCESS_KEY_ID=key,
        AWS_SECRET_ACCESS_KEY=secret,
        AWS_DEFAULT_REGION="us-east-1",
        AWS_CONFIG_FILE=str(tmp / "no-aws-config"),
        AWS_SHARED_CREDENTIALS_FILE=str(tmp / "no-aws-credentials"),
        AWS_EC2_METADATA_DISABLED="true",
    )
    return env


class MotoServer:
    """`python -m moto.server` on a loopback port; killable (SIGKILL) and restartable on that port.

    moto keeps everything in memory, so a restart comes back empty. Multipart parts down to 64 KiB
    are accepted (S3's floor is 5 MiB), so tests can use 1 MiB parts on small files.
    """

    def __init__(self, log_dir: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log_dir = log_dir
        self.log: Path | None = None
        self.proc: subprocess.Popen | None = None

    def start(self) -> MotoServer:
        env = {**os.environ, "S3_UPLOAD_PART_MIN_SIZE": str(64 * 1024)}
        self.log = self.log_dir / f"moto-{self.port}.log"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        _wait_http(f"{self.url}/moto-api/", self.proc, log=self.log)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def enable_auth(self) -> None:
        """From now on every request is authenticated and authorized against moto's IAM."""
        req = urllib.request.Request(
            f"{self.url}/moto-api/reset-auth",
            data=b"0",
            method="POST",
            headers={"Content-Type": "text/plain"},  # not a form: moto reads the raw body
        )
        with urllib.request.urlopen(req, timeout=HTTP_READ):
            pass


class Proxy:
    """The counting, throttling proxy (this module run as a script) in front of `upstream`."""

    def __init__(self, upstream: str, rate: int = 0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.snapshots.s3_support", "--upstream", upstream, "--rate", str(rate)],
            stdout=subprocess.PIPE,
            cwd=REPO,
            text=True,
        )
        assert self.proc.stdout is not None
        # Its first line, once it listens; nothing (EOF) if it exits first.
        ready, _, _ = select.select([self.proc.stdout], [], [], S3_SERVER_START)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("PORT "):
            self.stop()
            raise RuntimeError(
                f"the proxy did not start within {S3_SERVER_START:g} s: its first line was {line!r}, "
                f"not 'PORT <n>' (exit status {self.proc.returncode}; its errors went to this test's stderr)"
            )
        self.url = f"http://{HOST}:{int(line.split()[1])}"

    def _post(self, what: str, body: bytes = b"") -> None:
        req = urllib.request.Request(f"{self.url}/__proxy/{what}", data=body, method="POST")
        with urllib.request.urlopen(req, timeout=HTTP_READ):
            pass

    def requests(self) -> list[dict[str, Any]]:
        return self.stats()["requests"]

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.url}/__proxy/stats", timeout=HTTP_READ) as resp:
            return json.loads(resp.read())

    def reset(self) -> None:
        self._post("reset")

    def set_rate(self, bytes_per_s: int) -> None:
        self._post("rate", str(bytes_per_s).encode())

    def hold(self, match: str) -> None:
        """Requests whose path contains `match` wait at the proxy until `release`."""
        self._post("hold", match.encode())

    def release(self) -> None:
        self._post("release")

    def fail(self, match: str, count: int, status: int, code: str, method: str | None = None) -> None:
        """The next `count` requests (of `method`, if given) whose path contains `match` get this S3 error."""
        fault = {"match": match, "method": method, "count": count, "status": status, "code": code}
        self._post("fail", json.dumps(fault).encode())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait()


def waiting_for_flock(pid: int, path: Path) -> bool:
    """Whether process `pid` is blocked waiting for a flock on `path` (Linux: /proc/locks marks waiters "->")."""
    try:
        inode = path.stat().st_ino
    except FileNotFoundError:
        return False
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if len(fields) > 6 and fields[1] == "->" and fields[2] == "FLOCK":
            if fields[5] == str(pid) and fields[6].rsplit(":", 1)[-1] == str(inode):
                return True
    return False


def get_bytes(requests: list[dict[str, Any]], path: str) -> int:
    """Body bytes sent in answer to GETs of `path` (e.g. "/bucket/prefix/model.safetensors")."""
    return sum(r["bytes"] for r in requests if r["method"] == "GET" and r["path"] == path)


# --- the proxy itself (runs in its own process) ----------------------------------------------------

_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "expect", "upgrade"}


class _Limiter:
    """One byte rate shared by every connection: each chunk waits for the end of its slot."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self.next = 0.0

    async def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        now = time.monotonic()
        self.next = max(self.next, now) + n / self.rate
        await asyncio.sleep(self.next - now)


def _serve(upstream: str, rate: int) -> None:
    from aiohttp import ClientError, ClientSession, ClientTimeout, web

    limiter = _Limiter(rate)
    state: dict[str, Any] = {"requests": [], "in_flight": 0, "max_in_flight": 0, "held": 0}
    hold: dict[str, Any] = {"match": None, "released": asyncio.Event()}
    faults: dict[str, Any] = {"match": None, "method": None, "count": 0, "status": 503, "code": "SlowDown"}

    def abort(request: web.Request) -> web.StreamResponse:
        # Like a server that died: the connection drops, no status line, no body.
        if request.transport is not None:
            request.transport.abort()
        raise ConnectionResetError("upstream is gone")

    async def control(request: web.Request) -> web.Response:
        what = request.match_info["what"]
        if request.method == "GET" and what == "stats":
            return web.json_response({k: state[k] for k in ("requests", "max_in_flight", "held")})
        if request.method != "POST":
            return web.json_response({"error": "POST"}, status=405)
        if what == "reset":
            state.update(requests=[], max_in_flight=0)
        elif what == "rate":
            limiter.rate = int(await request.text())
        elif what == "hold":  # requests whose path contains the body wait for `release`
            hold.update(match=await request.text(), released=asyncio.Event())
        elif what == "release":
            hold["match"] = None
            hold["released"].set()
        elif what == "fail":  # the next `count` matching requests get `status`/`code` from here
            faults.update(await request.json())
        else:
            return web.json_response({"error": "unknown"}, status=404)
        return web.json_response({})

    def injected(record: dict[str, Any]) -> web.Response | None:
        if faults["count"] <= 0 or faults["match"] not in record["path"]:
            return None
        if faults["method"] not in (None, record["method"]):
            return None
        faults["count"] -= 1
        record["status"] = faults["status"]
        body = f"<Error><Code>{faults['code']}</Code><Message>injected</Message></Error>"
        return web.Response(status=faults["status"], text=body, content_type="application/xml")

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        record = {
            "method": request.method,
            "path": request.path,
            "range": request.headers.get("Range"),
            "status": None,
            "bytes": 0,
            "started": None,  # proxy's monotonic clock: when forwarding began and the answer ended
            "ended": None,
        }
        state["requests"].append(record)
        if hold["match"] and hold["match"] in request.path:
            state["held"] += 1
            await hold["released"].wait()
        if (fault := injected(record)) is not None:
            return fault
        state["in_flight"] += 1
        state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
        record["started"] = time.monotonic()
        session: ClientSession = request.app["session"]
        try:
            try:
                upstream_resp = await session.request(
                    request.method,
                    upstream + request.raw_path,
                    headers=headers,
                    data=body,
                    allow_redirects=False,
                )
            except (ClientError, OSError):
                return abort(request)
            async with upstream_resp:
                record["status"] = upstream_resp.status
                resp = web.StreamResponse(status=upstream_resp.status)
                for k, v in upstream_resp.headers.items():
                    if k.lower() not in _HOP:
                        resp.headers.add(k, v)
                if upstream_resp.content_length is not None:
                    resp.content_length = upstream_resp.content_length
                await resp.prepare(request)
                if request.method != "HEAD":
                    try:
                        async for chunk in upstream_resp.content.iter_chunked(64 * 1024):
                            await limiter.take(len(chunk))
                            await resp.write(chunk)
                            record["bytes"] += len(chunk)
                    except (ClientError, OSError):
                        return abort(request)
                await resp.write_eof()
                return resp
        finally:
            state["in_flight"] -= 1
            record["ended"] = time.monotonic()

    async def start_session(app: web.Application) -> Any:
        app["session"] = ClientSession(timeout=ClientTimeout(total=None), auto_decompress=False)
        yield
        await app["session"].close()

    async def main() -> None:
        app = web.Application(client_max_size=1024**3)
        app.cleanup_ctx.append(start_session)
        app.router.add_route("*", "/__proxy/{what}", control)
        app.router.add_route("*", "/{tail:.*}", forward)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, HOST, 0)
        await site.start()
        port = runner.addresses[0][1]
        print(f"PORT {port}", flush=True)
        await asyncio.Event().wait()

    logging.basicConfig(level=logging.CRITICAL)  # aborted connections are the point, not news
    asyncio.run(main())


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--rate", type=int, default=0)
    args = parser.parse_args()
    _serve(args.upstream, args.rate)
