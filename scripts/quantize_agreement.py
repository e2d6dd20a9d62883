#!/usr/bin/env python3
"""How many greedy answers quantized weights leave unchanged, per model folder (docs/memory.md).

    python scripts/quantize_agreement.py [FOLDER ...]    # default: the tiny family checkpoints in tests/data

Each folder answers 20 short prompts greedily (temperature 0, 32 tokens, float32 activations) with full
weights, then with `--quantize int8` and `int4`; prints one JSON line per folder and scheme with the count of
answers identical to the full-weight ones.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("tests/data/llada2/llada2_tiny", "tests/data/dream/dream_tiny", "tests/data/llada_hf")
PROMPTS = (
    "The cat sat", "Once upon a time", "A small dog ran", "The sun", "In the morning", "We went", "def add(a, b):",
    "床前明月光，", "白日依山尽，", "The jury said it", "She opened the door", "It was late", "Rain fell on",
    "The old man", "My favourite", "Numbers: 1, 2, 3,", "Hello", "The river", "He said that", "At night",
)  # fmt: skip


def main() -> int:
    sys.path.insert(0, str(REPO))
    from celeris_cli.engine import load_engine

    for folder in sys.argv[1:] or [str(REPO / f) for f in FOLDERS]:
        answers = {}
        for scheme in ("none", "int8", "int4"):
            engine = load_engine(folder, device="cpu", dtype="float32", quantize=scheme)
            params = engine.params({"gen_length": 32, "temperature": 0.0})
            answers[scheme] = [r.text for r in engine.generate(list(PROMPTS), params)]
        for scheme in ("int8", "int4"):
            same = sum(a == b for a, b in zip(answers["none"], answers[scheme]))
            print(json.dumps({"model": Path(folder).name, "quantize": scheme, "identical": same, "of": len(PROMPTS)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
