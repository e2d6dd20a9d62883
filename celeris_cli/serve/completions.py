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
import re
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from ..errors import CelerisError, PromptTooLong
from ..spool.backend import Prepared
from .runner import Answer
from .schema import (
    APIError,
    ChatBody,
    Choice,
    CompletionBody,
    Prompt,
    chat_completion,
    chunk,
    completion,
    new_id,
    to_requests,
    usage,
)
from .state import ServeState

log = logging.getLogger(__name__)


MAX_DIGITS = 40  # an integer longer than this is no setting's value (a seed has at most 19 digits)


class _HugeInt:
    """An integer too long to be any setting's value, kept unconverted: the model's check then names the
    field (`seed: Input should be a valid integer`) instead of int() raising on 5,000 digits."""

    def __init__(self, digits: str) -> None:
        self.digits = len(digits)

    def __repr__(self) -> str:
        return f"an integer of {self.digits} digits"


def _int(digits: str) -> int | _HugeInt:
    return int(digits) if len(digits) <= MAX_DIGITS else _HugeInt(digits)


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """A JSON body validated by `model`; errors in OpenAI's shape, naming the key. Runs off the event loop
    (`read_body`): a megabyte of JSON and its validation take a while."""
    try:
        data = json.loads(raw, parse_int=_int)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON ({e})") from None
    except RecursionError:
        raise APIError(400, "the body is nested too deeply") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = _telling(e.errors())
        param = ".".join(str(p) for p in err["loc"] if not _member(p)) or None  # None: a key itself is bad
        message = err["msg"].removeprefix("Value error, ")  # our validators' words, without pydantic's prefix
        raise APIError(400, f"{param or 'a key of the body'}: {message}", param=param) from None
    except RecursionError:  # nesting under json's limit can still pass pydantic's
        raise APIError(400, "the body is nested too deeply") from None


# a value of the wrong type for one member of a union: the other members' errors say more
_MISMATCH = {"string_type", "int_type", "float_type", "bool_type", "list_type", "dict_type", "model_type"}
_MISMATCH |= {"literal_error", "none_required", "is_instance_of", "model_attributes_type"}


def _telling(errors: list[Any]) -> Any:
    """The error to report: where a value failed every member of a union, the one that says what is wrong
    with it (`at most 5`) rather than that it is not of another member's type."""
    return next((e for e in errors if e["type"] not in _MISMATCH), errors[0])


def _member(part: int | str) -> bool:
    """Whether a part of pydantic's error location names a member of a union (`str`, `list[int]`,
    `constrained-int`, `function-after[_utf8(), str]`, `TextPart`), not a key: keys are snake_case."""
    return isinstance(part, str) and ("[" in part or "-" in part or part[:1].isupper() or part in _TYPES)


_TYPES = ("str", "int", "float", "bool", "none", "list", "dict")


async def read_body(request: Request, model: type[BaseModel]) -> Any:
    return await asyncio.to_thread(parse_body, await request.body(), model)


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
    prompts = to_requests(body, rid, state.limits.max_tokens)  # bounds first: nothing sized yet
    if body.stream and len(prompts) > 1:
        raise APIError(400, "stream: a streamed completion takes one prompt", param="stream")
    busy(state, len(prompts))
    prepared = await asyncio.to_thread(_prepare, state, prompts, chat)  # tokenizing a long prompt takes a while
    params = prepared[0].group
    if params.gen_length > state.limits.max_tokens:  # the config's default length, no request key
        key = "max_completion_tokens" if chat and "max_completion_tokens" in body.model_fields_set else "max_tokens"
        raise APIError(
            400, f"{key} {params.gen_length} is over this server's limit of {state.limits.max_tokens}", param=key
        )
    busy(state, len(prompts))  # again: others may have come in while this one was prepared
    route = request.url.path
    t0 = time.perf_counter()
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = _stream(state, prepared[0], rid, chat, include_usage, route, t0)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-store"})
    state.begin(len(prepared))
    try:
        futures = state.runner.submit(prepared)
        answers = await _wait(state, request, futures)
    finally:
        state.end(len(prepared))
    if answers is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    for answer in answers:
        state.count(route, answer, time.perf_counter() - t0)
    use = usage(sum(a.prompt_tokens for a in answers), sum(a.completion_tokens for a in answers))
    choices = [Choice(a.text, a.finish_reason, a.logprobs, a.error) for a in answers]
    if chat:
        return JSONResponse(chat_completion(rid, state.model_id, choices[0], use))
    return JSONResponse(completion(rid, state.model_id, choices, use))


