"""The gateway: OpenAI's routes by deployment name, the admin API, health and metrics.

The request path is pure ASGI (no `BaseHTTPMiddleware`, nothing that buffers): the gateway reads
the body (bounded), looks at `model` and `stream`, and hands the request to that deployment's
activator, which streams the answer through. No timeout here cuts a long generation. `ERRORS` is
the one table from the activator's errors to HTTP statuses.

Who may call what is decided before any of that, by `keys.KeyAuth` (bearer keys: the admin's, or a
tenant's limited to its deployments) and `http.AdminGuard` (the admin API takes JSON from no
foreign origin); the handlers only ask the caller's `Principal` whether a deployment is theirs.
How much it may call is `limits.Limiter`'s, per key, before the activator sees the request.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from activator import ActivatorError, DeadlineExceeded, QueueFull, Unavailable, UpstreamError
from stoker.api.cost import cost_routes
from stoker.api.dashboard import dashboard_routes
from stoker.api.logs import InstanceLogs
from stoker.api.openapi import openapi_schema
from stoker.api.revisions import revision_routes
from stoker.api.routes import cascade_routes
from stoker.control.deployment import pin_revision
from stoker.control.history import HistoryConfig, HistorySampler
from stoker.control.platform import Platform
from stoker.control.registry import not_found
from stoker.errors import (
    SERVER_ERROR,
    UNAVAILABLE,
    APIError,
    error_response,
    invalid,
)
from stoker.gateway.cascade import Cascades
from stoker.gateway.keys import KeyAuth, KeyStore, principal_of, validate_key_request
from stoker.gateway.limits import NO_LIMITS, Limiter, Limits, UsageTap, estimate_tokens
from stoker.gateway.request_log import Observer
from stoker.http import (
    AdminGuard,
    ClientGone,
    InternalErrors,
    openai_exception_handlers,
    parse_json_object,
    read_body,
)
from stoker.node.gpu_metrics import register_gpu_metrics

log = logging.getLogger("stoker.gateway")

MAX_BODY_BYTES = 4 << 20

# The activator's errors as the client sees them: (status, OpenAI error type).
ERRORS: dict[type[ActivatorError], tuple[int, str]] = {
    QueueFull: (503, UNAVAILABLE),
    DeadlineExceeded: (503, UNAVAILABLE),
    Unavailable: (503, UNAVAILABLE),
    UpstreamError: (502, SERVER_ERROR),
}


def api_error(exc: ActivatorError) -> APIError:
    status, kind = next((v for cls, v in ERRORS.items() if isinstance(exc, cls)), (500, SERVER_ERROR))
    headers = {}
    retry_after = getattr(exc, "retry_after_s", None)
    if retry_after is not None:
        headers["retry-after"] = str(retry_after)
    return APIError(status, str(exc), type=kind, code=exc.code, headers=headers)


class InferenceEndpoint:
    """`POST /v1/chat/completions` and `POST /v1/completions`, routed by the body's `model`, within
    the caller's limits (`limits.Limiter`): a limited key's answer goes out through a `UsageTap`,
    which adds its x-ratelimit-* headers and settles its token charge."""

    def __init__(
        self,
        platform: Router,
        limiter: Limiter,
        cascades: Cascades | None = None,
        observer: Observer | None = None,
    ) -> None:
        self.platform = platform
        self.limiter = limiter
        self.cascades = cascades  # routes by name (`stoker.gateway.cascade`); None: deployments only
        self.observer = observer  # request log, drift, traces (`stoker.gateway.request_log`); None: off
        self.meter = getattr(
            platform, "cost", None
        )  # tokens, idle share, arrival log (`stoker.control.cost`)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ticket = tap = observed = metered = None
        try:
            body = await read_body(receive, scope, MAX_BODY_BYTES)
            parsed, name, stream = _route_fields(body)
            deployment = self.platform.get(name)
            principal = principal_of(scope)
            if deployment is None and self.cascades is not None:
                # A cascade route: None unless the caller may call both its deployments too.
                deployment = self.cascades.lookup(name, principal.may_call)
            # Not the caller's: the same 404 as a deployment that does not exist (no existence leak).
            if deployment is None or not principal.may_call(name):
                raise APIError(
                    404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
                )
            if (
                self.meter is not None
            ):  # counted for cost: tokens, requests, in flight (`stoker.control.cost`)
                metered = self.meter.tap(send, name, estimate_tokens(parsed, len(body))[0])
                send = metered or send
            if self.observer is not None:  # measured for the request log and traces, 429s included
                observed = self.observer.tap(send, name, deployment, principal.key_id, parsed, stream)
                send = observed or send
            if principal.admin:  # `x-stoker-revision: N` from the admin: that revision answers
                pin_revision(scope)
            if not principal.admin:  # the admin's key is never limited
                estimate = estimate_tokens(parsed, len(body))
                ticket = self.limiter.admit(
                    principal.key_id, principal.limits, estimate, principal.tenant or ""
                )
            if ticket is not None:
                send = tap = UsageTap(send, ticket)
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
            if ticket is not None:
                if tap is not None and (used := tap.used()) is not None:
                    ticket.settle(used)
                ticket.close()
            if observed is not None:
                self.observer.done(observed, scope)
            if metered is not None:
                self.meter.done(metered, scope)


def _route_fields(body: bytes) -> tuple[dict, str, bool]:
    parsed = parse_json_object(body)
    model = parsed.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required and must be a non-empty string.", param="model")
    stream = parsed.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid(f"'stream' must be a boolean, got {stream!r}.", param="stream")
    return parsed, model, stream


@dataclass(frozen=True)
class Access:
    """Who may call what: the admin key (None: none set), the tenant keys, the origins the admin
    API accepts browser requests from, and the limits of keys that set none of their own."""

    admin_key: str | None
    keys: KeyStore
    origins: frozenset[str]
    default_limits: Limits = NO_LIMITS


class Router(Protocol):
    """What the data routes need: each deployment's `spec` (name, snapshot id) and activator. The
    `Platform` in one process; `stoker.gateway.plane.GatewayPlane` in a gateway of its own."""

    def get(self, name: str) -> Any: ...

    def list(self) -> list[Any]: ...


def data_routes(
    platform: Router, limiter: Limiter, cascades: Cascades | None = None, observer: Observer | None = None
) -> list[Route]:
    """OpenAI's routes."""

    async def models(request: Request) -> Response:
        principal = principal_of(request.scope)
        cards = [
            {
                "id": d.spec.name,
                "object": "model",
                "created": 0,
                "owned_by": "stoker",
                "root": d.spec.snapshot_id,
            }
            for d in platform.list()
            if principal.may_call(d.spec.name)
        ]
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
        card = {"id": d.spec.name, "object": "model", "created": 0, "owned_by": "stoker"}
        return JSONResponse({**card, "root": d.spec.snapshot_id})

    inference = InferenceEndpoint(platform, limiter, cascades, observer)
    return [
        Route("/v1/chat/completions", inference, methods=["POST"]),
        Route("/v1/completions", inference, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
    ]


def common_routes(platform: Router, registry: CollectorRegistry) -> list[Route]:
    """Health, the process's own metrics, the API's schema."""

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok", "deployments": len(platform.list())})

    schema = openapi_schema()

    async def openapi(request: Request) -> Response:
        return JSONResponse(schema)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]


