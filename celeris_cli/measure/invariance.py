"""Whether an answer depends on its batch: the same requests decoded alone and in batches, compared.

An answer must depend only on its request (model, prompt, settings, seed). These measurements decode the
held-out poem and English openings (mixed lengths, interleaved, one seed per prompt) alone and batched and
count the identical answers.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..engine import Engine
from .bench import agreement
from .evaluate import EvalSet


def mixed_prompts(n: int) -> list[str]:
    """n held-out openings of mixed lengths: poems and English prose, interleaved."""
    evalset = EvalSet.load()
    pool = [r["prompt"] for pair in zip(evalset.poems, evalset.english) for r in pair]
    return pool[:n]


def batch_invariance(
    engine: Engine, n_prompts: int, batch_size: int, settings: dict[str, Any] | None = None
) -> dict[str, Any]:
    """How often an answer decoded alone equals the same request decoded in a batch of mixed-length prompts
    (held-out poem and English openings, interleaved), with the model's defaults and one seed per prompt.
    In float32 this must be 1.0; in bfloat16 left padding changes the rounding, and this measures by how much."""
    prompts = mixed_prompts(n_prompts)
    params = engine.params(settings or {})
    seeds = list(range(len(prompts)))
    t0 = time.perf_counter()
    batched = [r.text for r in engine.generate(prompts, params, batch_size=batch_size, seeds=seeds)]
    alone = [engine.generate([p], params, batch_size=1, seeds=[s])[0].text for p, s in zip(prompts, seeds)]
    lengths = [len(engine.encode_prompt(p)) for p in prompts]
    return {
        "prompts": len(prompts),
        "prompt_tokens": {"min": min(lengths), "max": max(lengths)},
        "batch_size": batch_size,
        "dtype": str(engine.dtype).replace("torch.", ""),
        "settings": {k: v for k, v in params.report().items() if k != "seed"},
        "seeds": f"0..{len(prompts) - 1}, one per prompt",
        "wall_s": round(time.perf_counter() - t0, 1),
        **agreement(alone, batched),
    }


def deterministic_cost(
    engine: Engine, batch_sizes: list[int], n_prompts: int, settings: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Output tokens/s with the batch-invariant mode on and off (`deterministic`), side by side, at each batch
    size: the same mixed-length prompts (at least one full batch's worth), one seed each, the model's
    defaults under `settings`. On and off alternate which runs first from one batch size to the next, so a
    drift in the machine's load does not favour one. Also whether each mode's answers are the same at every
    batch size (share of rows identical to the batch-1 or smallest batch's answers)."""
    base = engine.params(settings or {})
    rows: list[dict[str, Any]] = []
    texts: dict[bool, dict[int, list[str]]] = {True: {}, False: {}}
    n = max(n_prompts, *batch_sizes)
    prompts = mixed_prompts(n)
    seeds = list(range(len(prompts)))
    for i, batch in enumerate(batch_sizes):
        cell: dict[str, Any] = {"batch_size": batch, "prompts": len(prompts)}
        for on in (True, False) if i % 2 == 0 else (False, True):
            t0 = time.perf_counter()
            results = engine.generate(prompts, base.with_(deterministic=on), batch_size=batch, seeds=seeds)
            wall = time.perf_counter() - t0
            tokens = sum(r.output_tokens for r in results)
            cell["on" if on else "off"] = {"wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 2)}
            texts[on][batch] = [r.text for r in results]
        cell["cost"] = round(1 - cell["on"]["tokens_per_s"] / cell["off"]["tokens_per_s"], 4)
        rows.append(cell)
    first = batch_sizes[0]
    return {
        "prompts": len(prompts),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "settings": {k: v for k, v in base.report().items() if k not in ("seed", "deterministic")},
        "rows": rows,
        "same_answers_as_batch": {
            "batch": first,
            **{
                ("on" if on else "off"): {b: agreement(texts[on][first], t)["identical_rows"] for b, t in by.items()}
                for on, by in texts.items()
            },
        },
    }
