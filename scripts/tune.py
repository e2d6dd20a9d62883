"""Try decoding settings on the tuning split of the shipped eval set (never the eval split), one model load.

    nice python scripts/tune.py --english 50 --poems 0 --samples 2 --out tune.jsonl \
        '{"block_length": 8}' '{"block_length": 8, "presence_penalty": 0.5}'

Each argument is a setting (JSON, layered over the model's defaults as flags would be); each prints one JSON
line of `celeris eval --split tune` figures and is appended to --out.
"""

from __future__ import annotations

import argparse
import json

from celeris_cli.engine import load_engine
from celeris_cli.measure.evaluate import EvalSet, evaluate

KEYS = (
    "structure_rate",
    "distinct_2",
    "english_word_validity",
    "english_distinct_2",
    "english_repetition_rate",
    "english_empty_rate",
    "english_mean_words",
    "wall_s",
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("settings", nargs="+")
    ap.add_argument("--poems", type=int, default=100)
    ap.add_argument("--english", type=int, default=50)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--model", default=None, help="a model folder or an embedded model's name")
    args = ap.parse_args()
    engine = load_engine(args.model)
    evalset = EvalSet.load()
    for raw in args.settings:
        setting = json.loads(raw)
        report = evaluate(
            engine, engine.params(setting), evalset, args.poems, args.english, 32, False, "tune", args.samples
        )
        row = {"setting": setting, **{k: report[k] for k in KEYS}, "samples": report["samples"]}
        line = json.dumps(row, ensure_ascii=False)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
