"""What exact computation costs an AR step: the default model's step over a KV cache, greedy, at each width,
with plain kernels, with the batch-invariant linear layers (`arch.invariant`), with exact attention
(`arch.exact`) and with both (what `spec` and `ar` run), side by side in one process.

    python scripts/exact_cost.py                       # widths 1, 16, 64; gen 128 after an 8-token prompt
    python scripts/exact_cost.py --widths 1 --repeats 3

Prints one line per width and variant: ms per step and tokens/s (the median of --repeats decodes), each
decode `celeris bench`'s AR limit (its prompt's prefill included) under that variant's kernels.
"""

from __future__ import annotations

import argparse
import statistics

from celeris_cli.arch import exact, invariant
from celeris_cli.engine import load_engine
from celeris_cli.measure.bench import autoregressive_limit


def decode(engine: object, B: int, G: int, inv: bool, exact_keys: bool) -> float:
    """Seconds per output token a row of `bench`'s AR limit (`measure.bench.autoregressive_limit`: an 8-token
    prompt, then G greedy steps over a KV cache) takes with these kernels."""
    with invariant.enabled(inv), exact.enabled(exact_keys):
        limit = autoregressive_limit(engine, B, B, 8, G)  # type: ignore[arg-type]
    return B / limit["tokens_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--widths", default="1,16,64")
    ap.add_argument("--gen-length", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    engine = load_engine(args.model, "cpu", "float32")
    variants = {"plain": (False, False), "invariant": (True, False), "exact": (False, True), "both": (True, True)}
    for B in (int(w) for w in args.widths.split(",")):
        runs: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(args.repeats):  # the order alternates, so neither side always runs on a warmer machine
            for name in list(variants) if r % 2 == 0 else list(reversed(variants)):
                runs[name].append(decode(engine, B, args.gen_length, *variants[name]))
        plain = statistics.median(runs["plain"])
        for name, secs in runs.items():
            s = statistics.median(secs)
            print(f"width {B:>3} {name:>9}: {s * 1e3:7.2f} ms/step  {B / s:8.1f} tokens/s  x plain {plain / s:.2f}")


if __name__ == "__main__":
    main()
