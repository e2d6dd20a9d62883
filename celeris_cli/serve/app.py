"""The ASGI app: routes, the API key check, the body size limit, and every error in OpenAI's shape."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from ..spool.folders import HEARTBEAT
from ..spool.status import read_heartbeat
from .batch_routes import batch_routes, file_routes
from .completions import completion_routes
from .guard import Guard
from .schema import APIError
from .state import ServeState

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class BodyLimit:
    """413 for a body over the limit: at once from Content-Length, or as soon as a chunked body passes it.
    Uploads (`/v1/files`) have their own, larger limit."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], state: ServeState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        upload = scope["path"] == "/v1/files"
        limit = self.state.limits.max_file_bytes if upload else self.state.limits.max_body_bytes
        what = "an uploaded file" if upload else "a request body"
        too_large = APIError(413, f"{what} may be at most {limit} bytes", code="request_too_large")
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length", b"").decode()
        if length.isdigit() and int(length) > limit:
            await JSONResponse(too_large.body(), status_code=413)(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise too_large
            return message

        await self.app(scope, counted, send)


def create_app(state: ServeState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if state.batches is not None:
            state.batches.start()
        yield
        if state.batches is not None:
            state.batches.stop()
        state.runner.close()

    app = FastAPI(title="celeris", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    def require_key(request: Request) -> None:
        if not state.keys.accepts(request.headers.get("authorization")):
            raise APIError(
                401,
                "a valid API key is needed: Authorization: Bearer KEY",
                "authentication_error",
                code="invalid_api_key",
            )

    guarded = [Depends(require_key)]
    app.include_router(completion_routes(state), dependencies=guarded)
    app.include_router(file_routes(state), dependencies=guarded)
    app.include_router(batch_routes(state), dependencies=guarded)

    @app.get("/v1/models", dependencies=guarded)
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model(state)]}

    @app.get("/v1/models/{model_id}", dependencies=guarded)
    def model(model_id: str) -> dict[str, Any]:
        if model_id != state.model_id:
            raise APIError(404, f"model {model_id!r} is not served here", "not_found_error", "model", "model_not_found")
        return _model(state)

    @app.get("/metrics", dependencies=guarded)
    def metrics() -> Response:
        return Response(state.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/health")
    def health() -> dict[str, Any]:
        """Open without a key, for load balancers: the model, the waiting rows, and the queue's daemon."""
        out: dict[str, Any] = {"status": "ok", "model": state.model_id, "waiting": state.runner.depth}
        out["threads"] = state.threads
        if state.queue is not None:
            # the heartbeat only, judged by its pid: probing the queue's flock, even shared, could make a
            # daemon starting at that instant find its lock held and exit
            beat = read_heartbeat(state.queue.folders.logs / HEARTBEAT, lock_holder="")
            out["queue"] = {"daemon_pid": beat.get("pid") if beat else None, "state": beat["state"] if beat else None}
        return out

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"][1:]) or None
        return JSONResponse(APIError(400, f"{param}: {err['msg']}", param=param).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        err = APIError(
            exc.status_code, str(exc.detail), "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        )
        return JSONResponse(err.body(), status_code=exc.status_code)

    # any other exception is a 500 from `Guard` (outermost): a handler for Exception here would answer and
    # then raise it again, and the server would reset the client's keep-alive connection
    app.add_middleware(BodyLimit, state=state)
    app.add_middleware(Guard, state=state)
    return app


def _model(state: ServeState) -> dict[str, Any]:
    return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "celeris"}
