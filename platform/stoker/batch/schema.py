"""The batch API's part of the OpenAPI document (`stoker.api.openapi`): `/v1/files` and
`/v1/batches`, with the bounds `stoker.batch.lines` and `stoker.batch.routes` enforce."""

from __future__ import annotations

from typing import Any

from stoker.batch.lines import ENDPOINTS, MAX_METADATA_KEY, MAX_METADATA_KEYS, MAX_METADATA_VALUE


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict[str, Any]:
    error = {
        "type": "object",
        "required": ["error"],
        "properties": {"error": {"type": "object", "required": ["message", "type"]}},
    }
    return {str(c): {"description": "an error, in OpenAI's shape", **_json(error)} for c in codes}


_FILE = {
    "type": "object",
    "required": ["id", "object", "bytes", "created_at", "filename", "purpose"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "file"},
        "bytes": {"type": "integer"},
        "created_at": {"type": "integer"},
        "filename": {"type": "string"},
        "purpose": {"type": "string", "enum": ["batch", "batch_output"]},
        "status": {"type": "string"},
    },
}
_BATCH = {
    "type": "object",
    "required": [
        "id",
        "object",
        "endpoint",
        "input_file_id",
        "completion_window",
        "status",
        "request_counts",
    ],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "batch"},
        "endpoint": {"type": "string"},
        "input_file_id": {"type": "string"},
        "completion_window": {"type": "string"},
        "status": {
            "type": "string",
            "enum": [
                "validating",
                "in_progress",
                "finalizing",
                "completed",
                "failed",
                "expired",
                "cancelling",
                "cancelled",
            ],
        },
        "output_file_id": {"type": ["string", "null"]},
        "error_file_id": {"type": ["string", "null"]},
        "request_counts": {
            "type": "object",
            "properties": {n: {"type": "integer"} for n in ("total", "completed", "failed")},
        },
        "usage": {"type": "object"},
        "metadata": {"type": ["object", "null"]},
        "cost_usd": {
            "type": "number",
            "description": "Stoker's own: the batch's share of its deployments' spend while it ran",
        },
    },
}
_BATCH_REQUEST = {
    "type": "object",
    "required": ["input_file_id", "endpoint", "completion_window"],
    "additionalProperties": False,
    "properties": {
        "input_file_id": {"type": "string", "pattern": "^file-[0-9a-f]{24}$"},
        "endpoint": {"type": "string", "enum": list(ENDPOINTS)},
        "completion_window": {"type": "string", "description": 'a duration from 1m to 7d, e.g. "24h"'},
        "metadata": {
            "type": ["object", "null"],
            "maxProperties": MAX_METADATA_KEYS,
            "propertyNames": {"minLength": 1, "maxLength": MAX_METADATA_KEY},
            "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE},
        },
    },
}


def _list(item: dict[str, Any]) -> dict[str, Any]:
    return _json(
        {
            "type": "object",
            "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": item}},
        }
    )


def _param(name: str, where: str = "path", **schema: Any) -> dict[str, Any]:
    return {"name": name, "in": where, "required": where == "path", "schema": {"type": "string", **schema}}


def batch_paths() -> dict[str, Any]:
    file_id, batch_id = [_param("file_id")], [_param("batch_id")]
    limit = {"name": "limit", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 1}}
    return {
        "/v1/files": {
            "post": {
                "summary": "Upload a file (a batch's input, JSONL): multipart `file` and `purpose: batch`",
                "requestBody": {
                    "required": True,
                    "content": {
                        "multipart/form-data": {
                            "schema": {
                                "type": "object",
                                "required": ["file", "purpose"],
                                "properties": {
                                    "file": {"type": "string", "format": "binary"},
                                    "purpose": {"type": "string", "enum": ["batch"]},
                                },
                            }
                        }
                    },
                },
                "responses": {
                    "200": {"description": "the File object", **_json(_FILE)},
                    **_errors(400, 401, 413, 415, 503),
                },
            },
            "get": {
                "summary": "The caller's files",
                "parameters": [
                    _param("purpose", "query", enum=["batch", "batch_output"]),
                    _param("order", "query", enum=["asc", "desc"]),
                    _param("after", "query"),
                    limit,
                ],
                "responses": {"200": {"description": "the list", **_list(_FILE)}, **_errors(400, 401)},
            },
        },
        "/v1/files/{file_id}": {
            "get": {
                "summary": "One of the caller's files",
                "parameters": file_id,
                "responses": {"200": {"description": "it", **_json(_FILE)}, **_errors(401, 404)},
            },
            "delete": {
                "summary": "Delete one of the caller's files (not the input of a batch still running)",
                "parameters": file_id,
                "responses": {
                    "200": {"description": "deleted", **_json({"type": "object"})},
                    **_errors(400, 401, 404, 503),
                },
            },
        },
        "/v1/files/{file_id}/content": {
            "get": {
                "summary": "A file's bytes",
                "parameters": file_id,
                "responses": {
                    "200": {"description": "the bytes", "content": {"application/octet-stream": {}}},
                    **_errors(401, 404, 503),
                },
            }
        },
        "/v1/batches": {
            "post": {
                "summary": "Run every request of a JSONL file at low priority, within its completion window",
                "requestBody": {"required": True, **_json(_BATCH_REQUEST)},
                "responses": {
                    "200": {"description": "the Batch object, validating", **_json(_BATCH)},
                    **_errors(400, 401, 404, 413, 429),
                },
            },
            "get": {
                "summary": "The caller's batches, newest first",
                "parameters": [_param("after", "query"), limit],
                "responses": {"200": {"description": "the list", **_list(_BATCH)}, **_errors(400, 401)},
            },
        },
        "/v1/batches/{batch_id}": {
            "get": {
                "summary": "One of the caller's batches",
                "parameters": batch_id,
                "responses": {"200": {"description": "it", **_json(_BATCH)}, **_errors(401, 404)},
            }
        },
        "/v1/batches/{batch_id}/cancel": {
            "post": {
                "summary": "Cancel a batch: lines in flight finish, the rest go to the error file",
                "parameters": batch_id,
                "responses": {
                    "200": {"description": "the batch, cancelling", **_json(_BATCH)},
                    **_errors(401, 404, 409),
                },
            }
        },
    }
