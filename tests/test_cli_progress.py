"""Progress on stderr: a Rich bar on a terminal, plain lines in logs, nothing with --quiet."""

from __future__ import annotations

import io

from celeris_cli.cli.progress import Progress


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
