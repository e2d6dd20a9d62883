"""A chat template's own switches (`chat_template_kwargs`, such as `enable_thinking`) through `celeris generate
--chat`, `celeris batch` lines and serve's chat completions. SDAR's released chat template (tests/data/sdar/
sdar_tiny) reads `enable_thinking`: false opens the answer with an empty thinking block. The expected text is read
off the template by hand; the tiny DiffusionGemma folder's template reads no switch, so it refuses one by name."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from typer.testing import CliRunner

from celeris_cli import load_engine
from celeris_cli.cli import app
from celeris_cli.errors import UsageError

from .serve_helpers import Server

DATA = Path(__file__).parent / "data"
SDAR = DATA / "sdar" / "sdar_tiny"
GEMMA = DATA / "diffusion_gemma" / "diffusion_gemma_tiny"
HI = [{"role": "user", "content": "hi"}]
OFF = {"enable_thinking": False}


def test_enable_thinking_false_adds_the_empty_thinking_block_and_true_or_unset_do_not() -> None:
    tok = load_engine(SDAR, device="cpu", dtype="float32").tokenizer
    plain = tok.render_chat(HI)
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.render_chat(HI, OFF) == plain + "<think>\n\n</think>\n\n"
    assert tok.render_chat(HI, {"enable_thinking": True}) == plain


def test_a_switch_the_template_does_not_read_or_one_celeris_sets_is_refused_by_name() -> None:
    tok = load_engine(SDAR, device="cpu", dtype="float32").tokenizer
    with pytest.raises(UsageError, match="does not read 'enable_thoughts' \\(it reads: .*enable_thinking"):
        tok.render_chat(HI, {"enable_thoughts": False})
    with pytest.raises(UsageError, match="add_generation_prompt is set by Celeris"):
        tok.render_chat(HI, {"add_generation_prompt": False})
    gemma = load_engine(GEMMA, device="cpu", dtype="float32").tokenizer
    with pytest.raises(UsageError, match="does not read 'enable_thinking'"):
        gemma.render_chat(HI, OFF)


def _generate(*extra: str) -> tuple[int, str]:
    args = ["generate", "--model", str(SDAR), "--prompt", "hi", "--gen-length", "4", "--json", "--quiet", *extra]
    run = CliRunner().invoke(app, args)
    return run.exit_code, run.stdout if run.exit_code == 0 else run.output


def test_generate_passes_the_switches_to_the_chat_template() -> None:
    think = len(load_engine(SDAR, device="cpu", dtype="float32").tokenizer.encode("<think>\n\n</think>\n\n"))
    code, out = _generate("--chat")
    assert code == 0, out
    code, off = _generate("--chat", "--chat-template-kwargs", json.dumps(OFF))
    assert code == 0, off
    assert (
        json.loads(off)["prompt_tokens"] == json.loads(out)["prompt_tokens"] + think > json.loads(out)["prompt_tokens"]
    )
    code, out = _generate("--chat-template-kwargs", json.dumps(OFF))
    assert code != 0 and "--chat-template-kwargs: only with --chat" in out
    code, out = _generate("--chat", "--chat-template-kwargs", "[1]")
    assert code != 0 and "must be a JSON object" in out
    code, out = _generate("--chat", "--chat-template-kwargs", '{"thinking": true}')
    assert code != 0 and "does not read 'thinking'" in out


def test_a_batch_line_carries_its_switches_and_a_prompt_line_may_not(tmp_path: Path) -> None:
    lines = [
        {"custom_id": "on", "messages": HI, "gen_length": 4},
        {"custom_id": "off", "messages": HI, "gen_length": 4, "chat_template_kwargs": OFF},
        {"custom_id": "prompt", "prompt": "hi", "gen_length": 4, "chat_template_kwargs": OFF},
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run = CliRunner().invoke(app, ["batch", "-i", str(src), "-o", str(out), "--model", str(SDAR), "--dtype", "float32"])
    results = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    tokens = {k: results[k]["response"]["body"]["usage"]["prompt_tokens"] for k in ("on", "off")}
    assert tokens["off"] > tokens["on"], (tokens, run.output)
    failed = (tmp_path / "out.jsonl.failed.jsonl").read_text()
    assert "prompt" not in results and "chat_template_kwargs must be given with messages" in failed


def test_serve_takes_chat_template_kwargs_on_a_chat_and_refuses_an_unread_one(tmp_path: Path) -> None:
    s = Server("--model", str(SDAR), "--device", "cpu", "--dtype", "float32", log=tmp_path / "serve.log").start()
    try:
        client = s.client()
        ask = {"model": "sdar_tiny", "messages": HI, "max_tokens": 4, "seed": 1}
        on = client.chat.completions.create(**ask)  # type: ignore[call-overload]
        off = client.chat.completions.create(**ask, extra_body={"chat_template_kwargs": OFF})  # type: ignore[call-overload]
        assert off.usage.prompt_tokens > on.usage.prompt_tokens
        with pytest.raises(openai.BadRequestError, match="does not read 'thinking'"):
            client.chat.completions.create(**ask, extra_body={"chat_template_kwargs": {"thinking": True}})  # type: ignore[call-overload]
    finally:
        s.stop()
