"""Help that tells the truth, at once: flags without a value placeholder, closed sets with their
choices, the embedded model's effective defaults, and no heavy import on the way to the help text."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from celeris_cli.cli import app, load_commands
from celeris_cli.cli.app import COMMANDS as TABLE
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
    config = json.loads((ROOT / "celeris_cli/models/celeris-spec/generation_config.json").read_text())
    params = {p.name: p for p in load_commands().commands["generate"].params}  # type: ignore[attr-defined]
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


def test_generate_help_never_shows_a_default_the_default_model_refuses() -> None:
    """A knob the embedded model's strategy does not use shows no default, but says so; the steps show the
    spelling the model's own settings use; every other knob's shown default, given back as a flag, is
    accepted by the default model."""
    import re

    from celeris_cli import load_engine
    from celeris_cli.params import PER_REQUEST, honoured, parse_text

    params = {p.name: p for p in load_commands().commands["generate"].params}  # type: ignore[attr-defined]
    engine = load_engine(device="cpu", dtype="float32")
    strategy = engine.params().strategy
    for name in KNOBS:
        text = params[name].help or ""
        if name not in PER_REQUEST and name not in honoured(strategy):
            assert "[default:" not in text and f"not used by the default model's {strategy} strategy" in text, name
        elif name == "structured_outputs":  # none by default: nothing to show, nothing refused
            assert "[default:" not in text
        elif name not in ("stop", "denoise_steps"):
            shown = re.search(r"\[default: ([^;\]]+)", text).group(1)  # type: ignore[union-attr]
            flag = "--" + name.replace("_", "-")
            engine.params({flag: parse_text(flag, {"on": True, "off": False}.get(shown, shown))})  # accepted
    steps = params["denoise_steps"].help or ""
    assert f"[default: {engine.params().denoise_steps};" in steps  # the diffusion mode's steps over the answer


def test_root_help_lists_every_command_as_its_own_help_would() -> None:
    """`celeris --help` writes the commands from a table (`app.COMMANDS`) without importing them: the rows are
    Typer's own rendering of the loaded commands, at a narrow and a wide terminal, in the registered order."""
    import typer.core

    group = load_commands()
    assert sorted(group.commands) == sorted(TABLE)  # every command in the table, and no other
    for width in (80, 200):
        ctx = group.make_context("celeris", [], resilient_parsing=True)
        ctx.terminal_width = width
        from_table, from_commands = ctx.make_formatter(), ctx.make_formatter()
        group.format_commands(ctx, from_table)
        typer.core.TyperGroup.format_commands(group, ctx, from_commands)
        assert from_table.getvalue() == from_commands.getvalue(), width


def test_root_help_imports_no_command_module() -> None:
    """The root help loads no command's module (generate's options would import `params`); a command's help
    loads its own."""
    code = (
        "import sys\n"
        "sys.argv = ['celeris', *sys.argv[1:]]\n"
        "from celeris_cli.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith('celeris_cli.')), file=sys.stderr)\n"
    )
    root = subprocess.run([sys.executable, "-c", code, "--help"], capture_output=True, text=True, check=True, cwd=ROOT)
    assert "Commands:" in root.stdout and "generate" in root.stdout
    loaded = eval(root.stderr.strip())
    assert "celeris_cli.params" not in loaded and "celeris_cli.cli.generate" not in loaded, loaded
    sub = subprocess.run(
        [sys.executable, "-c", code, "generate", "--help"], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert "--denoise-steps" in sub.stdout and "celeris_cli.cli.generate" in sub.stderr
