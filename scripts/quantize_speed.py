#!/usr/bin/env python3
"""Weights and decode speed of full, int8 and int4 weights side by side in one process (docs/memory.md).

    python scripts/quantize_speed.py [--model celeris-block] [--dtype float32] [--rounds 3]

Loads the model three times (none, int8, int4), then decodes the same 32 poem and English openings (64
tokens, the model's shipped settings, batch 16) with each in turn, `--rounds` times round-robin so that a
slow moment of a shared machine falls on every scheme alike; prints one JSON line per scheme: the weights'
bytes, the median output tokens/s, and the ratio to the full weights'. Run it with nothing else running.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCHEMES = ("none", "int8", "int4")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from celeris_cli.engine import load_engine
    from celeris_cli.measure.evaluate import EvalSet

    evalset = EvalSet.load()
    prompts = [r["prompt"] for pair in zip(evalset.poems, evalset.english) for r in pair][:32]
    engines = {s: load_engine(args.model, device="cpu", dtype=args.dtype, quantize=s) for s in SCHEMES}
    speeds: dict[str, list[float]] = {s: [] for s in SCHEMES}
    for engine in engines.values():  # warm up
        engine.generate(prompts[:2], engine.params({"gen_length": 8}))
    for _ in range(args.rounds):
        for s, engine in engines.items():
            t0 = time.perf_counter()
            results = engine.generate(prompts, engine.params({"gen_length": 64}), batch_size=16)
            speeds[s].append(sum(r.output_tokens for r in results) / (time.perf_counter() - t0))
    base = statistics.median(speeds["none"])
    for s, engine in engines.items():
        weights = sum(t.numel() * t.element_size() for t in engine.model.state_dict().values())
        tps = statistics.median(speeds[s])
        runs = [round(x, 1) for x in speeds[s]]
        row = {"quantize": s, "dtype": args.dtype, "weights_mb": round(weights / 1e6, 2),
               "tokens_per_s": round(tps, 1), "of_full": round(tps / base, 3), "runs": runs}  # fmt: skip
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
