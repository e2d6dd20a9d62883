"""DiffusionGemma's thinking switch (`enable_thinking`, a `chat_template_kwargs` key) against transformers' own
`apply_chat_template` and `generate` (tests/data/diffusion_gemma/diffusion_gemma_thinking_reference.json; how it
was made: tests/data/diffusion_gemma/README.md).

The folder is `saved_by_transformers/` with its chat template replaced by the released one
(tests/data/released/google__diffusiongemma-26B-A4B-it/chat_template.jinja, SOURCES.md says from where): on, the
template opens a system turn with `<|think|>`; off or unset, the generation prompt ends in an empty thought
channel. Each conversation (a user turn; system and user; a reply carrying a thought channel, then a user turn) is
rendered with the switch on, off and unset, through the path serve, `celeris batch` and the queue take
(`Preparer`); the answers are token-exact there, through `celeris batch`, serve's chat completions and
`celeris generate --chat --chat-template-kwargs`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from celeris_cli import load_engine
from celeris_cli.cli import app
from celeris_cli.spool.backend import Preparer
from celeris_cli.spool.formats import Request

from .serve_helpers import Server
from .test_diffusion_gemma_released import PAD, decoder_passes, request

DATA = Path(__file__).parent / "data"
TEMPLATE = DATA / "released" / "google__diffusiongemma-26B-A4B-it" / "chat_template.jinja"
REF = json.loads((DATA / "diffusion_gemma" / "diffusion_gemma_thinking_reference.json").read_text(encoding="utf-8"))
RENDERS, RUNS = REF["renders"], REF["runs"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """saved_by_transformers/ with the released chat template, as the reference runs were made."""
    path = tmp_path_factory.mktemp("thinking") / "diffusion_gemma"
    shutil.copytree(DATA / "diffusion_gemma" / "saved_by_transformers", path)
    shutil.copyfile(TEMPLATE, path / "chat_template.jinja")
    return path


@pytest.fixture(scope="module")
def engine(folder: Path):  # type: ignore[no-untyped-def]
    return load_engine(folder, device="cpu", dtype="float32")


def prepared(engine: Any, messages: list[dict[str, Any]], switches: dict[str, Any]) -> list[int]:
    """A conversation's prompt ids as serve, `celeris batch` and the queue make them."""
    row = Request("t", 1, messages=messages, chat_template_kwargs=switches or None)
    ids: list[int] = Preparer.of(engine, engine.params({})).prepare(row).payload[1]
    return ids


def test_the_records_are_of_the_released_template_and_the_switch_changes_each_prompt() -> None:
    """What the records must hold for the tests below to mean what they say."""
    assert hashlib.sha256(TEMPLATE.read_bytes()).hexdigest() == REF["provenance"]["chat_template_sha256"]
    text = {(r["conversation"], r["setting"]): r["text"] for r in RENDERS}
    for conv in REF["conversations"]:
        on, off, unset = text[conv, "on"], text[conv, "off"], text[conv, "unset"]
        assert "<|think|>" in on and not on.endswith("<channel|>")
        assert "<|think|>" not in off and off.endswith("<|turn>model\n<|channel>thought\n<channel|>")
        assert unset == off  # the template's default is off
    pairs = {(c, s) for c in REF["conversations"] for s in ("on", "off")}
    assert {(r["conversation"], r["setting"]) for r in RUNS} == pairs
    assert {"t_max" in r["settings"] for r in RUNS} == {True, False}  # greedy-limit and released-schedule runs


@pytest.mark.parametrize("case", RENDERS, ids=[f"{r['conversation']}-{r['setting']}" for r in RENDERS])
def test_celeris_renders_each_conversation_as_transformers(engine: Any, case: dict[str, Any]) -> None:
    messages, switches = REF["conversations"][case["conversation"]], case["chat_template_kwargs"]
    assert engine.tokenizer.render_chat(messages, switches or None) == case["text"]
    assert prepared(engine, messages, switches) == case["ids"]


