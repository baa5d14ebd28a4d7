"""Cascade routes in the API server, for a cluster's controller: the SQLite `CascadeRoutes`'
interface (`stoker.control.routes`) over StokerRoute resources (`stoker.spec.resources`), one per
route, named as the route, its spec the route's fields in camelCase:

    apiVersion: stoker.dev/v1alpha1
    kind: StokerRoute
    metadata: {name: assist}
    spec: {small: chat-small, large: chat-large, minMeanLogprob: -1.0, escalateOnContext: true}

`stoker routes` writes them, and so may `kubectl apply`; `kubectl get sroute` lists them. Reads
come from a `Mirror`; each resource is read back as the admin API takes a route
(`validate_route`): one that does not validate is logged once (per version) and left out. A
replace carries the resourceVersion the mirror holds, so a write over someone else's newer one is
refused (409 `conflict`), never made. `on_change` (the routing table's bump) hears of every
change, so that the gateways' copies follow one applied with kubectl.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

from lightkube import ApiError, AsyncClient

from stoker.control.kube.errors import conflict, refused
from stoker.control.kube.kinds import API_VERSION, StokerRoute
from stoker.control.kube.mirror import Mirror
from stoker.errors import APIError, invalid
from stoker.spec.resources import (
    GROUP,
    ROUTE_KIND,
    ROUTE_PLURAL,
    object_name_error,
    route_from_resource,
    route_to_resource,
)
from stoker.spec.routes import CascadeRoute, route_not_found, validate_route
from warm_pool.backends.kube_access import calls

log = logging.getLogger("stoker.kube")


class ResourceRoutes:
    """Cascade routes as StokerRoute resources in `namespace` (see the module). `start()` the
    mirror and `wait_synced` before serving."""

    # Every call the table makes: the mirror's list and watch, a route's create, replace, delete.
    API_CALLS = calls(GROUP, ROUTE_PLURAL, "list", "watch", "create", "update", "delete")

    def __init__(
        self,
        client: AsyncClient,
        namespace: str,
        *,
        on_change: Callable[[], None] | None = None,
        retry_s: float = 1.0,
    ) -> None:
        self._client, self.namespace = client, namespace
        self._on_change = on_change
        self._routes: dict[str, CascadeRoute] = {}  # those that validate
        self._mirror = Mirror(client, StokerRoute, namespace, retry_s=retry_s, on_change=self._changed)

    # ---- the mirror --------------------------------------------------------------------------

    def start(self) -> None:
        self._mirror.start()

    async def wait_synced(self, timeout_s: float) -> None:
        await self._mirror.wait_synced(timeout_s)

    async def aclose(self) -> None:
        await self._mirror.close()

    def close(self) -> None:
        """The cascades' shutdown: the mirror closes with the controller (`aclose`)."""

    def _changed(self, name: str) -> None:
        obj = self._mirror.get(name)
        self._routes.pop(name, None)
        if obj is not None:
            try:
                self._routes[name] = validate_route(route_from_resource(name, obj.get("spec") or {}))
            except APIError as exc:  # once per version: the mirror calls this when one changed
                log.warning("StokerRoute %s/%s is no route, left out: %s", self.namespace, name, exc.message)
        if self._on_change is not None:
            self._on_change()

    # ---- the CascadeRoutes' interface ---------------------------------------------------------

    async def put(self, route: CascadeRoute) -> bool:
        """Create or replace `route`; whether it was created."""
        if (why := object_name_error(route.name, "route")) is not None:
            raise invalid(why[0].upper() + why[1:] + ".", "name")
        current = self._mirror.get(route.name)
        spec = route_to_resource(route.to_dict())
        try:
            if current is None:
                obj: dict[str, Any] = {
                    "apiVersion": API_VERSION,
                    "kind": ROUTE_KIND,
                    "metadata": {"name": route.name, "namespace": self.namespace},
                    "spec": spec,
                }
                made = await self._client.create(StokerRoute(obj), namespace=self.namespace)
            else:
                obj = copy.deepcopy(current)
                obj["spec"] = spec
                made = await self._client.replace(StokerRoute(obj), namespace=self.namespace)
        except ApiError as exc:
            if exc.status.code == 409:
                raise conflict("route", route.name, exc) from None
            raise refused(f"the route {route.name!r}", exc) from None
        self._mirror.put(made.to_dict())
        return current is None

    def get(self, name: str) -> CascadeRoute | None:
        return self._routes.get(name)

    async def delete(self, name: str) -> CascadeRoute:
        route = self._routes.get(name)
        if route is None:
            raise route_not_found(name)
        try:
            await self._client.delete(StokerRoute, name, namespace=self.namespace)
        except ApiError as exc:
            if exc.status.code == 404:
                self._mirror.forget(name)
                raise route_not_found(name) from None
            raise refused(f"the deletion of the route {name!r}", exc) from None
        self._mirror.forget(name)
        return route

    def all(self) -> list[CascadeRoute]:
        """In the order they were made."""
        made = {n: o["metadata"].get("creationTimestamp") or "" for n, o in self._mirror.objects.items()}
        return sorted(self._routes.values(), key=lambda r: (made.get(r.name, ""), r.name))
