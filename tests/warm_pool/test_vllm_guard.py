"""Stoker's guard inside vLLM (`warm_pool/vllm_guard/stoker_vllm_guard.py`), as plain ASGI in this
process: what it answers for each route with and without the key, that it reads no body and sends
no key anywhere, and that vLLM's Python can import it without Stoker. It running inside a real vLLM
is tests/platform/serve/test_vllm_engine.py's."""

from __future__ import annotations

import ast
import importlib.util
import json
import logging
import sys

import pytest

from warm_pool import engine_signals, reconcile
from warm_pool.launch import VLLM_GUARD, VLLM_GUARD_DIR

KEY = "sk-instance-0123456789abcdef"
BEARER = f"Bearer {KEY}".encode()
MODULE_PATH = VLLM_GUARD_DIR / "stoker_vllm_guard.py"


def _load():
    spec = importlib.util.spec_from_file_location("stoker_vllm_guard", MODULE_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


guard = _load()


@pytest.mark.parametrize(
    ("path", "authorization", "status"),
    [
        ("/health", None, 0),  # readiness: open
        ("/health", b"Bearer wrong", 0),
        ("/v1/models", None, 401),
        ("/v1/models", BEARER, 0),
        ("/v1/chat/completions", BEARER, 0),
        ("/metrics", None, 401),
        ("/metrics", BEARER, 0),
        ("/server_info", BEARER, 0),
        ("/sleep", BEARER, 0),
        ("/wake_up", BEARER, 0),
        ("/is_sleeping", BEARER, 0),
        ("/collective_rpc", None, 401),  # nothing says which routes exist without the key
        ("/collective_rpc", BEARER, 403),
        ("/reset_prefix_cache", BEARER, 403),
        ("/pause", BEARER, 403),
        ("/update_weights", BEARER, 403),
        ("/docs", BEARER, 403),
        ("/metrics/", BEARER, 403),  # exact paths: vLLM's /metrics mount serves below it too
        ("/v1", BEARER, 403),
        ("/v1/models", b"bearer " + KEY.encode(), 401),  # the header Stoker sends, byte for byte
        ("/v1/models", BEARER + b"x", 401),
        ("/v1/models", KEY.encode(), 401),
        ("/v1/models", b"", 401),
    ],
)
def test_what_the_guard_does_with_each_request(path, authorization, status):
    assert guard.decide(path, authorization, BEARER) == status


def test_every_route_stoker_calls_on_an_engine_passes_with_the_key():
    # warm_pool.engine_calls (sleep, wake, capabilities, start phases), engine_signals (load),
    # reconcile (sleep state), and the two the gateways proxy (stoker.gateway.endpoint).
    called = [
        "/sleep", "/wake_up", "/server_info", engine_signals.METRICS_PATH, reconcile.PATH, "/health",
        "/v1/chat/completions", "/v1/completions",
    ]  # fmt: skip
    assert [p for p in called if guard.decide(p, BEARER, BEARER) != 0] == []


class Inner:
    """The app behind the guard: records what reached it."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def __call__(self, scope, receive, send) -> None:
        self.seen.append(scope["path"])
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})


async def call(app, path: str, authorization: bytes | None = None, **scope_extra):
    scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "headers": []}
    if authorization is not None:
        scope["headers"] = [(b"authorization", authorization)]
    scope.update(scope_extra)
    sent = []

    async def receive():  # a refused request's body is never read
        raise AssertionError("the guard read the body")

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    return sent


async def test_refusals_are_openai_errors_sent_before_any_body_is_read():
    inner = Inner()
    app = guard.EngineGuard(inner, key=KEY)
    start, body = await call(app, "/v1/completions")
    assert start["status"] == 401 and (b"www-authenticate", b"Bearer") in start["headers"]
    assert json.loads(body["body"])["error"]["type"] == "authentication_error"
    start, body = await call(app, "/collective_rpc", BEARER)
    assert start["status"] == 403
    assert json.loads(body["body"])["error"] == {
        "message": "Stoker does not serve this route of the engine.",
        "type": "permission_error",
        "param": None,
        "code": "route_refused",
    }
    assert dict(start["headers"])[b"content-length"] == str(len(body["body"])).encode()
    assert inner.seen == []
    assert [m["status"] for m in await call(app, "/v1/models", BEARER) if "status" in m] == [200]
    assert inner.seen == ["/v1/models"]


async def test_routes_are_matched_below_the_root_path():
    inner = Inner()
    app = guard.EngineGuard(inner, key=KEY)
    [start, _] = await call(app, "/api/collective_rpc", BEARER, root_path="/api")
    assert start["status"] == 403
    [start, _] = await call(app, "/api/v1/models", BEARER, root_path="/api")
    assert start["status"] == 200


async def test_a_websocket_without_the_key_is_closed_before_it_is_accepted():
    inner = Inner()
    app = guard.EngineGuard(inner, key=KEY)
    sent = await call(app, "/v1/realtime", type="websocket")
    assert sent == [{"type": "websocket.close", "code": 1008}] and inner.seen == []


async def test_lifespan_passes_through():
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["type"])

    await guard.EngineGuard(app, key=KEY)({"type": "lifespan"}, None, None)
    assert seen == ["lifespan"]


def test_the_key_comes_from_vllms_variable_and_there_is_no_guard_without_one(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    assert guard.EngineGuard(Inner())._expected == BEARER  # vLLM builds it with the app alone
    monkeypatch.delenv("VLLM_API_KEY")
    with pytest.raises(RuntimeError, match="VLLM_API_KEY is not set"):
        guard.EngineGuard(Inner())
    monkeypatch.setenv("VLLM_API_KEY", "")
    with pytest.raises(RuntimeError):
        guard.EngineGuard(Inner())


async def test_the_key_is_never_logged_nor_echoed(caplog):
    app = guard.EngineGuard(Inner(), key=KEY)
    with caplog.at_level(logging.DEBUG, logger="stoker_vllm_guard"):
        sent = await call(app, "/collective_rpc", BEARER)
        sent += await call(app, "/v1/models", BEARER + b"x")
    assert "refused POST /collective_rpc" in caplog.text
    assert KEY not in caplog.text and KEY.encode() not in b"".join(m.get("body", b"") for m in sent)


def test_vllms_python_can_import_it_without_stoker():
    """Only the standard library, and alone in its directory: that directory is what vLLM's
    PYTHONPATH gets, so nothing of Stoker's comes with it."""
    tree = ast.parse(MODULE_PATH.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported - {"__future__"} <= sys.stdlib_module_names, imported
    assert {p.name for p in VLLM_GUARD_DIR.iterdir() if p.name != "__pycache__"} == {MODULE_PATH.name}


def test_the_launch_names_this_class_and_the_variable_it_reads():
    module, _, name = VLLM_GUARD.rpartition(".")
    assert (module, name) == (MODULE_PATH.stem, guard.EngineGuard.__name__)
    assert guard.KEY_ENV == "VLLM_API_KEY"
