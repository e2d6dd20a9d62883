"""The OpenAI objects the server speaks: request bodies (pydantic, strict), the errors' shape, and the
completion, chat completion and chunk objects built from an answer.

A request body becomes the queue's own `Request` (`to_request`), so the server and the queue prepare a
request the same way: OpenAI's keys map to Celeris settings as in a batch file (`spool.formats`), any
other key must be a Celeris setting by its name, and anything else is a 400 naming the key.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from ..errors import UsageError
from ..params import MAX_SIZE, MAX_STOP_CHARS, MAX_TOP_LOGPROBS, check_values
from ..spool.formats import LEGACY_TOP_LOGPROBS, OPENAI_PARAMS, Request, asks_nothing, logprobs_of

MAX_PROMPTS = 2048  # prompts in one completion request (OpenAI's cap)
MAX_STOPS = 4  # stop strings in one request (OpenAI's cap)


def _utf8(text: str) -> str:
    """JSON may spell a lone surrogate (\\ud800); it is no text and cannot be encoded: a 400 naming the field."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("holds a lone surrogate (not valid Unicode text)") from None
    return text


def _stop_chars(stop: str) -> str:
    if len(stop) > MAX_STOP_CHARS:
        raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters, got {len(stop)}")
    return stop


def _stops(stop: str | list[str] | None) -> str | list[str] | None:
    many = [stop] if isinstance(stop, str) else stop or []
    if len(many) > MAX_STOPS:
        raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(many)}")
    if any(not s for s in many):
        raise ValueError("a stop string may not be empty")
    return stop


Text = Annotated[str, AfterValidator(_utf8)]
Size = Annotated[int, Field(ge=1, le=MAX_SIZE)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=MAX_SIZE)]
Stop = Annotated[str, AfterValidator(_utf8), AfterValidator(_stop_chars)]

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
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        # the message and param may quote the client's text (a key): a lone surrogate there must not make the
        # answer unencodable
        message, param = (_printable(x) for x in (self.message, self.param))
        return {"error": {"message": message, "type": self.type, "param": param, "code": self.code}}


