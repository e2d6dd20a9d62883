"""`celeris generate` as a Unix tool: prompts from arguments, files and pipes; answers to stdout or a file,
streamed batch by batch; bad lines named and skipped; Ctrl-C keeps finished work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from celeris_cli.cli import app

runner = CliRunner()
FAST = ["--gen-length", "8", "--block-length", "8", "--denoise-steps", "4", "--device", "cpu", "-t", "0"]
ROOT = Path(__file__).parents[1]


def gen(model: Path, *args: str, input: str | bytes | None = None):  # type: ignore[no-untyped-def]
    return runner.invoke(app, ["generate", "--model", str(model), *FAST, *args], input=input)


def records(stdout: str) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in stdout.splitlines()]


def test_positional_prompts_come_before_prompt_options(tiny_model: Path) -> None:
    r = gen(tiny_model, "春眠不觉晓，", "To be", "--prompt", "床前", "--jsonl")
    assert r.exit_code == 0, r.output
    assert [x["prompt"] for x in records(r.stdout)] == ["春眠不觉晓，", "To be", "床前"]


@pytest.mark.parametrize("file_args", [[], ["--file", "-"]], ids=["piped", "file-dash"])
def test_stdin_gives_one_record_per_line(tiny_model: Path, file_args: list[str]) -> None:
    r = gen(tiny_model, "--jsonl", *file_args, input="床前明月光，\n\n白日依山尽，\n")
    assert r.exit_code == 0, r.output
    assert [x["prompt"] for x in records(r.stdout)] == ["床前明月光，", "白日依山尽，"]


def test_no_prompt_and_an_empty_stdin_is_a_usage_error(tiny_model: Path) -> None:
    r = gen(tiny_model, input="")
    assert r.exit_code == 2 and "no prompt given" in r.stderr


def test_output_file_is_complete_and_stdout_stays_empty(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "answers.jsonl"
    r = gen(tiny_model, "床前", "To be", "--jsonl", "--output", str(out))
    assert r.exit_code == 0, r.output
    assert r.stdout == ""
    assert [x["prompt"] for x in records(out.read_text(encoding="utf-8"))] == ["床前", "To be"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["answers.jsonl"]  # no temporary file left


def test_output_file_is_not_touched_by_a_run_that_fails_before_answering(tmp_path: Path) -> None:
    out = tmp_path / "answers.txt"
    out.write_text("previous\n")
    r = runner.invoke(app, ["generate", "x", "--model", str(tmp_path / "nope"), "--output", str(out)])
    assert r.exit_code == 2
    assert out.read_text() == "previous\n" and sorted(p.name for p in tmp_path.iterdir()) == ["answers.txt"]


def test_output_into_a_missing_folder_is_a_usage_error(tiny_model: Path, tmp_path: Path) -> None:
    r = gen(tiny_model, "x", "--output", str(tmp_path / "no" / "such" / "file.txt"))
    assert r.exit_code == 2 and r.stderr.startswith("Error: cannot write --output")


def test_quiet_silences_stderr_but_not_the_answers(tiny_model: Path) -> None:
    loud = gen(tiny_model, "床前")
    assert loud.exit_code == 0 and "tokens/s" in loud.stderr
    quiet = gen(tiny_model, "床前", "--quiet")
    assert quiet.exit_code == 0 and quiet.stderr == "" and quiet.stdout == loud.stdout


def test_version_option_and_version_command() -> None:
    from celeris_cli import __version__

    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.stdout == f"celeris {__version__}\n"
    r = runner.invoke(app, ["version"])
    assert r.exit_code == 0
    lines = r.stdout.splitlines()
    assert lines[0] == f"celeris {__version__}"
    assert any(x.startswith("torch ") for x in lines) and any(x.startswith("device ") for x in lines)
    assert any(x.startswith("dtype ") for x in lines)


def test_shell_completion_is_offered() -> None:
    r = runner.invoke(app, ["--help"])
    assert "--install-completion" in r.stdout and "--show-completion" in r.stdout


def _bad_file(tmp_path: Path) -> Path:
    f = tmp_path / "prompts.txt"
    f.write_bytes("床前\n".encode() + ("床" * 400 + "\n").encode() + b"\xff\xfe bad\n" + b"To be\n")
    return f


def test_bad_file_lines_are_named_and_skipped_and_the_run_exits_1(tiny_model: Path, tmp_path: Path) -> None:
    f = _bad_file(tmp_path)
    r = gen(tiny_model, "--file", str(f), "--jsonl")
    assert r.exit_code == 1
    assert [x["prompt"] for x in records(r.stdout)] == ["床前", "To be"]
    assert f"{f}:2: prompt of" in r.stderr and "exceeds the model's context" in r.stderr
    assert f"{f}:3: not valid UTF-8" in r.stderr
    assert "Traceback" not in r.output


def test_strict_fails_the_whole_run_naming_the_first_bad_line(tiny_model: Path, tmp_path: Path) -> None:
    f = _bad_file(tmp_path)
    r = gen(tiny_model, "--file", str(f), "--jsonl", "--strict")
    assert r.exit_code == 2 and r.stdout == ""
    [line] = r.stderr.strip().splitlines()
    assert line.startswith(f"Error: {f}:2: prompt of") and line.endswith("(and 1 more bad lines)")


def test_each_batch_is_written_before_the_next_is_decoded(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from celeris_cli.engine import Engine

    seen: list[int] = []
    decode = Engine.decode_batch

    def spy(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(len(sys.stdout.buffer.getvalue().splitlines()))  # type: ignore[attr-defined]
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "decode_batch", spy)
    monkeypatch.setattr(Engine, "continuous", lambda self, params: False)  # as for a static-only strategy
    r = gen(tiny_model, "a", "b", "c", "d", "e", "--jsonl", "--batch-size", "2")
    assert r.exit_code == 0, r.output
    assert seen == [0, 2, 4]  # lines already on stdout when each batch starts
    assert [x["prompt"] for x in records(r.stdout)] == ["a", "b", "c", "d", "e"]  # input order


def test_an_error_mid_run_keeps_the_finished_batches(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from celeris_cli.engine import Engine
    from celeris_cli.errors import CelerisError

    decode = Engine.decode_batch
    calls: list[int] = []

    def second_fails(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 2:
            raise CelerisError("the device went away")
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "decode_batch", second_fails)
    monkeypatch.setattr(Engine, "continuous", lambda self, params: False)  # static batches
    r = gen(tiny_model, "a", "b", "c", "--jsonl", "--batch-size", "1")
    assert r.exit_code == 1 and r.stderr.strip().endswith("Error: the device went away")
    assert [x["prompt"] for x in records(r.stdout)] == ["a"]


def test_text_output_is_in_input_order_whatever_the_prompt_lengths(tiny_model: Path) -> None:
    prompts = ["床前明月光，疑是地上霜。", "春", "To be, or not to be", "白"]
    together = gen(tiny_model, *prompts, "--batch-size", "2", "--jsonl")
    alone = [records(gen(tiny_model, p, "--jsonl").stdout)[0]["text"] for p in prompts]
    assert [x["text"] for x in records(together.stdout)] == alone


def test_ctrl_c_keeps_every_finished_record_as_a_complete_line_and_exits_130(tiny_model: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"第{i}首\n" for i in range(64)), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = ["--model", str(tiny_model), "--jsonl", "--batch-size", "1", "--gen-length", "16", "--block-length",
            "16", "--denoise-steps", "16", "--no-early-exit", "--device", "cpu", "--dtype", "float32"]  # fmt: skip
    p = subprocess.Popen(
        [sys.executable, "-m", "celeris_cli", "generate", "--file", str(prompts), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as from a terminal, even under CI
    )
    assert p.stdout is not None
    first = [p.stdout.readline(), p.stdout.readline()]  # two batches are finished
    p.send_signal(signal.SIGINT)
    rest, err = p.communicate(timeout=120)
    assert p.returncode == 130, err.decode()
    lines = b"".join(first).decode().splitlines() + rest.decode().splitlines()
    assert 2 <= len(lines) < 64
    assert [json.loads(line)["prompt"] for line in lines] == [f"第{i}首" for i in range(len(lines))]
    assert f"Interrupted: {len(lines)} of 64 answers written" in err.decode()


def test_a_reader_that_goes_away_ends_the_run_quietly(tiny_model: Path) -> None:
    """`celeris generate ... | head`: more output than a pipe holds, and a reader that leaves at once. Click
    turns the broken pipe into exit 1 with nothing on stderr: the answers were not delivered."""
    cmd = [sys.executable, "-m", "celeris_cli", "generate", "x", "--model", str(tiny_model), "--samples", "300",
           "--jsonl", "--gen-length", "8", "--block-length", "8", "--denoise-steps", "2"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert p.stdout is not None and p.stdout.read(1)
    p.stdout.close()  # the reader leaves while answers are still coming
    _, err = p.communicate(timeout=300)
    assert b"Traceback" not in err and b"BrokenPipeError" not in err
    assert p.returncode == 1


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_sigterm_keeps_what_is_finished_in_the_output_file_as_ctrl_c_does(
    tiny_model: Path, tmp_path: Path, signum: int, code: int
) -> None:
    """`kill`, `timeout` and systemd send SIGTERM: `-o out.jsonl` holds every finished answer, whole, and
    no temp file is left, as after Ctrl-C."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("".join(f"第{i}首\n" for i in range(64)), encoding="utf-8")
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = ["--model", str(tiny_model), "--jsonl", "-o", str(out), "--batch-size", "1", "--gen-length", "16",
            "--block-length", "16", "--denoise-steps", "16", "--no-early-exit", "--device", "cpu",
            "--dtype", "float32"]  # fmt: skip
    p = subprocess.Popen(
        [sys.executable, "-m", "celeris_cli", "generate", "--file", str(prompts), *args],
        stderr=subprocess.PIPE,
        env=env,
        preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL) for s in (signal.SIGINT, signal.SIGTERM)],
    )
    try:
        deadline = time.monotonic() + 120  # a ceiling on a hang
        while not any(len(t.read_bytes().splitlines()) >= 3 for t in tmp_path.glob(".out.jsonl.*.tmp")):
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        p.send_signal(signum)
        _, err = p.communicate(timeout=120)
    finally:
        p.kill() if p.poll() is None else None
    assert p.returncode == code, err.decode()
    lines = out.read_text(encoding="utf-8").splitlines()
    assert 3 <= len(lines) < 64 and [json.loads(x)["prompt"] for x in lines] == [f"第{i}首" for i in range(len(lines))]
    assert f"{len(lines)} of 64 answers written" in err.decode() and b"Traceback" not in err
    assert not list(tmp_path.glob(".out.jsonl.*"))
