"""Whether an answer depends on its batch: the same requests decoded alone and in batches, compared.

An answer must depend only on its request (model, prompt, settings, seed). These measurements decode the
held-out poem and English openings (mixed lengths, interleaved, one seed per prompt) alone and batched and
count the identical answers.
"""

from __future__ import annotations

import time
from typing import Any

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
