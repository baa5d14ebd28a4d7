"""`/v1/responses` in the gateway's OpenAPI document (`stoker.api.openapi`): the request as
`stoker.engine.responses_api.parse_responses` takes it, with the bounds it enforces, and the
Response (`stoker.engine.response_events`). The gateway routes it by `model` as it routes chat;
the engines answer it (vLLM its own, Stoker's engine the stateless part)."""

from __future__ import annotations

from typing import Any

from stoker.engine import tools
from stoker.engine.responses_api import METADATA_PAIRS, METADATA_VALUE, ROLES


def responses_paths(errors: dict[str, Any]) -> dict[str, Any]:
    """The path's description; `errors`: the error answers, in OpenAI's shape."""
    name = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}
    text_part = {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"enum": ["input_text", "output_text"]}, "text": {"type": "string"}},
    }
    content = {"anyOf": [{"type": "string"}, {"type": "array", "items": text_part}]}
    item = {
        "anyOf": [
            {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "type": {"const": "message"},
                    "role": {"enum": sorted(ROLES)},
                    "content": content,
                },
            },
            {
                "type": "object",
                "required": ["type", "call_id", "name", "arguments"],
                "properties": {
                    "type": {"const": "function_call"},
                    "call_id": {"type": "string", "minLength": 1},
                    "name": name,
                    "arguments": {"type": "string", "description": "JSON"},
                },
            },
            {
                "type": "object",
                "required": ["type", "call_id", "output"],
                "properties": {
                    "type": {"const": "function_call_output"},
                    "call_id": {"type": "string", "minLength": 1},
                    "output": content,
                },
            },
        ]
    }
    tool = {
        "type": "object",
        "required": ["type", "name"],
        "properties": {
            "type": {"const": "function"},
            "name": name,
            "description": {"type": "string", "maxLength": tools.MAX_DESCRIPTION},
            "parameters": {"type": "object", "description": "a JSON Schema of an object"},
            "strict": {"type": "boolean"},
        },
    }
    json_schema = {
        "type": "object",
        "required": ["type", "name", "schema"],
        "properties": {
            "type": {"const": "json_schema"},
            "name": name,
            "schema": {"type": "object"},
            "strict": {"type": "boolean"},
            "description": {"type": "string"},
        },
    }
    formats = [
        {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}}
    ]
    request = {
        "type": "object",
        "required": ["model", "input"],
        "properties": {
            "model": {"type": "string", "minLength": 1},
            "input": {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": item}]},
            "instructions": {"type": "string"},
            "tools": {"type": "array", "minItems": 1, "maxItems": tools.MAX_TOOLS, "items": tool},
            "tool_choice": {
                "anyOf": [
                    {"enum": ["none", "auto", "required"]},
                    {
                        "type": "object",
                        "required": ["type", "name"],
                        "properties": {"type": {"const": "function"}, "name": name},
                    },
                ]
            },
            "parallel_tool_calls": {"type": "boolean"},
            "text": {"type": "object", "properties": {"format": {"anyOf": [*formats, json_schema]}}},
            "max_output_tokens": {"type": "integer", "minimum": 1},
            "temperature": {"type": "number", "minimum": 0, "maximum": 2},
            "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            "seed": {"type": "integer"},
            "stream": {"type": "boolean"},
            "stream_options": {"type": "object", "properties": {"include_obfuscation": {"type": "boolean"}}},
            "store": {
                "type": "boolean",
                "description": "false or left out: Stoker keeps no responses (true: 400)",
            },
            "metadata": {
                "type": "object",
                "maxProperties": METADATA_PAIRS,
                "additionalProperties": {"type": "string", "maxLength": METADATA_VALUE},
            },
            "user": {"type": "string"},
        },
    }
    answer = {
        "type": "object",
        "required": ["id", "object", "status", "output"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "response"},
            "created_at": {"type": "integer"},
            "status": {"enum": ["completed", "incomplete"]},
            "model": {"type": "string"},
            "output": {"type": "array", "items": {"type": "object"}},
            "usage": {
                "type": "object",
                "properties": {
                    k: {"type": "integer"} for k in ("input_tokens", "output_tokens", "total_tokens")
                },
            },
        },
    }
    post = {
        "summary": "A Response from the deployment named by `model` (stateless: nothing is stored)",
        "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
        "responses": {
            "200": {
                "description": "the Response; with `stream: true`, its events (`event:` and `data:` lines)",
                "content": {
                    "application/json": {"schema": answer},
                    "text/event-stream": {"schema": {"type": "string"}},
                },
            },
            **errors,
        },
    }
    return {"/v1/responses": {"post": post}}