@pytest.mark.parametrize("case", RUNS, ids=[f"{r['conversation']}-{r['setting']}-{r['seed']}" for r in RUNS])
def test_every_recorded_run_is_token_exact(engine: Any, case: dict[str, Any]) -> None:
    ids = prepared(engine, REF["conversations"][case["conversation"]], case["chat_template_kwargs"])
    assert ids == case["input_ids"]
    greedy = "t_max" in case["settings"]
    outs, nfe = engine.decode_ids([ids], engine.params(request(case, greedy)))
    n = len(case["output_ids"])
    assert outs[0][:n] == case["output_ids"] and set(outs[0][n:]) <= {PAD}
    valid = sum(t != PAD for t in case["output_ids"])
    assert valid / decoder_passes(nfe, case) == pytest.approx(case["tokens_per_forward"], rel=1e-6)


def _generate(folder: Path, case: dict[str, Any], *switch: str) -> dict[str, Any]:
    prompt = REF["conversations"][case["conversation"]][-1]["content"]
    args = ["generate", "--model", str(folder), "--prompt", prompt, "--chat", *switch, "--json", "--quiet"]
    args += ["--dtype", "float32", "--gen-length", str(case["settings"]["max_new_tokens"])]
    args += ["--noise", "torch", "--seed", str(case["seed"])]
    p = CliRunner().invoke(app, args)
    assert p.exit_code == 0, p.output
    out: dict[str, Any] = json.loads(p.stdout)
    return out


def test_celeris_generate_chat_takes_the_switch(engine: Any, folder: Path) -> None:
    """`celeris generate --chat --chat-template-kwargs` on the released schedule's single-turn runs; without the
    switch, the template's own default (off)."""
    for case in (r for r in RUNS if r["conversation"] == "user" and "t_max" not in r["settings"]):
        want = engine.tokenizer.continuation(case["input_ids"], case["answer_ids"])
        given = _generate(folder, case, "--chat-template-kwargs", json.dumps(case["chat_template_kwargs"]))
        assert (given["text"], given["prompt_tokens"]) == (want, len(case["input_ids"])), case["setting"]
        if case["setting"] == "off":
            assert _generate(folder, case)["text"] == want


def test_every_recorded_run_through_celeris_batch(engine: Any, folder: Path, tmp_path: Path) -> None:
    """`celeris batch` lines with `messages` and `chat_template_kwargs`, as a chat completion carries them."""
    src, out = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    lines = [
        {
            "custom_id": str(i),
            "messages": REF["conversations"][c["conversation"]],
            "chat_template_kwargs": c["chat_template_kwargs"],
            **request(c, "t_max" in c["settings"]),
        }
        for i, c in enumerate(RUNS)
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in lines))
    args = ["batch", "-i", str(src), "-o", str(out), "--model", str(folder), "--dtype", "float32"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    results = {r["custom_id"]: r["response"]["body"] for r in map(json.loads, out.read_text().splitlines())}
    for i, case in enumerate(RUNS):
        want = engine.tokenizer.continuation(case["input_ids"], case["answer_ids"])
        assert results[str(i)]["text"] == want, (case["conversation"], case["setting"], case["seed"])
        assert results[str(i)]["usage"]["prompt_tokens"] == len(case["input_ids"])


def test_serve_chat_completions_take_the_switch(engine: Any, folder: Path, tmp_path: Path) -> None:
    """serve's chat completions with `chat_template_kwargs` in the body, on the conversations with a system turn and
    with a reply: the same answers as transformers' runs."""
    s = Server("--model", str(folder), "--device", "cpu", "--dtype", "float32", log=tmp_path / "serve.log").start()
    try:
        client = s.client()
        for case in (r for r in RUNS if r["conversation"] != "user" and "t_max" not in r["settings"]):
            extra = {"chat_template_kwargs": case["chat_template_kwargs"], "noise": "torch"}
            ask = {"model": folder.name, "messages": REF["conversations"][case["conversation"]], "seed": case["seed"]}
            got = client.chat.completions.create(  # type: ignore[call-overload]
                **ask, max_tokens=case["settings"]["max_new_tokens"], extra_body=extra
            )
            want = engine.tokenizer.continuation(case["input_ids"], case["answer_ids"])
            assert (got.choices[0].message.content, got.usage.prompt_tokens) == (want, len(case["input_ids"]))
    finally:
        s.stop()
