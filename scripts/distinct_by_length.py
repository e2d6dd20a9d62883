"""What a distinct-2 gap between two decoders is made of: pooled distinct-2 falls as the pooled text grows,
so a decoder that writes longer poems reads lower. Decodes `celeris bench`'s poem openings with the
reference decoder and the default fast mode (celeris-tiny's settings, as the issue #12 command runs them),
then reports distinct-2 pooled as is, with each pair of answers cut to the shorter one's length, and over
each answer's first k lines, with the answers' line counts. About 10 minutes on 2 CPU cores (the reference).

    python scripts/distinct_by_length.py --prompts 64 --out texts.json
"""

from __future__ import annotations

import argparse
import collections
import json
import re

from celeris_cli.engine import load_engine
from celeris_cli.measure.evaluate import EvalSet, distinct_2

MARKS = re.compile(r"[，。]")
KS = (2, 4)  # first lines compared


def first_lines(text: str, k: int) -> str:
    return "".join(re.split(r"(?<=[，。])", text)[:k])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="celeris-tiny")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--gen-length", type=int, default=256)
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--steps", type=int, default=256, help="denoising steps over the whole canvas")
    ap.add_argument("--out", default=None, help="also write both decoders' answers here (JSON)")
    args = ap.parse_args()
    engine = load_engine(args.model)
    prompts = [r["prompt"] for r in EvalSet.load().poems[: args.prompts]]
    canvas = {"gen_length": args.gen_length, "block_length": args.block_length, "denoise_steps": args.steps}
    texts = {
        mode: [r.text for r in engine.generate(prompts, engine.params({**canvas, **over}), batch_size=16)]
        for mode, over in (("dual-cache", {"cache": "dual"}), ("reference", {"strategy": "reference"}))
    }
    ref, fast = texts["reference"], texts["dual-cache"]
    cut = [min(len(a), len(b)) for a, b in zip(ref, fast)]
    report = {
        mode: {
            "characters": sum(map(len, answers)),
            "distinct_2": round(distinct_2(answers), 4),
            "distinct_2_length_matched": round(distinct_2([t[:n] for t, n in zip(answers, cut)]), 4),
            **{f"distinct_2_first_{k}_lines": round(distinct_2([first_lines(t, k) for t in answers]), 4) for k in KS},
            "line_marks": dict(sorted(collections.Counter(len(MARKS.findall(t)) for t in answers).items())),
        }
        for mode, answers in texts.items()
    }
    print(json.dumps(report, ensure_ascii=False, indent=1))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(texts, f, ensure_ascii=False)


if __name__ == "__main__":
    main()
