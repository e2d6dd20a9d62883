"""What `watch` does when it starts: a fresh folder gets its queue folders, a relative `model:` is found
under `root`, an unknown model name lists the embedded ones, the `--once` summary counts every file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from celeris_cli.errors import ConfigError
from celeris_cli.spool.config import load_config
from celeris_cli.spool.daemon import Spool

from .spool_helpers import FOLDERS, FakeBackend, drop, failures, outputs


def fresh_config(where: Path, **extra: object) -> Path:
    """A config in a fresh folder: `configs/batch.yaml` and nothing else."""
    (where / "configs").mkdir(parents=True)
    path = where / "configs" / "batch.yaml"
    path.write_text(json.dumps({"root": "..", "settle_s": 0.2, "batch_window_s": 0, **extra}))
    return path


def test_watch_once_in_a_fresh_folder_creates_its_folders_and_serves(tmp_path: Path) -> None:
    config = fresh_config(tmp_path)
    assert Spool(load_config(config), FakeBackend).run(once=True) == 0
    assert all((tmp_path / d).is_dir() for d in FOLDERS)
    drop(tmp_path, "a.txt", "hello\n")
    assert Spool(load_config(config), FakeBackend).run(once=True) == 0
    assert len(outputs(tmp_path)["a.txt.results.jsonl"]) == 1


def test_a_missing_root_is_a_config_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="^root: folder does not exist"):
        load_config(fresh_config(tmp_path, root="../nowhere"))


def test_a_relative_model_resolves_against_root_as_the_config_says(tmp_path: Path) -> None:
    (tmp_path / "mymodel").mkdir()
    assert load_config(fresh_config(tmp_path, model="mymodel")).model == str(tmp_path / "mymodel")


def test_an_unknown_model_name_lists_the_embedded_models(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"'celeris-tinny' is neither .*embedded: celeris-block, celeris-spec, celeris-tiny"
    ):
        load_config(fresh_config(tmp_path, model="celeris-tinny"))


def test_once_summary_counts_quarantined_files_with_correct_plurals(tmp_path: Path) -> None:
    from celeris_cli.cli.queue import summary_line

    config = fresh_config(tmp_path)
    drop(tmp_path, "good.txt", "one prompt\n", age_s=30)
    drop(tmp_path, "bad.pdf", "not a format\n", age_s=20)
    drop(tmp_path, "empty.txt", "", age_s=10)
    spool = Spool(load_config(config), FakeBackend)
    assert spool.run(once=True) == 1 and len(failures(tmp_path)) == 2
    assert summary_line(spool.counts, 0.25) == (
        "celeris watch --once: 3 files (2 quarantined), 1 result, 2 failures in 0.2 s"
    )
