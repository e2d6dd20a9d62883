"""Lines of a queue file the way OpenAI's clients write them: chat content as text parts or an assistant's
null content read as `serve` reads them, a part that is not text refused by name, and a number past
Python's 4300-digit limit that line's own `invalid_json`, never the file's or the daemon's end."""

from __future__ import annotations

import json
from typing import Any

from celeris_cli.spool.formats import parse_file


def parse(*lines: Any) -> tuple[dict[str, Any], dict[str, tuple[str, str]]]:
    data = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()
    requests, errors = parse_file("f.jsonl", data, 10**7)
    return {r.custom_id: r.messages for r in requests}, {
        str(e.custom_id or e.line): (e.code, e.message) for e in errors
    }


def chat(custom_id: str, *messages: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "url": "/v1/chat/completions", "body": {"messages": list(messages)}}


def test_chat_content_is_read_as_serve_reads_it() -> None:
    ok, errors = parse(
        chat("null", {"role": "user", "content": "hi"}, {"role": "assistant", "content": None}),
        chat("parts", {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}),
        chat("user-null", {"role": "user", "content": None}),
    )
    assert ok["null"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]
    assert ok["parts"] == [{"role": "user", "content": "a\nb"}]
    assert errors["user-null"][0] == "missing_prompt"  # only an assistant's content may be null


def test_a_part_that_is_not_text_is_refused_by_name() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    _, errors = parse(chat("img", {"role": "user", "content": [{"type": "text", "text": "see"}, image]}))
    code, message = errors["img"]
    assert code == "bad_param" and "'image_url'" in message and "reads text" in message


def test_a_5000_digit_number_is_its_lines_error_and_the_rest_are_read() -> None:
    huge = '{"custom_id": "huge", "prompt": "x", "gen_length": ' + "9" * 5000 + "}"
    ok, errors = parse({"custom_id": "a", "prompt": "x"}, huge, {"custom_id": "b", "prompt": "y"})
    assert set(ok) == {"a", "b"}
    assert errors["2"][0] == "invalid_json" and "4300 digits" in errors["2"][1]
