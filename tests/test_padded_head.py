"""A head padded past its tokenizer (LLaDA-8B: 126,464 rows against a smaller tokenizer) never yields an id
the tokenizer cannot decode (issue 59): the logits stop at the tokenizer's last id, with either kind of
tokenizer, whatever the strategy, the temperature, a constraint or the log probabilities asked for."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from celeris_cli import load_engine
from celeris_cli.engine import Engine

from .conftest import make_model

PADDED = 126_464  # LLaDA-8B's head
LETTERS = "abcdefghijklmnopqrstuvwxyz"
SPECIALS = ["<unk>", "<s>", "</s>", "<|mdm_mask|>", "<|eot_id|>"]  # eos 2, mask 3, end of turn 4
PUNCTUATION = list(",.!?'-") + ["▁"] + ["▁" + c for c in "atiswo"]  # 44 pieces in all


def hf_tokenizer_json(path: Path, last_at: int | None = None) -> int:
    """A 44-piece tokenizer.json: letters, a few word starts, punctuation and the special tokens. last_at: the
    id of its last piece, past a gap of ids without a token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pieces = SPECIALS + list(LETTERS) + PUNCTUATION
    vocab = {p: i for i, p in enumerate(pieces)}
    if last_at is not None:
        vocab[pieces[-1]] = last_at
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path))
    return len(pieces)


@pytest.fixture(scope="module")
def padded_hf(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Path) -> tuple[Path, int]:
    folder = tmp_path_factory.mktemp("padded") / "hf"
    ids = {"mask_token_id": 3, "eos_token_id": 2, "pad_token_id": 2, "eot_token_id": 4, "bos_token_id": 1}
    make_model(folder, tiny_tokenizer, n_layers=1, d_model=16, vocab_size=PADDED, **ids)
    (folder / "tokenizer.model").unlink()
    return folder, hf_tokenizer_json(folder / "tokenizer.json")


@pytest.fixture(scope="module")
def padded_sp(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Path) -> tuple[Path, int]:
    import sentencepiece as spm

    folder = make_model(tmp_path_factory.mktemp("padded") / "sp", tiny_tokenizer, n_layers=1, d_model=16)
    padded = make_model(tmp_path_factory.mktemp("padded") / "sp_big", tiny_tokenizer, n_layers=1, d_model=16,
                        vocab_size=PADDED)  # fmt: skip
    shutil.rmtree(folder)
    size = spm.SentencePieceProcessor(model_file=str(tiny_tokenizer)).get_piece_size()
    return padded, size


def sampled_ids(engine: Engine, strategy: str, seeds: range, **settings: object) -> list[int]:
    params = engine.params({"strategy": strategy, "temperature": 1.0, "gen_length": 16, **settings})
    prompts = [engine.tokenizer.encode_prompt("to be or not")] * len(seeds)
    out, _ = engine.decode_ids(prompts, params, list(seeds))
    return [i for row in out for i in row]


@pytest.mark.parametrize("kind", ["tokenizer.json", "sentencepiece"])
def test_a_padded_head_never_yields_an_id_past_its_tokenizer(kind: str, padded_hf, padded_sp) -> None:  # type: ignore[no-untyped-def]
    folder, size = padded_hf if kind == "tokenizer.json" else padded_sp
    engine = load_engine(folder, device="cpu", dtype="float32")
    assert engine.model.cfg.vocab_size == PADDED and size < 1000
    for strategy in ("fast", "reference", "dream"):
        ids = sampled_ids(engine, strategy, range(4))
        assert len(ids) == 4 * 16 and max(ids) < size, (strategy, max(ids))
    results = engine.generate(["to be or not"] * 4, engine.params({"temperature": 1.0, "gen_length": 16}),
                              seeds=range(4))  # fmt: skip
    assert all(r.output_tokens > 0 for r in results)  # decoded to text: sentencepiece raised on such ids


def test_the_logits_a_decoder_sees_stop_at_the_tokenizers_last_id(padded_hf) -> None:  # type: ignore[no-untyped-def]
    """The head's width, and what is read from it: log probabilities with no entry for an id without a token,
    and a constraint's draws."""
    folder, size = padded_hf
    engine = load_engine(folder, device="cpu", dtype="float32")
    h = torch.randn(2, 3, 16)
    assert engine.model.step_head()(h).shape[-1] == size and engine.model(torch.tensor([[5, 6]])).shape[-1] == size
    params = engine.params({"temperature": 1.0, "gen_length": 8, "logprobs": True, "top_logprobs": 20})
    [r] = engine.generate(["to be"], params)
    assert r.logprobs and all(e["token"] or e["bytes"] == [] for e in r.logprobs)
    assert all(len(e["top_logprobs"]) == 20 and all(t["bytes"] for t in e["top_logprobs"][:5]) for e in r.logprobs)
    ids = sampled_ids(engine, "fast", range(3), structured_outputs={"regex": "[a-z]{3,6}"})  # under a constraint
    assert max(ids) < size


def test_ids_without_a_token_below_the_last_are_never_drawn(tmp_path: Path, tiny_tokenizer: Path) -> None:
    """A tokenizer.json whose last piece sits past a gap: the ids in the gap are at -inf, never sampled."""
    folder = tmp_path / "gap"
    ids = {"mask_token_id": 3, "eos_token_id": 2, "pad_token_id": 2, "eot_token_id": 4, "bos_token_id": 1}
    make_model(folder, tiny_tokenizer, n_layers=1, d_model=16, vocab_size=PADDED, **ids)
    (folder / "tokenizer.model").unlink()
    far = 600  # the last piece's id: the ids from the one before it up to 599 have no token
    size = hf_tokenizer_json(folder / "tokenizer.json", last_at=far) - 1  # the pieces below the gap
    engine = load_engine(folder, device="cpu", dtype="float32")
    logits = engine.model.step_head()(torch.randn(4, 16))
    assert logits.shape[-1] == far + 1 and torch.isinf(logits[:, size:far]).all()
    assert torch.isfinite(logits[:, :size]).all() and torch.isfinite(logits[:, far]).all()
    drawn = set(sampled_ids(engine, "fast", range(4)))
    assert not drawn & set(range(size, far))
