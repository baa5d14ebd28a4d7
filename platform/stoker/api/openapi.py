"""The OpenAPI 3.1 description of the gateway and the admin API, served at `/openapi.json`.

Written out rather than derived: the routes are pure ASGI endpoints that read bodies themselves,
so no framework knows their shapes. It says what the platform accepts and answers, with the ranges
its validation enforces (the engines' `protocol.py` for generation, `stoker.api.responses` for
`/v1/responses`, `stoker.spec.deployment.FIELDS` for deploys), so a client generator or a fuzzer
(schemathesis, in the tests) can be pointed at a running platform. Each feature writes its own
paths where it is (`stoker.api.inference_schema` for chat, completions and embeddings,
`stoker.api.responses`, `stoker.batch.schema`, …); this module holds the admin API's and puts them
together. Every error is OpenAI's error object.
"""

from __future__ import annotations

from typing import Any

from stoker.api.cost import cost_paths
from stoker.api.dashboard import dashboard_paths
from stoker.api.inference_schema import inference_paths
from stoker.api.logs import DEFAULT_TAIL
from stoker.api.responses import responses_paths
from stoker.api.revisions import revision_paths
from stoker.batch.schema import batch_paths
from stoker.gateway.drift import drift_paths
from stoker.spec import priority
from stoker.spec.deployment import NAME, deploy_schema
from stoker.spec.routes import route_schema
from warm_pool.instance_logs import MAX_TAIL_LINES

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

_KEY_PRIORITY = {"type": ["integer", "null"], "minimum": priority.LOWEST, "maximum": priority.HIGHEST}


def deploy_request() -> dict[str, Any]:
    """The deploy body's schema: `stoker.spec.deployment.deploy_schema`, written there once."""
    return deploy_schema()


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict[str, Any]:
    return {str(c): {"description": "an error, in OpenAI's shape", **_json(_ERROR)} for c in codes}


def openapi_schema() -> dict[str, Any]:
    deployment = {"type": "object", "required": ["name", "model"], "properties": {"name": {"type": "string"}}}
    name_param = [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}]
    id_param = [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}]
    key = {
        "type": "object",
        "required": ["id", "key"],
        "properties": {"id": {"type": "string"}, "key": {"type": "string"}, "tenant": {"type": "string"}},
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Stoker",
            "version": "1",
            "description": "OpenAI-compatible serving and the admin API",
        },
        "paths": {
            **inference_paths(_errors(400, 401, 404, 413, 429, 500, 502, 503)),
            **responses_paths(_errors(400, 401, 404, 413, 429, 500, 502, 503)),
            **batch_paths(),
            "/v1/models": {
                "get": {
                    "summary": "The deployments, as OpenAI's model list",
                    "responses": {"200": {"description": "the list", **_json({"type": "object"})}},
                }
            },
            "/v1/models/{model}": {
                "get": {
                    "summary": "One deployment, as OpenAI's model object, if the caller's key may call it",
                    "parameters": [
                        {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
                    ],
                    "responses": {
                        "200": {"description": "the model", **_json({"type": "object"})},
                        **_errors(401, 404),
                    },
                }
            },
            "/healthz": {
                "get": {"summary": "The gateway is up", "responses": {"200": {"description": "up"}}}
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "responses": {"200": {"description": "text exposition", "content": {"text/plain": {}}}},
                }
            },
            "/metrics/engines": {
                "get": {
                    "summary": "Every READY instance's engine metrics, labelled deployment, revision, instance",
                    "responses": {"200": {"description": "text exposition", "content": {"text/plain": {}}}},
                }
            },
            "/admin/v1/deployments": {
                "get": {
                    "summary": "Every deployment",
                    "responses": {
                        "200": {"description": "the list", **_json({"type": "array", "items": deployment})}
                    },
                },
                "post": {
                    "summary": "Create a deployment, or update its settings",
                    "requestBody": {"required": True, **_json(deploy_request())},
                    "responses": {
                        "200": {"description": "updated", **_json(deployment)},
                        "201": {"description": "created", **_json(deployment)},
                        **_errors(400, 409, 413),
                    },
                },
            },
            "/admin/v1/deployments/{name}": {
                "get": {
                    "summary": "One deployment",
                    "parameters": name_param,
                    "responses": {"200": {"description": "it", **_json(deployment)}, **_errors(404)},
                },
                "delete": {
                    "summary": "Drain and remove a deployment",
                    "parameters": name_param,
                    "responses": {
                        "200": {
                            "description": "removed",
                            **_json(
                                {
                                    "type": "object",
                                    "properties": {"name": {"type": "string"}, "deleted": {"const": True}},
                                }
                            ),
                        },
                        **_errors(404),
                    },
                },
            },
            "/admin/v1/deployments/{name}/logs": _logs(name_param),
            **_cascade_paths(name_param),
            **revision_paths(name_param),
            **cost_paths(),
            **dashboard_paths(),
            **drift_paths(name_param),
            "/admin/v1/keys": {
                "get": {
                    "summary": "Every API key: id, tenant, deployments, created (never the key)",
                    "responses": {"200": {"description": "the list", **_json({"type": "object"})}},
                },
                "post": {
                    "summary": "Make a tenant's key for some deployments; the answer holds the key, shown once",
                    "requestBody": {"required": True, **_json(_key_request())},
                    "responses": {
                        "201": {"description": "created", **_json(key)},
                        **_errors(400, 409, 413, 415),
                    },
                },
            },
            "/admin/v1/keys/{id}": {
                "delete": {
                    "summary": "Revoke a key at once",
                    "parameters": id_param,
                    "responses": {
                        "200": {
                            "description": "revoked",
                            **_json(
                                {
                                    "type": "object",
                                    "properties": {"id": {"type": "string"}, "deleted": {"const": True}},
                                }
                            ),
                        },
                        **_errors(404),
                    },
                },
            },
        },
    }


