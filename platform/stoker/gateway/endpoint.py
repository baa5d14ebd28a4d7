"""One inference request on the data plane: OpenAI's routes by deployment name.

The request path is pure ASGI (no `BaseHTTPMiddleware`, nothing that buffers): the endpoint reads
the body (bounded), looks at `model` and `stream`, and hands the request to that deployment's
revision (`stoker.gateway.revisions.pick_revision`) and its activator, which streams the answer
through. No timeout here cuts a long generation. The activator's errors become HTTP by their own
table (`activator.errors`: each carries its status, OpenAI type and code).

Who may call what is decided before any of that, by `keys.KeyAuth` (bearer keys: the admin's, or a
tenant's limited to its deployments) and `http.AdminGuard` (the admin API takes JSON from no
foreign origin); the handlers only ask the caller's `Principal` whether a deployment is theirs.
How much it may call is `limits.Limiter`'s, per key, before the activator sees the request; at
what priority, `stoker.spec.priority`'s (the body's `priority`, else the key's default, never below
the key's floor), which the activator's hold queue and the engines honour.
The same routes serve `stoker up` (its `Platform`) and `stoker gateway` (its `GatewayPlane`):
both are a `Router`.
"""

from __future__ import annotations

from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from activator import ActivatorError
from stoker.errors import (
    APIError,
    error_response,
    invalid,
)
from stoker.gateway.body_budget import BodyBudget, read_body_within
from stoker.gateway.cascade import Cascades
from stoker.gateway.keys import principal_of
from stoker.gateway.limits import Limiter, estimate_tokens
from stoker.gateway.request_log import Observer
from stoker.gateway.revisions import PRIORITY, pin_revision
from stoker.gateway.taps import Finish, TappedRequest, taps
from stoker.http import (
    MAX_REQUEST_BYTES,
    ClientGone,
    parse_json_object,
)
from stoker.spec import priority

MAX_BODY_BYTES = MAX_REQUEST_BYTES


def api_error(exc: ActivatorError) -> APIError:
    """The activator's error as the client sees it: its own status, OpenAI type and code
    (`activator.errors`, the one table), with `Retry-After` where it says when to try again."""
    headers = {}
    retry_after = getattr(exc, "retry_after_s", None)
    if retry_after is not None:
        headers["retry-after"] = str(retry_after)
    return APIError(exc.status, str(exc), type=exc.type, code=exc.code, headers=headers)


EMBEDDINGS = "/v1/embeddings"
RESPONSES = "/v1/responses"  # the engines serve it (vLLM's own; Stoker's, `stoker.engine.responses_api`)


class InferenceEndpoint:
    """`POST /v1/chat/completions`, `POST /v1/completions`, `POST /v1/responses` and `POST
    /v1/embeddings` (a deployment with `--task embed`: its engine refuses the others, and a
    generating one this), routed by the body's `model`, through the request taps
    (`stoker.gateway.taps`, in their documented order: cost, request log, limits) to the
    deployment's revision and its activator. Cascade routes (`stoker.gateway.cascade`) read chat
    and completion answers only: the other two name deployments."""

    def __init__(
        self,
        platform: Router,
        limiter: Limiter,
        cascades: Cascades | None = None,
        observer: Observer | None = None,
        budget: BodyBudget | None = None,
    ) -> None:
        self.platform = platform
        # The bytes of bodies read and not yet done with, bounded (`body_budget`): memory that
        # would otherwise grow with the clients offering requests, not with what is served.
        self.budget = budget or BodyBudget()
        self.cascades = cascades  # routes by name (`stoker.gateway.cascade`); None: deployments only
        # The meter: tokens, idle share, arrival log (`stoker.control.cost`, or a gateway's own).
        self.taps = taps(limiter, meter=getattr(platform, "cost", None), observer=observer)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        finishes: list[Finish] = []
        body = b""
        try:
            body = await read_body_within(self.budget, receive, scope, MAX_BODY_BYTES)
            parsed, name, stream = _route_fields(body)
            deployment = self.platform.get(name)
            principal = principal_of(scope)
            embeddings = scope["path"] == EMBEDDINGS
            cascaded = not embeddings and scope["path"] != RESPONSES
            if deployment is None and self.cascades is not None and cascaded:
                # A cascade route: None unless the caller may call both its deployments too.
                deployment = self.cascades.lookup(name, principal.may_call)
            # Not the caller's: the same 404 as a deployment that does not exist (no existence leak).
            if deployment is None or not principal.may_call(name):
                raise APIError(
                    404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
                )
            limits = principal.limits  # its priority class: the body's, else the key's default
            scope[PRIORITY] = priority.of_request(
                parsed.get("priority"), limits.priority, limits.priority_min
            )
            estimate = estimate_tokens(parsed, len(body), embeddings=embeddings)
            request = TappedRequest(name, deployment, principal, parsed, stream, estimate)
            for tap in self.taps:  # a tap's 429 is answered through the taps started before it
                send, finish = tap.start(send, request)
                if finish is not None:
                    finishes.append(finish)
            if principal.admin:  # `x-stoker-revision: N` from the admin: that revision answers
                pin_revision(scope)
            await deployment.serve(scope, receive, send, body, parsed, stream, principal.key_id)
        except APIError as exc:
            await error_response(exc)(scope, receive, send)
        except ActivatorError as exc:
            error = api_error(exc)
            if (revision := scope.get("stoker.revision")) is not None:  # the revision that failed it
                error.headers["x-stoker-revision"] = str(revision)
            await error_response(error)(scope, receive, send)
        except ClientGone:
            return
        finally:
            self.budget.give(len(body))  # held until here: in the queue, while streaming, refused
            for finish in reversed(finishes):  # innermost first: limits settle, the log, the meter
                finish(scope)


