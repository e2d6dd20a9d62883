"""`celeris eval`: quality figures on a fixed held-out set, reused by `bench` to check faster decoding.

- structure rate: prompted with the first line of a held-out five- or seven-character regular poem, the
  share of completions that add at least three complete lines, each as long as the prompt line, ending
  alternately in ， and 。 (a line cut off by the end of the canvas is allowed; anything else fails);
- distinct-2: unique character bigrams over all bigrams, pooled over all poem completions, punctuation
  excluded (bigrams do not cross it). Greedy decoding of a small model repeats one filler line for every
  prompt and scores near 0.02 while still scoring well on structure, so both are always reported;
- NLL bound per token on held-out documents (the diffusion ELBO, Monte-Carlo over mask ratios);
- English word validity: the share of generated English words found in the training vocabulary (a word
  cut off by the end of the canvas is not counted);
- English prose (`english_quality`): word-level distinct-2 pooled over all answers, the repetition rate
  (answers in which one word is more than 20% of the words, or a word 3-gram occurs twice), the empty-answer
  rate and the mean length in words; the same figures for the human continuations of the same openings,
  cut to the same canvas, are the reference row.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
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


def words_of(text: str) -> list[str]:
    """The answer's words, lower-cased, punctuation dropped."""
    return [w.lower() for w in WORD.findall(text)]


def word_distinct_2(completions: list[str]) -> float:
    """Unique word bigrams over all word bigrams, pooled over answers (a bigram never spans two answers)."""
    bigrams: list[tuple[str, str]] = []
    for text in completions:
        words = words_of(text)
        bigrams.extend(zip(words, words[1:]))
    return len(set(bigrams)) / len(bigrams) if bigrams else 0.0


MIN_WORDS_FOR_SHARE = 10  # below this, any word is a large share of an answer: only 3-grams count


def repetitive(text: str, share: float = 0.2) -> bool:
    """One word more than `share` of the words (answers of at least MIN_WORDS_FOR_SHARE words), or a word
    3-gram that occurs twice."""
    words = words_of(text)
    if len(words) >= MIN_WORDS_FOR_SHARE and max(Counter(words).values()) > share * len(words):
        return True
    trigrams = list(zip(words, words[1:], words[2:]))
    return len(set(trigrams)) < len(trigrams)


def english_quality(completions: list[str]) -> dict[str, float]:
    """Word-level distinct-2, repetition rate, empty-answer rate (no word at all) and mean length in words."""
    n = len(completions)
    lengths = [len(words_of(t)) for t in completions]
    return {
        "distinct_2": word_distinct_2(completions),
        "repetition_rate": sum(map(repetitive, completions)) / n if n else 0.0,
        "empty_rate": sum(k == 0 for k in lengths) / n if n else 0.0,
        "mean_words": sum(lengths) / n if n else 0.0,
    }


def human_continuations(engine: Any, rows: list[dict[str, str]], gen_length: int) -> list[str]:
    """What the corpus wrote after each opening, cut to the model's canvas (gen_length tokens), so that the
    reference row is measured on answers of the length the model could give."""
    out = []
    for r in rows:
        rest = r["text"][len(r["prompt"]) :] if r["text"].startswith(r["prompt"]) else r["text"]
        out.append(engine.tokenizer.decode(engine.tokenizer.encode(rest)[:gen_length]))
    return out


def poem_quality(prompts: list[str], completions: list[str], reasons: list[str]) -> dict[str, float]:
    ok = [poem_structure_ok(p, c, r) for p, c, r in zip(prompts, completions, reasons)]
    return {"structure_rate": sum(ok) / len(ok) if ok else 0.0, "distinct_2": distinct_2(completions)}


def heldout_nll(engine: Any, docs: list[str], seq_len: int = 128, draws: int = 8, seed: int = 0) -> float | None:
    """Diffusion NLL upper bound per token on held-out documents, packed into rows with EOS between. For a
    block-diffusion model (llada_block), the bound of its blocks at the model's default block length. None
    for the other families, whose attention pattern or logit shift the estimate does not model."""
    import torch

    from ..recipe.train import nll_bound

    if engine.arch.name not in ("llada", "llada_block", "llada_spec"):
        return None
    joint = engine.arch.name == "llada_spec"  # its blocks over a causal cache, as it was trained
    sizes = [engine.params({}).block_length] if engine.arch.name != "llada" else None

    flat: list[int] = []
    for d in docs:
        flat += engine.tokenizer.encode(d) + [engine.tokenizer.eos_id]
    rows = len(flat) // seq_len
    if rows == 0:
        raise UsageError("held-out set is too small for the NLL estimate")
    x = torch.tensor(flat[: rows * seq_len]).view(rows, seq_len)
    g = torch.Generator().manual_seed(seed)
    return nll_bound(engine.model, x, engine.tokenizer.mask_id, g, draws, rows=32, sizes=sizes, joint=joint)[0]


# Which rows of the shipped set serve which purpose: settings are chosen on "tune", reported on "eval".
SPLITS: dict[str, tuple[slice, slice]] = {
    "eval": (slice(0, 200), slice(0, 100)),  # (poem rows, English rows)
    "tune": (slice(200, 300), slice(100, 150)),
}


def evaluate(
    engine: Any,
    params: Any,
    evalset: EvalSet,
    poems: int = 200,
    english: int = 100,
    batch_size: int = 32,
    nll: bool = True,
    split: str = "eval",
    samples: int = 1,
) -> dict[str, Any]:
    """Generate on the split's held-out prompts with `params` (`samples` answers per prompt, seeds
    params.seed, +1, ...) and score the outputs."""
    import time

    if split not in SPLITS:
        raise UsageError(f"unknown split {split!r} (choose {', '.join(SPLITS)})")
    poem_split, en_split = SPLITS[split]
    poem_rows = evalset.poems[poem_split][:poems]
    en_rows = evalset.english[en_split][:english]
    seeds = [params.seed + k for k in range(samples)]

    def run(rows: list[dict[str, str]]) -> list[Any]:
        prompts = [r["prompt"] for r in rows for _ in seeds]
        return engine.generate(prompts, params, batch_size=batch_size, seeds=seeds * len(rows)) if rows else []

    t0 = time.perf_counter()
    pr, en = run(poem_rows), run(en_rows)
    wall = time.perf_counter() - t0
    quality = poem_quality([r.prompt for r in pr], [r.text for r in pr], [r.finish_reason for r in pr])
    validity, n_words = word_validity([r.text for r in en], evalset.words, [r.finish_reason for r in en])
    prose = english_quality([r.text for r in en])
    human = english_quality(human_continuations(engine, en_rows, params.gen_length))
    out_tokens = sum(r.output_tokens for r in pr + en)
    report: dict[str, Any] = {
        "split": split,
        "poems": len(pr),
        "english_prompts": len(en),
        **quality,
        "english_word_validity": validity,
        "english_words": n_words,
        **{f"english_{k}": v for k, v in prose.items()},
        "human_reference": {f"english_{k}": v for k, v in human.items()},
        "output_tokens": out_tokens,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(out_tokens / wall, 1),
        "settings": pr[0].settings if pr else params.report(),
        "english_settings": en[0].settings if en else params.report(),
        "device": str(engine.device),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "samples": [{"prompt": r.prompt, "text": r.text} for r in (pr[:3] + en[:2])],
    }
    if nll:
        bound = heldout_nll(engine, evalset.heldout)
        report["heldout_nll_per_token"] = None if bound is None else round(bound, 4)
    return report