def _logs(name_param: list[dict[str, Any]]) -> dict[str, Any]:
    query = [
        {
            "name": "instance",
            "in": "query",
            "schema": {"type": "string"},
            "description": "an instance id of the deployment, live or gone (default: the one that wrote last)",
        },
        {
            "name": "tail",
            "in": "query",
            "schema": {"type": "integer", "minimum": 0, "maximum": MAX_TAIL_LINES, "default": DEFAULT_TAIL},
            "description": "the last N lines first",
        },
        {
            "name": "follow",
            "in": "query",
            "schema": {"type": "boolean", "default": False},
            "description": "then stream what it writes next until the client leaves or the instance is gone",
        },
    ]
    return {
        "get": {
            "summary": "An instance's log (secrets redacted): its last lines, then what it writes next",
            "parameters": [*name_param, *query],
            "responses": {
                "200": {"description": "the log", "content": {"text/plain": {"schema": {"type": "string"}}}},
                **_errors(400, 403, 404),
            },
        }
    }


def _key_request() -> dict[str, Any]:
    name = {"type": "string", "pattern": f"^{NAME.pattern}$"}
    return {
        "type": "object",
        "required": ["tenant", "deployments"],
        "additionalProperties": False,
        "properties": {
            "tenant": name,
            "deployments": {"type": "array", "items": name, "minItems": 1, "maxItems": 1024},
            "rps": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1e6},
            "tpm": {"type": ["integer", "null"], "minimum": 1, "maximum": 10**12},
            "max_concurrent": {"type": ["integer", "null"], "minimum": 1, "maximum": 1_000_000},
            "priority": _KEY_PRIORITY,  # its requests' default; at least priority_min
            "priority_min": _KEY_PRIORITY,
        },
    }


def _cascade_paths(name_param: list[dict[str, Any]]) -> dict[str, Any]:
    """`stoker.api.routes`'s routes."""
    request = route_schema()
    route = {"type": "object", "required": ["name", "small", "large"], "properties": request["properties"]}
    return {
        "/admin/v1/routes": {
            "get": {
                "summary": "Every cascade route",
                "responses": {"200": {"description": "the list", **_json({"type": "object"})}},
            },
            "post": {
                "summary": "Create a cascade route (a name answered by a small deployment, escalating to a large one), or replace it",
                "requestBody": {"required": True, **_json(request)},
                "responses": {
                    "200": {"description": "replaced", **_json(route)},
                    "201": {"description": "created", **_json(route)},
                    **_errors(400, 409, 413, 415),
                },
            },
        },
        "/admin/v1/routes/{name}": {
            "get": {
                "summary": "One cascade route, with its requests by outcome since the platform started",
                "parameters": name_param,
                "responses": {"200": {"description": "it", **_json(route)}, **_errors(404)},
            },
            "delete": {
                "summary": "Remove a cascade route",
                "parameters": name_param,
                "responses": {
                    "200": {
                        "description": "removed",
                        **_json(
                            {
                                "type": "object",
                                "properties": {"name": {"type": "string"}, "deleted": {"const": True}},
                            }
                        ),
                    },
                    **_errors(404),
                },
            },
        },
    }