def admin_routes(platform: Platform, access: Access | None, limiter: Limiter) -> list[Route]:
    """The admin API: deployments, keys, instance logs, the engines' metrics."""

    async def engine_metrics(request: Request) -> Response:
        """Every serving instance's own metrics (READY, SLEEPING, DRAINING), labelled by deployment, revision and instance,
        read now (`stoker.control.federate`); admin-only, as /metrics."""
        return Response(await platform.engine_metrics(), media_type=CONTENT_TYPE_LATEST)

    def describe(d) -> dict:
        decision = d.pool.last_decision
        last = None
        if decision is not None:
            last = {
                "ready": decision.ready,
                "sleeping": decision.sleeping,
                "reason": decision.reason,
                "forecast": decision.forecast,
            }
        failure = d.pool.last_failure
        counts: dict[str, int] = {}
        for pool in d.pools():
            for state, n in pool.counts().items():
                counts[state] = counts.get(state, 0) + n
        return {
            **d.spec.to_dict(),  # the primary revision's (most traffic)
            "latest_revision": d.latest.revision,
            "traffic": {str(r): p for r, p in sorted(d.traffic.items())},
            "instances": counts,  # every revision's
            # id, state, phase, url, pid, since (epoch s), and the revision each serves
            "instance_list": [
                {**i, "revision": u.spec.revision} for u in d.units.values() for i in u.pool.instances()
            ],
            "decision": last,
            "unavailable": d.pool.unavailable,  # why no instance can start; None: they can
            "failed_starts": d.pool.failed_starts,  # in a row, since the last that reached READY
            "last_failure": failure.to_dict() if failure is not None else None,  # of any instance, kept
        }

    async def list_deployments(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [describe(d) for d in platform.list()]})

    async def create_deployment(request: Request) -> Response:
        body = parse_json_object(await read_body(request.receive, request.scope, MAX_BODY_BYTES))
        spec, created = await platform.deploy(body)
        d = platform.get(spec.name)
        deployed = next(r for r in platform.revisions(spec.name) if r["revision"] == spec.revision)
        return JSONResponse(describe(d) | {"deployed": deployed}, status_code=201 if created else 200)

    async def get_deployment(request: Request) -> Response:
        d = platform.get(request.path_params["name"])
        if d is None:
            raise not_found(request.path_params["name"])
        return JSONResponse(describe(d))

    async def delete_deployment(request: Request) -> Response:
        spec = await platform.remove(request.path_params["name"])
        return JSONResponse({"name": spec.name, "deleted": True})

    async def create_key(request: Request) -> Response:
        body = parse_json_object(await read_body(request.receive, request.scope, MAX_BODY_BYTES))
        tenant, deployments, limits = validate_key_request(body)
        if access is None or access.admin_key is None:
            # A tenant key would close the data path while the admin API stays open to anyone.
            raise APIError(
                409,
                "Keys need an admin key: restart `stoker up` with STOKER_ADMIN_KEY set.",
                code="admin_key_required",
            )
        record, key = access.keys.create(tenant, deployments, limits)
        return JSONResponse({**record.to_dict(), "key": key}, status_code=201)

    async def list_keys(request: Request) -> Response:
        records = access.keys.all() if access is not None else []
        return JSONResponse({"object": "list", "data": [r.to_dict() for r in records]})

    async def revoke_key(request: Request) -> Response:
        key_id = request.path_params["id"]
        if access is None:
            raise APIError(
                404, f"No key with id {key_id!r}.", type="not_found_error", param="id", code="key_not_found"
            )
        record = access.keys.revoke(key_id)
        limiter.forget(record.id)
        return JSONResponse({"id": record.id, "deleted": True})

    return [
        Route("/metrics/engines", engine_metrics, methods=["GET"]),
        Route("/admin/v1/deployments", list_deployments, methods=["GET"]),
        Route("/admin/v1/deployments", create_deployment, methods=["POST"]),
        Route("/admin/v1/deployments/{name}", get_deployment, methods=["GET"]),
        Route("/admin/v1/deployments/{name}", delete_deployment, methods=["DELETE"]),
        Route("/admin/v1/deployments/{name}/logs", InstanceLogs(platform), methods=["GET"]),
        *revision_routes(platform),
        Route("/admin/v1/keys", list_keys, methods=["GET"]),
        Route("/admin/v1/keys", create_key, methods=["POST"]),
        Route("/admin/v1/keys/{id}", revoke_key, methods=["DELETE"]),
    ]


