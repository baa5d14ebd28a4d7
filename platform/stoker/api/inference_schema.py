"""The OpenAPI schemas of the inference routes the engines answer through the gateway:
`/v1/chat/completions`, `/v1/completions` and `/v1/embeddings`, with the ranges the engines'
validation enforces (`stoker.engine.protocol`, `stoker.engine.tools`, `stoker.engine.embed`).
`stoker.api.openapi` puts them into `/openapi.json` beside the other features' paths
(`stoker.api.responses`, `stoker.batch.schema`), each written where its feature is."""

from __future__ import annotations

from typing import Any

from stoker.engine.embed import FORMATS, MAX_INPUTS
from stoker.engine.protocol import MAX_N, MAX_STOP_SEQUENCES
from stoker.engine.tools import MAX_DESCRIPTION, MAX_TOOLS
from stoker.spec import priority

# vLLM's `priority`: lower is served first; the key's default where absent, never below its floor.
_PRIORITY = {
    "type": "integer",
    "minimum": priority.LOWEST,
    "maximum": priority.HIGHEST,
    "description": "lower is served first (default: the key's priority, else 0; a key's floor refuses less)",
}
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


def _embeddings(errors: dict[str, Any]) -> dict[str, Any]:
    return {
        "post": {
            "summary": "Embeddings from the deployment named by `model` (deployed with `task: embed`)",
            "requestBody": {"required": True, **_json(_EMBEDDING_REQUEST)},
            "responses": {
                "200": {"description": "one embedding per input, in order", **_json(_EMBEDDING_RESPONSE)},
                **errors,
            },
        }
    }


def _generation(summary: str, request: dict[str, Any], errors: dict[str, Any]) -> dict[str, Any]:
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
                **errors,
            },
        }
    }


def inference_paths(errors: dict[str, Any]) -> dict[str, Any]:
    """The three routes' paths; `errors`: the error responses they share (OpenAI's error object)."""
    return {
        "/v1/chat/completions": _generation(
            "Chat completion from the deployment named by `model`", _CHAT_REQUEST, errors
        ),
        "/v1/completions": _generation(
            "Text completion from the deployment named by `model`", _COMPLETION_REQUEST, errors
        ),
        "/v1/embeddings": _embeddings(errors),
    }


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}
