"""The CPU engine's HTTP surface: vLLM's OpenAI-compatible routes, health, metrics, sleep and wake.

LoRA adapters come and go by vLLM's routes (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`),
are listed by `/v1/models` with their `parent`, and a request names one as its `model`
(`stoker.engine.adapters`). The generation routes (chat, completions, and `/v1/responses`: a chat
generation answered as a Response, `stoker.engine.responses_api`) are pure ASGI endpoints: they
read the body under a size limit, answer every refusal as an OpenAI error before any header goes
out, then stream each delta to the client as it is produced (nothing buffered). A chat stream's
role chunk goes out with the first token, in the same write, never before it exists. A task
watches the connection for `http.disconnect` the whole time, and a client that leaves cancels its
generation at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from stoker.engine import embed, response_events
from stoker.engine.choices import merged, start_choices
from stoker.engine.core import Engine
from stoker.engine.generation import Generation
from stoker.engine.protocol import Kind, ensure_served, parse_request
from stoker.engine.responses import ResponseShape, sse
from stoker.engine.responses_api import parse_responses, renamed
from stoker.engine.tools import CallReader
from stoker.errors import UNAVAILABLE, APIError, error_response, invalid
from stoker.http import (
    BearerAuth,
    ClientGone,
    InternalErrors,
    internal_error,
    openai_exception_handlers,
    parse_json_object,
    read_body,
)

log = logging.getLogger("stoker.engine")

# Level 1 frees the weights (on a GPU: to pinned host memory); level 2 also drops them from the page
# cache. vLLM numbers its levels the same way.
SLEEP_LEVELS = (1, 2)
# Routes served without the instance's key: readiness, which says nothing and changes nothing.
OPEN_PATHS = frozenset({"/health"})
# The instance's key comes from the environment, not argv: a command line is visible to every local
# user in /proc/<pid>/cmdline, an environment only to the process's owner.
API_KEY_ENV = "STOKER_ENGINE_API_KEY"

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # tells nginx-style proxies not to buffer the stream
]


async def until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(receive: Receive, work: Awaitable[None]) -> None:
    """Run `work`; if the client disconnects first, cancel it."""
    worker = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnect(receive))
    try:
        await asyncio.wait({worker, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (worker, watcher):
            task.cancel()
        for task in (worker, watcher):
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if not worker.cancelled() and worker.exception() is not None:
        raise worker.exception()


class CompletionsEndpoint:
    """`POST /v1/chat/completions` or `POST /v1/completions`, as a pure ASGI app."""

    def __init__(self, engine: Engine, kind: Kind, max_body_bytes: int) -> None:
        self.engine = engine
        self.kind = kind
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        engine = self.engine
        try:
            if engine.embedder is not None:
                raise embed.not_generative(engine)
            body = parse_json_object(await read_body(receive, scope, self.max_body_bytes))
            req = parse_request(self.kind, body, engine.sampling_defaults)
            adapter = _resolve(engine, req.model)
            engine.check_serving()
            ids = engine.prompt_ids(req)
            max_new = engine.budget(len(ids), req.params)
            generations = await start_choices(engine, req.n, ids, req.params, max_new, adapter)
        except APIError as exc:
            await error_response(exc)(scope, receive, send)
            return
        except ClientGone:
            return
        text_of = engine.token_text if req.params.logprobs is not None else None
        first = generations[0]
        shape = ResponseShape(self.kind, _response_id(self.kind, first.request_id), req.model, text_of)
        spec = req.tools if req.tools is not None and req.tools.constrained else None
        readers = [CallReader(spec) if spec is not None else None for _ in generations]
        async with contextlib.AsyncExitStack() as held:
            for generation in generations:
                await held.enter_async_context(generation)
            if req.stream:
                work = self._stream(generations, shape, req.include_usage, readers, send)
            else:
                work = self._whole(generations, shape, readers, scope, receive, send)
            await cancel_on_disconnect(receive, work)

    async def _whole(
        self, generations: list[Generation], shape: ResponseShape, readers: list, scope, receive, send
    ) -> None:
        parts: list[list[str]] = [[] for _ in generations]
        records: list[list] = [[] for _ in generations]
        try:
            async for index, delta in merged(generations):
                parts[index].append(delta.text)
                records[index] += delta.logprobs
        except Exception as exc:
            await error_response(_as_api_error(exc, generations[0]))(scope, receive, send)
            return
        choices = []
        for text, generation, recs, reader in zip(parts, generations, records, readers, strict=True):
            text, calls = "".join(text), None
            if reader is not None:
                reader.feed(text)
                reader.close()
                text, calls = "".join(reader.content), reader.calls
            choices.append((text, _finish(generation.finish_reason, reader), recs, calls))
        prompt, completion = _tokens(generations)
        await JSONResponse(shape.whole(choices, prompt, completion))(scope, receive, send)

    async def _stream(
        self,
        generations: list[Generation],
        shape: ResponseShape,
        include_usage: bool,
        readers: list,
        send: Send,
    ) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})

        async def emit(*events) -> None:
            body = b"".join(sse(data) for data in events)
            await send({"type": "http.response.body", "body": body, "more_body": True})

        # vLLM 0.32 sends the role (content "") when the first token exists, then that token's chunk:
        # here both go in one write, so no client sees the role before there is a token. Each
        # choice has its own role chunk, with its index, before its first token's.
        roles = set(range(len(generations))) if shape.kind == "chat" else set()
        try:
            async for index, delta in merged(generations):
                events = [shape.role_chunk(index)] if index in roles else []
                roles.discard(index)
                reader = readers[index]
                if reader is not None:  # with tools: content and calls as the reader finds them
                    read = reader.feed(delta.text) + (reader.close() if delta.finish_reason else [])
                    events += shape.event_chunks(read, delta.logprobs, index)
                    if not read and delta.logprobs:  # text held back: its tokens' logprobs go now
                        events.append(shape.chunk("", records=delta.logprobs, index=index))
                elif delta.text or delta.logprobs:
                    events.append(shape.chunk(delta.text, records=delta.logprobs, index=index))
                if delta.finish_reason:
                    events.append(shape.chunk("", _finish(delta.finish_reason, reader), index=index))
                if events:
                    await emit(*events)
            if include_usage:
                await emit(shape.usage_chunk(*_tokens(generations)))
        except Exception as exc:  # after the first byte an error can only travel as an event
            error = _as_api_error(exc, generations[0])
            log.warning("stream %s ended by an error: %s", generations[0].request_id, error.message)
            await emit(error.body())
        await emit("[DONE]")
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class ResponsesEndpoint:
    """`POST /v1/responses` (`stoker.engine.responses_api`): one chat generation, answered as a
    Response (`stoker.engine.response_events`), whole or as its stream of events."""

    def __init__(self, engine: Engine, max_body_bytes: int) -> None:
        self.engine, self.max_body_bytes = engine, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        engine = self.engine
        try:
            if engine.embedder is not None:
                raise embed.not_generative(engine)
            body = parse_json_object(await read_body(receive, scope, self.max_body_bytes))
            req, echo = parse_responses(body, engine.sampling_defaults)
            adapter = _resolve(engine, req.model)
            engine.check_serving()
            ids = engine.prompt_ids(req)
            generation = await engine.start(ids, req.params, engine.budget(len(ids), req.params), adapter)
        except APIError as exc:
            await error_response(renamed(exc))(scope, receive, send)
            return
        except ClientGone:
            return
        run = response_events.ResponseRun(
            "resp_" + generation.request_id, req.model, echo, req.tools, int(time.time())
        )
        async with generation:
            await cancel_on_disconnect(
                receive, self._answer(generation, run, req.stream, scope, receive, send)
            )

    async def _answer(
        self, generation: Generation, run: response_events.ResponseRun, stream: bool, scope, receive, send
    ) -> None:
        async def emit(events: list[dict], more: bool = True) -> None:
            body = b"".join(response_events.sse(event) for event in events)
            await send({"type": "http.response.body", "body": body, "more_body": more})

        if stream:
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        # `response.created` goes out with the first token, in its write, as chat's role chunk does.
        opening, parts = run.start(), []
        try:
            async for delta in generation:
                if not stream:
                    parts.append(delta.text)
                elif events := opening + run.feed(delta.text):
                    opening = []
                    await emit(events)
        except Exception as exc:
            error = renamed(_as_api_error(exc, generation))
            if stream:  # after the first byte an error can only travel as an event
                await emit(opening + run.failed(error), more=False)
            else:
                await error_response(error)(scope, receive, send)
            return
        if not stream:
            run.feed("".join(parts))
        events = run.finish(generation.finish_reason, generation.prompt_tokens, generation.completion_tokens)
        if stream:
            await emit(opening + events, more=False)
        else:
            await JSONResponse(run.response)(scope, receive, send)


class EmbeddingsEndpoint:
    """`POST /v1/embeddings` (`stoker.engine.embed`), as a pure ASGI app: a refusal before any
    header, the forward cancelled (it ends with its batch) when the client leaves."""

    def __init__(self, engine: Engine, max_body_bytes: int) -> None:
        self.engine, self.max_body_bytes = engine, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        engine = self.engine
        try:
            if engine.embedder is None:
                engine.check_serving()  # loading: 503; then, a generating engine: 400
                raise embed.not_embedding(engine)
            body = parse_json_object(await read_body(receive, scope, self.max_body_bytes))
            req = embed.parse_embedding_request(body)
            ensure_served(req.model, engine.config.served_model_name)
            engine.check_serving()
            batch = engine.embedder.token_ids(req)
        except APIError as exc:
            await error_response(exc)(scope, receive, send)
            return
        except ClientGone:
            return

        async def work() -> None:
            arrival = engine.clock()
            try:
                vectors = await engine.embedder.embed(batch, req.dimensions, req.priority)
            except APIError as exc:
                await error_response(exc)(scope, receive, send)
                return
            tokens = sum(len(ids) for ids in batch)
            engine.metrics.prompt_tokens.inc(tokens)
            engine.metrics.request_done(
                "stop", arrival=arrival, admitted=arrival, first_token=None, last_token=None,
                now=engine.clock(), prompt_tokens=tokens, generation_tokens=0, max_tokens=None,
                max_new_tokens=0,
            )  # fmt: skip
            await JSONResponse(embed.answer(req, vectors, tokens))(scope, receive, send)

        await cancel_on_disconnect(receive, work())


def _finish(reason: str | None, reader: CallReader | None) -> str | None:
    """An answer that ended by itself after its calls ends for them: `tool_calls`, as OpenAI says."""
    return "tool_calls" if reason == "stop" and reader is not None and reader.calls else reason


def _tokens(generations: list[Generation]) -> tuple[int, int]:
    """(prompt tokens, completion tokens) of a request: its one prompt, all of its choices."""
    return generations[0].prompt_tokens, sum(g.completion_tokens for g in generations)


def _as_api_error(exc: Exception, generation: Generation) -> APIError:
    """An error during generation, as the client sees it: ours as they are, anything else a 500 for
    this request only (logged with its traceback)."""
    if isinstance(exc, APIError):
        return exc
    log.error("request %s failed", generation.request_id, exc_info=exc)
    return internal_error("engine")


def _resolve(engine: Engine, model: str):
    """The LoRA adapter a request's `model` names, None for the base; a 404 for anything else."""
    served = engine.config.served_model_name
    if engine.adapters is None:  # still loading: only the base's name is known
        ensure_served(model, served)
        return None
    return engine.adapters.resolve(model, served)


