"""The commands shown in README.md and docs/*.md work: each one runs here, or is marked as needing what this
machine lacks and is then checked statically (its `celeris` subcommand exists, and so does every flag it
uses, with a value the flag accepts).

Which lines are commands, and the markers, are described in docs/contributing.md ("How the docs are
tested"). In short: the lines of ```bash / ```sh / ```shell blocks, the `$ ` lines of ```console and plain
blocks, and the command part of ```cron lines. A trailing comment `# needs: WHAT` (gpu, checkpoint,
network, ray, daemon, input, queue) or `# slow` keeps a line from running; `<!-- docs-test: needs: WHAT -->` or
`<!-- docs-test: slow -->` on the line before a fence marks the whole block. `# exits N` says the exit
status a line is shown to have (0 otherwise). A line runs when it is unmarked and every program in it is
`celeris` or one of a few plain shell tools; each file's lines run in order, in one fresh temporary folder
holding a copy of `configs/` (and `tests/`, `scripts/` as links), so a later line sees what an earlier one
made.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

SHELL_BLOCKS = {"bash", "sh", "shell"}
DOLLAR_BLOCKS = {"", "console", "text", "shell-session"}  # only `$ ` lines are commands there
NEEDS = {"gpu", "checkpoint", "network", "ray", "daemon", "input", "queue"}
RUNNABLE_PROGRAMS = {"celeris", "mkdir", "printf", "echo", "cat", "mv", "cp", "ls", "head", "wc"}
SEPARATORS = {"&&", "||", "|", ";", "&"}
REDIRECTS = {">", ">>", "<", ">&", "&>", ">|", "<<"}
COMMAND_TIMEOUT_S = 180

FENCE = re.compile(r"^(\s*)```\s*([A-Za-z0-9_-]*)")
BLOCK_MARKER = re.compile(r"^<!--\s*docs-test:\s*(.*?)\s*-->\s*$")
NEEDS_MARKER = re.compile(r"\bneeds:\s*([a-z-]+)")
SLOW_MARKER = re.compile(r"\bslow\b")
EXIT_MARKER = re.compile(r"\bexits (\d+)\b")


@dataclass
class DocCommand:
    file: Path
    line: int
    text: str  # as shown, comment included
    command: str  # the shell command, comment and `$ ` removed
    needs: set[str] = field(default_factory=set)
    slow: bool = False
    exit_code: int = 0
    cron: bool = False

    @property
    def where(self) -> str:
        return f"{self.file.relative_to(ROOT)}:{self.line}"

    def segments(self) -> list[list[str]]:
        return split_segments(self.command)

    @property
    def runs(self) -> bool:
        if self.needs or self.slow or self.cron:
            return False
        return all(Path(seg[0]).name in RUNNABLE_PROGRAMS for seg in self.segments())


def split_comment(line: str) -> tuple[str, str]:
    """Split a shell line at its first `#` that starts a word outside quotes."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1 :].strip()
    return line.rstrip(), ""


