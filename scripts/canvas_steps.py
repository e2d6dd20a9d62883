#!/usr/bin/env python3
"""Denoising steps per second of the tiny DiffusionGemma test checkpoint on the CPU (issue 55, item 5).

    OMP_NUM_THREADS=1 python scripts/canvas_steps.py --repeat 3

One prompt, the folder's generation_config (48 steps a canvas at most, 16 new tokens, canvases of 8), seed 0,
float32, batch of one: one untimed warm-up decode, then `--repeat` timed decodes. A step is one decoder pass
over the canvas (counted at the model: `hidden`, or `denoise` in checkouts before the step was chunked) with
what follows it (the head, entropies, draws); the causal passes over the prompt and the committed canvases
are in the wall time but not in the count. Prints one JSON line: the steps of a decode, each decode's wall
time, and steps/s of the best. It uses only what older checkouts also have (`load_engine`, `generate`,
`Result.text`), so the same file measures an old commit from a scratch worktree (PYTHONPATH=that worktree).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FOLDER = REPO / "tests" / "data" / "diffusion_gemma" / "diffusion_gemma_tiny"
PROMPT = "The jury said it"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="timed decodes, 1 to 20 (the best is reported)")
    args = ap.parse_args()
    if not 1 <= args.repeat <= 20:
        print(f"Error: --repeat {args.repeat}: give 1 to 20", file=sys.stderr)
        return 2
    import torch

    from celeris_cli.engine import load_engine

    engine = load_engine(FOLDER, device="cpu", dtype="float32")
    model = engine.model
    name = "hidden" if hasattr(model, "hidden") else "denoise"  # the decoder pass, in new and old checkouts
    inner = getattr(model, name)
    count = [0]

    def counted(*a: Any, **k: Any) -> Any:
        count[0] += 1
        return inner(*a, **k)

    setattr(model, name, counted)
    params = engine.params({"seed": 0})
    engine.generate([PROMPT], params, batch_size=1)  # warm-up
    walls, steps, tokens = [], None, None
    for _ in range(args.repeat):
        count[0] = 0
        t0 = time.perf_counter()
        (result,) = engine.generate([PROMPT], params, batch_size=1)
        walls.append(time.perf_counter() - t0)
        if steps is not None and (count[0], (result.text, result.output_tokens)) != (steps, tokens):
            print("Error: two decodes of the same request differ", file=sys.stderr)
            return 1
        steps, tokens = count[0], (result.text, result.output_tokens)
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    best = min(walls)
    out = {
        "commit": head.stdout.strip(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "steps": steps,
        "new_tokens": tokens[1] if tokens else None,
        "forwards": result.nfe,  # the engine's count: the steps, the prompt's pass and the commit passes
        "walls_s": [round(w, 3) for w in walls],
        "steps_per_s": round((steps or 0) / best, 1),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
