"""Shared helpers for queue tests: a queue root on disk, a config for it, and a fake backend at the model
boundary that records the batches it is given."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from celeris_cli.errors import PromptTooLong, UsageError
from celeris_cli.spool.backend import Prepared
from celeris_cli.spool.formats import Request

FOLDERS = ("batch_inputs", "batch_outputs", "batch_processed", "logs")


def make_queue(root: Path, model: Path | None = None, **overrides: Any) -> Path:
    for d in FOLDERS:
        (root / d).mkdir(parents=True, exist_ok=True)
    (root / "configs").mkdir(exist_ok=True)
    cfg: dict[str, Any] = {
        "root": "..",
        "settle_s": 0.2,
        "rescan_s": 0.5,
        "batch_window_s": 0.0,
        "device": "cpu",
        "dtype": "float32",
        "threads": 1,
        "generation": {"gen_length": 8, "block_length": 8, "denoise_steps": 4},
    }
    if model is not None:
        cfg["model"] = str(model)
    cfg.update(overrides)
    path = root / "configs" / "batch.yaml"
    path.write_text(json.dumps(cfg), encoding="utf-8")  # JSON is YAML
    return path


def drop(root: Path, name: str, content: str | bytes, age_s: float = 10.0) -> Path:
    """Publish a file into the inbox by rename, aged past the settle time with os.utime (no sleeping)."""
    inbox = root / "batch_inputs"
    inbox.mkdir(parents=True, exist_ok=True)
    tmp = inbox / f".{name}.part"
    tmp.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
    then = time.time() - age_s
    os.utime(tmp, (then, then))
    final = inbox / name
    os.rename(tmp, final)
    return final


def outputs(root: Path) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for f in sorted((root / "batch_outputs").glob("*.results.jsonl")):
        out[f.name] = [json.loads(line) for line in f.read_text(encoding="utf-8").splitlines()]
    return out


def claimed(root: Path) -> list[str]:
    """Files claimed and not yet published: `batch_inputs/.work/<claim>.<name>`."""
    work = root / "batch_inputs" / ".work"
    if not work.is_dir():
        return []
    return sorted(p.name for p in work.iterdir() if p.is_file() and not p.name.startswith("."))


def visible(folder: Path) -> list[str]:
    """The files a user sees in a folder (the queue's lock and temp files are dot-files)."""
    return sorted(p.name for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))


def failures(root: Path) -> list[dict[str, Any]]:
    path = root / "logs" / "failed.jsonl"
    if not path.exists():
        return []
    recs = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a torn line, as readers must tolerate
    return recs


class FakeBackend:
    KNOWN = {"gen_length": int, "temperature": float, "denoise_steps": int}

    def __init__(self, fail_on: str | None = None) -> None:
        self.batches: list[list[str]] = []
        self.fail_on = fail_on

    def prepare(self, request: Request) -> Prepared:
        for key, value in request.params.items():
            want = self.KNOWN.get(key)
            if want is None:
                raise UsageError(f"unknown generation parameter {key!r}")
            if not isinstance(value, (int, float) if want is float else int) or isinstance(value, bool):
                raise UsageError(f"{key} must be {want.__name__}, got {value!r}")
        prompt = request.prompt or request.messages[-1]["content"]  # type: ignore[index]
        if len(prompt) > 1000:
            raise PromptTooLong("prompt of more than 1000 tokens does not fit the model")
        group = tuple(sorted(request.params.items()))
        return Prepared(request, group, len(prompt) + 8, prompt)

    def run(self, batch: list[Prepared]) -> list[dict[str, Any]]:
        self.batches.append([p.request.custom_id for p in batch])
        if self.fail_on and any(self.fail_on in p.payload for p in batch):
            raise RuntimeError("simulated out of memory")
        return [{"text": p.payload[::-1], "finish_reason": "stop"} for p in batch]
