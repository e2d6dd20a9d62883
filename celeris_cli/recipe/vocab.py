"""Train the sentencepiece tokenizer for our own models.

Every frequent Han character is a user-defined symbol, so Chinese text is always one token per character
(a five-character line is five tokens, which is what a small model needs to learn verse structure) and
never falls back to bytes. English gets BPE pieces from the remaining vocabulary. Rare characters use
byte fallback instead of <unk>. The traditional->simplified table is embedded as the normalization rule.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

SPECIALS = {"unk": "<unk>", "bos": "<s>", "eos": "</s>", "pad": "<pad>"}
MASK_PIECE = "<|mdm_mask|>"
EOT_PIECE = "<|eot_id|>"
PUNCT = "，。？！、；：“”‘’《》（）·—…"
HAN = re.compile(r"[\u3400-\u9fff\U00020000-\U0002ffff]")


def train_tokenizer(
    corpus: Path,
    out_dir: Path,
    fold: dict[str, str] | None = None,
    han_chars: int = 7000,
    bpe_pieces: int = 2000,
    max_lines: int = 400_000,
) -> Path:
    """Train `tokenizer.model` from a one-document-per-line text file. Returns its path."""
    import sentencepiece as spm

    lines = corpus.read_text(encoding="utf-8").splitlines()[:max_lines]
    counts = Counter(ch for line in lines for ch in line if HAN.match(ch))
    han = [c for c, _ in counts.most_common(han_chars)]
    symbols = list(dict.fromkeys(list(PUNCT) + han))
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        english = Path(tmp) / "english.txt"
        # BPE merges are learned on the non-Han lines; Han characters are fixed symbols anyway.
        english.write_text("\n".join(ln for ln in lines if not HAN.search(ln)) + "\n", encoding="utf-8")
        rule = Path(tmp) / "fold.tsv"
        rule.write_text(
            "".join(
                f"{ord(a):X}\t{ord(b):X}\n" for a, b in (fold or {}).items() if len(a) == 1 and len(b) == 1 and a != b
            ),
            encoding="utf-8",
        )
        kwargs: dict[str, Any] = {}
        if fold:
            kwargs["normalization_rule_tsv"] = str(rule)
        else:
            kwargs["normalization_rule_name"] = "identity"
        spm.SentencePieceTrainer.train(
            input=str(english),
            model_prefix=str(out_dir / "tokenizer"),
            model_type="bpe",
            vocab_size=len(symbols) + bpe_pieces + 256 + 6,
            user_defined_symbols=symbols,
            control_symbols=[MASK_PIECE, EOT_PIECE],
            byte_fallback=True,
            character_coverage=1.0,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=3,
            unk_piece=SPECIALS["unk"],
            bos_piece=SPECIALS["bos"],
            eos_piece=SPECIALS["eos"],
            pad_piece=SPECIALS["pad"],
            split_digits=True,
            hard_vocab_limit=False,
            num_threads=2,
            minloglevel=2,
            **kwargs,
        )
    (out_dir / "tokenizer.vocab").unlink(missing_ok=True)
    return out_dir / "tokenizer.model"


def special_ids(model_file: Path) -> dict[str, int]:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    return {
        "mask_token_id": sp.piece_to_id(MASK_PIECE),
        "eot_token_id": sp.piece_to_id(EOT_PIECE),
        "eos_token_id": sp.eos_id(),
        "pad_token_id": sp.pad_id(),
        "bos_token_id": sp.bos_id(),
        "vocab_size": sp.get_piece_size(),
    }


if __name__ == "__main__":  # pragma: no cover - used once by the recipe
    import sys

    corpus_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    fold = json.loads((corpus_dir / "t2s.json").read_text(encoding="utf-8"))
    path = train_tokenizer(corpus_dir / "train.txt", out, fold)
    print(path, special_ids(path))
