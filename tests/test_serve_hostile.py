"""`celeris serve` against a hostile client, through real HTTP on loopback: sizes bounded before any work,
the event loop free while a huge request is validated, browsers' cross-site and rebinding requests refused,
malformed values answered with a 400 naming the field (never a traceback), a keep-alive connection that
survives every error, and the prompt shapes the OpenAI clients send (lists of prompts, token ids, content
parts). One server for the module, keyless on loopback as a user starts it: the embedded block model in
float32."""

from __future__ import annotations

import http.client
import json
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from .serve_helpers import Server

MODEL = "celeris-block"
BASE = ("--model", MODEL, "--device", "cpu", "--dtype", "float32")
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("hostile")
    limits = ("--max-body-bytes", "2000000", "--max-tokens", "64", "--threads", "2")
    s = Server(*BASE, *limits, log=root / "serve.log").start()
    yield s
    s.stop()
    assert "Traceback" not in (root / "serve.log").read_text(encoding="utf-8")  # every error was answered


def call(
    server: Server, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], Any]:
    """(status, headers, JSON body) of one request on a fresh connection, headers exactly as given."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        data = r.read()
        kind = r.getheader("content-type") or ""
        return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(data) if "json" in kind else data
    finally:
        conn.close()


def post(server: Server, body: Any, path: str = "/v1/completions", **headers: str) -> tuple[int, Any]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, _, out = call(server, "POST", path, raw, {**JSON, **headers})
    return status, out


def rss_kib(server: Server) -> int:
    assert server.proc is not None
    status = Path(f"/proc/{server.proc.pid}/status").read_text(encoding="utf-8")
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))


# -- sizes: bounded before anything is sized by them ----------------------------------------------------
def test_a_max_tokens_of_a_billion_is_a_400_naming_it_and_the_server_does_not_grow(server: Server) -> None:
    before = rss_kib(server)
    for key, value in (("max_tokens", 10**9), ("max_tokens", 10**7), ("gen_length", 10**9)):
        status, body = post(server, {"prompt": "x", key: value})
        assert status == 400 and body["error"]["param"] == key, body
    status, body = post(server, {"prompt": "x", "max_tokens": 65})  # under the ceiling, over --max-tokens
    assert status == 400 and "64" in body["error"]["message"]
    status, body = post(server, {"prompt": "x", "max_tokens": 8, "block_length": 10**9})
    assert status == 400 and body["error"]["param"] == "block_length"
    assert rss_kib(server) < before + 100_000  # no list per block of a billion tokens


def test_health_answers_within_half_a_second_while_a_huge_prompt_is_validated(server: Server) -> None:
    big = json.dumps({"prompt": "床前明月光，疑是地上霜。" * 25_000, "max_tokens": 8}, ensure_ascii=False).encode()
    out: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: out.update(r=post(server, big)))
    worker.start()
    probes = 0
    while worker.is_alive():
        with urllib.request.urlopen(server.url + "/health", timeout=0.5) as r:  # raises if the loop stalls
            assert json.loads(r.read())["status"] == "ok"
        probes += worker.is_alive()  # this probe was answered while the big request was still in progress
    worker.join()
    status, body = out["r"]
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert probes >= 1


# -- a browser page must not reach the server ---------------------------------------------------------
def test_json_only_with_its_content_type(server: Server) -> None:
    body = json.dumps({"prompt": "x", "max_tokens": 4}).encode()
    for kind in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Content-Type": kind} if kind else {}
        status, _, out = call(server, "POST", "/v1/completions", body, headers)
        assert status == 415 and out["error"]["code"] == "unsupported_media", kind
    assert call(server, "POST", "/v1/completions", body, {"Content-Type": "application/json; charset=utf-8"})[0] == 200


def test_a_foreign_host_or_a_cross_site_origin_is_refused(server: Server) -> None:
    body = json.dumps({"prompt": "x", "max_tokens": 4}).encode()
    status, _, out = call(server, "POST", "/v1/completions", body, {**JSON, "Host": "rebind.evil.example"})
    assert status == 421 and out["error"]["code"] == "misdirected_request"
    assert call(server, "GET", "/v1/models", headers={"Host": "rebind.evil.example:8000"})[0] == 421
    for origin in ("https://evil.example", "null", "http://127.0.0.1.evil.example"):
        status, _, out = call(server, "POST", "/v1/completions", body, {**JSON, "Origin": origin})
        assert status == 403 and out["error"]["code"] == "cross_origin", origin
    upload = b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--b--\r\n'
    multipart = {"Content-Type": "multipart/form-data; boundary=b", "Origin": "https://evil.example"}
    assert call(server, "POST", "/v1/files", upload, multipart)[0] == 403
    for host in (f"localhost:{server.port}", f"[::1]:{server.port}", "127.0.0.1"):
        headers = {**JSON, "Host": host, "Origin": f"http://{host}"}
        assert call(server, "POST", "/v1/completions", body, headers)[0] == 200, host


# -- malformed values: a 400 naming the field, never a traceback -----------------------------------------
def test_malformed_values_are_400s_naming_the_field(server: Server) -> None:
    seed = b'{"prompt": "x", "max_tokens": 4, "seed": ' + b"7" * 5000 + b"}"
    assert post(server, seed)[1]["error"]["param"] == "seed"
    status, body = post(server, b'{"prompt": ' + b"[" * 200_000 + b"]" * 200_000 + b"}")
    assert status == 400 and "nested" in body["error"]["message"]
    status, body = post(server, b'{"prompt": "a\\ud800b", "max_tokens": 4}')
    assert status == 400 and body["error"]["param"] == "prompt"
    chat = b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 4}'
    status, body = post(server, chat, "/v1/chat/completions")
    assert status == 400 and body["error"]["param"] == "messages.0.content"
    status, body = post(server, b'{"prompt": "x", "max_tokens": 4, "\\ud800": 1}')  # the key itself
    assert status == 400 and "a key of the body" in body["error"]["message"]
    for stop, why in (("", "empty"), (["a", "b", "c", "d", "e"], "at most 4")):
        status, body = post(server, {"prompt": "x", "max_tokens": 4, "stop": stop})
        assert status == 400 and body["error"]["param"] == "stop" and why in body["error"]["message"], body


def test_a_keep_alive_connection_answers_after_every_error(server: Server) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.auto_open = 0  # a connection the server closed raises instead of quietly reconnecting
    conn.connect()
    bodies = [
        b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}",
        b'{"prompt": ' + b"[" * 200_000 + b"}",
        b'{"prompt": "\\ud800"}',
        b"not json",
        json.dumps({"prompt": "x", "max_tokens": 10**9}).encode(),
        json.dumps({"prompt": "The quick", "max_tokens": 4}).encode(),
    ]
    statuses = []
    for body in bodies:
        conn.request("POST", "/v1/completions", body=body, headers=JSON)
        r = conn.getresponse()
        r.read()
        statuses.append(r.status)
    conn.close()
    assert statuses == [400, 400, 400, 400, 400, 200]


# -- the prompt shapes OpenAI's clients send ------------------------------------------------------------
def test_a_list_of_prompts_gives_one_choice_each_as_alone(server: Server) -> None:
    client = server.client()
    prompts = ["The quick", "床前明月光，"]
    many = client.completions.create(model=MODEL, prompt=prompts, max_tokens=16, seed=4)
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=16, seed=4) for p in prompts]
    assert [c.index for c in many.choices] == [0, 1]
    assert [c.text for c in many.choices] == [a.choices[0].text for a in alone]
    assert many.usage is not None and many.usage.completion_tokens == sum(
        a.usage.completion_tokens for a in alone if a.usage is not None
    )


def test_token_id_prompts_answer_as_their_text(server: Server) -> None:
    from celeris_cli.arch.folder import ModelFolder
    from celeris_cli.engine import model_dir

    tokenizer = ModelFolder.open(model_dir(MODEL)).tokenizer()
    ids = [tokenizer.encode_prompt(p) for p in ("The quick", "白日依山尽，")]
    client = server.client()
    text = client.completions.create(model=MODEL, prompt="The quick", max_tokens=16, seed=2).choices[0].text
    assert client.completions.create(model=MODEL, prompt=ids[0], max_tokens=16, seed=2).choices[0].text == text
    both = client.completions.create(model=MODEL, prompt=ids, max_tokens=16, seed=2)
    assert len(both.choices) == 2 and both.choices[0].text == text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[10**6], max_tokens=4)
    assert "vocabulary" in e.value.message


def test_chat_content_as_text_parts_answers_as_the_string(server: Server) -> None:
    client = server.client()
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "To be, or not"}], max_tokens=16, seed=1
    )
    parts = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "To be, or not"}]}],
        max_tokens=16, seed=1,
    )  # fmt: skip
    assert parts.choices[0].message.content == plain.choices[0].message.content


# -- the smaller ones -----------------------------------------------------------------------------------
def test_models_created_is_fixed_and_metrics_count_every_route(server: Server) -> None:
    from celeris_cli.engine import model_dir

    made = int((model_dir(MODEL) / "config.json").stat().st_mtime)  # not the time of the request
    assert server.get("/v1/models")["data"][0]["created"] == made == server.get(f"/v1/models/{MODEL}")["created"]
    call(server, "GET", "/v1/nowhere")
    call(server, "POST", "/v1/completions", b"x", {"Content-Type": "text/plain"})
    metrics = server.get("/metrics")
    assert 'celeris_serve_requests_total{route="other",status="404"}' in metrics
    assert 'celeris_serve_requests_total{route="other",status="415"}' in metrics
    assert 'celeris_serve_requests_total{route="/v1/models",status="200"}' in metrics
    assert server.get("/health")["threads"] == 2  # --threads


class _Broken:
    """A runner whose every request fails inside the route: an error no route turns into an answer."""

    depth = 0

    def prepare(self, *args: Any) -> Any:
        raise RuntimeError("simulated bug")

    def close(self) -> None:
        pass


def test_an_unexpected_error_is_a_500_that_closes_the_connection_and_the_next_request_is_answered() -> None:
    import uvicorn

    from celeris_cli.serve.app import create_app
    from celeris_cli.serve.settings import Keys, Limits
    from celeris_cli.serve.state import ServeState

    from .serve_helpers import free_port, wait_for

    state = ServeState(_Broken(), "broken", Limits(), Keys())  # type: ignore[arg-type]
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, timeout=30)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)  # one client, reconnecting as told
        conn.request("POST", "/v1/completions", body=b'{"prompt": "x"}', headers=JSON)
        r = conn.getresponse()
        body = json.loads(r.read())
        assert (
            r.status == 500 and body["error"]["type"] == "server_error" and "simulated" not in body["error"]["message"]
        )
        assert r.getheader("connection") == "close"
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        conn.close()
        assert 'route="/v1/completions",status="500"' in state.metrics.text().decode()
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_an_assistant_turn_with_null_content_is_accepted_as_an_empty_one(server: Server) -> None:
    """OpenAI's clients send `content: null` for an assistant turn that called tools."""
    client = server.client()

    def ask(content: str | None) -> str | None:
        messages: Any = [
            {"role": "user", "content": "Shall I compare"},
            {"role": "assistant", "content": content},
            {"role": "user", "content": "To be, or not"},
        ]
        return (
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, seed=3)
            .choices[0]
            .message.content
        )

    assert ask(None) == ask("")
    status, body = post(server, {"messages": [{"role": "user", "content": None}]}, "/v1/chat/completions")
    assert status == 400 and "needs content" in body["error"]["message"]  # only an assistant's may be null


