"""An answer's text holds no special token (as transformers' `skip_special_tokens`), and a family that pads after
its answer ends the text at the pad: CoDA's answers end in runs of <|endoftext|>, its pad, not its eos."""

from __future__ import annotations

from pathlib import Path

import pytest

from celeris_cli import load_engine
from celeris_cli.arch.folder import ModelFolder

DATA = Path(__file__).parent / "data"
FAMILIES = [
    DATA / "llada_hf",
    DATA / "dream" / "dream_tiny",
    DATA / "llada2" / "llada2_tiny",
    DATA / "sdar" / "sdar_tiny",
    DATA / "llada_moe" / "lladamoe_tiny",
    DATA / "coda" / "coda_tiny",
    DATA / "rnd1" / "rnd1_tiny",
    DATA / "diffucoder" / "diffucoder_tiny",
    DATA / "nemotron" / "nemotron_tiny",
    DATA / "diffusion_gemma" / "diffusion_gemma_tiny",
]


@pytest.mark.parametrize("folder", FAMILIES, ids=lambda p: p.name)
def test_special_tokens_are_left_out_of_an_answers_text(folder: Path) -> None:
    tok = ModelFolder.open(folder).tokenizer()
    assert tok.special_ids, "the folder's tokenizer marks its special tokens"
    words = tok.encode(" the cat")
    special = sorted(tok.special_ids)[:3]
    prompt = [special[0], *tok.encode("a b")]
    text = tok.continuation(prompt, [special[-1], *words, *special])
    assert text == tok.continuation(prompt, words)
    assert not any(tok.backend.piece(i) in text for i in special)


def test_a_family_that_pads_after_its_answer_ends_the_text_at_the_pad() -> None:
    engine = load_engine(DATA / "coda" / "coda_tiny", device="cpu", dtype="float32")
    pad, eos = engine.tokenizer.pad_id, engine.tokenizer.eos_id
    assert pad != eos and pad not in engine.special.stop_ids  # CoDA: eos <|im_end|>, pad <|endoftext|>
    prompt, words = engine.tokenizer.encode("c d e"), engine.tokenizer.encode(" f g h")
    text, n_out, reason = engine.finish([*words, pad, pad, *words], prompt=prompt)
    assert (text, n_out, reason) == (engine.tokenizer.continuation(prompt, words), len(words), "stop")
    assert "<|endoftext|>" not in text
