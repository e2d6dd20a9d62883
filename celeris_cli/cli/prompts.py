"""Where `celeris generate` gets its prompts: arguments, `--prompt`, a `--file` (or `-` for stdin), or a
piped stdin. A file's lines keep their line numbers, so a bad line can be named and skipped."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ..errors import InvalidText, UsageError

STDIN = "-"


@dataclass(frozen=True)
class Prompt:
    text: str
    source: str | None = None  # the file it came from ("<stdin>" for a pipe); None for an argument
    line: int | None = None  # its line number in that file, counting from 1

    @property
    def where(self) -> str:
        """`file:line` for a file's line; an argument is named by its text's start."""
        return f"{self.source}:{self.line}" if self.source is not None else f"prompt {self.text[:20]!r}"


@dataclass(frozen=True)
class BadLine:
    """A line that could not become a prompt (not UTF-8); reported with its number and skipped."""

    source: str
    line: int
    error: UsageError


def _stdin_bytes() -> bytes:
    buffer: BinaryIO | None = getattr(sys.stdin, "buffer", None)
    return buffer.read() if buffer is not None else sys.stdin.read().encode("utf-8")


def read_lines(data: bytes, source: str) -> tuple[list[Prompt], list[BadLine]]:
    """One prompt per non-blank line, stripped; a BOM and CRLF endings are accepted."""
    prompts: list[Prompt] = []
    bad: list[BadLine] = []
    data = data.removeprefix(b"\xef\xbb\xbf")
    for number, raw in enumerate(data.splitlines(), start=1):
        try:
            text = raw.decode("utf-8").strip()
        except UnicodeDecodeError as e:
            bad.append(BadLine(source, number, InvalidText(f"not valid UTF-8 ({e.reason} at byte {e.start})")))
            continue
        if text:
            prompts.append(Prompt(text, source, number))
    return prompts, bad


def gather(args: list[str], options: list[str], file: Path | None) -> tuple[list[Prompt], list[BadLine]]:
    """Arguments first, then `--prompt`s, then the file's lines. With none of them and a piped stdin,
    stdin is the file."""
    prompts = [Prompt(p) for p in [*args, *options]]
    bad: list[BadLine] = []
    if file is None and not prompts and not sys.stdin.isatty():
        file = Path(STDIN)
    if file is not None:
        if str(file) == STDIN:
            data, source = _stdin_bytes(), "<stdin>"
        else:
            try:
                data, source = file.read_bytes(), str(file)
            except OSError as e:
                raise UsageError(f"cannot read --file {file}: {e.strerror or e}") from None
        from_file, bad = read_lines(data, source)
        prompts += from_file
    if not prompts and not bad:
        raise UsageError("no prompt given: celeris generate PROMPT, --file FILE, or pipe prompts on stdin")
    return prompts, bad
