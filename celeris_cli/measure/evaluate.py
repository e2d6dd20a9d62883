"""`celeris eval`: quality figures on a fixed held-out set, reused by `bench` to check faster decoding.

- structure rate: prompted with the first line of a held-out five- or seven-character regular poem, the
  share of completions that add at least three complete lines, each as long as the prompt line, ending
  alternately in ， and 。 (a line cut off by the end of the canvas is allowed; anything else fails);
- distinct-2: unique character bigrams over all bigrams, pooled over all poem completions, punctuation
  excluded (bigrams do not cross it). Greedy decoding of a small model repeats one filler line for every
  prompt and scores near 0.02 while still scoring well on structure, so both are always reported;
- NLL bound per token on held-out documents (the diffusion ELBO, Monte-Carlo over mask ratios);
- English word validity: the share of generated English words found in the training vocabulary (a word
  cut off by the end of the canvas is not counted).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import UsageError

PUNCT = "，。"
LINE = re.compile(r"([^，。]*)([，。])")
HAN = re.compile(r"^[\u3400-\u9fff\U00020000-\U0002ffff]+$")
WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)?")


def evalset_dir() -> Path:
    return Path(str(resources.files("celeris_cli"))) / "evaldata"


@dataclass(frozen=True)
class EvalSet:
    poems: list[dict[str, str]]
    english: list[dict[str, str]]
    words: frozenset[str]
    heldout: list[str]

    @classmethod
    def load(cls, folder: Path | None = None) -> EvalSet:
        folder = folder or evalset_dir()
        if not (folder / "poems.jsonl").is_file():
            raise UsageError(f"no evaluation set in {folder} (expected poems.jsonl, english.jsonl, words.txt)")

        def rows(name: str) -> list[dict[str, str]]:
            return [json.loads(x) for x in (folder / name).read_text(encoding="utf-8").splitlines() if x.strip()]

        words = frozenset((folder / "words.txt").read_text(encoding="utf-8").split())
        heldout = (folder / "heldout.txt").read_text(encoding="utf-8").splitlines()
        return cls(rows("poems.jsonl"), rows("english.jsonl"), words, [h for h in heldout if h.strip()])


def build_evalset(corpus: Path, out: Path, poems: int = 300, english: int = 150, heldout: int = 400) -> None:
    """Copy a fixed, deterministic sample of the corpus's held-out split into `out` (shipped in the wheel)."""
    rng = random.Random(0)
    out.mkdir(parents=True, exist_ok=True)
    for src, dst, n in (("eval_poems.jsonl", "poems.jsonl", poems), ("eval_english.jsonl", "english.jsonl", english)):
        rows = [x for x in (corpus / src).read_text(encoding="utf-8").splitlines() if x.strip()]
        rng.shuffle(rows)
        (out / dst).write_text("\n".join(rows[:n]) + "\n", encoding="utf-8")
    (out / "words.txt").write_text((corpus / "english_words.txt").read_text(encoding="utf-8"), encoding="utf-8")
    docs = [x for x in (corpus / "heldout.txt").read_text(encoding="utf-8").splitlines() if x.strip()]
    rng.shuffle(docs)
    (out / "heldout.txt").write_text("\n".join(docs[:heldout]) + "\n", encoding="utf-8")


def poem_structure_ok(prompt: str, completion: str, finish_reason: str = "stop") -> bool:
    """Three or more complete lines of the prompt line's length, with alternating ，/。."""
    m = LINE.fullmatch(prompt.strip())
    if not m or not HAN.match(m.group(1)):
        raise UsageError(f"not a poem opening line: {prompt!r}")
    n = len(m.group(1))
    text = completion.strip()
    lines = LINE.findall(text)
    consumed = sum(len(a) + 1 for a, _ in lines)
    tail = text[consumed:]
    if tail and not (finish_reason == "length" and HAN.match(tail) and len(tail) < n):
        return False
    if len(lines) < 3:
        return False
    for i, (body, mark) in enumerate(lines, start=1):  # the prompt is line 0 and ends with ，
        if len(body) != n or not HAN.match(body) or mark != PUNCT[i % 2]:
            return False
    return True


