"""`/v1/files` and `/v1/batches`: thin routes over `FileStore` and `BatchStore`."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict

from .batches import BatchStore
from .completions import read_body
from .files import FileStore, file_object
from .schema import APIError
from .state import ServeState


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


def _no_file(file_id: str) -> APIError:
    return APIError(404, f"no file {file_id!r}", "not_found_error", "file_id", "file_not_found")


def _no_batch(batch_id: str) -> APIError:
    return APIError(404, f"no batch {batch_id!r}", "not_found_error", "batch_id", "batch_not_found")


def _off() -> APIError:
    return APIError(
        400, "files and batches need the queue: start celeris serve with --queue CONFIG", code="batch_api_off"
    )


def file_routes(state: ServeState) -> APIRouter:
    router = APIRouter()

    def store() -> FileStore:
        if state.files is None:
            raise _off()
        return state.files

    @router.post("/v1/files")
    def upload(file: UploadFile = File(...), purpose: str = Form(...)) -> dict[str, Any]:
        if purpose != "batch":
            raise APIError(400, f"purpose must be 'batch', got {purpose!r}", param="purpose")
        files = store()
        meta = files.add_stream(file.file, file.filename or "upload.jsonl", purpose)
        with open(files.path(meta["id"]), "rb") as f:
            lines = sum(1 for raw in f if raw.strip())
        if lines > state.limits.max_batch_lines:
            files.delete(meta["id"])
            raise APIError(
                400, f"the file has {lines} request lines; the limit is {state.limits.max_batch_lines}", param="file"
            )
        return file_object(meta)

    @router.get("/v1/files")
    def list_files() -> dict[str, Any]:
        return {"object": "list", "data": [file_object(m) for m in store().listing()]}

    @router.get("/v1/files/{file_id}")
    def get_file(file_id: str) -> dict[str, Any]:
        meta = store().get(file_id)
        if meta is None:
            raise _no_file(file_id)
        return file_object(meta)

    @router.get("/v1/files/{file_id}/content")
    def content(file_id: str) -> FileResponse:
        files = store()
        if files.get(file_id) is None:
            raise _no_file(file_id)
        return FileResponse(files.path(file_id), media_type="application/octet-stream")

    @router.delete("/v1/files/{file_id}")
    def delete(file_id: str) -> dict[str, Any]:
        if not store().delete(file_id):
            raise _no_file(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    return router


def batch_routes(state: ServeState) -> APIRouter:
    router = APIRouter()

    def store() -> BatchStore:
        if state.batches is None:
            raise _off()
        return state.batches

    @router.post("/v1/batches")
    async def create(request: Request) -> dict[str, Any]:
        body: BatchCreate = await read_body(request, BatchCreate)
        batches = store()  # the file's lines are parsed and fsynced: off the event loop
        return await asyncio.to_thread(
            batches.create, body.input_file_id, body.endpoint, body.completion_window, body.metadata
        )

    @router.get("/v1/batches")
    def list_batches(after: str | None = None, limit: int = Query(20, ge=1, le=100)) -> dict[str, Any]:
        data, more = store().page(after, limit)
        first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
        return {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": more}

    @router.get("/v1/batches/{batch_id}")
    def get_batch(batch_id: str) -> dict[str, Any]:
        batch = store().get(batch_id)
        if batch is None:
            raise _no_batch(batch_id)
        return batch

    @router.post("/v1/batches/{batch_id}/cancel")
    def cancel(batch_id: str) -> dict[str, Any]:
        batch = store().cancel(batch_id)
        if batch is None:
            raise _no_batch(batch_id)
        return batch

    return router
