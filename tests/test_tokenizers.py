"""HF tokenizer.json folders (LLaDA's format) and chat templates rendered in a sandbox."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from celeris_cli import load_engine
from celeris_cli.cli import app
from celeris_cli.errors import UsageError

from .conftest import LINES, make_model

TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<pad>", "<|mdm_mask|>", "<|eot_id|>", "<|start|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(LINES, trainer)
    folder = tmp_path_factory.mktemp("hf") / "m"
    make_model(folder, tiny_tokenizer, vocab_size=tok.get_vocab_size(), eot_token_id=5)
    (folder / "tokenizer.model").unlink()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return folder


def test_hf_tokenizer_folder_loads_and_generates(hf_model: Path) -> None:
    engine = load_engine(hf_model, device="cpu", dtype="float32")
    assert engine.tokenizer.mask_id == 4 and engine.tokenizer.stop_ids == {2, 5}
    ids = engine.tokenizer.encode("To be, or not")
    assert engine.tokenizer.decode(ids) == "To be, or not"
    [r] = engine.generate(["To be"], engine.params({"gen_length": 8, "denoise_steps": 4}))
    assert r.prompt_tokens == len(engine.tokenizer.encode("To be"))


def test_byte_level_bpe_word_pieces_are_the_letter_pieces_without_g_dot(hf_model: Path) -> None:
    """Byte-level BPE marks a word's first piece with Ġ (a space before it): the rest continue a word."""
    tok = load_engine(hf_model, device="cpu", dtype="float32").tokenizer
    pieces = {tok.backend.piece(i) or "" for i in tok.word_pieces}
    assert pieces and all(p.isalpha() and p.isascii() for p in pieces)
    starts = {tok.backend.piece(i) for i in range(tok.backend.size()) if (tok.backend.piece(i) or "").startswith("Ġ")}
    assert starts and not pieces & starts


def test_chat_mode_renders_the_template(hf_model: Path) -> None:
    engine = load_engine(hf_model, device="cpu", dtype="float32")
    text = engine.tokenizer.render_chat("hello")
    assert text == "<|start|>user\nhello<|eot_id|><|start|>assistant\n"
    r = CliRunner().invoke(
        app,
        [
            "generate",
            "--model",
            str(hf_model),
            "--chat",
            "--prompt",
            "hello",
            "--json",
            "--gen-length",
            "8",
            "--denoise-steps",
            "2",
            "--device",
            "cpu",
        ],
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["prompt_tokens"] == len(engine.tokenizer.encode(text))


def test_chat_template_cannot_escape_the_sandbox(hf_model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "evil"
    shutil.copytree(hf_model, folder)
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": evil}))
    engine = load_engine(folder, device="cpu", dtype="float32")
    with pytest.raises(UsageError, match="chat template failed to render"):
        engine.tokenizer.render_chat("x")


def test_chat_without_a_template_is_a_clear_error(tiny_model: Path) -> None:
    r = CliRunner().invoke(app, ["generate", "--model", str(tiny_model), "--chat", "--prompt", "x"])
    assert r.exit_code != 0 and "no chat_template" in r.output


DATA = Path(__file__).parent / "data"
EVERY_KIND = {  # one folder of each tokenizer kind the project reads
    "sentencepiece": Path(__file__).parents[1] / "celeris_cli" / "models" / "celeris-block",
    "tokenizer.json (LLaDA)": DATA / "llada_hf",
    "tokenizer.json (LLaDA2)": DATA / "llada2" / "llada2_tiny",
    "vocab.json + merges.txt (Dream)": DATA / "dream" / "dream_tiny",
}


@pytest.mark.parametrize("kind", EVERY_KIND)
@pytest.mark.parametrize(
    ("prompt", "answer", "stop"),
    [
        ("It was a dark and stormy night, and", " we would not", ()),
        ("It was a dark and stormy night, and", " we would not", (". And",)),  # cut by a stop string
        ("床前明月光，", "疑是地上霜。", ()),  # Han after Han: no space to keep, none added
    ],
)
def test_the_answer_is_the_exact_continuation_of_the_prompt(
    kind: str, prompt: str, answer: str, stop: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = load_engine(EVERY_KIND[kind], device="cpu", dtype="float32")
    head = engine.encode_prompt(prompt)
    made = engine.encode_prompt(answer + ". And then")  # as a model makes them: " we" with its ▁ or Ġ
    if engine.tokenizer.decode(made[:1]) == "":  # sentencepiece's lone ▁ before a text without a space
        made = made[1:]
    assert engine.tokenizer.decode(head + made) == prompt + answer + ". And then"  # they spell the whole text
    monkeypatch.setattr(engine, "decode_ids", lambda batch, params, seeds=None, rules=None: ([made], 1))
    # static: the batch decoder is the boundary faked here; both schedulings cut text in Engine._result
    [r] = engine.generate([prompt], engine.params({"stop": list(stop)}), scheduling="static")
    assert r.text == (answer if stop else answer + ". And then")
