"""The OpenAI objects the server speaks: request bodies (pydantic, strict), the errors' shape, and the
completion, chat completion and chunk objects built from an answer.

A request body becomes the queue's own `Request` (`to_request`), so the server and the queue prepare a
request the same way: OpenAI's keys map to Celeris settings as in a batch file (`spool.formats`), any
other key must be a Celeris setting by its name, and anything else is a 400 naming the key.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from ..errors import UsageError
from ..params import check_values
from ..spool.formats import OPENAI_PARAMS, Request

ErrorType = Literal[
    "invalid_request_error", "authentication_error", "not_found_error", "rate_limit_error", "server_error"
]


class APIError(Exception):
    """An HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: ErrorType = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: str
    content: str
    name: str | None = None


class _Body(BaseModel):
    """Keys both endpoints share. Extra keys are kept and must be Celeris settings (checked by name)."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None  # Celeris's own knob of that name: >= 0, on the fast and block decoders
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI keys Celeris cannot honour, accepted only at the value that asks for nothing
    n: Literal[1] = 1
    logprobs: Literal[False] | None = None
    frequency_penalty: Literal[0] | None = None
    logit_bias: dict[str, Any] | None = None


class CompletionBody(_Body):
    prompt: str
    echo: Literal[False] = False
    best_of: Literal[1] | None = None
    suffix: None = None


class ChatBody(_Body):
    messages: list[Message]
    max_completion_tokens: int | None = None
    top_logprobs: Literal[0] | None = None


# body keys handled here, not generation settings
_OWN = {"model", "prompt", "messages", "stream", "stream_options", "user", "n", "logprobs", "echo", "best_of"}
_OWN |= {
    "suffix",
    "top_logprobs",
    "frequency_penalty",
    "logit_bias",
    "metadata",
}  # metadata: ignored, as the queue does


def to_request(body: CompletionBody | ChatBody, request_id: str) -> Request:
    """The queue's Request for a body: OpenAI keys mapped to settings, other keys checked one by one as
    Celeris settings (a 400 naming the first unknown one)."""
    given = body.model_dump(exclude_unset=True, exclude_none=True)
    if given.get("logit_bias"):
        raise APIError(400, "logit_bias is not supported by celeris", param="logit_bias")
    if "max_tokens" in given and "max_completion_tokens" in given:
        raise APIError(400, "give one of max_tokens and max_completion_tokens", param="max_completion_tokens")
    params: dict[str, Any] = {}
    for key, value in given.items():
        if key in _OWN:
            continue
        target = OPENAI_PARAMS.get(key)  # max_tokens -> gen_length; a Celeris setting keeps its name
        name = target or key
        if name in params:
            raise APIError(400, f"{key} and {name} name the same setting; give one", param=key)
        try:
            check_values({name: value})
        except UsageError as e:
            raise APIError(400, str(e).replace(name, key), param=key) from None
        params[name] = value
    if isinstance(body, ChatBody):
        if not body.messages:
            raise APIError(400, "messages must hold at least one message", param="messages")
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        return Request(request_id, 0, messages=messages, params=params)
    if not body.prompt.strip():
        raise APIError(400, "prompt is empty", param="prompt")
    return Request(request_id, 0, prompt=body.prompt, params=params)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion(
    id: str, model: str, text: str, finish_reason: str, use: dict[str, int], created: int | None = None
) -> dict[str, Any]:
    return {
        "id": id,
        "object": "text_completion",
        "created": created if created is not None else int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}],
        "usage": use,
    }


def chat_completion(
    id: str, model: str, text: str, finish_reason: str, use: dict[str, int], created: int | None = None
) -> dict[str, Any]:
    return {
        "id": id,
        "object": "chat.completion",
        "created": created if created is not None else int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason,
                "logprobs": None,
            }
        ],
        "usage": use,
    }


def chunk(chat: bool, id: str, model: str, created: int, text: str | None, finish_reason: str | None) -> dict[str, Any]:
    """One streamed event: a piece of text (None: the first chat event, with the role) or the last one."""
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if text is None else {"content": text}
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta if finish_reason is None else {},
            "finish_reason": finish_reason,
        }
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
        kind = "text_completion"
    return {"id": id, "object": kind, "created": created, "model": model, "choices": [choice]}
