"""Cascade routes' pure parts as tables (`stoker.spec.routes`): validation, the logprob request
and its undoing, the score, the context signals and estimate, the saving; the table in SQLite and a
gateway's synced copy (`stoker.control.routes`); and the two-step serving (`stoker.gateway.cascade`) against
scripted deployments (ASGI messages in, ASGI messages out; the live platform is
`test_cascade_live.py`, the split planes `test_cascade_planes.py`)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from activator import QueueFull
from stoker.control.routes import CascadeRoutes
from stoker.errors import APIError
from stoker.gateway.cascade import Cascades
from stoker.gateway.routes import SyncedRoutes
from stoker.spec.routes import (
    DEFAULT_MIN_MEAN_LOGPROB,
    CascadeRoute,
    context_exceeded,
    context_of,
    mean_logprob,
    prompt_tokens_at_least,
    saving,
    validate_route,
    with_logprobs,
    without_logprobs,
)


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ([], None, "JSON object"),
        ({"name": "a", "small": "s", "large": "l", "color": 1}, "color", "Unknown field"),
        ({"small": "s", "large": "l"}, "name", "'name' must be the route's name"),
        ({"name": "Bad Name", "small": "s", "large": "l"}, "name", "'name' must be"),
        ({"name": "a", "large": "l"}, "small", "'small' must be a deployment's name"),
        ({"name": "a", "small": "s", "large": 3}, "large", "got 3"),
        ({"name": "a", "small": "s", "large": "s"}, "large", "another deployment"),
        ({"name": "s", "small": "s", "large": "l"}, "name", "must differ"),
        ({"name": "a", "small": "s", "large": "l", "min_mean_logprob": 0.5}, "min_mean_logprob", "-9999..0"),
        ({"name": "a", "small": "s", "large": "l", "min_mean_logprob": "-1"}, "min_mean_logprob", "'-1'"),
        ({"name": "a", "small": "s", "large": "l", "min_mean_logprob": True}, "min_mean_logprob", "True"),
        ({"name": "a", "small": "s", "large": "l", "escalate_on_context": "no"}, "escalate_on_context", "true or false"),
    ],
)  # fmt: skip
def test_bad_routes_are_a_400_naming_the_field(body, param, fragment):
    with pytest.raises(APIError) as info:
        validate_route(body)
    assert (info.value.status, info.value.param) == (400, param)
    assert fragment in info.value.message


def test_a_route_takes_defaults():
    assert validate_route({"name": "assist", "small": "s", "large": "l"}) == CascadeRoute(
        "assist", "s", "l", DEFAULT_MIN_MEAN_LOGPROB, True
    )
    route = validate_route(
        {"name": "a", "small": "s", "large": "l", "min_mean_logprob": -2, "escalate_on_context": False}
    )
    assert (route.min_mean_logprob, route.escalate_on_context) == (-2.0, False)


@pytest.mark.parametrize(
    ("parsed", "chat", "sent", "added"),
    [
        ({"messages": []}, True, {"messages": [], "logprobs": True}, True),
        ({"logprobs": False}, True, {"logprobs": True}, True),
        ({"logprobs": None, "top_logprobs": 0}, True, {"logprobs": True, "top_logprobs": 0}, True),
        ({"logprobs": True, "top_logprobs": 2}, True, {"logprobs": True, "top_logprobs": 2}, False),
        ({"top_logprobs": 2}, True, {"top_logprobs": 2}, False),  # the engine's 400 to give
        ({"logprobs": "yes"}, True, {"logprobs": "yes"}, False),
        ({"prompt": "x"}, False, {"prompt": "x", "logprobs": 0}, True),
        ({"prompt": "x", "logprobs": None}, False, {"prompt": "x", "logprobs": 0}, True),
        ({"prompt": "x", "logprobs": 3}, False, {"prompt": "x", "logprobs": 3}, False),
    ],
)
def test_logprobs_are_asked_for_only_where_the_client_did_not(parsed, chat, sent, added):
    assert with_logprobs(parsed, chat) == (sent, added)


def _chat(*choices: list[float]) -> dict:
    return {
        "choices": [
            {"index": i, "logprobs": {"content": [{"token": "t", "logprob": v} for v in values]}}
            for i, values in enumerate(choices)
        ]
    }


@pytest.mark.parametrize(
    ("answer", "skip_prompt", "score"),
    [
        (_chat([-0.5, -1.5]), False, -1.0),
        (_chat([-0.5, -1.5], [-0.1]), False, -1.0),  # the least sure choice
        (_chat([-10000.0, 0.0]), False, -9999.0 / 2),  # -inf is written -9999 and floored there
        ({"choices": [{"logprobs": {"token_logprobs": [-1.0, -3.0]}}]}, False, -2.0),
        # echo: the prompt's tokens (the first is null) are left out
        (
            {
                "choices": [{"logprobs": {"token_logprobs": [None, -8.0, -1.0]}}],
                "usage": {"prompt_tokens": 2},
            },
            True,
            -1.0,
        ),
        ({"choices": [{"logprobs": None}]}, False, None),
        ({"choices": [{"logprobs": {"content": []}}]}, False, None),
        ({"choices": "x"}, False, None),
        ([], False, None),
    ],
)
def test_mean_logprob(answer, skip_prompt, score):
    assert mean_logprob(answer, skip_prompt) == score


def test_added_logprobs_are_taken_out_again():
    answer = _chat([-0.5])
    answer["choices"][0]["message"] = {"role": "assistant", "content": "hi"}
    assert without_logprobs(answer)["choices"][0] == {
        "index": 0,
        "logprobs": None,
        "message": {"role": "assistant", "content": "hi"},
    }


CPU = {
    "error": {
        "message": "This model's maximum context length is 64 tokens; the prompt has 99.",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }
}
VLLM = {
    "error": {
        "message": "This model's maximum context length is 64 tokens. However, your prompt contains 99 input tokens.",
        "type": "BadRequestError",
        "param": "input_tokens",
        "code": 400,
    }
}
VLLM_DECODER = {"object": "error", "message": "The decoder prompt (length 99) is longer than the maximum model length of 64. Make sure…", "type": "BadRequestError", "code": 400}  # fmt: skip
OTHER = {"error": {"message": "'temperature' must be in [0, 2].", "type": "invalid_request_error", "param": "temperature"}}  # fmt: skip


@pytest.mark.parametrize(
    ("status", "body", "exceeded"),
    [
        (400, CPU, True),
        (400, VLLM, True),
        (400, VLLM_DECODER, True),
        (400, OTHER, False),
        (500, CPU, False),
        (400, "not json", False),
    ],
)
def test_context_exceeded_reads_both_engines(status, body, exceeded):
    raw = json.dumps(body).encode() if not isinstance(body, str) else body.encode()
    assert context_exceeded(status, raw) is exceeded


@pytest.mark.parametrize(
    ("parsed", "tokens"),
    [
        ({"messages": [{"role": "user", "content": "x" * 80}]}, 10),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 80}]}], "max_tokens": 5}, 15),
        ({"prompt": "é" * 40, "max_completion_tokens": 1}, 11),  # 80 bytes
        ({"prompt": [1, 2, 3], "max_tokens": 2}, 5),  # token ids count exactly
        ({"prompt": "x", "max_tokens": True}, 0),
        ({"messages": "nonsense"}, 0),
    ],
)  # fmt: skip
def test_the_context_estimate_undercounts(parsed, tokens):
    assert prompt_tokens_at_least(parsed) == tokens


def test_context_of_a_snapshot(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    assert (context_of(tmp_path, "cpu"), context_of(tmp_path, "vllm")) == (4096, 8192)
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 64}}))
    assert context_of(tmp_path, "cpu") == 64
    assert context_of(tmp_path / "missing", "cpu") is None


def test_saving():
    assert saving(0.5, [2.0, 3.0, 4.0]) == 2.5
    assert saving(4.0, [2.0]) == -2.0
    assert saving(0.5, []) is None


async def test_routes_survive_a_reopen(tmp_path: Path):
    db = tmp_path / "stoker.db"
    routes = CascadeRoutes(db)
    assert await routes.put(CascadeRoute("assist", "s", "l")) is True
    assert await routes.put(CascadeRoute("assist", "s", "l", -2.0)) is False
    await routes.put(CascadeRoute("b", "s", "l"))
    routes.close()
    again = CascadeRoutes(db)
    assert [r.name for r in again.all()] == ["assist", "b"]
    assert again.get("assist").min_mean_logprob == -2.0
    await again.delete("b")
    with pytest.raises(APIError) as info:
        await again.delete("b")
    assert (info.value.status, info.value.code) == (404, "route_not_found")
    assert [r.name for r in CascadeRoutes(db).all()] == ["assist"]


def test_a_gateways_copy_is_replaced_whole_from_the_table():
    removed: list[str] = []
    synced = SyncedRoutes(on_removed=removed.append)
    entry = {
        "name": "assist",
        "small": "s",
        "large": "l",
        "min_mean_logprob": -2.0,
        "escalate_on_context": True,
    }
    synced.replace([{**entry, "small_context": 64}, {**entry, "name": "b", "small_context": None}])
    assert synced.get("assist") == CascadeRoute("assist", "s", "l", -2.0, True)
    assert [synced.small_context(r) for r in synced.all()] == [64, None]
    synced.replace([{**entry, "name": "b", "small_context": 128}])
    assert (synced.get("assist"), removed, synced.small_context(synced.get("b"))) == (None, ["assist"], 128)


# ---- the two-step serving, against scripted deployments ---------------------------------------


class Scripted:
    """A deployment whose `serve` sends a fixed answer (or raises), noting what it was sent."""

    def __init__(
        self, name: str, status: int = 200, body: object = None, chunks: int = 1, error=None, takes=1.0
    ):
        self.spec = SimpleNamespace(name=name, snapshot_id="s-" + name, engine="cpu")
        self.status, self.body, self.chunks, self.error = status, body, chunks, error
        self.takes = takes  # seconds on the rig's clock
        self.clock = [0.0]  # the rig's
        self.calls: list[dict] = []

    async def serve(self, scope, receive, send, body, parsed, stream, owner):
        self.calls.append(json.loads(body))
        self.clock[0] += self.takes
        if self.error is not None:
            raise self.error
        raw = self.body if isinstance(self.body, bytes) else json.dumps(self.body).encode()
        await send(
            {"type": "http.response.start", "status": self.status, "headers": [(b"x-stoker-instance", b"i")]}
        )
        step = max(1, len(raw) // self.chunks)
        parts = [raw[i : i + step] for i in range(0, len(raw), step)]
        for i, part in enumerate(parts):
            await send({"type": "http.response.body", "body": part, "more_body": i < len(parts) - 1})


def _answer(model: str, logprobs: list[float]) -> dict:
    return {
        "model": model,
        "choices": [{"index": 0, "message": {"content": "x"}, "logprobs": {"content": [{"logprob": v} for v in logprobs]}}],
    }  # fmt: skip


async def _serve(cascades, route, parsed, stream=False, path="/v1/chat/completions"):
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {"type": "http", "path": path, "headers": []}
    await cascades.serve(route, scope, receive, send, parsed, stream, "k")
    start = sent[0]
    headers = dict(start["headers"])
    body = b"".join(m.get("body", b"") for m in sent[1:])
    assert not sent[-1].get("more_body", False)
    return start["status"], headers, body


def _rig(small: Scripted, large: Scripted, **route):
    platform = SimpleNamespace(get={"s": small, "l": large}.get, data_dir=Path("/nonexistent"))
    registry = CollectorRegistry()
    clock = [0.0]
    for d in (small, large):
        if d is not None:
            d.clock = clock
    table = lambda: CascadeRoutes(Path(platform.data_dir) / "stoker.db")  # noqa: E731
    cascades = Cascades(platform, registry, clock=lambda: clock[0], table=table)
    return cascades, CascadeRoute("assist", "s", "l", **route), registry


CHAT = {"model": "assist", "messages": [{"role": "user", "content": "hi"}]}


async def test_a_sure_answer_stays_small_with_its_added_logprobs_taken_out():
    small, large = Scripted("s", body=_answer("s", [-0.2, -0.4])), Scripted("l")
    cascades, route, registry = _rig(small, large, min_mean_logprob=-1.0)
    status, headers, body = await _serve(cascades, route, CHAT)
    assert (status, headers[b"x-stoker-cascade"], headers[b"x-stoker-cascade-logprob"]) == (
        200,
        b"small",
        b"-0.3000",
    )
    assert json.loads(body)["choices"][0]["logprobs"] is None and json.loads(body)["model"] == "s"
    assert small.calls == [{**CHAT, "model": "s", "logprobs": True}] and large.calls == []
    assert (
        registry.get_sample_value("stoker_cascade_requests_total", {"route": "assist", "outcome": "small"})
        == 1
    )


async def test_an_unsure_answer_goes_to_large_and_the_client_sees_one_answer():
    small = Scripted("s", body=_answer("s", [-3.0]), takes=0.5)
    large = Scripted("l", body=_answer("l", [-3.0]), takes=3.0)
    cascades, route, registry = _rig(small, large, min_mean_logprob=-1.0)
    _status, headers, body = await _serve(cascades, route, {**CHAT, "logprobs": True})
    assert (headers[b"x-stoker-cascade"], json.loads(body)["model"]) == (b"escalated-unsure", "l")
    assert json.loads(body)["choices"][0]["logprobs"] is not None  # asked for: kept
    assert large.calls == [{**CHAT, "model": "l", "logprobs": True}]
    labels = {"route": "assist", "outcome": "escalated_unsure"}
    assert registry.get_sample_value("stoker_cascade_requests_total", labels) == 1

    def seconds(kind: str) -> float:
        return registry.get_sample_value(f"stoker_cascade_{kind}_seconds_total", {"route": "assist"})

    assert (seconds("saved"), seconds("lost")) == (0.0, 0.5)  # the half second on the small one
    assert (
        registry.get_sample_value("stoker_cascade_latency_seconds_sum", {"route": "assist", "side": "large"})
        == 3.0
    )
    # The large side has answered once (3 s): a sure small answer in 0.5 s saved 2.5 s.
    small.body = _answer("s", [-0.1])
    await _serve(cascades, route, CHAT)
    assert (seconds("saved"), seconds("lost")) == (2.5, 0.5)
    assert cascades.counts["assist"] == {
        "small": 1,
        "escalated_unsure": 1,
        "escalated_context": 0,
        "escalated_error": 0,
    }


@pytest.mark.parametrize(
    ("small", "outcome"),
    [
        (Scripted("s", status=400, body=CPU), "escalated-context"),
        (Scripted("s", status=503, body={"error": {"message": "down"}}), "escalated-error"),
        (Scripted("s", error=QueueFull(1, 4)), "escalated-error"),
    ],
)
async def test_context_and_failures_escalate(small, outcome):
    cascades, route, _ = _rig(small, Scripted("l", body=_answer("l", [-0.1])))
    status, headers, _body = await _serve(cascades, route, CHAT)
    assert (status, headers[b"x-stoker-cascade"]) == (200, outcome.encode())


async def test_other_answers_are_the_small_ones():
    small = Scripted("s", status=400, body=OTHER)
    cascades, route, _ = _rig(small, Scripted("l"))
    status, headers, body = await _serve(cascades, route, CHAT)
    assert (status, headers[b"x-stoker-cascade"], json.loads(body)) == (400, b"small", OTHER)
    # Context escalation off: the small one's 400 is the answer.
    cascades, route, _ = _rig(Scripted("s", status=400, body=CPU), Scripted("l"), escalate_on_context=False)
    status, headers, _body = await _serve(cascades, route, CHAT)
    assert (status, headers[b"x-stoker-cascade"]) == (400, b"small")


async def test_an_answer_past_the_bound_goes_out_unjudged(monkeypatch):
    monkeypatch.setattr("stoker.gateway.cascade.MAX_ANSWER_BYTES", 64)
    small = Scripted("s", body=_answer("s", [-5.0] * 40), chunks=8)
    cascades, route, _ = _rig(small, Scripted("l"))
    status, headers, body = await _serve(cascades, route, CHAT)
    assert (status, headers[b"x-stoker-cascade"]) == (200, b"small")
    assert json.loads(body) == _answer("s", [-5.0] * 40)  # whole, and not judged


async def test_a_stream_goes_through_unless_refused_before_its_first_byte():
    sse = b'data: {"choices":[]}\n\ndata: [DONE]\n\n'
    small = Scripted("s", body=sse, chunks=2)
    cascades, route, _ = _rig(small, Scripted("l"), min_mean_logprob=0.0)
    status, headers, body = await _serve(cascades, route, {**CHAT, "stream": True}, stream=True)
    assert (status, headers[b"x-stoker-cascade"], body) == (200, b"small", sse)
    assert "logprobs" not in small.calls[0]  # a stream is not judged: nothing asked for
    refused = Scripted("s", status=400, body=CPU)
    cascades, route, _ = _rig(refused, Scripted("l", body=sse))
    status, headers, body = await _serve(cascades, route, {**CHAT, "stream": True}, stream=True)
    assert (status, headers[b"x-stoker-cascade"], body) == (200, b"escalated-context", sse)


async def test_a_clearly_too_long_prompt_skips_the_small_one(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 16}))
    small, large = Scripted("s"), Scripted("l", body=_answer("l", [-0.1]))
    cascades, route, _ = _rig(small, large)
    cascades._platform.store = SimpleNamespace(path_of=lambda snapshot_id: tmp_path)
    long = {**CHAT, "messages": [{"role": "user", "content": "word " * 100}]}
    _status, headers, _ = await _serve(cascades, route, long)
    assert (headers[b"x-stoker-cascade"], small.calls) == (b"escalated-context", [])
    _status, headers, _ = await _serve(cascades, route, {**long, "stream": True}, stream=True)
    assert (headers[b"x-stoker-cascade"], small.calls) == (b"escalated-context", [])


async def test_a_gateway_serves_its_synced_copy_and_the_published_context():
    small, large = Scripted("s"), Scripted("l", body=_answer("l", [-0.1]))
    synced = SyncedRoutes()
    entry = {
        "name": "assist",
        "small": "s",
        "large": "l",
        "min_mean_logprob": -1.0,
        "escalate_on_context": True,
    }
    synced.replace([{**entry, "small_context": 16}])
    platform = SimpleNamespace(get={"s": small, "l": large}.get)  # no data_dir, no store
    cascades = Cascades(platform, CollectorRegistry(), routes=synced, contexts=synced.small_context)
    target = cascades.lookup("assist", lambda name: True)
    assert target is not None and cascades.conflict("assist").status == 409
    long = {**CHAT, "messages": [{"role": "user", "content": "word " * 100}]}
    _status, headers, _ = await _serve(cascades, target.route, long)
    assert (headers[b"x-stoker-cascade"], small.calls) == (b"escalated-context", [])
    with pytest.raises(RuntimeError):
        cascades.table  # noqa: B018 -- a gateway never writes routes


async def test_a_missing_deployment_is_a_503():
    cascades, route, _ = _rig(Scripted("s"), None)
    with pytest.raises(APIError) as info:
        await _serve(cascades, route, CHAT)
    assert (info.value.status, info.value.code) == (503, "route_deployment_missing")
