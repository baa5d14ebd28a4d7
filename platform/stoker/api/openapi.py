"""The OpenAPI 3.1 description of the gateway and the admin API, served at `/openapi.json`.

Written out rather than derived: the routes are pure ASGI endpoints that read bodies themselves,
so no framework knows their shapes. It says what the platform accepts and answers, with the ranges
its validation enforces (the engines' `protocol.py` for generation, `stoker.api.responses` for
`/v1/responses`, `stoker.spec.deployment.FIELDS` for deploys), so a client generator or a fuzzer
(schemathesis, in the tests) can be pointed at a running platform.
Every error is OpenAI's error object.
"""

from __future__ import annotations

from typing import Any

from stoker.api.cost import cost_paths
from stoker.api.dashboard import dashboard_paths
from stoker.api.logs import DEFAULT_TAIL
from stoker.api.responses import responses_paths
from stoker.api.revisions import revision_paths
from stoker.batch.schema import batch_paths
from stoker.engine.embed import FORMATS, MAX_INPUTS
from stoker.engine.protocol import MAX_N, MAX_STOP_SEQUENCES
from stoker.engine.tools import MAX_DESCRIPTION, MAX_TOOLS
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

# vLLM's `priority`: lower is served first; the key's default where absent, never below its floor.
_PRIORITY = {
    "type": "integer",
    "minimum": priority.LOWEST,
    "maximum": priority.HIGHEST,
    "description": "lower is served first (default: the key's priority, else 0; a key's floor refuses less)",
}
_KEY_PRIORITY = {"type": ["integer", "null"], "minimum": priority.LOWEST, "maximum": priority.HIGHEST}

_SAMPLING = {
    "max_tokens": {"type": "integer", "minimum": 1},
    "max_completion_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "stop": {
        "oneOf": [
            {"type": "string", "minLength": 1},
            {
                "type": "array",
                "items": {"type": "string", "minLength": 1},
                "minItems": 1,
                "maxItems": MAX_STOP_SEQUENCES,
            },
        ]
    },
    "seed": {"type": "integer"},
    "n": {"type": "integer", "minimum": 1, "maximum": MAX_N},
    "priority": _PRIORITY,
    "user": {"type": "string"},
}

_TEXT = {"type": "string", "minLength": 1}
_CONTENT = {
    "oneOf": [
        {"type": "string"},
        {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "text"],
                "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
            },
        },
    ]
}

_NAME = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}
_TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": _NAME,
                "description": {"type": "string", "maxLength": MAX_DESCRIPTION},
                "parameters": {"type": "object", "description": "a JSON Schema of an object"},
                "strict": {"type": "boolean"},
            },
        },
    },
}
_TOOL_CALL = {
    "type": "object",
    "required": ["function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            "properties": {
                "name": {"type": "string"},
                "arguments": {"type": "string", "description": "JSON"},
            },
        },
    },
}

_CHAT_REQUEST = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        "model": _TEXT,
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["role"],
                "properties": {
                    "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
                    "content": {"oneOf": [*_CONTENT["oneOf"], {"type": "null"}]},
                    "name": {"type": "string"},
                    "tool_calls": {"type": "array", "items": _TOOL_CALL},  # assistant messages
                    "tool_call_id": {"type": "string"},  # tool messages: the call answered
                },
            },
        },
        "tools": {"type": "array", "minItems": 1, "maxItems": MAX_TOOLS, "items": _TOOL},
        "tool_choice": {
            "oneOf": [
                {"enum": ["none", "auto", "required"]},
                {
                    "type": "object",
                    "required": ["type", "function"],
                    "properties": {
                        "type": {"const": "function"},
                        "function": {"type": "object", "required": ["name"], "properties": {"name": _NAME}},
                    },
                },
            ]
        },
        "parallel_tool_calls": {"type": "boolean"},
        **_SAMPLING,
    },
}

_COMPLETION_REQUEST = {
    "type": "object",
    "required": ["model", "prompt"],
    "properties": {
        "model": _TEXT,
        "prompt": {
            "oneOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
            ]
        },
        **_SAMPLING,
    },
}

_USAGE = {
    "type": "object",
    "properties": {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
    },
}

_COMPLETION_RESPONSE = {
    "type": "object",
    "required": ["id", "object", "choices"],
    "properties": {
        "id": {"type": "string"},
        "object": {"type": "string"},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {"type": "array"},
        "usage": _USAGE,
    },
}


_EMBEDDING_INPUT = {
    "oneOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": MAX_INPUTS},
        {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
        {
            "type": "array",
            "items": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
            "minItems": 1,
            "maxItems": MAX_INPUTS,
        },
    ]
}
_EMBEDDING_REQUEST = {
    "type": "object",
    "required": ["model", "input"],
    "properties": {
        "model": _TEXT,
        "input": _EMBEDDING_INPUT,
        "encoding_format": {"enum": list(FORMATS)},
        "dimensions": {"type": "integer", "minimum": 1},
        "priority": _PRIORITY,
        "user": {"type": "string"},
    },
}
_EMBEDDING_RESPONSE = {
    "type": "object",
    "required": ["object", "data", "model", "usage"],
    "properties": {
        "object": {"const": "list"},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["object", "index", "embedding"],
                "properties": {
                    "object": {"const": "embedding"},
                    "index": {"type": "integer"},
                    "embedding": {
                        "oneOf": [
                            {"type": "array", "items": {"type": "number"}},
                            {"type": "string", "description": "base64 of little-endian float32"},
                        ]
                    },
                },
            },
        },
        "model": {"type": "string"},
        "usage": _USAGE,
    },
}


def _embeddings() -> dict[str, Any]:
    return {
        "post": {
            "summary": "Embeddings from the deployment named by `model` (deployed with `task: embed`)",
            "requestBody": {"required": True, **_json(_EMBEDDING_REQUEST)},
            "responses": {
                "200": {"description": "one embedding per input, in order", **_json(_EMBEDDING_RESPONSE)},
                **_errors(400, 401, 404, 413, 429, 500, 502, 503),
            },
        }
    }


def deploy_request() -> dict[str, Any]:
    """The deploy body's schema: `stoker.spec.deployment.deploy_schema`, written there once."""
    return deploy_schema()


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict[str, Any]:
    return {str(c): {"description": "an error, in OpenAI's shape", **_json(_ERROR)} for c in codes}


def _generation(summary: str, request: dict[str, Any]) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, **_json(request)},
            "responses": {
                "200": {
                    "description": "the answer; with `stream: true`, server-sent events ending in `data: [DONE]`",
                    "content": {
                        "application/json": {"schema": _COMPLETION_RESPONSE},
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                **_errors(400, 401, 404, 413, 429, 500, 502, 503),
            },
        }
    }


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
            "/v1/chat/completions": _generation(
                "Chat completion from the deployment named by `model`", _CHAT_REQUEST
            ),
            "/v1/completions": _generation(
                "Text completion from the deployment named by `model`", _COMPLETION_REQUEST
            ),
            **responses_paths(_errors(400, 401, 404, 413, 429, 500, 502, 503)),
            "/v1/embeddings": _embeddings(),
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
