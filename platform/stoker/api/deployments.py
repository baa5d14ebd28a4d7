"""The admin API of deployments and keys: `GET/POST /admin/v1/deployments`, `GET/DELETE
/admin/v1/deployments/{name}` (and its `/logs`), `GET/POST /admin/v1/keys`, `DELETE
/admin/v1/keys/{id}`, and the engines' federated metrics (`GET /metrics/engines`).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from stoker.api.logs import InstanceLogs
from stoker.api.revisions import revision_routes
from stoker.control.adapters import AdapterDeployment
from stoker.control.platform import Platform
from stoker.errors import (
    APIError,
)
from stoker.gateway.endpoint import MAX_BODY_BYTES
from stoker.gateway.keys import Access
from stoker.gateway.limits import Limiter
from stoker.http import (
    parse_json_object,
    read_body,
)
from stoker.spec.deployment import not_found
from stoker.spec.keys import validate_key_request


def admin_routes(
    platform: Platform,
    access: Access | None,
    limiter: Limiter,
    name_taken: Callable[[str], APIError | None] = lambda name: None,
) -> list[Route]:
    """The admin API: deployments, keys, instance logs, the engines' metrics. `name_taken`: why a
    deployment may not take a name another kind of thing holds (a cascade route's), or None."""

    async def engine_metrics(request: Request) -> Response:
        """Every serving instance's own metrics (READY, SLEEPING, DRAINING), labelled by deployment, revision and instance,
        read now (`stoker.control.federate`); admin-only, as /metrics."""
        return Response(await platform.engine_metrics(), media_type=CONTENT_TYPE_LATEST)

    def describe(d) -> dict:
        if isinstance(d, AdapterDeployment):  # no instances of its own: its base's serve it
            return d.describe()
        decision = d.pool.last_decision
        last = None
        if decision is not None:
            last = {
                "ready": decision.ready,
                "sleeping": decision.sleeping,
                "reason": decision.reason,
                "forecast": decision.forecast,
                "adapters": list(decision.adapters),  # adapters handed to be loaded ahead
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
        every = [*platform.list(), *platform.adapters.list()]
        return JSONResponse({"object": "list", "data": [describe(d) for d in every]})

    async def create_deployment(request: Request) -> Response:
        body = parse_json_object(await read_body(request.receive, request.scope, MAX_BODY_BYTES))
        spec, created = await platform.deploy(body, name_taken)
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
        record, key = await access.keys.create(tenant, deployments, limits)
        platform.routes.bump()  # gateways of their own take the new key's hash now, not at their next poll
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
        record = await access.keys.revoke(key_id)
        limiter.forget(record.id)
        platform.routes.bump()  # a revoked key stops working at every gateway now
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
