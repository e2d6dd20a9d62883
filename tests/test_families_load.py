"""The families of the families wave through the command line: `celeris inspect` tells each one's layout,
attention, shift, block, strategies and (for a mixture of experts) its active parameters; `celeris generate
--model FOLDER` runs each tiny folder as its own code saved it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from celeris_cli.cli import app

from .test_families_cli import inspect_json

DATA = Path(__file__).parent / "data"
FOLDERS = {
    "sdar": DATA / "sdar" / "sdar_tiny",
    "sdar_moe": DATA / "sdar_moe" / "sdarmoe_tiny",
    "llada_moe": DATA / "llada_moe" / "lladamoe_tiny",
    "coda": DATA / "coda" / "coda_tiny",
    "rnd1": DATA / "rnd1" / "rnd1_tiny",
    "dream": DATA / "diffucoder" / "diffucoder_tiny",  # DiffuCoder
}
# architecture: attention, logit shift, block, mixture of experts
FACTS = {
    "sdar": ("block-causal", "no", "4 (default block_length)", False),
    "sdar_moe": ("block-causal", "no", "4 (default block_length)", True),
    "llada_moe": ("bidirectional", "no", "none", True),
    "coda": ("bidirectional", "yes", "none", False),
    "rnd1": ("bidirectional", "yes", "none", True),
    "dream": ("bidirectional", "yes", "none", False),
}


@pytest.mark.parametrize("family", FOLDERS)
def test_inspect_tells_each_familys_layout_attention_shift_block_and_experts(family: str) -> None:
    info = inspect_json(FOLDERS[family])
    assert info["architecture"].startswith(family + " ")
    attention, shift, block, moe = FACTS[family]
    assert (info["attention"], info["logit_shift"].split()[0], info["block"]) == (attention, shift, block)
    assert ("active_parameters" in info) == moe
    if moe:
        active = int(info["active_parameters"].split()[0].replace(",", ""))
        assert 0 < active < int(info["parameters"].replace(",", ""))
    assert info["bf16_weights"].endswith("MiB") and info["layout"]


@pytest.mark.parametrize("family", FOLDERS)
def test_generate_loads_each_folder_as_saved(family: str) -> None:
    """In process: the command line in a process of its own is `test_families_cli`'s, family by family."""
    p = CliRunner().invoke(app, [
        "generate", "--model", str(FOLDERS[family]), "--prompt", "The apples", "--gen-length", "8",
        "--temperature", "0", "--json", "--quiet", "--dtype", "float32",
    ])  # fmt: skip
    assert p.exit_code == 0, p.output
    r = json.loads(p.stdout)
    assert r["settings"]["strategy"] == inspect_json(FOLDERS[family])["strategies"].split(",")[0]
