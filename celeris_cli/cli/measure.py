"""`celeris eval`: a model's quality on held-out prompts (`celeris bench`, for speed, is in bench.py)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ..errors import CelerisError
from .app import QUANTIZE_HELP, DeviceOpt, DtypeOpt, QuantizeOpt, _json_setting, app, choice, fail


@app.command(name="eval")
def eval_cmd(
    model: Path = typer.Option(None, "--model", "-m", help="Model folder (default: the embedded model)."),
    poems: int = typer.Option(200, "--poems", min=1, help="Held-out poem openings to complete."),
    english: int = typer.Option(100, "--english", min=0, help="Held-out English openings to complete."),
    set_name: str = typer.Option(None, "--set", help="The generation setting, as JSON: '{\"temperature\": 0.8}'."),
    batch_size: int = typer.Option(32, "--batch-size", min=1),
    no_nll: bool = typer.Option(False, "--no-nll", help="Skip the held-out NLL estimate."),
    split: str = typer.Option(
        "eval", "--split", help="eval (report) or tune (choose settings here: rows the eval split never uses)."
    ),
    samples: int = typer.Option(1, "--samples", min=1, help="Answers per opening, with seeds seed, seed+1, ..."),
    device: DeviceOpt = choice(DeviceOpt.auto, "--device"),
    dtype: DtypeOpt = choice(DtypeOpt.auto, "--dtype"),
    quantize: QuantizeOpt = choice(QuantizeOpt.none, "--quantize", help=QUANTIZE_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON instead of a table."),
) -> None:
    """Quality on a fixed held-out set: verse structure and distinct-2, NLL bound, and English word validity,
    distinct-2, repetition, empty answers and length, beside the human continuations'."""
    from ..engine import load_engine
    from ..measure.evaluate import EvalSet, evaluate

    try:
        overrides = _json_setting(set_name)
        engine = load_engine(model, device.value, dtype.value, quantize=quantize.value)
        params = engine.params(overrides)
        report = evaluate(engine, params, EvalSet.load(), poems, english, batch_size, not no_nll, split, samples)
    except CelerisError as e:
        fail(e)
    if as_json:
        typer.echo(json.dumps(report, ensure_ascii=False))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"celeris eval (held-out, {report['split']} split)")
    for col in ("figure", "value", "human"):
        table.add_column(col)
    human = report["human_reference"]
    for key in (
        "structure_rate",
        "distinct_2",
        "english_word_validity",
        "english_distinct_2",
        "english_repetition_rate",
        "english_empty_rate",
        "english_mean_words",
        "heldout_nll_per_token",
        "poems",
        "english_prompts",
        "output_tokens",
        "wall_s",
        "tokens_per_s",
        "device",
        "dtype",
    ):
        if key in report:
            v = report[key]
            h = f"{human[key]:.4f}" if key in human else ""
            table.add_row(key, f"{v:.4f}" if isinstance(v, float) else str(v), h)
    console = Console()
    console.print(table)
    console.print("settings: " + json.dumps(report["settings"]), soft_wrap=True)
    if report["english_settings"] != report["settings"]:
        console.print("English settings: " + json.dumps(report["english_settings"]), soft_wrap=True)