def _lora_name(body: dict) -> str:
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise invalid("'lora_name' must be a non-empty string.", param="lora_name")
    return name


def _response_id(kind: Kind, request_id: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + request_id


def build_app(
    engine: Engine,
    *,
    max_body_bytes: int,
    on_startup: Callable[[], None],
    on_shutdown: Callable[[], None],
    api_key: str | None = None,
) -> Starlette:
    """The engine's app. With `api_key`, every route but `/health` wants `Authorization: Bearer KEY`:
    the platform starts each instance with a secret of its own, so nothing else on the machine can
    call, sleep or wake it."""
    served = engine.config.served_model_name

    def card() -> dict:
        out = {
            "id": served,
            "object": "model",
            "created": 0,
            "owned_by": "stoker",
            "root": str(engine.config.snapshot_dir),
        }
        if engine.max_model_len:
            out["max_model_len"] = engine.max_model_len
        return out

    def adapter_cards() -> dict[str, dict]:
        """vLLM's cards for LoRA adapters: `root` is the adapter's path, `parent` the base's name."""
        loaded = engine.adapters.loaded if engine.adapters is not None else {}
        return {
            name: {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "stoker",
                "root": a.path,
                "parent": served,
            }
            for name, a in loaded.items()
        }

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [card(), *adapter_cards().values()]})

    async def model(request: Request) -> Response:
        """OpenAI's `GET /v1/models/{model}`: the model object, or a 404 in OpenAI's error shape."""
        name = request.path_params["model"]
        if name == served:
            return JSONResponse(card())
        if (adapter := adapter_cards().get(name)) is not None:
            return JSONResponse(adapter)
        message = f"The model `{name}` does not exist."
        return error_response(APIError(404, message, param="model", code="model_not_found"))

    async def lora_body(request: Request) -> dict:
        if engine.embedder is not None:
            raise embed.not_generative(engine)
        if engine.adapters is None:
            raise APIError(
                503, f"The engine is {engine.state}.", type=UNAVAILABLE, code=f"engine_{engine.state}"
            )
        return parse_json_object(await read_body(request.receive, request.scope, max_body_bytes))

    async def load_lora_adapter(request: Request) -> Response:
        """vLLM's `POST /v1/load_lora_adapter` {lora_name, lora_path, load_inplace?}: 200 and a line
        of text, or an OpenAI error (400 a bad adapter, 404 no such path, 503 every slot busy)."""
        try:
            body = await lora_body(request)
            name, path = _lora_name(body), body.get("lora_path")
            if not isinstance(path, str) or not path:
                raise invalid("Both 'lora_name' and 'lora_path' must be provided.", param="lora_path")
            if name == served:
                raise invalid(f"'lora_name' cannot be the base model's name `{served}`.", param="lora_name")
            inplace = body.get("load_inplace", False)
            if not isinstance(inplace, bool):
                raise invalid("'load_inplace' must be true or false.", param="load_inplace")
            await engine.adapters.load(name, path, inplace)
        except APIError as exc:
            return error_response(exc)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(request: Request) -> Response:
        try:
            name = _lora_name(await lora_body(request))
            await engine.adapters.unload(name)
        except APIError as exc:
            return error_response(exc)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def health(request: Request) -> Response:
        engine.check_loop()
        if engine.state == "ready":
            return Response(status_code=200)
        if engine.state == "sleeping":  # as vLLM's: the process is well; /is_sleeping says it rests
            return JSONResponse({"status": "sleeping"})
        return JSONResponse({"status": engine.state, "error": engine.failure}, status_code=503)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def sleep(request: Request) -> Response:
        raw = request.query_params.get("level", "1")
        if raw not in {str(level) for level in SLEEP_LEVELS}:
            return error_response(invalid(f"'level' must be 1 or 2, got {raw!r}.", param="level"))
        try:
            await engine.sleep(int(raw))
        except APIError as exc:
            return error_response(exc)
        return Response(status_code=200)

    async def wake_up(request: Request) -> Response:
        if engine.state not in ("ready", "sleeping"):
            return error_response(
                APIError(503, f"The engine is {engine.state}.", code=f"engine_{engine.state}")
            )
        await engine.wake_up()
        return Response(status_code=200)

    async def is_sleeping(request: Request) -> Response:
        return JSONResponse({"is_sleeping": engine.state == "sleeping"})

    async def server_info(request: Request) -> Response:
        # What the pool asks every engine at READY (vLLM answers the same route with its config):
        # the sleep levels this engine serves, so the policy only plans tiers that exist.
        # An embedding engine has none (`stoker.engine.embed`): its pool stops and starts it.
        levels = [] if engine.config.task == "embed" else list(SLEEP_LEVELS)
        return JSONResponse({"engine": "stoker", "sleep_levels": levels, "task": engine.config.task})

    routes = [
        Route("/v1/chat/completions", CompletionsEndpoint(engine, "chat", max_body_bytes), methods=["POST"]),
        Route("/v1/completions", CompletionsEndpoint(engine, "completion", max_body_bytes), methods=["POST"]),
        Route("/v1/responses", ResponsesEndpoint(engine, max_body_bytes), methods=["POST"]),
        Route("/v1/embeddings", EmbeddingsEndpoint(engine, max_body_bytes), methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/sleep", sleep, methods=["POST"]),
        Route("/wake_up", wake_up, methods=["POST"]),
        Route("/is_sleeping", is_sleeping, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        on_startup()
        yield
        on_shutdown()

    return Starlette(
        routes=routes,
        exception_handlers=openai_exception_handlers(),
        middleware=[
            Middleware(InternalErrors, component="engine"),
            *([Middleware(BearerAuth, key=api_key, open_paths=OPEN_PATHS)] if api_key else []),
        ],
        lifespan=lifespan,
    )
