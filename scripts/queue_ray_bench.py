"""The queue on Ray against the queue in-process: `python scripts/queue_ray_bench.py [--prompts 64]
[--batch-size 16] [--actors 1 2] [--dtype float32]`.

Each run is a fresh queue served by a real `celeris watch --once` process over one file of held-out
prompts (mixed lengths, one seed each), so wall times include starting Ray and loading the model in each
actor, as a cron run sees them; `serving_s` is the span of the daemon's event log, from its `start`
(Ray up, models loaded) to its `stop`, at one-second resolution. Prints one JSON line: wall time,
prompts/s and how many answers equal the in-process run's, per run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def requests(n: int) -> str:
    from celeris_cli.measure.evaluate import EvalSet

    evalset = EvalSet.load()
    pool = [r["prompt"] for pair in zip(evalset.poems, evalset.english) for r in pair]
    return "".join(json.dumps({"id": f"p{i}", "prompt": pool[i % len(pool)], "seed": i}) + "\n" for i in range(n))


def serve(
    root: Path, source: str, batch_size: int, dtype: str, actors: int | None, model: str | None = None
) -> dict[str, Any]:
    for d in ("batch_inputs", "batch_outputs", "batch_processed", "logs", "configs"):
        (root / d).mkdir(parents=True)
    cfg: dict[str, Any] = {"root": "..", "device": "cpu", "dtype": dtype, "batch_size": batch_size, "settle_s": 0}
    if model:  # a folder as the user named it from here; or an embedded model's name
        cfg["model"] = str(Path(model).resolve()) if Path(model).exists() else model
    if actors:
        cfg["engine"] = {"ray": {"actors": actors}}
    (root / "configs" / "batch.yaml").write_text(json.dumps(cfg))
    (root / "batch_inputs" / "requests.jsonl").write_text(source, encoding="utf-8")
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-m", "celeris_cli", "watch", str(root / "configs" / "batch.yaml"), "--once", "--quiet"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    if p.returncode != 0 or p.stdout:
        raise SystemExit(f"watch exited {p.returncode}; stdout {p.stdout!r}; stderr {p.stderr[-2000:]}")
    out = root / "batch_outputs" / "requests.jsonl.results.jsonl"
    texts = {r["custom_id"]: r["response"]["body"]["text"] for r in map(json.loads, out.read_text().splitlines())}
    events = [json.loads(x) for x in (root / "logs" / "events.jsonl").read_text().splitlines()]
    in_flight = max((e["in_flight"] for e in events if e["event"] == "submit"), default=0)
    start, stop = (datetime.fromisoformat(e["time"]) for e in (events[0], events[-1]))  # 1 s resolution
    serving = max((stop - start).total_seconds(), 1.0)  # after Ray's start and the model loads
    return {"wall_s": round(wall, 1), "prompts_per_s": round(len(texts) / wall, 2), "max_in_flight": in_flight,
            "serving_s": serving, "serving_prompts_per_s": round(len(texts) / serving, 2), "texts": texts}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--actors", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model", default=None, help="a model folder or an embedded model's name (default: the default)")
    args = ap.parse_args()
    source = requests(args.prompts)
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for actors in [None, *args.actors]:
            name = f"ray-actors-{actors}" if actors else "local"
            runs[name] = serve(Path(tmp) / name, source, args.batch_size, args.dtype, actors, args.model)
    texts = {name: run.pop("texts") for name, run in runs.items()}
    local = runs["local"]
    for name, run in runs.items():
        run["identical_to_local"] = sum(texts[name].get(k) == v for k, v in texts["local"].items())
        run["overhead_vs_local"] = round(local["prompts_per_s"] / run["prompts_per_s"] - 1, 3)
    print(json.dumps({"prompts": args.prompts, "batch_size": args.batch_size, "dtype": args.dtype, "runs": runs}))


if __name__ == "__main__":
    main()
