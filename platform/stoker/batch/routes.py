"""`/v1/files` and `/v1/batches`, as OpenAI's API has them, for the caller's tenant only.

    POST   /v1/files                      multipart: `file` and `purpose` ("batch"); the File object
    GET    /v1/files                      ?purpose= &limit= (1-10,000) &after= &order=asc|desc
    GET    /v1/files/{file_id}            the File object
    GET    /v1/files/{file_id}/content    the bytes
    DELETE /v1/files/{file_id}            {"id", "object": "file", "deleted": true}
    POST   /v1/batches                    {"input_file_id", "endpoint", "completion_window", "metadata"}
    GET    /v1/batches                    ?limit= (1-100) &after=
    GET    /v1/batches/{batch_id}         the Batch object
    POST   /v1/batches/{batch_id}/cancel  the Batch object, cancelling

The keys' middleware has found the caller before any of this (`stoker.gateway.keys.KeyAuth`); a
file or batch of another tenant answers exactly as one that does not exist (404 naming the id).
Every refusal is OpenAI's error shape naming the field.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from snapshots.errors import RemoteError
from stoker.batch.config import BatchConfig
from stoker.batch.files import FILE_ID, UPLOAD_PURPOSES, FileStore, OverLimit, TooMany, owner_of
from stoker.batch.lines import batch_request
from stoker.batch.multipart import boundary_of, read_form
from stoker.batch.records import BATCH_ID, BatchRecord, new_batch_id
from stoker.batch.runner import BatchRunner
from stoker.errors import NOT_FOUND, APIError, invalid
from stoker.gateway.keys import principal_of
from stoker.http import parse_json_object, read_body

MAX_REQUEST_BYTES = 64 << 10
READ_CHUNK = 1 << 20
_CONTROL = re.compile(r"[\x00-\x1f\x7f/\\]")


def _not_found(kind: str, value: str, param: str) -> APIError:
    return APIError(
        404, f"No such {kind}: {value!r}.", type=NOT_FOUND, param=param, code=f"{kind.lower()}_not_found"
    )


def _limit(request: Request, default: int, high: int) -> int:
    raw = request.query_params.get("limit")
    if raw is None:
        return default
    if not (raw.isdigit() and len(raw) <= 6 and 1 <= int(raw) <= high):
        raise invalid(f"'limit' must be an integer in [1, {high}], got {raw!r}.", "limit")
    return int(raw)


def _after(request: Request, pattern: re.Pattern) -> str | None:
    after = request.query_params.get("after")
    if after is not None and not pattern.fullmatch(after):
        raise invalid(f"'after' must be an id from the list, got {after!r}.", "after")
    return after


def _page(items: list[dict[str, Any]], after: str | None, limit: int) -> dict[str, Any]:
    """OpenAI's cursor page: the items after the one named `after`, `limit` of them."""
    if after is not None:
        ids = [i["id"] for i in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


def _filename(name: str | None) -> str:
    if name is None:
        raise invalid("Send the file in the multipart field `file`.", "file")
    name = _CONTROL.sub("_", name.rsplit("/", 1)[-1])[:255].strip()
    return name or "upload.jsonl"


def batch_routes(
    files: Callable[[], FileStore],
    runner: Callable[[], BatchRunner],
    config: BatchConfig,
    wall: Callable[[], float] = time.time,
) -> list[Route]:
    """The routes, over the file store and the runner the app makes at its start."""

    async def upload(request: Request) -> Response:
        owner = owner_of(principal_of(request.scope))
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > config.upload_limit_bytes + MAX_REQUEST_BYTES:
            raise _too_large(config.upload_limit_bytes)
        boundary = boundary_of(request.headers.get("content-type", ""))
        store = files()
        sink = None

        def open_sink():
            nonlocal sink
            try:
                sink = store.begin(owner, config.upload_limit_bytes)
            except TooMany as exc:
                raise invalid(
                    f"A tenant keeps at most {exc.limit} files: delete some first.", "file"
                ) from None
            return sink

        try:
            try:
                form = await read_form(request.receive, boundary, open_sink)
            except OverLimit:
                raise _too_large(config.upload_limit_bytes) from None
            purpose = form.fields.get("purpose")
            if purpose not in UPLOAD_PURPOSES:
                allowed = ", ".join(UPLOAD_PURPOSES)
                raise invalid(f"'purpose' must be one of {allowed}; got {purpose!r}.", "purpose")
            unknown = sorted(
                set(form.fields) - {"purpose", "expires_after[anchor]", "expires_after[seconds]"}
            )
            if unknown:
                raise invalid(f"Unknown field(s) {unknown}; send `file` and `purpose`.", unknown[0])
            if sink is None:
                raise invalid("Send the file in the multipart field `file`.", "file")
            try:
                made = await sink.commit(_filename(form.filename), purpose)
            except RemoteError as exc:
                raise _unavailable(exc, "file") from None
        except BaseException:
            if sink is not None:
                sink.abort()
            raise
        return JSONResponse(made.to_dict())

    async def list_files(request: Request) -> Response:
        owner = owner_of(principal_of(request.scope))
        purpose = request.query_params.get("purpose")
        if purpose is not None and purpose not in ("batch", "batch_output"):
            raise invalid(f"'purpose' must be batch or batch_output, got {purpose!r}.", "purpose")
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise invalid(f"'order' must be asc or desc, got {order!r}.", "order")
        limit, after = _limit(request, 10_000, 10_000), _after(request, FILE_ID)
        found = [f.to_dict() for f in files().list(owner) if purpose is None or f.purpose == purpose]
        return JSONResponse(_page(found[::-1] if order == "desc" else found, after, limit))

    def _file(request: Request):
        owner = owner_of(principal_of(request.scope))
        file_id = request.path_params["file_id"]
        found = files().get(owner, file_id) if FILE_ID.fullmatch(file_id) else None
        if found is None:
            raise _not_found("File", file_id, "file_id")
        return owner, found

    async def get_file(request: Request) -> Response:
        return JSONResponse(_file(request)[1].to_dict())

    async def content(request: Request) -> Response:
        owner, found = _file(request)
        try:
            chunks = await files().read(owner, found.id)
        except RemoteError as exc:
            raise _unavailable(exc) from None
        if chunks is None:
            raise _not_found("File", found.id, "file_id")
        return StreamingResponse(chunks, media_type="application/octet-stream")

    async def delete_file(request: Request) -> Response:
        owner, found = _file(request)
        users = [b.id for b in runner().store.of(owner) if b.running and b.input_file_id == found.id]
        if users:
            raise invalid(f"The file is the input of batch {users[0]}, which has not finished.", "file_id")
        try:
            await files().delete(owner, found.id)
        except RemoteError as exc:
            raise _unavailable(exc) from None
        return JSONResponse({"id": found.id, "object": "file", "deleted": True})

    async def create_batch(request: Request) -> Response:
        principal = principal_of(request.scope)
        owner = owner_of(principal)
        body = parse_json_object(await read_body(request.receive, request.scope, MAX_REQUEST_BYTES))
        asked = batch_request(body, config)
        source = files().get(owner, asked.input_file_id)
        if source is None:
            raise _not_found("File", asked.input_file_id, "input_file_id")
        if source.purpose != "batch":
            raise invalid(
                f"The file {source.id} has purpose {source.purpose!r}, not 'batch'.", "input_file_id"
            )
        active = sum(1 for b in runner().store.of(owner) if b.running)
        if active >= config.max_active:
            raise APIError(
                429,
                f"A tenant runs at most {config.max_active} batches at once; wait for one to finish.",
                param="input_file_id",
                code="too_many_batches",
            )
        now = int(wall())
        record = BatchRecord(
            id=new_batch_id(),
            owner=owner,
            key_id=principal.key_id,
            endpoint=asked.endpoint,
            input_file_id=asked.input_file_id,
            completion_window=asked.completion_window,
            window_s=asked.window_s,
            created_at=now,
            expires_at=now + int(asked.window_s),
            metadata=asked.metadata,
        )
        runner().submit(record)
        return JSONResponse(runner().view(record))

    def _batch(request: Request) -> BatchRecord:
        owner = owner_of(principal_of(request.scope))
        batch_id = request.path_params["batch_id"]
        found = runner().store.get(owner, batch_id) if BATCH_ID.fullmatch(batch_id) else None
        if found is None:
            raise _not_found("Batch", batch_id, "batch_id")
        return found

    async def list_batches(request: Request) -> Response:
        owner = owner_of(principal_of(request.scope))
        limit, after = _limit(request, 20, 100), _after(request, BATCH_ID)
        every = [runner().view(b) for b in runner().store.of(owner)]
        return JSONResponse(_page(every, after, limit))

    async def get_batch(request: Request) -> Response:
        return JSONResponse(runner().view(_batch(request)))

    async def cancel(request: Request) -> Response:
        record = _batch(request)
        if record.status in ("completed", "failed", "expired"):
            raise APIError(
                409,
                f"The batch is {record.status}: it cannot be cancelled.",
                param="batch_id",
                code="batch_done",
            )
        runner().cancel(record)
        return JSONResponse(runner().view(record))

    return [
        Route("/v1/files", upload, methods=["POST"]),
        Route("/v1/files", list_files, methods=["GET"]),
        Route("/v1/files/{file_id}", get_file, methods=["GET"]),
        Route("/v1/files/{file_id}", delete_file, methods=["DELETE"]),
        Route("/v1/files/{file_id}/content", content, methods=["GET"]),
        Route("/v1/batches", create_batch, methods=["POST"]),
        Route("/v1/batches", list_batches, methods=["GET"]),
        Route("/v1/batches/{batch_id}", get_batch, methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", cancel, methods=["POST"]),
    ]


def _unavailable(exc: RemoteError, param: str = "file_id") -> APIError:
    """Object storage failed (after its retries): a 503 the client may retry, naming no secret."""
    return APIError(
        503, f"The file store failed: {exc}", type="server_error", param=param, code="file_store_unavailable"
    )


def _too_large(limit: int) -> APIError:
    return APIError(
        413, f"The file is over the upload limit of {limit} bytes.", param="file", code="file_too_large"
    )
