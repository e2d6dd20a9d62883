"""`celeris serve` with the real `openai` client against a real server subprocess: completions, chat,
streaming, the key, the limits, and 32 concurrent clients. One server for the module (the embedded
block model in float32, where an answer does not depend on its batch mates)."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from .serve_helpers import Server, celeris

KEY = "sk-test-0123456789"
MODEL = "celeris-block"
BASE = ("--model", MODEL, "--device", "cpu", "--dtype", "float32")  # one thread: serve_helpers.ENV


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("serve")
    key_file = root / "keys"
    key_file.write_text(f"{KEY}\n", encoding="utf-8")
    limits = ("--max-body-bytes", "20000", "--max-tokens", "64", "--batch-size", "16")
    s = Server(*BASE, "--api-key-file", str(key_file), *limits, key=KEY, log=root / "serve.log").start()
    yield s
    s.stop()
    assert KEY not in (root / "serve.log").read_text(encoding="utf-8")  # the key is never logged


def test_a_completion_is_the_answer_celeris_generate_gives(server: Server) -> None:
    r = server.client().completions.create(model=MODEL, prompt="The quick", max_tokens=16, seed=7)
    cli = celeris("generate", *BASE, "--prompt", "The quick", "--gen-length", "16", "--seed", "7", "-q")
    assert cli.returncode == 0, cli.stderr
    assert r.choices[0].text == cli.stdout.rstrip("\n")
    assert r.object == "text_completion" and r.model == MODEL
    u = r.usage
    assert u is not None and u.completion_tokens <= 16 and u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_a_chat_completion_answers_its_conversation(server: Server) -> None:
    """The embedded models have no chat template: the conversation's text is the prompt, as in the queue."""
    client = server.client()
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "床前明月光，"}], max_tokens=24, seed=3
    )
    plain = client.completions.create(model=MODEL, prompt="床前明月光，", max_tokens=24, seed=3)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == plain.choices[0].text != ""
    assert chat.usage is not None and chat.usage.prompt_tokens == plain.usage.prompt_tokens  # type: ignore[union-attr]


def test_a_streamed_chat_sends_an_event_per_block_that_add_up_to_the_answer(server: Server) -> None:
    client = server.client()
    messages = [{"role": "user", "content": "To be, or not to be"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, seed=5)  # type: ignore[arg-type]
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, seed=5, stream=True)  # type: ignore[arg-type]
    )
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == whole.choices[0].message.content
    assert len(pieces) > 2  # block by block (the Latin preset's blocks are 4 tokens), not the answer at once
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_a_streamed_completion_ends_with_its_usage_and_done(server: Server) -> None:
    body = {"model": MODEL, "prompt": "白日依山尽，", "max_tokens": 16, "seed": 1, "stream": True}
    body["stream_options"] = {"include_usage": True}
    raw = _raw_stream(server, body)
    events = [line[len("data: ") :] for line in raw.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] > 0
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2])
    plain = server.client().completions.create(model=MODEL, prompt="白日依山尽，", max_tokens=16, seed=1)
    assert text == plain.choices[0].text


def test_a_streamed_answer_with_a_stop_string_adds_up_to_the_whole_answer(server: Server) -> None:
    client = server.client()
    kw = {"model": MODEL, "prompt": "床前明月光，", "max_tokens": 48, "seed": 9, "stop": ["。"]}
    whole = client.completions.create(**kw)  # type: ignore[call-overload]
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)  # type: ignore[call-overload]
    assert streamed == whole.choices[0].text and "。" not in streamed
    free = client.completions.create(**{**kw, "stop": None})  # type: ignore[call-overload]
    assert free.choices[0].text.startswith(streamed + "。")  # the stop string did cut this answer


def test_a_celeris_setting_by_its_own_name_is_honoured(server: Server) -> None:
    client = server.client()
    base = client.completions.create(model=MODEL, prompt="The quick", max_tokens=16, seed=2)
    greedy = client.completions.create(
        model=MODEL, prompt="The quick", max_tokens=16, seed=2, extra_body={"block_steps": 1}
    )
    assert greedy.choices[0].text != base.choices[0].text


def test_an_unknown_key_is_a_400_naming_it(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model=MODEL, prompt="x", extra_body={"frobnicate": 1})
    assert e.value.status_code == 400
    assert "frobnicate" in e.value.message and e.value.body["param"] == "frobnicate"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:  # an OpenAI key Celeris cannot honour
        server.client().completions.create(model=MODEL, prompt="x", n=2)
    assert e.value.body["param"] == "n"  # type: ignore[index]


def test_no_key_or_a_wrong_key_is_401(server: Server) -> None:
    with pytest.raises(openai.AuthenticationError):
        server.client(key="sk-wrong").completions.create(model=MODEL, prompt="x", max_tokens=4)
    status, body = server.post("/v1/completions", b'{"prompt": "x"}')
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert server.get("/health")["status"] == "ok"  # open, for load balancers


def test_an_oversized_body_is_413(server: Server) -> None:
    with pytest.raises(openai.APIStatusError) as e:
        server.client().completions.create(model=MODEL, prompt="word " * 5000, max_tokens=4)
    assert e.value.status_code == 413 and "20000 bytes" in e.value.message


def test_limits_on_max_tokens_and_the_context_are_400s(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model=MODEL, prompt="x", max_tokens=65)
    assert e.value.body["param"] == "max_tokens" and "64" in e.value.message  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model=MODEL, prompt="word " * 600, max_tokens=8)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="gpt-4", prompt="x", max_tokens=4)


def test_32_concurrent_clients_are_all_answered_together_and_as_alone(server: Server) -> None:
    prompts = [f"{w} {i}" for i, w in enumerate(["The quick", "床前明月光", "Shall I", "春眠不觉晓"] * 8)]
    answers: dict[int, str] = {}
    errors: list[BaseException] = []
    go = threading.Barrier(32)

    def ask(i: int) -> None:
        try:
            go.wait()
            r = server.client().completions.create(model=MODEL, prompt=prompts[i], max_tokens=8, seed=i)
            answers[i] = r.choices[0].text
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(answers) == 32
    rows = _histogram(server.get("/metrics", key=KEY), "celeris_serve_batch_rows")
    assert rows["count"] > rows["le_1"]  # some engine batches held several requests
    for i in (0, 13, 31):  # rule 2: the same answer alone as among 31 others
        alone = server.client().completions.create(model=MODEL, prompt=prompts[i], max_tokens=8, seed=i)
        assert alone.choices[0].text == answers[i]


def test_models_and_metrics(server: Server) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    text = server.get("/metrics", key=KEY)
    assert "celeris_serve_output_tokens_total" in text and 'route="/v1/completions"' in text


def test_a_host_beyond_loopback_without_a_key_refuses_to_start(tmp_path: Path) -> None:
    r = celeris("serve", "--host", "0.0.0.0", "--port", "1")
    assert r.returncode == 2
    assert r.stderr.startswith("Error: --host 0.0.0.0") and "--api-key-file" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def _raw_stream(server: Server, body: dict) -> str:
    import urllib.request

    req = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(), method="POST")
    req.add_header("Authorization", f"Bearer {KEY}")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        return str(r.read().decode())


def _histogram(text: str, name: str) -> dict[str, float]:
    count = re.search(rf"^{name}_count (\S+)$", text, re.M)
    le_1 = re.search(rf'^{name}_bucket{{le="1.0"}} (\S+)$', text, re.M)
    assert count and le_1, text
    return {"count": float(count.group(1)), "le_1": float(le_1.group(1))}