def split_segments(command: str) -> list[list[str]]:
    """The simple commands of a line: split at `&&`, `|`, `;`, with redirections and what follows cut off."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    segments: list[list[str]] = [[]]
    cut = False
    for token in lexer:
        if token in SEPARATORS:
            segments.append([])
            cut = False
        elif token in REDIRECTS or cut:
            cut = True
        else:
            segments[-1].append(token)
    segments = [[t for t in seg if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", t)] for seg in segments]
    return [seg for seg in segments if seg]


def doc_commands(path: Path) -> list[DocCommand]:
    commands: list[DocCommand] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    in_block, kind, block_marks, pending_marks = False, "", "", ""
    continued: tuple[int, str] | None = None
    for number, raw in enumerate(lines, start=1):
        fence = FENCE.match(raw)
        if fence:
            if in_block:
                in_block = False
            else:
                in_block, kind, block_marks = True, fence.group(2).lower(), pending_marks
            pending_marks, continued = "", None
            continue
        if not in_block:
            marker = BLOCK_MARKER.match(raw.strip())
            pending_marks = marker.group(1) if marker else ("" if raw.strip() else pending_marks)
            continue
        text = raw.strip()
        start = number
        if continued:
            start, text = continued[0], continued[1] + " " + text
            continued = None
        if kind in SHELL_BLOCKS:
            text = text[2:] if text.startswith("$ ") else text
            if not text or text.startswith("#"):
                continue
        elif kind == "cron":
            if not text or text.startswith("#"):
                continue
            fields = text.split(None, 5)
            text = fields[5] if not text.startswith("@") else text.split(None, 1)[1]
        elif kind in DOLLAR_BLOCKS and text.startswith("$ "):
            text = text[2:]
        else:
            continue
        if text.endswith("\\"):
            continued = (start, text[:-1].rstrip())
            continue
        command, comment = split_comment(text)
        marks = f"{comment} {block_marks}"
        exit_code = EXIT_MARKER.search(comment)
        commands.append(
            DocCommand(
                file=path,
                line=start,
                text=text,
                command=command,
                needs=set(NEEDS_MARKER.findall(marks)),
                slow=bool(SLOW_MARKER.search(marks)),
                exit_code=int(exit_code.group(1)) if exit_code else 0,
                cron=kind == "cron",
            )
        )
    return commands


ALL_COMMANDS = [c for path in DOC_FILES for c in doc_commands(path)]


@cache
def celeris_command() -> Any:
    """The Click group behind `celeris` (Typer may carry its own copy of Click, so nothing here names it)."""
    from celeris_cli.cli import load_commands  # every command module, loaded

    return load_commands()


def option_names(command: Any) -> set[str]:
    """Every spelling of every option of a command, `--help` included."""
    names = {"--help"}
    for param in command.params:
        if param.param_type_name == "option":
            names.update([*param.opts, *param.secondary_opts])
    return names


def is_number(token: str) -> bool:
    return re.fullmatch(r"-?\d+(\.\d+)?", token) is not None


def check_celeris(args: list[str], where: str) -> None:
    """The subcommand exists, every flag is one of its options, and the line parses: each value is of its
    option's type and in its range or choices (the command's own parser, without running the command)."""
    from celeris_cli.cli.batch import _optional_ray_address

    group = celeris_command()
    global_options = option_names(group)
    while args and args[0].startswith("-"):
        assert args[0] in global_options, f"{where}: `celeris {args[0]}` is not an option of celeris"
        args = args[1:]
    if not args:
        return
    name, rest = args[0], args[1:]
    assert name in group.commands, f"{where}: `celeris {name}` is not a command (known: {sorted(group.commands)})"
    sub = group.commands[name]
    while rest and rest[0] in getattr(sub, "commands", {}):  # a command group's subcommand: `celeris bench sweep`
        name, sub, rest = f"{name} {rest[0]}", sub.commands[rest[0]], rest[1:]
    options = option_names(sub)
    for token in rest:
        if token == "--":
            break
        if token.startswith("-") and token != "-" and not is_number(token):
            flag = token.partition("=")[0]
            assert flag in options, f"{where}: `celeris {name} {flag}`: no such option (known: {sorted(options)})"
    if "--help" in rest:
        return
    try:
        sub.make_context(f"celeris {name}", _optional_ray_address(list(rest)))
    except Exception as error:  # Click's UsageError, from whichever copy of Click Typer carries
        message = error.format_message() if hasattr(error, "format_message") else str(error)
        raise AssertionError(f"{where}: `celeris {' '.join(args)}` does not parse: {message}") from None


def check_statically(command: DocCommand) -> None:
    for segment in command.segments():
        program = segment[0]
        if Path(program).name == "celeris":
            check_celeris(segment[1:], command.where)
        elif program in ("python", "python3") and len(segment) > 1 and segment[1].startswith("scripts/"):
            assert (ROOT / segment[1]).is_file(), f"{command.where}: no script {segment[1]}"
        elif program.startswith(("scripts/", ".ci/")):
            assert (ROOT / program).is_file(), f"{command.where}: no script {program}"


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=lambda c: c.where)
def test_doc_command_is_checked_statically(command: DocCommand) -> None:
    unknown = command.needs - NEEDS
    assert not unknown, f"{command.where}: unknown marker needs: {sorted(unknown)} (known: {sorted(NEEDS)})"
    check_statically(command)


RUN_FILES = sorted({c.file for c in ALL_COMMANDS if c.runs})


@pytest.mark.parametrize("path", RUN_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_commands_run_from_a_fresh_folder(path: Path, tmp_path: Path) -> None:
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    for name in ("tests", "scripts"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    failures = []
    for command in (c for c in ALL_COMMANDS if c.file == path and c.runs):
        try:
            done = subprocess.run(
                ["bash", "-c", command.command],
                cwd=tmp_path,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            failures.append(f"{command.where}: `{command.command}` ran past {COMMAND_TIMEOUT_S} s")
            continue
        if done.returncode != command.exit_code:
            failures.append(
                f"{command.where}: `{command.command}` exited {done.returncode}, the docs show"
                f" {command.exit_code}\n{done.stderr[-1500:]}"
            )
    assert not failures, "\n\n".join(failures)


def test_the_docs_show_commands_that_run() -> None:
    """Guards the parser: if it stopped finding commands, every test above would pass on nothing."""
    readme = [c for c in ALL_COMMANDS if c.file.name == "README.md"]
    assert sum(c.runs for c in readme) >= 5
    assert any(c.cron for c in readme)
    assert {p.name for p in DOC_FILES} >= {
        "README.md",
        "settings.md",
        "queue.md",
        "models.md",
        "gpu.md",
        "embedded-models.md",
        "benchmarks.md",
        "contributing.md",
    }


def test_readme_is_short_and_tells_no_history() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    assert not re.search(r"(?i)\bissues? #?\d+|#\d+\b|\bround (one|two|three|four|five|\d+)\b", text)


def test_design_card_commands_are_shown_as_written() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for command in (
        'celeris generate --prompt "床前明月光，" --denoise-steps 20',
        "celeris watch configs/batch.yaml",
        "celeris retry logs/failed.jsonl",
    ):
        assert command in text
    cron = [seg for c in ALL_COMMANDS if c.cron and c.file.name == "README.md" for seg in c.segments()]
    card = ["celeris", "watch", "configs/batch.yaml", "--once"]
    assert any([Path(seg[0]).name, *seg[1:]] == card for seg in cron)


def test_where_the_docs_say_what_retry_all_takes_they_name_force_too() -> None:
    """`retry --all` leaves out a line's own user errors (bad_param, invalid_json...), which only `--force`
    resubmits; a paragraph that tells what `--all` retries without `--force` is how "--all retries every
    record" crept in. The option help the docs paraphrase says the same."""
    from celeris_cli.cli import load_commands

    for path in DOC_FILES:
        for para in re.split(r"\n\s*\n", path.read_text(encoding="utf-8")):
            if "retry" in para and re.search(r"--all\b", para):
                assert "--force" in para, f"{path.name}: says what retry --all does without --force:\n{para}"
    retry = load_commands().commands["retry"]
    helps = {p.opts[0]: p.help or "" for p in retry.params}
    assert "except line-level user errors" in helps["--all"] and "every record" in helps["--force"]


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_files(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        assert (path.parent / target.split("#")[0]).exists(), f"{path.name}: broken link {target}"
