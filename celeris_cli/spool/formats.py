"""Input formats: bytes of one prompt file -> requests, and a failure for every line that is not one.

- `.txt`: one prompt per line; ids are `line-N`.
- `.jsonl`: `{"id" | "custom_id", "prompt" | "messages", ...generation params}` per line, or the
  OpenAI / vLLM batch format `{"custom_id", "method", "url", "body": {"messages" | "prompt", ...}}`.

UTF-8 with or without a BOM, LF or CRLF. One bad line never sinks the file. A file that cannot be
read at all (binary, not UTF-8 anywhere, empty, an unknown extension) is a `FileRejected`.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from typing import Any

SUPPORTED = (".txt", ".jsonl")
# OpenAI body keys and the generation parameter each maps to (None: accepted and ignored)
OPENAI_PARAMS = {
    "model": None,
    "user": None,
    "metadata": None,
    "max_tokens": "gen_length",
    "max_completion_tokens": "gen_length",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "stop": "stop",
    "seed": "seed",
}
# OpenAI body keys Celeris cannot honour, and the one value of each that asks for nothing
UNSUPPORTED = {"n": 1, "stream": False, "best_of": 1}
LEGACY_TOP_LOGPROBS = 5  # the completions endpoint's integer `logprobs`: at most 5, as OpenAI's
SAFE_ID = re.compile(r"^[^\x00-\x1f/\\]{1,256}$")


@dataclass(frozen=True)
class Request:
    custom_id: str
    line: int
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    params: dict[str, Any] = field(default_factory=dict)
    attempt: int = 1
    origin: dict[str, Any] | None = None  # for retried requests: where the first attempt came from
    chat_template_kwargs: dict[str, Any] | None = None  # the chat template's switches (with messages only)

    def body(self) -> dict[str, Any]:
        """The request as a self-contained simple-JSONL object (what `retry` resubmits)."""
        out: dict[str, Any] = {"custom_id": self.custom_id}
        if self.messages is not None:
            out["messages"] = self.messages
        else:
            out["prompt"] = self.prompt
        if self.chat_template_kwargs is not None:
            out["chat_template_kwargs"] = self.chat_template_kwargs
        out.update(self.params)
        return out


def result_line(source: str, request: Request, body: dict[str, Any]) -> dict[str, Any]:
    """One results-file line, in the OpenAI batch output shape, matched by custom_id."""
    return {
        "id": f"{source}:{request.line}",
        "custom_id": request.custom_id,
        "response": {"status_code": 200, "body": body},
        "error": None,
    }


@dataclass(frozen=True)
class LineError:
    line: int
    code: str
    message: str
    request: dict[str, Any] | str | None
    custom_id: str | None = None
    retryable: bool = False
    attempt: int = 1


class FileRejected(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def parse_file(name: str, data: bytes, max_line_bytes: int) -> tuple[list[Request], list[LineError]]:
    suffix = name[name.rfind(".") :].lower() if "." in name else ""
    if suffix not in SUPPORTED:
        raise FileRejected("unsupported_format", f"unsupported file type {suffix or '(none)'!r}; use .txt or .jsonl")
    if not data.strip(b"\xef\xbb\xbf \t\r\n"):
        raise FileRejected("empty_file", "the file is empty")
    if b"\x00" in data[:8192]:
        raise FileRejected("binary_file", "the file is binary (NUL bytes), not UTF-8 text")
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    requests: list[Request] = []
    errors: list[LineError] = []
    seen: set[str] = set()
    decoded_any = False
    for number, raw in enumerate(data.split(b"\n"), start=1):
        raw = raw.rstrip(b"\r")
        if not raw.strip():
            continue
        if len(raw) > max_line_bytes:
            errors.append(
                LineError(
                    number,
                    "line_too_long",
                    f"line is {len(raw)} bytes; the limit is {max_line_bytes}",
                    raw[:200].decode("utf-8", "replace") + "...",
                )
            )
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            errors.append(
                LineError(
                    number,
                    "invalid_utf8",
                    f"line is not valid UTF-8 ({e.reason} at byte {e.start})",
                    raw[:200].decode("utf-8", "replace"),
                )
            )
            continue
        decoded_any = True
        result = _parse_txt(number, text) if suffix == ".txt" else _parse_jsonl(number, text)
        if isinstance(result, LineError):
            errors.append(result)
        elif result.custom_id in seen:
            errors.append(
                LineError(
                    number,
                    "duplicate_id",
                    f"id {result.custom_id!r} appears earlier in this file; ids must be unique per file",
                    result.body(),
                    result.custom_id,
                )
            )
        else:
            seen.add(result.custom_id)
            requests.append(result)
    if not decoded_any and errors and all(e.code == "invalid_utf8" for e in errors):
        raise FileRejected("invalid_utf8", "no line of the file is valid UTF-8")
    return requests, errors


def asks_nothing(key: str, value: Any) -> bool:
    """Whether a request key holds the value that asks for nothing, as OpenAI's clients send by default
    (`logprobs: false`, `top_logprobs: 0`, `response_format: {"type": "text"}`): left out of the settings, so a
    strategy without log probabilities or constraints takes the request as it takes one without the key."""
    if key == "logprobs":
        return value is False
    if key == "top_logprobs":
        return value is None or (value == 0 and not isinstance(value, bool))
    if key == "response_format":
        return value == {"type": "text"}
    return False


def logprobs_of(body: dict[str, Any]) -> dict[str, Any] | str:
    """The settings an OpenAI body's `logprobs` and `top_logprobs` ask for, the same for the queue's lines
    and `serve`: chat's `logprobs: true` with `top_logprobs` (0 to 20), or the completions endpoint's integer
    `logprobs` (the alternatives to list, 0 to 5) alone; values that ask for nothing give nothing (`asks_nothing`).
    A message naming the key for anything else."""
    value, top = body.get("logprobs"), body.get("top_logprobs")
    wrong = f"logprobs={value!r}: give true/false (chat) or an integer from 0 to {LEGACY_TOP_LOGPROBS} (completions)"
    top = None if asks_nothing("top_logprobs", top) else top
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value <= LEGACY_TOP_LOGPROBS:
            return wrong
        if top is not None:
            return "top_logprobs: give it with logprobs: true, or an integer logprobs alone, not both"
        return {"logprobs": True, "top_logprobs": value}
    if value not in (None, True, False):
        return wrong
    if top is not None and value is not True:
        return "top_logprobs: needs logprobs: true"
    return ({"logprobs": True} if value else {}) | ({"top_logprobs": top} if top is not None else {})


def _parse_txt(number: int, text: str) -> Request | LineError:
    prompt = text.strip()
    return Request(custom_id=f"line-{number}", line=number, prompt=prompt)


def _parse_jsonl(number: int, text: str) -> Request | LineError:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return LineError(number, "invalid_json", f"not valid JSON: {e.msg} at column {e.colno}", text[:500])
    except RecursionError:
        return LineError(number, "invalid_json", "the line's JSON is nested too deeply", text[:500])
    except ValueError:  # Python's limit on the digits of an integer (4300)
        message = f"the line holds a number of more than {sys.get_int_max_str_digits()} digits"
        return LineError(number, "invalid_json", message, text[:500])
    if not isinstance(obj, dict):
        return LineError(number, "invalid_json", "each line must be a JSON object", text[:500])
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        # a JSON escape such as \ud800 decodes to a lone surrogate: no tokenizer or writer can take it
        return LineError(
            number, "invalid_utf8", "a \\u escape makes a lone UTF-16 surrogate, which is not valid text", text[:500]
        )
    raw_id = obj.get("custom_id", obj.get("id", f"line-{number}"))
    if not isinstance(raw_id, (str, int)) or isinstance(raw_id, bool):
        return LineError(number, "invalid_id", f"id must be a string, got {raw_id!r}", obj)
    custom_id = str(raw_id)
    if not SAFE_ID.match(custom_id) or custom_id in (".", "..") or custom_id.startswith("../"):
        return LineError(
            number,
            "invalid_id",
            f"id must be 1-256 characters without '/', '\\', NUL or control characters; got {custom_id[:80]!r}",
            obj,
            None,
        )
    meta = obj.get("_celeris", {})
    attempt = meta.get("attempt", 1) if isinstance(meta, dict) else 1
    origin = meta.get("origin") if isinstance(meta, dict) else None
    if "body" in obj or "method" in obj or "url" in obj:
        body = obj.get("body")
        if not isinstance(body, dict):
            return LineError(number, "missing_prompt", "OpenAI batch line without a body object", obj, custom_id)
        params: dict[str, Any] = {}
        for key, value in body.items():
            if key in ("messages", "prompt"):
                continue
            if key in UNSUPPORTED:
                neutral = UNSUPPORTED[key]
                if value is not None and (type(value) is not type(neutral) or value != neutral):
                    return LineError(
                        number, "bad_param", f"{key}={value!r} is not supported by celeris", obj, custom_id
                    )
                continue
            if asks_nothing(key, value) or key in ("logprobs", "top_logprobs"):  # the latter two: below
                continue
            if key in OPENAI_PARAMS:
                if OPENAI_PARAMS[key] and value is not None:  # OpenAI's null means "the default"
                    params[OPENAI_PARAMS[key]] = value  # type: ignore[index]
            else:
                params[key] = value  # generation params of our own, validated by the engine
        logprobs = logprobs_of(body)
        if isinstance(logprobs, str):
            return LineError(number, "bad_param", logprobs, obj, custom_id)
        params.update(logprobs)
        content = body
    else:
        own = ("id", "custom_id", "prompt", "messages", "_celeris")
        params = {k: v for k, v in obj.items() if k not in own and not asks_nothing(k, v)}
        content = obj
    prompt, messages = content.get("prompt"), content.get("messages")
    switches = params.pop("chat_template_kwargs", None)
    if switches is not None and (not isinstance(switches, dict) or messages is None):
        why = "a JSON object" if not isinstance(switches, dict) else "given with messages (a chat), not a prompt"
        return LineError(number, "bad_param", f"chat_template_kwargs must be {why}", obj, custom_id)
    if messages is not None:
        texts = _message_texts(messages)
        if isinstance(texts, tuple):  # (code, message)
            return LineError(number, *texts, obj, custom_id)
        return Request(custom_id, number, messages=texts, params=params, attempt=attempt, origin=origin,
                       chat_template_kwargs=switches)  # fmt: skip
    if not isinstance(prompt, str) or not prompt.strip():
        return LineError(
            number, "missing_prompt", 'no prompt: give a non-empty string "prompt" or "messages"', obj, custom_id
        )
    return Request(custom_id, number, prompt=prompt, params=params, attempt=attempt, origin=origin)


def _message_texts(messages: Any) -> list[dict[str, Any]] | tuple[str, str]:
    """Chat messages with their content as text, as `serve` reads them: a string, text parts joined by
    newlines, or an assistant's null content as empty. A part that is not text is refused by name."""
    shape = "messages must be a non-empty list of {role, content} objects"
    if not isinstance(messages, list) or not messages:
        return "missing_prompt", shape
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return "missing_prompt", shape
        content = m.get("content")
        if isinstance(content, list):
            kinds = [p.get("type") if isinstance(p, dict) else None for p in content]
            other = next((k for k in kinds if k != "text"), "text")
            if other != "text":
                message = f"messages[{i}]: a content part of type {str(other)[:40]!r}: this model reads text"
                return "bad_param", message
            if not content or not all(isinstance(p.get("text"), str) for p in content):
                return "missing_prompt", f"messages[{i}]: text parts need a string `text`"
            content = "\n".join(p["text"] for p in content)
        elif content is None and m["role"] == "assistant":
            content = ""
        if not isinstance(content, str):
            return "missing_prompt", shape
        out.append({**m, "content": content})
    return out
