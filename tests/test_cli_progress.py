"""Progress on stderr: a Rich bar on a terminal, plain lines in logs, nothing with --quiet."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

from celeris_cli.cli.progress import Progress

REPO = Path(__file__).parents[1]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_with_rate_and_eta_when_stderr_is_not_a_terminal() -> None:
    out = io.StringIO()
    with Progress(4, quiet=False, every_s=0.0, stream=out) as p:
        p.advance(1, 10)
        p.advance(3, 40)
    [line] = out.getvalue().splitlines()  # one per step, none for the last (the summary line covers it)
    assert line.startswith("generate: 1/4 answers, ") and "tok/s" in line and "eta" in line


def test_plain_lines_are_periodic_not_one_per_batch() -> None:
    out = io.StringIO()
    with Progress(100, quiet=False, every_s=3600.0, stream=out) as p:
        for _ in range(10):
            p.advance(1, 10)
    assert out.getvalue() == ""


def test_a_terminal_gets_a_bar_with_tokens_per_second_and_eta() -> None:
    out = Terminal()
    with Progress(4, quiet=False, stream=out) as p:
        assert p._bar is not None
        p.advance(2, 20)
        p._bar.refresh()
        shown = out.getvalue()
    assert "generate" in shown and "2/4" in shown and "tok/s" in shown and "eta" in shown


def test_quiet_silences_both() -> None:
    for stream in (io.StringIO(), Terminal()):
        with Progress(4, quiet=True, every_s=0.0, stream=stream) as p:
            p.advance(1, 10)
        assert stream.getvalue() == ""


def screen(raw: str) -> list[str]:
    """The lines a terminal shows after `raw`: as much of a VT100 as Rich's live display uses (carriage
    return, newline, cursor up, erase in line); colours and cursor visibility change no text."""
    lines: list[list[str]] = [[]]
    row = col = 0
    for m in re.finditer(r"\x1b\[([?\d;]*)([A-Za-z])|(.)", raw, re.S):
        arg, command, ch = m.groups()
        if ch is None:
            if command == "A":
                row = max(row - int(arg or 1), 0)
            elif command == "K":
                line = lines[row]
                line[:] = [] if arg == "2" else line[:col] if arg in ("", "0") else [" "] * col + line[col:]
            else:
                assert command in "hlm", f"the test's terminal does not know ESC[{arg}{command}"
            continue
        if ch == "\n":
            row, col = row + 1, 0
        elif ch == "\r":
            col = 0
        else:
            line = lines[row]
            line += [" "] * (col + 1 - len(line))
            line[col] = ch
            col += 1
        lines += [[] for _ in range(row + 1 - len(lines))]
    return ["".join(line).rstrip() for line in lines]


def test_answers_printed_under_the_bar_each_start_on_their_own_line() -> None:
    """stdout and stderr on one 120-column terminal, as a user runs it: the bar never shares a line with
    an answer, and once the run ends the screen holds the answers and the summary, nothing else."""
    prompts = ["床前明月光，", "白日依山尽，", "It was a dark night, and", "春眠不觉晓，", "The jury said it"]
    cmd = [sys.executable, "-m", "celeris_cli", "generate", *(a for p in prompts for a in ("-p", p)),
           "--batch-size", "2", "--gen-length", "16", "--device", "cpu", "--seed", "0"]  # fmt: skip
    rich_env = ("COLUMNS", "LINES", "FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")
    env = {k: v for k, v in os.environ.items() if k not in rich_env}  # the terminal alone decides
    env.update(PYTHONPATH=str(REPO), TERM="xterm-256color")
    piped = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert piped.returncode == 0, piped.stderr
    answers = piped.stdout.splitlines()

    main, side = pty.openpty()
    fcntl.ioctl(side, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    with subprocess.Popen(cmd, env=env, stdin=side, stdout=side, stderr=side) as proc:
        os.close(side)
        raw = b""
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            raw += chunk
        assert proc.wait(timeout=600) == 0
    os.close(main)
    text = raw.decode("utf-8")
    assert "━" in text  # the bar was drawn: the property is exercised
    shown = [line for line in screen(text) if line]
    assert shown[:-1] == [a.rstrip() for a in answers if a.rstrip()], shown
    assert shown[-1].startswith("[5 prompt(s), ")