def _printable(text: str | None) -> Any:
    return text if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class TextPart(BaseModel):
    """One part of a message's content as agent SDKs send it: `{"type": "text", "text": ...}`."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: Text


class Message(BaseModel):
    """A chat message: its content a string, text parts, or null on an assistant's message (as OpenAI's
    clients send an assistant turn that called tools). A part that is not text (`image_url`, `input_audio`,
    `file`) is refused by name: this model reads text."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: Text
    content: Text | Annotated[list[TextPart], Field(min_length=1, max_length=MAX_PROMPTS)] | None
    name: Text | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data: Any) -> Any:
        parts = data.get("content") if isinstance(data, dict) else None
        for i, part in enumerate(parts if isinstance(parts, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                shown = kind.encode("utf-8", "backslashreplace").decode()[:40]
                raise ValueError(f"content part {i} is of type {shown!r}: this model reads text; give text parts")
        return data

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> Message:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content: a {self.role} message needs content (only an assistant's may be null)")
        return self

    def text(self) -> dict[str, Any]:
        """The message as the queue takes it: text parts joined by newlines (as vLLM joins them); null
        content (an assistant's) is empty."""
        if self.content is None:
            content = ""
        else:
            content = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        out: dict[str, Any] = {"role": self.role, "content": content}
        return out | ({"name": self.name} if self.name is not None else {})


class _Body(BaseModel):
    """Keys both endpoints share. Extra keys are kept and must be Celeris settings (checked by name)."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    max_tokens: Size | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None  # Celeris's own knob of that name: >= 0, on the fast and block decoders
    stop: Annotated[Stop | list[Stop] | None, AfterValidator(_stops)] = None
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    # OpenAI keys Celeris cannot honour, accepted only at the value that asks for nothing
    n: Literal[1] = 1
    frequency_penalty: Literal[0] | None = None
    logit_bias: dict[str, Any] | None = None


class CompletionBody(_Body):
    # text, several texts (one choice each), token ids, or several lists of token ids
    prompt: (
        Text
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    echo: Literal[False] = False
    best_of: Literal[1] | None = None
    suffix: None = None
    # the legacy endpoint's log probabilities: the chosen token's and the N likeliest beside it (0 to 5)
    logprobs: Annotated[int, Field(ge=0, le=LEGACY_TOP_LOGPROBS)] | Literal[False] | None = None


class ChatBody(_Body):
    messages: Annotated[list[Message], Field(max_length=MAX_PROMPTS)]
    chat_template_kwargs: dict[str, Any] | None = None  # the template's switches, e.g. enable_thinking (vLLM's name)
    max_completion_tokens: Size | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None


# body keys handled here, not generation settings
_OWN = {"model", "prompt", "messages", "stream", "stream_options", "user", "n", "logprobs", "echo", "best_of"}
_OWN |= {"chat_template_kwargs"}  # a chat's, passed to its template
_OWN |= {
    "suffix",
    "top_logprobs",
    "frequency_penalty",
    "logit_bias",
    "metadata",
}  # metadata: ignored, as the queue does


Prompt = tuple[Request, list[int] | None]  # a request, and its prompt's token ids when given as ids


def to_requests(body: CompletionBody | ChatBody, request_id: str, max_tokens: int) -> list[Prompt]:
    """The queue's Requests for a body, one per prompt: OpenAI keys mapped to settings, other keys checked
    one by one as Celeris settings (a 400 naming the first unknown one), and the answer's length checked
    against this server's `max_tokens` before anything is sized by it."""
    given = {k: v for k, v in body.model_dump(exclude_unset=True, exclude_none=True).items() if not asks_nothing(k, v)}
    if given.get("logit_bias"):
        raise APIError(400, "logit_bias is not supported by celeris", param="logit_bias")
    if "max_tokens" in given and "max_completion_tokens" in given:
        raise APIError(400, "give one of max_tokens and max_completion_tokens", param="max_completion_tokens")
    params: dict[str, Any] = {}
    logprobs = logprobs_of(given)  # as the queue reads the same body
    if isinstance(logprobs, str):
        raise APIError(400, logprobs, param=logprobs.partition("=")[0].partition(":")[0])
    if logprobs.get("logprobs") and body.stream:
        message = "logprobs: not with stream (a streamed answer's events carry no log probabilities)"
        raise APIError(400, message, param="logprobs")
    params.update(logprobs)
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
        if name == "gen_length" and value > max_tokens:
            raise APIError(400, f"{key} {value} is over this server's limit of {max_tokens}", param=key)
        params[name] = value
    if isinstance(body, ChatBody):
        if not body.messages:
            raise APIError(400, "messages must hold at least one message", param="messages")
        messages = [m.text() for m in body.messages]
        switches = body.chat_template_kwargs
        return [(Request(request_id, 0, messages=messages, params=params, chat_template_kwargs=switches), None)]
    prompts: list[Any] = body.prompt if isinstance(body.prompt, list) and not _ids(body.prompt) else [body.prompt]
    out: list[Prompt] = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, list):  # token ids: the text they spell stands for the prompt's script
            out.append((Request(request_id, i, prompt="", params=params), list(prompt)))
        elif not prompt.strip():
            raise APIError(400, "prompt is empty", param="prompt" if len(prompts) == 1 else f"prompt.{i}")
        else:
            out.append((Request(request_id, i, prompt=prompt, params=params), None))
    return out


def _ids(prompt: list[Any]) -> bool:
    """Whether a list prompt is one prompt of token ids (not several prompts)."""
    return bool(prompt) and isinstance(prompt[0], int)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass(frozen=True)
class Choice:
    """One answer as a response reports it: its text and finish reason, its tokens' log probabilities where
    the request asked for them (`engine.Result.logprobs` entries), and why a constrained answer ended
    unfinished (`error`, beside finish_reason "length")."""

    text: str
    finish_reason: str
    logprobs: list[dict[str, Any]] | None = None
    error: str | None = None


def _spelled(entry: dict[str, Any]) -> str:
    """A token as the legacy shape names it: its text, or `bytes:\\xe6\\x97` for bytes that are not whole
    characters (one of several tokens that spell one character), as OpenAI's API writes them."""
    raw = bytes(entry["bytes"])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def legacy_logprobs(entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """The completions endpoint's shape of a choice's log probabilities: `tokens`, `token_logprobs`,
    `top_logprobs` (one {token: logprob} per position) and `text_offset` (where each token starts in the
    text, in characters: a token that ends inside a character starts where that character does)."""
    if entries is None:
        return None
    offsets, spelled = [], b""
    for e in entries:
        offsets.append(len(spelled.decode("utf-8", "ignore")))
        spelled += bytes(e["bytes"])
    return {
        "tokens": [_spelled(e) for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{_spelled(t): t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }


def _extra(choice: Choice) -> dict[str, Any]:
    return {} if choice.error is None else {"error": choice.error}


def completion(
    id: str, model: str, choices: Sequence[Choice], use: dict[str, int], created: int | None = None
) -> dict[str, Any]:
    """A text completion: one choice per prompt, in order."""
    return {
        "id": id,
        "object": "text_completion",
        "created": created if created is not None else int(time.time()),
        "model": model,
        "choices": [
            {
                "index": i,
                "text": c.text,
                "finish_reason": c.finish_reason,
                "logprobs": legacy_logprobs(c.logprobs),
                **_extra(c),
            }
            for i, c in enumerate(choices)
        ],
        "usage": use,
    }


def chat_completion(
    id: str, model: str, choice: Choice, use: dict[str, int], created: int | None = None
) -> dict[str, Any]:
    return {
        "id": id,
        "object": "chat.completion",
        "created": created if created is not None else int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": choice.text},
                "finish_reason": choice.finish_reason,
                "logprobs": None if choice.logprobs is None else {"content": choice.logprobs},
                **_extra(choice),
            }
        ],
        "usage": use,
    }


def chunk(
    chat: bool,
    id: str,
    model: str,
    created: int,
    text: str | None,
    finish_reason: str | None,
    error: str | None = None,
) -> dict[str, Any]:
    """One streamed event: a piece of text (None: the first chat event, with the role) or the last one (with
    the error of a constrained answer that ended unfinished, as a whole answer's choice has it)."""
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
    if error is not None:
        choice["error"] = error
    return {"id": id, "object": kind, "created": created, "model": model, "choices": [choice]}
