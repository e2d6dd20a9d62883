"""scripts/distinct_by_length.py, end to end on the tiny test model: every mode's answers for every seed are
kept, the figures are computed from them (the length-matched ones with each answer and the reference's for the
same prompt and seed cut to the shorter), and a second run reuses the kept answers instead of decoding again."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from celeris_cli.measure.evaluate import distinct_2

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--prompts", "6", "--gen-length", "24", "--block-length", "8", "--steps", "24", "--seeds", "2"]
ARGS += ["--set", '{"temperature": 1.0}']  # the test model decodes greedily by default
ALT = '{"cache": "prefix", "suffix_window": 4}'


def run(model: Path, answers: Path, *extra: str) -> dict:
    p = subprocess.run(
        [sys.executable, "scripts/distinct_by_length.py", "--model", str(model), *ARGS, "--answers", str(answers),
         *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_distinct_by_length_reports_modes_over_seeds_from_kept_answers(tiny_model: Path, tmp_path: Path) -> None:
    answers = tmp_path / "answers.json"
    report = run(tiny_model, answers, "--mode", f"alt={ALT}")
    assert set(report) == {"reference", "default", "alt"}
    (store,) = json.loads(answers.read_text(encoding="utf-8")).values()
    assert len(store) == 3  # a slot per mode, keyed by its settings as they resolved

    def mode_of(key: str) -> str:
        settings = json.loads(key)
        return (
            "reference"
            if settings["strategy"] == "reference"
            else "alt"
            if settings["cache"] == "prefix"
            else "default"
        )

    texts = {mode_of(key): [slot[s] for s in ("0", "1")] for key, slot in store.items()}
    assert texts["reference"][0] != texts["reference"][1]  # two seeds, two draws
    assert texts["reference"][0] != texts["alt"][0]  # two decoders
    for name, runs in texts.items():
        row = report[name]
        assert all(len(a) == 6 for a in runs)
        assert row["distinct_2_per_seed"] == [round(distinct_2(a), 4) for a in runs]
        assert row["distinct_2"] == round(sum(distinct_2(a) for a in runs) / 2, 4)
        diff = [100 * (distinct_2(a) - distinct_2(ref)) for a, ref in zip(runs, texts["reference"])]
        assert row["minus_reference_points"] == round((diff[0] + diff[1]) / 2, 2)
        assert row["its_standard_error"] == round(abs(diff[0] - diff[1]) / 2, 2)  # two seeds: |a - b| / 2
        pairs = [list(zip(a, ref)) for a, ref in zip(runs, texts["reference"])]
        cut = [distinct_2([t[: min(len(t), len(r))] for t, r in p]) for p in pairs]
        ref_cut = [distinct_2([r[: min(len(t), len(r))] for t, r in p]) for p in pairs]
        assert row["distinct_2_length_matched"] == round(sum(cut) / 2, 4)
        assert row["reference_length_matched"] == round(sum(ref_cut) / 2, 4)
        assert row["characters_per_seed"] == sum(len(t) for a in runs for t in a) / 2
        assert sum(row["line_marks_per_seed"].values()) + row["other_line_marks_per_seed"] == 6

    # the kept answers are used as they are: an edited one shows in the next report, nothing is decoded again
    whole = json.loads(answers.read_text(encoding="utf-8"))
    (key,) = whole
    (default,) = [k for k in whole[key] if mode_of(k) == "default"]
    whole[key][default]["0"] = ["春风明月春风明月"] * 6
    answers.write_text(json.dumps(whole, ensure_ascii=False), encoding="utf-8")
    again = run(tiny_model, answers)
    assert set(again) == {"reference", "default"}
    assert again["default"]["distinct_2_per_seed"][0] == round(distinct_2(["春风明月春风明月"] * 6), 4)
    assert again["reference"] == report["reference"]
    # other settings are other answers: the edited slot is not served to them
    other = run(tiny_model, answers, "--set", '{"temperature": 0.9}')
    assert other["default"]["distinct_2_per_seed"][0] != again["default"]["distinct_2_per_seed"][0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mode", 'reference={"cache": "dual"}'], "other than reference and default"),
        (["--mode", "dual"], "expected NAME=JSON"),
        (["--mode", "dual=[1]"], "expected a JSON object"),
        (["--set", '"hot"'], "expected a JSON object"),
        (["--seeds", "0"], "1 or more"),
    ],
)
def test_distinct_by_length_refuses_bad_arguments_by_name(
    args: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # in this process (argparse refuses before any model loads): a traceback would be an exception here
    script = ROOT / "scripts" / "distinct_by_length.py"
    monkeypatch.setattr(sys, "argv", [str(script), *args])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(script), run_name="__main__")
    assert exited.value.code == 2 and message in capsys.readouterr().err
