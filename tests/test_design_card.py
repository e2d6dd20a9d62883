"""The design card, as an acceptance test: its four commands exactly as it writes them, on the default model,
in a fresh folder holding nothing but the queue's config, each in a real `celeris` process.

    celeris generate --prompt "床前明月光，" --denoise-steps 20
    celeris watch configs/batch.yaml            (a daemon, stopped by SIGTERM)
    celeris retry logs/failed.jsonl
    celeris watch configs/batch.yaml --once     (as cron runs it)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from celeris_cli.cli import app

ROOT = Path(__file__).parents[1]
CARD_PROMPT = "床前明月光，"


def celeris(cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celeris_cli", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def drop(folder: Path, name: str, text: str) -> None:
    """Publish a file into the inbox as producers should: written elsewhere, then renamed in."""
    tmp = folder.parent / f".{name}.part"
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, folder / name)


def results(path: Path) -> dict[str, dict]:
    return {r["custom_id"]: r for r in map(json.loads, path.read_text(encoding="utf-8").splitlines())}


def test_the_design_cards_four_commands_work_as_written_on_the_default_model(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "configs", tmp_path / "configs")  # a fresh folder: the config and nothing else

    # 1. generate, at the card's step count: an answer, exit 0
    gen = celeris(tmp_path, "generate", "--prompt", CARD_PROMPT, "--denoise-steps", "20")
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.strip() and "Error" not in gen.stderr

    # 2. the daemon: it makes its folders, serves a dropped file, and stops on SIGTERM with exit 0
    daemon = subprocess.Popen(
        [sys.executable, "-m", "celeris_cli", "watch", "configs/batch.yaml"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        inbox = tmp_path / "batch_inputs"
        _wait(lambda: inbox.is_dir() or daemon.poll() is not None)
        assert daemon.poll() is None, daemon.communicate()[1]
        drop(inbox, "poems.txt", "白日依山尽，\n春眠不觉晓，\n")
        request = {"custom_id": "bad", "prompt": "x", "temperature": -1}
        drop(inbox, "mixed.jsonl", json.dumps({"custom_id": "ok", "prompt": "Shall I compare thee"}) + "\n")
        drop(inbox, "bad.jsonl", json.dumps(request) + "\n")
        outputs = tmp_path / "batch_outputs"
        done = [outputs / f"{n}.results.jsonl" for n in ("poems.txt", "mixed.jsonl")]
        _wait(lambda: all(p.exists() for p in done) and (tmp_path / "logs" / "failed.jsonl").exists())
    finally:
        daemon.send_signal(signal.SIGTERM)
        _, err = daemon.communicate(timeout=60)
    assert daemon.returncode == 0, err
    poems = results(done[0])
    assert len(poems) == 2 and all(r["response"]["status_code"] == 200 for r in poems.values())
    assert (tmp_path / "batch_processed" / "poems.txt").exists()

    # 3. retry over the failure log: the bad request's record is read, and the command exits 0
    [record] = [json.loads(x) for x in (tmp_path / "logs" / "failed.jsonl").read_text().splitlines()]
    assert record["custom_id"] == "bad" and "temperature" in record["message"]
    retry = celeris(tmp_path, "retry", "logs/failed.jsonl")
    assert retry.returncode == 0, retry.stderr
    assert "1 line-level user errors" in retry.stdout

    # 4. cron: drain once and exit
    drop(tmp_path / "batch_inputs", "cron.txt", f"{CARD_PROMPT}\n")
    past = time.time() - 60
    os.utime(tmp_path / "batch_inputs" / "cron.txt", (past, past))
    once = celeris(tmp_path, "watch", "configs/batch.yaml", "--once")
    assert once.returncode == 0, once.stderr
    [answer] = results(outputs / "cron.txt.results.jsonl").values()
    assert answer["response"]["status_code"] == 200 and answer["response"]["body"]["text"]


def _wait(predicate, timeout: float = 240.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_the_cards_steps_change_the_default_models_forwards_and_are_reported_as_asked() -> None:
    """The card's command at 4 and 32 steps, as a user runs it (`--json`), on the default model: a diffusion
    decoder, so the steps are what it runs (the JSON reports the steps asked, in total and in the settings)
    and what it costs: 32 steps take at least 1.5x the forwards of 4, and give another answer."""
    runner = CliRunner()
    runs = {}
    for steps in (4, 32):
        r = runner.invoke(app, ["generate", "--prompt", CARD_PROMPT, "--denoise-steps", str(steps), "--json"])
        assert r.exit_code == 0, r.output
        record = json.loads(r.stdout)
        assert record["denoise_steps"] == steps and record["settings"]["denoise_steps"] == steps, record
        runs[steps] = record
    assert runs[32]["nfe"] >= 1.5 * runs[4]["nfe"], (runs[4]["nfe"], runs[32]["nfe"])
    assert runs[32]["text"] != runs[4]["text"]


@pytest.mark.parametrize("prompt", [CARD_PROMPT, "Shall I compare thee"], ids=["han", "latin"])
def test_the_step_sweep_on_the_default_model_moves_the_forwards_on_every_script(prompt: str) -> None:
    """5, 10, 20 and 40 steps (`bench sweep`'s counts) on a prompt of each script, whose presets differ: each
    runs the steps asked, and more steps never take fewer forwards."""
    from celeris_cli import load_engine

    engine = load_engine(device="cpu", dtype="float32")
    nfe = []
    for steps in (5, 10, 20, 40):
        [result] = engine.generate([prompt], engine.params({"denoise_steps": steps}))
        assert result.text and result.settings["denoise_steps"] == steps
        nfe.append(result.nfe)
    assert nfe == sorted(nfe) and nfe[-1] >= 1.5 * nfe[0], nfe


def test_spec_keeps_its_answer_at_every_step_count_and_trades_positions_for_forwards() -> None:
    """`--strategy spec` on the default model: the steps set the draft's width (gen_length / steps), so the
    answer is the same at every count (its AR mode's) and what moves is the work: drafting every round, fewer
    steps compute more positions per answer token."""
    from celeris_cli import load_engine

    engine = load_engine(device="cpu", dtype="float32")
    texts, per_token = set(), []
    for steps in (5, 10, 20, 40):
        before = engine.positions_computed
        params = engine.params({"strategy": "spec", "denoise_steps": steps, "drafting": "always"})
        [result] = engine.generate([CARD_PROMPT], params)
        assert result.text and result.settings["denoise_steps"] == steps
        texts.add(result.text)
        per_token.append((engine.positions_computed - before) / result.output_tokens)
    assert len(texts) == 1
    assert per_token == sorted(per_token, reverse=True) and per_token[0] > per_token[-1], per_token


def test_guidance_and_random_remasking_change_the_block_models_greedy_answers() -> None:
    from celeris_cli import load_engine

    engine = load_engine("celeris-block", device="cpu", dtype="float32")
    prompts = [CARD_PROMPT, "白日依山尽，", "春眠不觉晓，", "Shall I compare thee"]
    greedy = engine.params({"temperature": 0.0})
    plain = [r.text for r in engine.generate(prompts, greedy)]
    for knob, value in (("cfg_scale", 2.0), ("remasking", "random")):
        changed = [r.text for r in engine.generate(prompts, greedy.with_(**{knob: value}))]
        assert changed != plain, knob
