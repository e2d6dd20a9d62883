"""Settings per script of the prompt (a model folder's `by_script`), and the fast decoder's answer-wide
rules: presence penalty and min_tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from celeris_cli import load_engine
from celeris_cli.engine import Engine
from celeris_cli.errors import ModelError, UsageError
from celeris_cli.params import GenerationParams, script_layers, script_of


def test_the_script_of_a_prompt_is_its_letters_majority() -> None:
    assert script_of("床前明月光，") == "han"
    assert script_of("Shall I compare thee to a summer's day?") == "latin"
    assert script_of("李白 wrote this line") == "latin"  # 2 Han characters, 13 Latin letters
    assert script_of("李白写 the moon") == "latin" and script_of("李白写了 the moon") == "latin"
    assert script_of("李白写了诗 moon") == "han"
    assert script_of("…, 123") is None


def test_a_script_preset_applies_under_the_users_layers_only() -> None:
    base = GenerationParams.defaults_from({"block_length": 32, "temperature": 1.2})
    latin = {"block_length": 8, "temperature": 0.9, "presence_penalty": 0.5}
    assert base.under(latin).block_length == 8 and base.under(latin).presence_penalty == 0.5
    user = GenerationParams.from_mapping({"temperature": 1.5}, base)
    assert user.under(latin).temperature == 1.5 and user.under(latin).block_length == 8  # the user's value wins
    ref = GenerationParams.from_mapping({"strategy": "reference"}, base)
    assert ref.under(latin).presence_penalty == 0.0  # not honoured by the reference decoder: left alone


@pytest.mark.parametrize(
    ("presets", "message"),
    [
        ({"cyrillic": {}}, "unknown script"),
        ({"latin": {"gen_length": 8}}, "gen_length cannot differ by script"),
        ({"latin": {"temperature": -1}}, "temperature must be"),
        ({"latin": {"bogus": 1}}, "unknown generation parameter"),
        ([], "must map a script"),
    ],
)
def test_a_bad_script_preset_is_named(presets: object, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        script_layers({"by_script": presets})


def test_a_bad_preset_in_a_model_folder_fails_the_load(tmp_path: Path, tiny_model: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(tiny_model, folder)
    (folder / "generation_config.json").write_text(json.dumps({"by_script": {"latin": {"min_p": 2}}}))
    with pytest.raises(ModelError, match="min_p"):
        load_engine(folder, device="cpu", dtype="float32")


def test_each_row_runs_and_reports_its_scripts_preset_whatever_its_batch(tmp_path: Path, tiny_model: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(tiny_model, folder)
    config = {"gen_length": 16, "block_length": 16, "denoise_steps": 16, "temperature": 1.0}
    preset = {"latin": {"block_length": 4, "presence_penalty": 1.0, "min_tokens": 3}}
    (folder / "generation_config.json").write_text(json.dumps({**config, "by_script": preset}))
    e = load_engine(folder, device="cpu", dtype="float32")
    prompts = ["床前明月光，", "To be, or not to be", "白日依山尽，", "The quick"]
    mixed = e.generate(prompts, batch_size=4)
    assert [r.settings["block_length"] for r in mixed] == [16, 4, 16, 4]
    assert [r.settings["presence_penalty"] for r in mixed] == [0.0, 1.0, 0.0, 1.0]
    alone = [e.generate([p])[0] for p in prompts]
    assert [r.text for r in alone] == [r.text for r in mixed]  # an answer depends only on its request
    plain = load_engine(tiny_model, device="cpu", dtype="float32")
    no_preset = [r.text for r in plain.generate(prompts, plain.params(dict(config)), batch_size=4)]
    assert no_preset[0::2] == [r.text for r in mixed][0::2]  # verse rows untouched by the Latin preset
    assert no_preset[1::2] != [r.text for r in mixed][1::2]  # Latin rows decoded with the preset
    forced = e.generate(prompts[1:2], e.params({"block_length": 16}))[0]
    assert forced.settings["block_length"] == 16 and forced.settings["presence_penalty"] == 1.0


def test_min_tokens_keeps_stop_tokens_out_of_the_answers_first_positions(eos_prone: Engine) -> None:
    base = {"gen_length": 16, "block_length": 8, "denoise_steps": 16, "temperature": 1.0, "early_exit": False}
    prompts = ["床前明月光，", "To be, or not to be", "白日依山尽，", "The quick"]
    free = eos_prone.generate(prompts, eos_prone.params(base))
    assert min(r.output_tokens for r in free) < 5  # the EOS-prone model ends early without the rule
    held = eos_prone.generate(prompts, eos_prone.params({**base, "min_tokens": 5}))
    assert all(r.output_tokens >= 5 for r in held)


def test_presence_penalty_lowers_the_reuse_of_committed_tokens(engine: Engine) -> None:
    base = {"gen_length": 32, "block_length": 8, "denoise_steps": 32, "temperature": 0.0, "order_temperature": 0.0}
    prompts = ["床前明月光，", "To be, or not to be", "白日依山尽，", "The quick"]

    def repeats(penalty: float) -> int:
        ids, _ = engine.decode_ids(
            [engine.encode_prompt(p) for p in prompts], engine.params({**base, "presence_penalty": penalty})
        )
        return sum(len(row) - len(set(row)) for row in ids)

    assert repeats(5.0) < repeats(0.0)


def test_the_batch_command_gives_each_request_its_scripts_preset(tmp_path: Path, tiny_model: Path) -> None:
    """`celeris batch` (the queue's preparer and packer) runs each request with its script's preset, the
    same answer as `generate`, and a request's own setting still wins over the preset. The packer groups
    requests by the settings they will run with, so batches hold --batch-size rows of one preset."""
    from .test_batch import celeris

    folder = tmp_path / "m"
    shutil.copytree(tiny_model, folder)
    config = {"gen_length": 16, "block_length": 16, "denoise_steps": 16, "temperature": 1.0}
    preset = {"latin": {"block_length": 4, "presence_penalty": 1.0, "min_tokens": 3}}
    (folder / "generation_config.json").write_text(json.dumps({**config, "by_script": preset}))
    prompts = ["床前明月光，", "To be, or not to be", "白日依山尽，", "The quick"] * 2
    lines = [json.dumps({"id": f"q{i}", "prompt": p}) for i, p in enumerate(prompts)]
    lines.append(json.dumps({"id": "own", "prompt": "The quick", "block_length": 8}))
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    p = celeris("batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--model",
                str(folder), "--device", "cpu", "--dtype", "float32", "--batch-size", "4")  # fmt: skip
    assert p.returncode == 0, p.stderr
    bodies = [json.loads(x)["response"]["body"] for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    settings = [b["settings"] for b in bodies]
    assert [s["block_length"] for s in settings] == [16, 4, 16, 4] * 2 + [8]
    assert [s["presence_penalty"] for s in settings] == [0.0, 1.0, 0.0, 1.0] * 2 + [1.0]
    assert [b["timing"]["batch_size"] for b in bodies] == [4] * 9  # every row in the running set, 4 wide
    e = load_engine(folder, device="cpu", dtype="float32")
    assert [b["text"] for b in bodies[:8]] == [r.text for r in e.generate(prompts, batch_size=4)]


def test_a_request_that_sets_the_presets_knobs_keeps_them_whatever_its_batch_mates(
    tmp_path: Path, tiny_model: Path
) -> None:
    """A Latin request that sets every knob of its preset runs the verse settings; it is decoded with its own
    final settings, not with the preset applied again under another row's layers."""
    from .test_batch import celeris

    folder = tmp_path / "m"
    shutil.copytree(tiny_model, folder)
    config = {"gen_length": 16, "block_length": 16, "denoise_steps": 16, "temperature": 1.0}
    preset = {"latin": {"block_length": 4, "presence_penalty": 1.0, "min_tokens": 3}}
    (folder / "generation_config.json").write_text(json.dumps({**config, "by_script": preset}))
    own = {"block_length": 16, "presence_penalty": 0.0, "min_tokens": 0}
    latin = "The quick brown fox jumps over the lazy dog, and then"  # longer: the short Han row leads the batch
    lines = [json.dumps({"id": "han", "prompt": "白"}), json.dumps({"id": "en", "prompt": latin, **own})]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    p = celeris("batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--model",
                str(folder), "--device", "cpu", "--dtype", "float32")  # fmt: skip
    assert p.returncode == 0, p.stderr
    bodies = [json.loads(x)["response"]["body"] for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [b["timing"]["batch_size"] for b in bodies] == [2, 2]  # one running set: both rows in it together
    assert {k: bodies[1]["settings"][k] for k in own} == own
    e = load_engine(folder, device="cpu", dtype="float32")
    assert bodies[1]["text"] == e.generate([latin], e.params(own))[0].text


def test_subword_min_p_drops_only_unlikely_word_continuing_pieces() -> None:
    """The rule on the logits: a piece that continues a word is dropped below subword_min_p times the
    likeliest token's probability at the sampling temperature; a piece that starts a word is not, nor is the
    likeliest token, and nothing changes when decoding is greedy."""
    import torch

    from celeris_cli.decode.sampling import shape_masked
    from celeris_cli.params import Shaping

    T = 0.5  # the bound is on the sampled distribution: a rule blind to T would keep id 2 (0.15 / 0.40 > 0.5^2)
    probs = torch.tensor([0.40, 0.30, 0.15, 0.15])  # the sampled distribution: ids 0..3
    logits = (T * probs.log())[None, :]  # p ∝ exp(logit / T)
    masked, offset, stop = torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, dtype=torch.long), torch.tensor([])
    pieces = torch.tensor([1, 2])  # 1 and 2 continue a word; 0 and 3 start one
    rule = Shaping(presence_penalty=0.0, min_tokens=0, subword_min_p=0.5)
    out = shape_masked(logits, masked.nonzero(), None, offset, rule, 9, stop, T, pieces)
    kept = out[0] > float("-inf")
    assert kept.tolist() == [True, True, False, True]  # 0.30 >= 0.5 * 0.40 > 0.15; id 3 starts a word
    assert torch.allclose(out[0, kept], logits[0, kept])
    strict = shape_masked(logits, masked.nonzero(), None, offset, Shaping(0.0, 0, 0.8), 9, stop, T, pieces)
    assert (strict[0] > float("-inf")).tolist() == [True, False, False, True]  # 0.30 < 0.8 * 0.40
    top = shape_masked(logits, masked.nonzero(), None, offset, Shaping(0.0, 0, 0.99), 9, stop, T, torch.tensor([0, 1]))
    assert top[0, 0] == logits[0, 0]  # the likeliest token stays, even a continuing one
    greedy = shape_masked(logits, masked.nonzero(), None, offset, rule, 9, stop, 0.0, pieces)
    assert torch.equal(greedy, logits)
    with pytest.raises(UsageError, match="subword_min_p: only sampling"):  # so greedy refuses it when asked
        GenerationParams.from_mapping({"temperature": 0.0, "subword_min_p": 0.5})


def test_a_vocabulary_marked_wordpiece_style_continues_words_with_its_hash_pieces() -> None:
    """Which scheme a vocabulary follows is decided by most of its pieces, not by one stray piece."""
    from celeris_cli.arch.tokenizer import Tokenizer

    class Vocab:
        def __init__(self, pieces: list[str]) -> None:
            self.pieces = pieces

        def size(self) -> int:
            return len(self.pieces)

        def piece(self, i: int) -> str:
            return self.pieces[i]

    def word_pieces(pieces: list[str]) -> set[str]:
        tok = object.__new__(Tokenizer)
        tok.backend = Vocab(pieces)  # type: ignore[assignment]
        return {pieces[i] for i in tok.word_pieces}

    assert word_pieces(["[MASK]", "play", "##ing", "##ed", "un", "##til", ","]) == {"##ing", "##ed", "##til"}
    assert word_pieces(["▁play", "ing", "▁un", "til", "##x", ","]) == {"ing", "til"}  # ▁ wins; ##x is not letters
    assert word_pieces(["play", "ing", ","]) == set()  # no marks at all: nothing can be told


def test_word_pieces_are_the_pieces_without_a_word_start_mark(engine: Engine) -> None:
    """sentencepiece marks a word's first piece with ▁: the rest of the Latin pieces continue words."""
    sp = engine.tokenizer.backend
    pieces = engine.tokenizer.word_pieces
    assert pieces and all(sp.piece(i).isalpha() and sp.piece(i).isascii() for i in pieces)  # type: ignore[union-attr]
    starts = {i for i in range(sp.size()) if (sp.piece(i) or "").startswith("▁")}
    assert starts and not pieces & starts
    word = engine.tokenizer.encode(" understanding")  # more than one piece: the first starts the word
    assert len(word) > 1 and word[0] not in pieces and set(word[1:]) <= pieces


def test_subword_min_p_needs_a_tokenizer_that_marks_word_starts(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(engine.tokenizer.__dict__, "word_pieces", frozenset())  # a vocabulary with no marks
    params = engine.params({"gen_length": 8, "block_length": 8, "denoise_steps": 8, "temperature": 1.0})
    engine.generate(["To be"], params)  # without the rule it runs
    with pytest.raises(UsageError, match="subword_min_p: this model's tokenizer marks no word starts"):
        engine.params({"subword_min_p": 0.5, "temperature": 1.0})  # when the settings are made, before decoding
    with pytest.raises(UsageError, match="subword_min_p: this model's tokenizer marks no word starts"):
        engine.generate(["To be"], params.with_(subword_min_p=0.5))


def test_the_queue_refuses_subword_min_p_at_startup_and_per_request_on_a_vocabulary_without_marks(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celeris_cli.arch.tokenizer import Tokenizer
    from celeris_cli.errors import ConfigError
    from celeris_cli.spool.backend import Preparer
    from celeris_cli.spool.formats import Request

    sampled = {"gen_length": 8, "block_length": 8, "denoise_steps": 8, "temperature": 1.0}
    request = Request(custom_id="a", line=1, prompt="To be", params={"subword_min_p": 0.5})
    Preparer.load(str(tiny_model), sampled).prepare(request)  # a vocabulary with ▁ marks takes it
    monkeypatch.setattr(Tokenizer, "word_pieces", frozenset())  # one without any
    with pytest.raises(ConfigError, match="generation: subword_min_p: this model's tokenizer marks no word"):
        Preparer.load(str(tiny_model), {**sampled, "subword_min_p": 0.5})
    with pytest.raises(UsageError, match="subword_min_p: this model's tokenizer marks no word"):
        Preparer.load(str(tiny_model), sampled).prepare(request)


def test_celeris_tinys_shipped_settings_window_poems_and_leave_english_its_whole_canvas(engine: Engine) -> None:
    """celeris-tiny's folder: poems decode one position per step (threshold 1.0 on the probability) with the
    prefix cache and a suffix window of 16, English (its Latin preset) with threshold commits on the lead
    and the dual cache over the whole canvas; a user's own settings win over both."""
    from celeris_cli.engine import embedded_models

    raw = json.loads((embedded_models()["celeris-tiny"] / "generation_config.json").read_text(encoding="utf-8"))
    e = Engine(engine.model, engine.tokenizer, engine.device, engine.dtype, None).with_defaults(raw)
    poem, english = "床前明月光，", "The sea at night is"

    def settings_of(prompt: str, overrides: dict[str, object]) -> tuple[str, int, float, str]:
        p = e.params_for(prompt, e.params(overrides))
        return p.cache, p.suffix_window, p.threshold, p.confidence

    assert settings_of(poem, {}) == ("prefix", 16, 1.0, "prob")
    assert settings_of(english, {}) == ("dual", 0, 0.9, "lead")
    assert settings_of(poem, {"cache": "dual", "threshold": 0.9}) == ("dual", 16, 0.9, "prob")  # the rest the model's
    assert settings_of(english, {"cache": "prefix", "suffix_window": 8}) == ("prefix", 8, 0.9, "lead")