def _route_fields(body: bytes) -> tuple[dict, str, bool]:
    parsed = parse_json_object(body)
    model = parsed.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required and must be a non-empty string.", param="model")
    stream = parsed.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid(f"'stream' must be a boolean, got {stream!r}.", param="stream")
    return parsed, model, stream


class Router(Protocol):
    """What the data routes need: each deployment's `spec` (name, snapshot id) and activator. The
    `Platform` in one process; `stoker.gateway.plane.GatewayPlane` in a gateway of its own."""

    def get(self, name: str) -> Any: ...

    def list(self) -> list[Any]: ...


def data_routes(
    platform: Router,
    limiter: Limiter,
    cascades: Cascades | None = None,
    observer: Observer | None = None,
    inference: InferenceEndpoint | None = None,
    budget: BodyBudget | None = None,
) -> list[Route]:
    """OpenAI's routes; `inference`: the endpoint to serve them with, where the caller keeps it
    (the batch runner sends its lines through the same one: `stoker.batch.runner`)."""

    def card(d: Any) -> dict[str, Any]:
        """A deployment's model card; an adapter's names its base as `parent`, as vLLM lists one."""
        out = {
            "id": d.spec.name,
            "object": "model",
            "created": 0,
            "owned_by": "stoker",
            "root": d.spec.snapshot_id,
        }
        if getattr(d.spec, "base", None) is not None:
            out["parent"] = d.spec.base
        return out

    async def models(request: Request) -> Response:
        principal = principal_of(request.scope)
        adapters = getattr(platform, "adapters", None)  # a gateway of its own serves none yet
        every = [*platform.list(), *(adapters.list() if adapters is not None else [])]
        cards = [card(d) for d in every if principal.may_call(d.spec.name)]
        return JSONResponse({"object": "list", "data": cards})

    async def model(request: Request) -> Response:
        """OpenAI's `GET /v1/models/{model}`: one deployment, if the caller's key may call it;
        another tenant's is the same 404 as one that does not exist (no existence leak)."""
        principal = principal_of(request.scope)
        name = request.path_params["model"]
        d = platform.get(name)
        if d is None or not principal.may_call(name):
            message = f"The model `{name}` does not exist."
            return error_response(APIError(404, message, param="model", code="model_not_found"))
        return JSONResponse(card(d))

    if inference is None:
        inference = InferenceEndpoint(platform, limiter, cascades, observer, budget)
    return [
        Route("/v1/chat/completions", inference, methods=["POST"]),
        Route("/v1/completions", inference, methods=["POST"]),
        Route(RESPONSES, inference, methods=["POST"]),
        Route(EMBEDDINGS, inference, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
    ]
