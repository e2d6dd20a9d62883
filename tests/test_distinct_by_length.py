"""scripts/distinct_by_length.py, end to end on the tiny test model: both decoders' answers are kept, and
the length-matched figure is distinct-2 over each pair cut to the shorter answer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from celeris_cli.measure.evaluate import distinct_2

ROOT = Path(__file__).resolve().parents[1]


def test_distinct_by_length_reports_pooled_and_length_matched_distinct_2(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "texts.json"
    args = ["--model", str(tiny_model), "--prompts", "6", "--gen-length", "24", "--block-length", "8", "--steps", "24"]
    p = subprocess.run(
        [sys.executable, "scripts/distinct_by_length.py", *args, "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    report, texts = json.loads(p.stdout), json.loads(out.read_text(encoding="utf-8"))
    assert set(report) == set(texts) == {"reference", "dual-cache"}
    ref, fast = texts["reference"], texts["dual-cache"]
    assert len(ref) == len(fast) == 6 and ref != fast  # two decoders, the same prompts
    cut = [min(len(a), len(b)) for a, b in zip(ref, fast)]
    for mode, answers in texts.items():
        row = report[mode]
        assert row["characters"] == sum(map(len, answers))
        assert row["distinct_2"] == round(distinct_2(answers), 4)
        assert row["distinct_2_length_matched"] == round(distinct_2([t[:n] for t, n in zip(answers, cut)]), 4)
        assert sum(row["line_marks"].values()) == 6
