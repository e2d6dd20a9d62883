"""`celeris generate`: prompts in, answers out, in input order, each batch written as it finishes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from ..errors import EXIT_FAILED, EXIT_OK, CelerisError, UsageError
from .answering import prepare, run, template_options
from .app import (
    GRAPHS_HELP,
    MAX_MEMORY_HELP,
    QUANTIZE_HELP,
    DeviceOpt,
    DtypeOpt,
    GraphsOpt,
    QuantizeOpt,
    app,
    choice,
    fail,
)
from .constraint import choice_option, json_schema_option, regex_option, with_constraint
from .knobs import given, with_knob_options
from .output import Format, Sink
from .progress import interrupt_code, interrupted, sigterm_interrupts
from .prompts import gather


@app.command()
@with_knob_options
def generate(
    args: list[str] = typer.Argument(None, metavar="PROMPT", show_default=False, hidden=True),
    prompt: list[str] = typer.Option(None, "--prompt", "-p", metavar="TEXT", help="A prompt; repeat for several."),
    file: Path = typer.Option(
        None,
        "--file",
        "-f",
        metavar="FILE",
        help="A text file with one prompt per line; - reads stdin (as does a pipe when no prompt is given). "
        "A bad or too long line is reported with its line number and skipped, and the run exits 1.",
    ),
    model: Path = typer.Option(
        None, "--model", "-m", metavar="FOLDER", help="Model folder (default: the embedded model)."
    ),
    samples: int = typer.Option(
        1, "--samples", min=1, metavar="N", help="Answers per prompt, with seeds seed, seed+1, ..."
    ),
    batch_size: int = typer.Option(16, "--batch-size", min=1, metavar="N", help="Prompts decoded together."),
    device: DeviceOpt = choice(DeviceOpt.auto, "--device", help="auto picks CUDA when present."),
    dtype: DtypeOpt = choice(DtypeOpt.auto, "--dtype", help="auto picks bfloat16 where it is fast."),
    quantize: QuantizeOpt = choice(QuantizeOpt.none, "--quantize", help=QUANTIZE_HELP),
    max_memory: str = typer.Option(None, "--max-memory", metavar="SIZE", help=MAX_MEMORY_HELP),
    cuda_graphs: GraphsOpt = choice(GraphsOpt.auto, "--cuda-graphs", help=GRAPHS_HELP),
    chat: bool = typer.Option(False, "--chat", help="Render prompts with the model's chat template."),
    chat_template_kwargs: str = typer.Option(
        None,
        "--chat-template-kwargs",
        metavar="JSON",
        help="With --chat: the template's own switches, e.g. '{\"enable_thinking\": false}'.",
    ),
    as_json: bool = typer.Option(
        False,
        "--json",
        help="Print one JSON document (an array for several prompts), at the end.",
    ),
    as_jsonl: bool = typer.Option(False, "--jsonl", help="Print one JSON record per line, each batch as it finishes."),
    output: Path = typer.Option(
        None, "--output", "-o", metavar="FILE", help="Write answers to this file (atomically), not stdout."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress and no summary line on stderr."),
    strict: bool = typer.Option(
        False,
        "--strict",
        help="Any bad --file line fails the whole run (exit 2) before it starts.",
    ),
    json_schema: Path = json_schema_option(),
    regex: str = regex_option(),
    choices: list[str] = choice_option(),
    knobs: dict[str, Any] | None = None,  # the generation settings' options, by flag (with_knob_options)
) -> None:
    """Answer prompts given as arguments, with --prompt, in a --file, or piped on stdin.

    Answers are written in input order, each batch as soon as it finishes (--json: at the end).
    Ctrl-C writes what is finished and exits 130 (SIGTERM: the same, 143). The defaults shown are the
    embedded model's; another --model brings its own generation_config.json."""
    with sigterm_interrupts():  # `kill`, `timeout` and systemd keep what is finished, as Ctrl-C does
        try:
            if as_json and as_jsonl:
                raise UsageError("choose one of --json and --jsonl")
            if max_memory is not None:  # a usage error before the model loads
                from ..arch.memory import parse_size

                parse_size(max_memory)
            options = template_options(chat_template_kwargs)
            if options is not None and not chat:
                raise UsageError("--chat-template-kwargs: only with --chat (the chat template takes them)")
            prompts, bad = gather(list(args or []), list(prompt or []), file)
            overrides = given(with_constraint(knobs or {}, json_schema, regex, choices))
            from ..engine import load_engine

            engine = load_engine(
                model, device.value, dtype.value, quantize=quantize.value, max_memory=max_memory,
                cuda_graphs=cuda_graphs.value,
            )  # fmt: skip
            params = engine.params(overrides)
            if options is not None:  # its keys checked once, before any prompt
                engine.tokenizer.render_chat("", options)
            jobs, skipped = prepare(engine, params, prompts, bad, chat, strict, samples, options)
            fmt: Format = "json" if as_json else "jsonl" if as_jsonl else "text"
            sink = Sink(fmt, output, single=len(jobs) == 1 and not skipped)
        except CelerisError as e:
            fail(e)
        except KeyboardInterrupt as e:
            typer.echo(f"{interrupted(e)} before any answer", err=True)
            raise typer.Exit(interrupt_code(e)) from None
        errored = run(engine, params, jobs, batch_size, sink, quiet)
    if skipped:
        typer.echo(f"Error: {skipped} line(s) skipped (see above)", err=True)
    if errored:  # a constrained answer that could not complete its constraint: written, with its `error`
        typer.echo(f"Error: {errored} answer(s) ended with an error (see `error` in --json/--jsonl)", err=True)
    raise typer.Exit(EXIT_FAILED if skipped or errored else EXIT_OK)