def busy(state: ServeState, n: int) -> None:
    """429 (with Retry-After) when `n` more requests would pass --max-concurrent."""
    if n > state.limits.max_concurrent:
        raise APIError(400, f"prompt: {n} prompts, over this server's --max-concurrent", param="prompt")
    if state.in_flight + n > state.limits.max_concurrent:
        raise APIError(
            429,
            f"{state.in_flight} requests are in flight, the most this server takes; retry later",
            "rate_limit_error",
            code="too_many_requests",
            headers={"Retry-After": "1"},
        )


def _prepare(state: ServeState, prompts: list[Prompt], chat: bool) -> list[Prepared]:
    """Each prompt validated and tokenized (in a worker thread); a 400 naming the prompt at fault."""
    out = []
    for request, ids in prompts:
        try:
            out.append(state.runner.prepare(request, ids))
        except PromptTooLong as e:
            param = "messages" if chat else "prompt" if len(prompts) == 1 else f"prompt.{request.line}"
            raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
        except CelerisError as e:  # a message that starts with the field it is about names it as `param`
            head = str(e).partition(":")[0]
            named = head if re.fullmatch(r"[a-z_][a-z0-9_.]*", head) else None
            if named == "prompt" and len(prompts) > 1:
                named = f"prompt.{request.line}"
            raise APIError(400, str(e), param=named, code=e.code) from None
    return out


def _usage(a: Answer) -> dict[str, int]:
    return usage(a.prompt_tokens, a.completion_tokens)


def answer_error(e: BaseException) -> APIError:
    """A decoding failure as the client sees it: a request too large for the device's memory is the
    client's to make smaller (4xx, naming what to lower), as the queue answers it; anything else is ours."""
    if isinstance(e, CelerisError):  # TooLarge's code is `too_large`, as in the queue's failure records
        return APIError(400, str(e), code=e.code)
    return APIError(500, f"decoding failed ({type(e).__name__}); see the server's log", "server_error")


async def _wait(state: ServeState, request: Request, futures: list[Future[Answer]]) -> list[Answer] | None:
    """The answers; None when the client disconnected first (its rows are dropped, waiting or decoding)."""
    wrapped = [asyncio.wrap_future(f) for f in futures]
    while True:
        _, pending = await asyncio.wait(wrapped, timeout=0.25)
        if not pending:
            failed = next((w.exception() for w in wrapped if w.exception() is not None), None)
            if failed is not None:
                raise answer_error(failed)
            return [w.result() for w in wrapped]
        if await request.is_disconnected():
            for future in futures:
                if state.runner.drop(future):
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

    def event(text: str | None, finish: str | None = None, error: str | None = None) -> str:
        obj = chunk(chat, rid, state.model_id, created, text, finish, error)
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

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
            if not isinstance(e, CelerisError):
                log.warning("decoding failed: %s: %s", type(e).__name__, e)
            yield f"data: {json.dumps(answer_error(e).body())}\n\n"
            yield "data: [DONE]\n\n"
            return
        if not answer.text.startswith(sent):  # held_back keeps this from happening; say so if it ever does
            log.warning(
                "streamed text is not a prefix of the answer (%d of %d chars sent)", len(sent), len(answer.text)
            )
        rest = answer.text[len(sent) :] if answer.text.startswith(sent) else ""
        if rest:
            yield event(rest)
        yield event("", answer.finish_reason, answer.error)
        if include_usage:
            last: dict[str, Any] = {
                "id": rid,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created,
            }
            last |= {"model": state.model_id, "choices": [], "usage": _usage(answer)}
            yield f"data: {json.dumps(last)}\n\n"
        yield "data: [DONE]\n\n"
        state.count(route, answer, time.perf_counter() - t0)
    finally:
        if not future.done() and state.runner.drop(future):  # the client left before its answer
            state.metrics.dropped.inc()
        state.end()
