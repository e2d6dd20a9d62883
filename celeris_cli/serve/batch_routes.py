"""`/v1/files` and `/v1/batches`: thin routes over `FileStore` and `BatchStore`.

Files and batches belong to the API key that made them: another key gets 404, as for an id that does not
exist (on a server without keys, everything is everyone's). Work that reads or writes files runs off the
event loop, so streams and `/health` do not wait for it."""

from __future__ import annotations

import hashlib
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from .batches import BatchStore
from .completions import read_body
from .files import FileStore, file_object
from .private import no_room
from .schema import APIError
from .state import ServeState

MAX_FILES_PAGE = 10_000  # OpenAI's limit for `GET /v1/files`


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, Any] | None = None  # checked by `batch_record.metadata_problem`, in the user's terms


def _no_file(file_id: str) -> APIError:
    return APIError(404, f"no file {file_id!r}", "not_found_error", "file_id", "file_not_found")


def _no_batch(batch_id: str) -> APIError:
    return APIError(404, f"no batch {batch_id!r}", "not_found_error", "batch_id", "batch_not_found")


def _off() -> APIError:
    return APIError(
        400, "files and batches need the queue: start celeris serve with --queue CONFIG", code="batch_api_off"
    )


def owner_of(state: ServeState, request: Request) -> str | None:
    """Who owns what this request makes or sees: a hash of its API key (None without keys). The key has
    been checked already; only its hash is ever stored."""
    if not state.keys.required:
        return None
    token = (request.headers.get("authorization") or "").partition(" ")[2].strip()
    return hashlib.sha256(token.encode()).hexdigest()[:32]


def _page(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": more}


def file_routes(state: ServeState) -> APIRouter:
    router = APIRouter()

    def store() -> FileStore:
        if state.files is None:
            raise _off()
        return state.files

    @router.post("/v1/files")
    async def upload(request: Request) -> dict[str, Any]:
        files = store()
        owner = owner_of(state, request)
        try:  # parsed here, not by FastAPI, so a body over --max-file-bytes is the 413 it raises
            form = await request.form(max_files=1, max_fields=4)
        except APIError:
            raise
        except OSError as e:  # the upload's spool file on a full disk
            raise no_room(e, files.folder) or e from None
        except Exception as e:  # noqa: BLE001 - the multipart parser's own errors
            raise APIError(400, f"the body is not a multipart form with `file` and `purpose` ({e})") from None
        try:
            purpose, file = form.get("purpose"), form.get("file")
            if purpose != "batch":
                raise APIError(400, f"purpose must be 'batch', got {purpose!r}", param="purpose")
            if not isinstance(file, UploadFile):
                raise APIError(400, "the form has no `file` part", param="file")
            return await run_in_threadpool(_store_upload, state, files, file, owner)
        finally:
            await form.close()

    @router.get("/v1/files")
    def list_files(
        request: Request,
        after: str | None = None,
        limit: int = Query(MAX_FILES_PAGE, ge=1, le=MAX_FILES_PAGE),
        order: Literal["asc", "desc"] = "desc",
        purpose: str | None = None,
    ) -> dict[str, Any]:
        data, more = store().page(owner_of(state, request), after, limit, order, purpose)
        return _page([file_object(m) for m in data], more)

    @router.get("/v1/files/{file_id}")
    def get_file(request: Request, file_id: str) -> dict[str, Any]:
        meta = store().owned(file_id, owner_of(state, request))
        if meta is None:
            raise _no_file(file_id)
        return file_object(meta)

    @router.get("/v1/files/{file_id}/content")
    def content(request: Request, file_id: str) -> FileResponse:
        files = store()
        if files.owned(file_id, owner_of(state, request)) is None:
            raise _no_file(file_id)
        return FileResponse(files.path(file_id), media_type="application/octet-stream")

    @router.delete("/v1/files/{file_id}")
    def delete(request: Request, file_id: str) -> dict[str, Any]:
        files = store()
        if files.owned(file_id, owner_of(state, request)) is None or not files.delete(file_id):
            raise _no_file(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    return router


def _store_upload(state: ServeState, files: FileStore, file: UploadFile, owner: str | None) -> dict[str, Any]:
    try:
        meta = files.add_stream(file.file, file.filename or "upload.jsonl", "batch", owner=owner)
    except OSError as e:
        raise no_room(e, files.folder) or e from None
    with open(files.path(meta["id"]), "rb") as f:
        lines = sum(1 for raw in f if raw.strip())
    if lines > state.limits.max_batch_lines:
        files.delete(meta["id"])
        raise APIError(
            400, f"the file has {lines} request lines; the limit is {state.limits.max_batch_lines}", param="file"
        )
    return file_object(meta)


def batch_routes(state: ServeState) -> APIRouter:
    router = APIRouter()

    def store() -> BatchStore:
        if state.batches is None:
            raise _off()
        return state.batches

    @router.post("/v1/batches")
    async def create(request: Request) -> dict[str, Any]:
        body: BatchCreate = await read_body(request, BatchCreate)
        owner = owner_of(state, request)
        batches = store()
        return await run_in_threadpool(
            batches.create, owner, body.input_file_id, body.endpoint, body.completion_window, body.metadata
        )

    @router.get("/v1/batches")
    def list_batches(
        request: Request, after: str | None = None, limit: int = Query(20, ge=1, le=100)
    ) -> dict[str, Any]:
        data, more = store().page(owner_of(state, request), after, limit)
        return _page(data, more)

    @router.get("/v1/batches/{batch_id}")
    def get_batch(request: Request, batch_id: str) -> dict[str, Any]:
        batch = store().get(batch_id, owner_of(state, request))
        if batch is None:
            raise _no_batch(batch_id)
        return batch

    @router.post("/v1/batches/{batch_id}/cancel")
    def cancel(request: Request, batch_id: str) -> dict[str, Any]:
        batch = store().cancel(batch_id, owner_of(state, request))
        if batch is None:
            raise _no_batch(batch_id)
        return batch

    @router.post("/v1/batches/{batch_id}/retry")
    def retry(request: Request, batch_id: str) -> dict[str, Any]:
        """Not OpenAI's: a new batch of this batch's failed lines (see docs/serve.md)."""
        batch = store().retry(batch_id, owner_of(state, request))
        if batch is None:
            raise _no_batch(batch_id)
        return batch

    return router
