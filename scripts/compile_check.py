"""Does torch.compile pay on this machine? (issue #12, item 5)

    python scripts/compile_check.py --model celeris-tiny --prompts 32 --gen-length 256
    python scripts/compile_check.py --model celeris-block --prompts 64 --gen-length 256

Decodes the same prompts with the model's default mode three times: eager, then with the network's
forward (`hidden`, which every decoder calls) wrapped in `torch.compile(dynamic=True)` twice: the first
compiled run includes the warm-up (tracing, code generation, one graph per shape family the decoder
meets), the second is steady state. Prints one JSON line: wall times, output tokens/s, and whether the
compiled answers equal the eager ones.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from celeris_cli.engine import load_engine
from celeris_cli.measure.evaluate import EvalSet


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--gen-length", type=int, default=256)
    ap.add_argument("--mode", default="default", help="torch.compile mode")
    args = ap.parse_args()
    engine = load_engine(args.model)
    prompts = [r["prompt"] for r in EvalSet.load().poems[: args.prompts]]
    params = engine.params({"gen_length": args.gen_length})

    def run() -> tuple[float, int, list[str]]:
        t0 = time.perf_counter()
        results = engine.generate(prompts, params, batch_size=args.batch_size)
        return time.perf_counter() - t0, sum(r.output_tokens for r in results), [r.text for r in results]

    run()  # eager warm-up (allocator, threads)
    eager_s, eager_tokens, eager_texts = run()
    eager_hidden = engine.model.hidden
    engine.model.hidden = torch.compile(eager_hidden, dynamic=True, mode=None if args.mode == "default" else args.mode)
    first_s, _, _ = run()
    steady_s, steady_tokens, steady_texts = run()
    same = sum(a == b for a, b in zip(eager_texts, steady_texts))
    print(
        json.dumps(
            {
                "model": str(engine.model_dir),
                "strategy": params.strategy,
                "dtype": str(engine.dtype),
                "threads": torch.get_num_threads(),
                "prompts": len(prompts),
                "gen_length": args.gen_length,
                "eager_s": round(eager_s, 2),
                "eager_tokens_per_s": round(eager_tokens / eager_s, 1),
                "compiled_first_run_s": round(first_s, 2),
                "compiled_steady_s": round(steady_s, 2),
                "compiled_tokens_per_s": round(steady_tokens / steady_s, 1),
                "steady_speedup": round(eager_s / steady_s, 3),
                "answers_identical_to_eager": f"{same}/{len(prompts)}",
            }
        )
    )


if __name__ == "__main__":
    main()
