"""The logs endpoint behind `stoker logs` (`stoker.api.logs`), driven as ASGI with a scripted client:
what a tail and a follow send, that a follow ends when the client leaves, when the instance is
gone (after the rest of its log), and when the platform stops, and what it refuses. The live
platform's side is in `test_cli_failures.py`."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from stoker.api.logs import InstanceLogs
from tests.activator.conftest import eventually

NAME, INSTANCE = "tiny", "tiny-0123abcd"


@dataclass
class Pool:
    ids: set[str] = field(default_factory=lambda: {INSTANCE})

    def instances(self) -> list[dict]:
        return [{"id": i} for i in self.ids]


@dataclass
class Deployment:
    pool: Pool = field(default_factory=Pool)

    def pools(self) -> list[Pool]:  # one per revision serving; here one
        return [self.pool]


@dataclass
class Backend:
    log_dir: Path


@dataclass
class Platform:
    backend: Backend
    deployment: Deployment = field(default_factory=Deployment)
    closing: bool = False

    def get(self, name: str) -> Deployment | None:
        return self.deployment if name == NAME else None

    def stopping(self) -> bool:
        return self.closing


@dataclass
class Client:
    """One request: `receive` gives the (empty) body, then waits until `leave()`."""

    sent: list[dict] = field(default_factory=list)
    left: asyncio.Event = field(default_factory=asyncio.Event)
    asked: bool = False

    async def receive(self) -> dict:
        if not self.asked:
            self.asked = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await self.left.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int:
        return self.sent[0]["status"]

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent[1:])

    @property
    def ended(self) -> bool:
        return bool(self.sent) and self.sent[-1].get("more_body") is False


def scope(query: str, name: str = NAME) -> dict:
    return {"type": "http", "path_params": {"name": name}, "query_string": query.encode()}


@pytest.fixture
def log(tmp_path: Path) -> Path:
    """The instance's log: twenty lines."""
    path = tmp_path / f"{INSTANCE}.log"
    path.write_bytes(b"".join(f"line {i}\n".encode() for i in range(20)))
    return path


async def test_a_tail_is_the_last_lines_and_ends(log: Path) -> None:
    platform = Platform(Backend(log.parent))
    endpoint = InstanceLogs(platform)
    for query, lines in (("tail=3", [17, 18, 19]), ("tail=0", []), ("", list(range(20)))):
        client = Client()
        await endpoint(scope(query), client.receive, client.send)
        assert client.status == 200 and client.ended
        assert client.body == b"".join(f"line {i}\n".encode() for i in lines)


async def test_a_follow_sends_what_is_written_until_the_client_leaves(log: Path) -> None:
    platform = Platform(Backend(log.parent))
    client = Client()
    task = asyncio.create_task(
        InstanceLogs(platform, poll_s=0.01)(scope("tail=1&follow=true"), client.receive, client.send)
    )
    await eventually(lambda: client.body == b"line 19\n")
    with log.open("ab") as f:
        f.write(b"new one\nAuthorization: Bearer sk-stoker-abcdefghijklmnop\nhalf a li")
    await eventually(lambda: client.body.endswith(b"Authorization: Bearer [redacted]\n"))
    assert b"half a li" not in client.body  # a line goes out whole
    with log.open("ab") as f:
        f.write(b"ne\n")
    await eventually(lambda: client.body.endswith(b"half a line\n"))
    assert not task.done()  # the instance lives on: so does the follow
    client.left.set()
    await asyncio.wait_for(task, 1.0)  # the client left while nothing was being written: noticed


async def test_a_follow_ends_once_the_instance_is_gone_and_its_log_read(log: Path) -> None:
    platform = Platform(Backend(log.parent))
    client = Client()
    task = asyncio.create_task(
        InstanceLogs(platform, poll_s=0.01)(scope("tail=0&follow=1"), client.receive, client.send)
    )
    await asyncio.sleep(0.05)
    with log.open("ab") as f:
        f.write(b"stoker: error: cannot load\nno newline at the end")
    platform.deployment.pool.ids.clear()
    await asyncio.wait_for(task, 2.0)
    assert client.ended and client.body == b"stoker: error: cannot load\nno newline at the end"


async def test_a_follow_ends_when_the_platform_stops(log: Path) -> None:
    platform = Platform(Backend(log.parent))
    client = Client()
    task = asyncio.create_task(
        InstanceLogs(platform, poll_s=0.01)(scope("follow=true"), client.receive, client.send)
    )
    await eventually(lambda: b"line 19" in client.body)
    platform.closing = True
    await asyncio.wait_for(task, 2.0)
    assert client.ended


@pytest.mark.parametrize(
    ("query", "name", "status", "code"),
    [
        ("", "nope", 404, "deployment_not_found"),
        ("instance=tiny-ffffffff", NAME, 404, "log_not_found"),
        ("instance=../etc/passwd", NAME, 400, "invalid_request_error"),
        ("instance=other-0123abcd", NAME, 400, "invalid_request_error"),
        ("tail=-1", NAME, 400, "invalid_request_error"),
        ("tail=10001", NAME, 400, "invalid_request_error"),
        ("follow=maybe", NAME, 400, "invalid_request_error"),
        (f"instance={INSTANCE.replace('0123abcd', 'aaaaaaaa')}", NAME, 403, "log_unreadable"),
    ],
)
async def test_what_is_refused(log: Path, tmp_path: Path, query, name, status, code) -> None:
    (tmp_path / "secret.txt").write_text("not a log")
    (tmp_path / "tiny-aaaaaaaa.log").symlink_to(tmp_path / "secret.txt")  # planted: never followed
    client = Client()
    await InstanceLogs(Platform(Backend(log.parent)))(scope(query, name), client.receive, client.send)
    error = json.loads(client.body)["error"]
    assert client.status == status, error
    assert code in (error["code"], error["type"])
    assert b"not a log" not in client.body


async def test_without_an_instance_the_newest_log_is_read(log: Path, tmp_path: Path) -> None:
    newer = tmp_path / "tiny-ffffffff.log"
    newer.write_text("the newer one\n")
    (tmp_path / "tinyx-eeeeeeee.log").write_text("another deployment's\n")  # a prefix, not this one's
    client = Client()
    await InstanceLogs(Platform(Backend(tmp_path)))(scope("tail=5"), client.receive, client.send)
    assert client.body == b"the newer one\n"
    empty = Client()
    await InstanceLogs(Platform(Backend(tmp_path / "none")))(scope(""), empty.receive, empty.send)
    assert empty.status == 404
