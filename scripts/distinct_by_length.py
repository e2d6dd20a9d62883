"""What a distinct-2 gap between decoders is made of, over several seeds. Pooled distinct-2 falls as the
pooled text grows, so a decoder that writes longer poems reads lower, and on 64 prompts one run's figure
moves by about 2 points from seed to seed. Decodes `celeris bench`'s poem openings with the reference
decoder, the model's default decoding and any `--mode NAME=JSON` (settings over the model's), for seeds
0..N-1, then reports per mode, as means over the seeds: distinct-2 pooled (and each seed's; and, in
points, the mean of its per-seed differences to the reference's on the same seed, with that mean's
standard error); distinct-2 with each answer and the reference's for the same prompt and seed both cut to
the shorter one (this mode's figure and the reference's so cut); over each answer's first k lines; the
characters; and how many answers have 3 / 5 / 7 line marks after the prompt (4-, 6- and 8-line poems).
The reference decodes with each row leaving the batch once its answer is finished
(`strategies.reference_until_finished`: the same answers, exactly so in float32 and on every answer
checked in bfloat16, about 7 times sooner than the 10 minutes per seed it takes on 2 CPU cores to the end
of the canvas); `--answers FILE` keeps every (mode, seed)'s answers there and decodes only those it does
not hold yet.

    python scripts/distinct_by_length.py --seeds 4 --mode dual-cache='{"cache": "dual", "suffix_window": 0}' \
        --answers answers.json
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import re
import statistics
from pathlib import Path
from typing import Any
from unittest.mock import patch

from celeris_cli.decode.strategies import DECODERS, Decoder, reference_until_finished
from celeris_cli.engine import load_engine
from celeris_cli.measure.evaluate import EvalSet, distinct_2

MARKS = re.compile(r"[，。]")
KS = (2, 4)  # first lines compared


def first_lines(text: str, k: int) -> str:
    return "".join(re.split(r"(?<=[，。])", text)[:k])


def seeds_arg(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of seeds, 1 or more, got {text!r}")
    return int(text)


def settings_arg(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def mode_arg(text: str) -> tuple[str, dict[str, Any]]:
    name, sep, settings = text.partition("=")
    if not sep or not name or name in ("reference", "default"):
        raise argparse.ArgumentTypeError(
            f"expected NAME=JSON with a NAME other than reference and default, got {text!r}"
        )
    return name, settings_arg(settings)


def summary(runs: list[list[str]], refs: list[list[str]]) -> dict[str, Any]:
    """One mode's figures over its seeds (`runs[i]`: seed i's answers; `refs[i]`: the reference's)."""
    n = len(runs)
    d2 = [distinct_2(a) for a in runs]
    # each answer and the reference's for the same prompt and seed, both cut to the shorter of the two
    cut = [[min(len(t), len(r)) for t, r in zip(a, ref)] for a, ref in zip(runs, refs)]
    matched = [distinct_2([t[:c] for t, c in zip(a, cs)]) for a, cs in zip(runs, cut)]
    ref_matched = [distinct_2([r[:c] for r, c in zip(ref, cs)]) for ref, cs in zip(refs, cut)]
    marks = collections.Counter(len(MARKS.findall(t)) for a in runs for t in a)
    # paired by seed: this mode's distinct-2 minus the reference's on the same prompts and seed, in points
    diff = [100 * (x - distinct_2(ref)) for x, ref in zip(d2, refs)]
    return {
        "distinct_2": round(sum(d2) / n, 4),
        "distinct_2_per_seed": [round(x, 4) for x in d2],
        "minus_reference_points": round(statistics.mean(diff), 2),
        "its_standard_error": round(statistics.stdev(diff) / math.sqrt(n), 2) if n > 1 else None,
        "distinct_2_length_matched": round(sum(matched) / n, 4),
        "reference_length_matched": round(sum(ref_matched) / n, 4),
        **{
            f"distinct_2_first_{k}_lines": round(sum(distinct_2([first_lines(t, k) for t in a]) for a in runs) / n, 4)
            for k in KS
        },
        "characters_per_seed": round(sum(len(t) for a in runs for t in a) / n, 1),
        "line_marks_per_seed": {m: round(marks[m] / n, 2) for m in (3, 5, 7)},
        "other_line_marks_per_seed": round(sum(c for m, c in marks.items() if m not in (3, 5, 7)) / n, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="celeris-tiny")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--seeds", type=seeds_arg, default=1, help="seeds 0..N-1, each decoded by every mode")
    ap.add_argument("--gen-length", type=int, default=256)
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--steps", type=int, default=256, help="denoising steps over the whole canvas")
    ap.add_argument("--set", type=settings_arg, default={}, help="settings for every mode, as JSON")
    ap.add_argument("--mode", type=mode_arg, action="append", default=[], help="another mode: NAME=JSON settings")
    ap.add_argument("--answers", type=Path, default=None, help="keep the answers here; reuse those it holds")
    args = ap.parse_args()
    engine = load_engine(args.model)
    prompts = [r["prompt"] for r in EvalSet.load().poems[: args.prompts]]
    canvas = {"gen_length": args.gen_length, "block_length": args.block_length, "denoise_steps": args.steps, **args.set}
    modes = {"reference": {"strategy": "reference"}, "default": {}, **dict(args.mode)}
    # answers are keyed by the model, dtype and prompts, and each mode's by its settings as resolved over the
    # model's defaults, so a file never serves answers decoded with other settings (the weights and the
    # decoders' code are not in the key: start a new file when they change)
    key = json.dumps(
        {"model": str(engine.model_dir), "dtype": str(engine.dtype), "prompts": prompts}, ensure_ascii=False
    )
    kept = json.loads(args.answers.read_text(encoding="utf-8")) if args.answers and args.answers.exists() else {}
    store = kept.get(key, {})
    texts: dict[str, list[list[str]]] = {}
    until_finished = Decoder(DECODERS["reference"].plan, reference_until_finished)
    with patch.dict(DECODERS, {"reference": until_finished}):  # the same answers, sooner
        for name, over in modes.items():
            settings = {k: v for k, v in engine.params({**canvas, **over}).report().items() if k != "seed"}
            slot = store.setdefault(json.dumps(settings, sort_keys=True), {})  # its answers by seed
            for seed in range(args.seeds):
                if str(seed) not in slot:
                    params = engine.params({**canvas, **over, "seed": seed})
                    slot[str(seed)] = [r.text for r in engine.generate(prompts, params, batch_size=16)]
                    if args.answers:  # after each run, so an interrupted sweep keeps what it decoded
                        tmp = args.answers.with_suffix(".tmp")
                        tmp.write_text(json.dumps({**kept, key: store}, ensure_ascii=False), encoding="utf-8")
                        tmp.replace(args.answers)
            texts[name] = [slot[str(seed)] for seed in range(args.seeds)]
    report = {name: summary(runs, texts["reference"]) for name, runs in texts.items()}
    print(json.dumps(report, ensure_ascii=False, indent=1))


if __name__ == "__main__":
    main()
