#!/usr/bin/env python3
"""The queue daemon, one batch at a time against its running set, side by side (docs/scheduling.md).

    python scripts/queue_running_bench.py [--files 4] [--per-file 32] [--batch-size 16] [--lengths model]

Writes `--files` JSONL files of held-out poem and English openings, each line asking for its own gen_length
(16 to 128, cycling; `--lengths model`: none, the model's own, rows ending where the model ends them), into
two fresh queue folders, and runs `celeris watch --once`'s loop (`Spool.run`) on
each with the default model in float32: once with the in-process pool that decodes one batch at a time
(`InlinePool`), once with the running set (`RunningPool`), the model loaded once for both. Prints one JSON
line: wall time, output tokens/s and the ratio, and how many answers are identical. Run it alone.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GEN_LENGTHS = (16, 32, 64, 128)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--per-file", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lengths", choices=("mixed", "model"), default="mixed")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from celeris_cli.measure.evaluate import EvalSet
    from celeris_cli.spool import daemon
    from celeris_cli.spool.backend import EngineBackend
    from celeris_cli.spool.config import load_config
    from celeris_cli.spool.pool import as_pool

    evalset = EvalSet.load()
    pool = [r["prompt"] for pair in zip(evalset.poems, evalset.english) for r in pair]
    backend = None
    runs = {}
    for name, running in (("one_batch_at_a_time", False), ("running_set", True)):
        root = Path(tempfile.mkdtemp(prefix=f"celeris-{name}-"))
        for d in ("batch_inputs", "batch_outputs", "batch_processed", "logs", "configs"):
            (root / d).mkdir()
        cfg = {"root": "..", "device": "cpu", "dtype": "float32", "batch_size": args.batch_size, "settle_s": 0}
        (root / "configs" / "batch.yaml").write_text(json.dumps(cfg), encoding="utf-8")
        for f in range(args.files):
            lines = []
            for i in range(args.per_file):
                k = f * args.per_file + i
                gen = GEN_LENGTHS[k % len(GEN_LENGTHS)]
                lines.append(
                    json.dumps({"custom_id": f"{k}", "prompt": pool[k % len(pool)], "gen_length": gen, "seed": k})
                )
            (root / "batch_inputs" / f"part{f}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
        config = load_config(root / "configs" / "batch.yaml")
        if backend is None:
            backend = EngineBackend(None, "cpu", "float32", None, config.generation)
        daemon.as_pool = lambda b, t, m, running=running: as_pool(b, t, m, running)  # type: ignore[misc]
        spool = daemon.Spool(config, lambda backend=backend: backend)
        t0 = time.perf_counter()
        code = spool.run(once=True)
        wall = time.perf_counter() - t0
        texts, tokens = {}, 0
        for out in sorted((root / "batch_outputs").glob("*.results.jsonl")):
            for line in out.read_text(encoding="utf-8").splitlines():
                rec = json.loads(line)
                body = rec["response"]["body"]
                texts[rec["custom_id"]] = body["text"]
                tokens += body["usage"]["completion_tokens"]
        runs[name] = {"exit": code, "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 1),
                      "answers": len(texts), "texts": texts}  # fmt: skip
    a, b = runs["one_batch_at_a_time"].pop("texts"), runs["running_set"].pop("texts")
    same = sum(a[k] == b.get(k) for k in a)
    ratio = runs["running_set"]["tokens_per_s"] / max(runs["one_batch_at_a_time"]["tokens_per_s"], 1e-9)
    report = {"lengths": args.lengths, **runs, "speedup": round(ratio, 3), "identical_answers": same, "of": len(a)}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
