"""Help that tells the truth, at once: flags without a value placeholder, closed sets with their
choices, the embedded model's effective defaults, and no heavy import on the way to the help text."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from celeris_cli.cli import app
from celeris_cli.params import KNOBS

runner = CliRunner()
COMMANDS = ["generate", "batch", "watch", "retry", "status", "corpus", "train", "eval", "bench", "version"]
ROOT = Path(__file__).parents[1]


@pytest.mark.parametrize("command", [[], *[[c] for c in COMMANDS]], ids=["celeris", *COMMANDS])
def test_flags_show_no_value_placeholder(command: list[str]) -> None:
    r = runner.invoke(app, [*command, "--help"], terminal_width=100, prog_name="celeris")
    assert r.exit_code == 0, r.output
    assert "<bool>" not in r.stdout and "Usage: celeris" in r.stdout


def test_closed_sets_list_their_choices_from_the_knobs() -> None:
    out = runner.invoke(app, ["generate", "--help"], terminal_width=200).stdout
    for name in ("remasking", "strategy", "cache", "confidence", "alg"):
        assert "<" + "|".join(KNOBS[name].choices) + ">" in out, name


def test_generate_help_shows_the_embedded_models_defaults() -> None:
    config = json.loads((ROOT / "celeris_cli/models/celeris-block/generation_config.json").read_text())
    params = {p.name: p for p in typer.main.get_command(app).commands["generate"].params}  # type: ignore[attr-defined]
    presets = config.pop("by_script", {})
    for name, value in config.items():
        shown = ("on" if value else "off") if isinstance(value, bool) else str(value)
        help_text = params[name].help or ""
        assert f"[default: {shown}]" in help_text or f"[default: {shown};" in help_text, name  # the whole value
    for script, layer in presets.items():  # a script's preset is shown beside the default it replaces
        for name, value in layer.items():
            shown = ("on" if value else "off") if isinstance(value, bool) else str(value)
            assert f"; {script} prompts: {shown}]" in (params[name].help or ""), name
    assert "[default: 1.0]" in (params["top_p"].help or "")  # not in the file: the built-in default


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"]], ids=["celeris", "generate"])
def test_help_imports_neither_torch_nor_rich_nor_pydantic(argv: list[str]) -> None:
    code = (
        "import sys\n"
        f"sys.argv = ['celeris', *{argv!r}]\n"
        "from celeris_cli.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print([m for m in ('torch', 'rich', 'pydantic') if m in sys.modules], file=sys.stderr)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert p.stderr.strip() == "[]" and "Usage: celeris" in p.stdout