def middleware_for(access: Access | None, component: str, keys: Any = None) -> list[Middleware]:
    """Outermost first: errors become 500s; then auth (no body read before it); then the admin API's
    browser guard. Without `access` everything runs open, as the benchmarks want. `keys` stands in
    for `access.keys` (a gateway's table of key hashes)."""
    middleware = [Middleware(InternalErrors, component=component)]
    if access is not None:
        middleware += [
            Middleware(
                KeyAuth,
                admin_key=access.admin_key,
                store=keys if keys is not None else access.keys,
                admin_prefixes=("/admin/", "/metrics", "/cluster/"),
            ),
            Middleware(AdminGuard, origins=access.origins),
        ]
    return middleware


def build_gateway(
    platform: Platform,
    *,
    access: Access | None = None,  # None: no keys at all, everyone is the admin (benchmarks)
    on_shutdown: Callable[[], object] | None = None,
    observer: Observer | None = None,  # the request log, drift and traces (`stoker.gateway.request_log`)
) -> Starlette:
    """Both planes in one process (`stoker up`): OpenAI's routes, the admin API, the pools."""
    limiter = Limiter(
        access.default_limits if access is not None else NO_LIMITS, registry=platform.metrics_registry
    )
    cascades = Cascades(platform, platform.metrics_registry)  # cascade routes (`stoker.gateway.cascade`)
    platform.name_taken = cascades.conflict
    # The last hour for /dashboard (`stoker.control.history`); the GPUs' own figures where NVML sees any.
    sampler = HistorySampler(platform.metrics_registry, HistoryConfig.from_env())
    register_gpu_metrics(platform.metrics_registry)
    routes = [
        *data_routes(platform, limiter, cascades, observer),
        *common_routes(platform, platform.metrics_registry),
        *admin_routes(platform, access, limiter),
        *cascade_routes(platform, cascades),
        *cost_routes(platform),
        *dashboard_routes(sampler.history),
        *(observer.routes(platform) if observer is not None else []),
    ]
    middleware = middleware_for(access, "gateway")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await platform.start()
        sampler.start()
        try:
            yield
        finally:
            await sampler.stop()
            await platform.shutdown()
            cascades.close()
            if observer is not None:
                observer.close()
            if access is not None:
                access.keys.close()

    return Starlette(
        routes=routes,
        exception_handlers=openai_exception_handlers(),
        middleware=middleware,
        lifespan=lifespan,
    )
