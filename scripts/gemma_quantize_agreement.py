#!/usr/bin/env python3
"""How far int8 and int4 weights (routed experts included) move DiffusionGemma's tiny checkpoint (docs/memory.md).

    python scripts/gemma_quantize_agreement.py

For 20 short prompts, each against one random canvas of 8 tokens: the first denoising step's logits with full
float32 weights, then bfloat16 weights, and int8 and int4 under float32 and bfloat16 activations; prints one JSON
line per case with the share of positions whose argmax is unchanged and the logits' relative error. Then each
prompt's whole answer (16 tokens, greedy limit: temperature 1e-5 to 0, seed 0): how many are identical to full
float32 weights' and how many of their tokens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDER = REPO / "tests" / "data" / "diffusion_gemma" / "diffusion_gemma_tiny"
CASES = (("bfloat16", "none"), ("float32", "int8"), ("float32", "int4"), ("bfloat16", "int8"), ("bfloat16", "int4"))


def main() -> int:
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "scripts"))
    import torch
    from quantize_agreement import PROMPTS

    from celeris_cli.arch.checkpoint import load_model
    from celeris_cli.decode.diffusion_gemma import Context
    from celeris_cli.decode.strategies import Net
    from celeris_cli.engine import load_engine

    encode = load_engine(FOLDER, device="cpu", dtype="float32").encode_prompt
    prompts = [torch.tensor([encode(p)]) for p in PROMPTS]
    g = torch.Generator().manual_seed(0)
    canvases = [torch.randint(0, 320, (1, 8), generator=g) for _ in PROMPTS]
    settings = {"gen_length": 16, "temperature": 1e-5, "temperature_final": 0.0, "seed": 0}

    def first_step(dtype: str, scheme: str) -> torch.Tensor:
        model = load_model(FOLDER, "cpu", getattr(torch, dtype), scheme)
        with torch.no_grad():
            return torch.cat(
                [Context(Net(model), p, torch.ones_like(p, dtype=torch.bool)).denoise(c, None)[0]
                 for p, c in zip(prompts, canvases)]
            )  # fmt: skip

    def answers(dtype: str, scheme: str) -> list[list[int]]:
        engine = load_engine(FOLDER, device="cpu", dtype=dtype, quantize=scheme)
        params = engine.params(settings)
        return [engine.decode_ids([p[0].tolist()], params)[0][0] for p in prompts]

    ref, full = first_step("float32", "none"), answers("float32", "none")
    for dtype, scheme in CASES:
        logits, got = first_step(dtype, scheme), answers(dtype, scheme)
        same = sum(a == b for a, b in zip(full, got))
        tokens = sum(x == y for a, b in zip(full, got) for x, y in zip(a, b))
        print(
            json.dumps({
                "dtype": dtype, "quantize": scheme,
                "argmax_unchanged": round((logits.argmax(-1) == ref.argmax(-1)).float().mean().item(), 3),
                "relative_error": round(((logits - ref).norm() / ref.norm()).item(), 3),
                "answers_identical": same, "of": len(full),
                "tokens_identical": tokens, "of_tokens": sum(len(a) for a in full),
            })
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