def test_an_image_part_is_refused_by_name(server: Server) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    content = [{"type": "text", "text": "What is this?"}, image]
    status, body = post(server, {"messages": [{"role": "user", "content": content}]}, "/v1/chat/completions")
    assert status == 400 and "'image_url'" in body["error"]["message"] and "reads text" in body["error"]["message"]


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"prompt": "x", "logprobs": 10}, "logprobs", "less than or equal to 5"),
        ({"prompt": "x", "stop": "a" * 1001}, "stop", "at most 1000 characters, got 1001"),
        ({"prompt": "x", "stop": ["a", "b" * 1001]}, "stop.1", "at most 1000 characters, got 1001"),
        ({"prompt": [5, 4, 6]}, "prompt", "mask token"),  # celeris-block's mask id is 4
        ({"prompt": [5, 9280]}, "prompt", "past this model's vocabulary (ids 0 to 9279)"),
    ],
)
def test_errors_name_the_field_and_the_limit_in_the_users_terms(
    server: Server, body: dict[str, Any], param: str, words: str
) -> None:
    status, out = post(server, {**body, "max_tokens": 4})
    error = out["error"]
    assert status == 400 and error["param"] == param and words in error["message"], error
    assert not any(w in error["message"] + str(error["param"]) for w in ("constrained-", "items", "function-after"))
