"""`POST /v1/completions` and `POST /v1/chat/completions`, whole or streamed (server-sent events).

A streamed answer sends one event per committed block: a diffusion model commits a block at a time, and a
committed block never changes. Strategies that do not commit by block send the whole answer in one event.
Text that a stop string could still cut is held back until the answer is final, so the events always add
up to the answer a non-streamed request gets.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from ..errors import CelerisError, PromptTooLong
from .runner import Answer
from .schema import APIError, ChatBody, CompletionBody, chat_completion, chunk, completion, new_id, to_request, usage
from .state import ServeState

log = logging.getLogger(__name__)


async def read_body(request: Request, model: type[BaseModel]) -> Any:
    """A JSON body validated by `model`; errors in OpenAI's shape, naming the key."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"])
        raise APIError(400, f"{param}: {err['msg']}", param=param) from None


def held_back(text: str, stops: tuple[str, ...]) -> str:
    """The part of a partial answer that no later block can change: a stop string completed later may
    still cut its tail, and a character split across tokens decodes as U+FFFD until it is whole."""
    keep = len(text) - (max(map(len, stops)) - 1 if stops else 0)
    text = text[: max(keep, 0)]
    return text.rstrip("\ufffd")


def completion_routes(state: ServeState) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _answer(state, request, await read_body(request, CompletionBody), chat=False)

    @router.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _answer(state, request, await read_body(request, ChatBody), chat=True)

    return router


async def _answer(state: ServeState, request: Request, body: CompletionBody | ChatBody, chat: bool) -> Response:
    if body.model is not None and body.model != state.model_id:
        raise APIError(
            404,
            f"model {body.model!r} is not served here (serving {state.model_id!r})",
            "not_found_error",
            "model",
            "model_not_found",
        )
    rid = new_id("chatcmpl" if chat else "cmpl")
    try:
        prepared = state.runner.prepare(to_request(body, rid))
    except PromptTooLong as e:
        raise APIError(400, str(e), param="messages" if chat else "prompt", code="context_length_exceeded") from None
    except CelerisError as e:
        raise APIError(400, str(e)) from None
    params = prepared.group
    if params.gen_length > state.limits.max_tokens:
        key = "max_completion_tokens" if chat and "max_completion_tokens" in body.model_fields_set else "max_tokens"
        raise APIError(
            400, f"{key} {params.gen_length} is over this server's limit of {state.limits.max_tokens}", param=key
        )
    if state.in_flight >= state.limits.max_concurrent:
        raise APIError(
            429,
            f"{state.in_flight} requests are in flight, the most this server takes; retry later",
            "rate_limit_error",
            code="too_many_requests",
        )
    route = request.url.path
    t0 = time.perf_counter()
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = _stream(state, prepared, rid, chat, include_usage, route, t0)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-store"})
    state.begin()
    try:
        future = state.runner.submit([prepared])[0]
        answer = await _wait(state, request, future)
    finally:
        state.end()
    if answer is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    state.count(route, 200, answer, time.perf_counter() - t0)
    build = chat_completion if chat else completion
    return JSONResponse(build(rid, state.model_id, answer.text, answer.finish_reason, _usage(answer)))


def _usage(a: Answer) -> dict[str, int]:
    return usage(a.prompt_tokens, a.completion_tokens)


async def _wait(state: ServeState, request: Request, future: Future[Answer]) -> Answer | None:
    """The answer; None when the client disconnected first (its row is dropped if not yet decoding)."""
    wrapped = asyncio.wrap_future(future)
    while True:
        done, _ = await asyncio.wait({wrapped}, timeout=0.25)
        if done:
            return wrapped.result()
        if await request.is_disconnected():
            if future.cancel():
                state.metrics.dropped.inc()
            return None


async def _stream(
    state: ServeState, prepared: Any, rid: str, chat: bool, include_usage: bool, route: str, t0: float
) -> AsyncIterator[str]:
    """The events of one streamed answer. Nothing is queued until the response starts: a client gone
    before that costs nothing. Starlette cancels this generator when the client disconnects."""
    state.begin()
    loop = asyncio.get_running_loop()
    texts: asyncio.Queue[str] = asyncio.Queue()

    def on_text(text: str) -> None:  # called from the runner's thread
        loop.call_soon_threadsafe(texts.put_nowait, text)

    future = state.runner.stream(prepared, on_text)
    wrapped = asyncio.wrap_future(future)
    created = int(time.time())
    stops = prepared.group.stop
    sent = ""

    def event(text: str | None, finish: str | None = None) -> str:
        return f"data: {json.dumps(chunk(chat, rid, state.model_id, created, text, finish), ensure_ascii=False)}\n\n"

    try:
        if chat:
            yield event(None)  # the role first, as OpenAI's stream does
        while not wrapped.done() or not texts.empty():
            getter = asyncio.ensure_future(texts.get())
            both: set[asyncio.Future[Any]] = {getter, wrapped}
            await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                continue
            stable = held_back(getter.result(), stops)
            piece = stable[len(sent) :] if stable.startswith(sent) and len(stable) > len(sent) else ""
            sent += piece
            yield event(piece)  # one event per committed block
        try:
            answer = wrapped.result()
        except Exception as e:  # noqa: BLE001 - the stream has started: report the failure in it
            err = APIError(500, f"{type(e).__name__}: {e}", "server_error")
            yield f"data: {json.dumps(err.body())}\n\n"
            yield "data: [DONE]\n\n"
            state.metrics.requests.labels(route, "500").inc()
            return
        if not answer.text.startswith(sent):  # held_back keeps this from happening; say so if it ever does
            log.warning(
                "streamed text is not a prefix of the answer (%d of %d chars sent)", len(sent), len(answer.text)
            )
        rest = answer.text[len(sent) :] if answer.text.startswith(sent) else ""
        if rest:
            yield event(rest)
        yield event("", answer.finish_reason)
        if include_usage:
            last: dict[str, Any] = {
                "id": rid,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created,
            }
            last |= {"model": state.model_id, "choices": [], "usage": _usage(answer)}
            yield f"data: {json.dumps(last)}\n\n"
        yield "data: [DONE]\n\n"
        state.count(route, 200, answer, time.perf_counter() - t0)
    finally:
        if future.cancel():  # the client left before its row was decoded
            state.metrics.dropped.inc()
        state.end()
