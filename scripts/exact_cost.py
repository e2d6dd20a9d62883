"""What exact computation costs an AR step: the default model's step over a KV cache, greedy, at each width,
with plain kernels, with the batch-invariant linear layers (`arch.invariant`), with exact attention
(`arch.exact`) and with both (what `spec` and `ar` run), side by side in one process.

    python scripts/exact_cost.py                       # widths 1, 16, 64; gen 128 after an 8-token prompt
    python scripts/exact_cost.py --widths 1 --repeats 3

Prints one line per width and variant: ms per step and tokens/s (the median of --repeats decodes).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from celeris_cli.arch import exact, invariant
from celeris_cli.arch.kv import KVCache
from celeris_cli.engine import load_engine


def decode(model: object, B: int, P: int, G: int, inv: bool, exact_keys: bool) -> float:
    """Seconds per step of a greedy AR decode of B rows, G steps after a P-token prompt."""
    L = P + G
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, model.cfg.vocab_size, (B, L), generator=g)  # type: ignore[attr-defined]
    pos = torch.arange(L).expand(B, L)
    keys = torch.ones(B, L, dtype=torch.bool)
    with torch.no_grad(), invariant.enabled(inv), exact.enabled(exact_keys):
        h, kv = model.hidden(ids[:, :P], pos[:, :P], keys[:, :P])  # type: ignore[attr-defined]
        k0 = kv[0][0]
        cache = KVCache.empty(len(kv), B, k0.shape[1], L, k0.shape[3], torch.float32, k0.device)
        for (ck, cv), (k, v) in zip(cache.layers, kv):
            ck[:, :, :P], cv[:, :, :P] = k, v
        began = time.perf_counter()
        for t in range(P, L - 1):
            h, _ = model.hidden(ids[:, t : t + 1], pos[:, t : t + 1], keys[:, : t + 1], cache.view(length=t + 1), t)  # type: ignore[attr-defined]
            ids[:, t + 1] = model.head(h[:, -1]).argmax(-1)  # type: ignore[attr-defined]
        return (time.perf_counter() - began) / (L - 1 - P)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--widths", default="1,16,64")
    ap.add_argument("--gen-length", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model = load_engine(args.model, "cpu", "float32").model
    variants = {"plain": (False, False), "invariant": (True, False), "exact": (False, True), "both": (True, True)}
    for B in (int(w) for w in args.widths.split(",")):
        runs: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(args.repeats):  # the order alternates, so neither side always runs on a warmer machine
            for name in list(variants) if r % 2 == 0 else list(reversed(variants)):
                runs[name].append(decode(model, B, 8, args.gen_length, *variants[name]))
        plain = statistics.median(runs["plain"])
        for name, secs in runs.items():
            s = statistics.median(secs)
            print(f"width {B:>3} {name:>9}: {s * 1e3:7.2f} ms/step  {B / s:8.1f} tokens/s  x plain {plain / s:.2f}")


if __name__ == "__main__":
    main()
