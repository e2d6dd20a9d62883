"""Where answers go: stdout or an `--output` file, as text, JSON Lines or one JSON document.

Text and JSON Lines are written and flushed batch by batch, so a pipe sees each answer as soon as its batch
finishes and an interrupted run keeps every finished answer as a complete line. `--json` is one document,
so it is written once, at the end (or at the interrupt, with what is finished). An `--output` file is
written under a temporary name in its folder and renamed into place when the run ends, so a reader never
sees half a file.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Literal, TextIO

from ..errors import UsageError

Format = Literal["text", "jsonl", "json"]


class Sink:
    def __init__(self, fmt: Format, path: Path | None, single: bool = False) -> None:
        self.fmt = fmt
        self.single = single  # --json: one prompt asked for gives an object, several an array
        self.path = path
        self.written = 0
        self._held: list[dict[str, Any]] = []  # --json: records wait for the one document
        self._tmp: Path | None = None
        self._out: TextIO = sys.stdout
        if path is not None:
            self._tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            try:
                self._out = open(self._tmp, "w", encoding="utf-8")  # noqa: SIM115 (closed in close())
            except OSError as e:
                raise UsageError(f"cannot write --output {path}: {e.strerror or e}") from None

    @property
    def on_terminal(self) -> bool:
        """Whether answers show on a terminal as they are written (where a progress bar may be drawn)."""
        return self.fmt != "json" and self._out.isatty()

    def write(self, records: list[dict[str, Any]]) -> None:
        """One finished batch, in input order."""
        if self.fmt == "json":
            self._held += records
        else:
            for rec in records:
                self._out.write((json.dumps(rec, ensure_ascii=False) if self.fmt == "jsonl" else rec["text"]) + "\n")
            self._out.flush()
        self.written += len(records)

    def close(self) -> None:
        """Finish the output with what was written: the JSON document, then the file renamed into place."""
        if self.fmt == "json" and (self._held or not self.single):
            held = self._held[0] if self.single else self._held
            self._out.write(json.dumps(held, ensure_ascii=False, indent=2) + "\n")
        self._out.flush()
        if self._tmp is not None and self.path is not None:
            os.fsync(self._out.fileno())
            self._out.close()
            os.replace(self._tmp, self.path)
            self._tmp = None

    def discard(self) -> None:
        """Nothing to keep (the run failed before any answer): leave no temporary file behind."""
        if self._tmp is not None:
            self._out.close()
            self._tmp.unlink(missing_ok=True)
            self._tmp = None