def distinct_2(completions: list[str]) -> float:
    bigrams: list[str] = []
    for text in completions:
        for segment in re.split(r"[^\u3400-\u9fff\U00020000-\U0002ffffA-Za-z]+", text):
            bigrams.extend(segment[i : i + 2] for i in range(len(segment) - 1))
    return len(set(bigrams)) / len(bigrams) if bigrams else 0.0


def word_validity(
    completions: list[str], vocabulary: frozenset[str], reasons: list[str] | None = None
) -> tuple[float, int]:
    """Share of generated words in the training vocabulary. A word cut off by the end of the canvas
    (finish_reason "length", no space or punctuation after it) is not a generated word and is not counted,
    as a cut-off last line is allowed by the structure rule."""
    words: list[str] = []
    for i, text in enumerate(completions):
        found = WORD.findall(text)
        if found and reasons is not None and reasons[i] == "length" and text.endswith(found[-1]):
            found = found[:-1]
        words.extend(w.lower() for w in found)
    return (sum(w in vocabulary for w in words) / len(words) if words else 0.0), len(words)


def poem_quality(prompts: list[str], completions: list[str], reasons: list[str]) -> dict[str, float]:
    ok = [poem_structure_ok(p, c, r) for p, c, r in zip(prompts, completions, reasons)]
    return {"structure_rate": sum(ok) / len(ok) if ok else 0.0, "distinct_2": distinct_2(completions)}


def heldout_nll(engine: Any, docs: list[str], seq_len: int = 128, draws: int = 8, seed: int = 0) -> float:
    """Diffusion NLL upper bound per token on held-out documents, packed into rows with EOS between."""
    import torch

    from ..recipe.train import nll_bound

    flat: list[int] = []
    for d in docs:
        flat += engine.tokenizer.encode(d) + [engine.tokenizer.eos_id]
    rows = len(flat) // seq_len
    if rows == 0:
        raise UsageError("held-out set is too small for the NLL estimate")
    x = torch.tensor(flat[: rows * seq_len]).view(rows, seq_len)
    return nll_bound(engine.model, x, engine.tokenizer.mask_id, torch.Generator().manual_seed(seed), draws, rows=32)


def evaluate(
    engine: Any,
    params: Any,
    evalset: EvalSet,
    poems: int = 200,
    english: int = 100,
    batch_size: int = 32,
    nll: bool = True,
) -> dict[str, Any]:
    """Generate on the held-out prompts with `params` and score the outputs."""
    import time

    poem_rows = evalset.poems[:poems]
    en_rows = evalset.english[:english]
    t0 = time.perf_counter()
    pr = engine.generate([r["prompt"] for r in poem_rows], params, batch_size=batch_size)
    en = engine.generate([r["prompt"] for r in en_rows], params, batch_size=batch_size) if en_rows else []
    wall = time.perf_counter() - t0
    quality = poem_quality([r["prompt"] for r in poem_rows], [r.text for r in pr], [r.finish_reason for r in pr])
    validity, n_words = word_validity([r.text for r in en], evalset.words, [r.finish_reason for r in en])
    out_tokens = sum(r.output_tokens for r in pr + en)
    report: dict[str, Any] = {
        "poems": len(pr),
        "english_prompts": len(en),
        **quality,
        "english_word_validity": validity,
        "english_words": n_words,
        "output_tokens": out_tokens,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(out_tokens / wall, 1),
        "settings": params.report(),
        "device": str(engine.device),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "samples": [{"prompt": r.prompt, "text": r.text} for r in (pr[:3] + en[:2])],
    }
    if nll:
        report["heldout_nll_per_token"] = round(heldout_nll(engine, evalset.heldout), 4)
    return report
