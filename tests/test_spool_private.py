"""A queue holds every tenant's prompts and answers: by default its daemon writes 0600 files in 0700
folders whatever the umask (results, failure and event logs, journals; folders made before included),
and `private: false` leaves the modes to the umask. The real daemon in a subprocess over the fake backend,
run with the umask most systems have (022)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from .spool_helpers import drop, make_queue

REPO = Path(__file__).parents[1]


def once(config: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "tests.run_spool", str(config), "--once"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: os.umask(0o022),  # noqa: PLW1509 - the child's umask, before it runs
    )


def modes(root: Path) -> dict[str, int]:
    """Every file and folder the queue has under `root` (the config's folder aside), by relative path."""
    out = {}
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if rel.parts[0] != "configs" and not path.name.endswith(".lock"):
            out[str(rel)] = stat.S_IMODE(path.stat().st_mode)
    return out


@pytest.mark.parametrize("private", [None, True, False])
def test_the_queue_writes_private_files_unless_its_config_says_otherwise(tmp_path: Path, private: bool | None) -> None:
    config = make_queue(tmp_path, **({} if private is None else {"private": private}))
    for folder in ("batch_outputs", "logs"):  # made before, by hand, with the umask's 0755
        (tmp_path / folder).chmod(0o755)
    drop(tmp_path, "a.jsonl", '{"custom_id": "x", "prompt": "hello"}\n{not json\n')
    (tmp_path / "batch_inputs" / "a.jsonl").chmod(0o600)  # as `serve` publishes it
    done = once(config)
    assert done.returncode in (0, 1), done.stderr
    seen = modes(tmp_path)
    files = {k: v for k, v in seen.items() if (tmp_path / k).is_file()}
    folders = {k: v for k, v in seen.items() if (tmp_path / k).is_dir()}
    for name in ("batch_outputs/a.jsonl.results.jsonl", "logs/failed.jsonl", "logs/events.jsonl"):
        assert name in files
    if private is False:
        assert files["batch_outputs/a.jsonl.results.jsonl"] == 0o644 and files["logs/failed.jsonl"] == 0o644
        assert folders["batch_outputs"] == 0o755
    else:
        wrong = {k: oct(v) for k, v in files.items() if v != 0o600} | {
            k: oct(v) for k, v in folders.items() if v != 0o700
        }
        assert wrong == {}
