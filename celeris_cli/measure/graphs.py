"""`celeris bench graphs`: whether each decode step the decoders run is one graph, with no host read in it.

A step is the model call a decoder makes every round over its cache: `DiffusionLM.step` (the layers over the
cache, after `hidden` has done what reads the host) for the AR step, the `spec` round's forward and the cached
block steps, and DiffusionGemma's `denoise` (a canvas against the causal cache, its head included) for the
canvas step. For each, on each model that runs its strategy, a few prompts are decoded twice through the
engine: eagerly, then with that call (where the decoder makes it over a cache; a prefill is no step) replaced
by its `torch.compile(fullgraph=True)`. A graph break anywhere in the step (a `.item()`, a `bool(tensor)`, a
branch on a tensor's value, an untraceable call) is an error under fullgraph, so `fullgraph: true` is the
proof that none hides in it; `identical` compares the answers (text, tokens, forwards) with the eager ones.
The AR step's head and argmax are traced too, on the hidden states the step gave.

On CPU the backend is dynamo's `eager` (tracing only; inductor's compile takes minutes here). `graphs` counts
the traces: one per shape and per plan of Python numbers the step specialises on (a key length that grows with
each token is marked dynamic after it first changes; a running set's packed layout is not). On CUDA each step
is also timed eager and captured (`mode="reduce-overhead"`: inductor and CUDA graphs), per batch bucket, over a
decode of that many prompts.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..arch import exact, invariant
from ..arch.capture import is_step
from ..engine import Engine, load_engine

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # rows a step is timed at on CUDA
PROMPTS = ("The jury said it", "To be, or not", "红豆生南国，", "春眠不觉晓，")


@dataclass(frozen=True)
class Step:
    """A decode step: the settings whose decoder runs it, and the model method it is."""

    name: str
    settings: dict[str, Any]
    # `DiffusionLM.step` (over a cache), or DiffusionGemma's canvas pass: `hidden`, the decoder over the canvas
    # against the cache, as its step runs it (the head, softmax and draws follow a chunk of positions at a time)
    method: str = "step"
    wide: bool | None = None  # step: True for forwards of several positions a row, False for one, None: any


STEPS = (
    Step("ar-step", {"strategy": "ar"}, wide=False),
    Step("ar-step-deterministic", {"strategy": "ar", "deterministic": True}, wide=False),
    Step("spec-round", {"strategy": "spec", "drafting": "always", "denoise_steps": 2}, wide=True),
    Step("dual-cache-step", {"strategy": "fast", "cache": "dual"}),
    Step("prefix-cache-step", {"strategy": "fast", "cache": "prefix"}),
    Step("block-fast-step", {"strategy": "block-fast"}),
    Step("canvas-step", {"strategy": "diffusion-gemma"}, method="hidden"),
)


@dataclass
class Trace:
    """What one decode with a step compiled saw."""

    calls: int = 0  # the step's calls, each through the compiled function
    graphs: int = 0  # graphs dynamo made of it
    error: str | None = None  # the first graph break (or other failure) that stopped capture
    head_equal: bool | None = None  # the AR step's head and argmax traced equal to eager's (None: not traced)
    seconds: list[float] = field(default_factory=list)  # each call's time (`timed`)


def _counting(trace: Trace) -> Callable[..., Any]:
    """A dynamo backend that counts graphs and runs each as traced (no compiler)."""

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        trace.graphs += 1
        return gm.forward

    return backend


def _why(e: Exception) -> str:
    """The first line of a failure, and where in the package it happened."""
    text = str(e).strip()
    line = text.splitlines()[0][:200] if text else ""
    at = [s.strip() for s in text.splitlines() if "celeris_cli/" in s and "File" in s]
    return f"{type(e).__name__}: {line}" + (f" ({at[-1].split('celeris_cli/')[-1]})" if at else "")


@contextmanager
def compiled(
    model: Any, step: Step, trace: Trace, backend: Any, mode: str | None = None, sync: bool = False
) -> Iterator[None]:
    """`model`'s step method replaced, inside this block, by its `torch.compile(fullgraph=True)`; a call that
    fails to trace records why and runs eagerly from then on. `backend` None: no compiling, timing only; `sync`:
    each call's time waits for the device (CUDA)."""
    torch._dynamo.reset()
    config = torch._dynamo.config
    limit, fail = config.recompile_limit, config.fail_on_recompile_limit_hit
    config.recompile_limit = 64
    config.fail_on_recompile_limit_hit = True  # past the limit dynamo would run eagerly without a word
    eager = getattr(model, step.method)
    fn = eager if backend is None else torch.compile(eager, fullgraph=True, backend=backend, mode=mode)
    head = None if backend is None else torch.compile(_head_argmax, fullgraph=True, backend=backend, mode=mode)

    def call(*args: Any, **kwargs: Any) -> Any:
        if trace.error is not None or not is_step(step.method, args, step.wide):
            return eager(*args, **kwargs)
        began = time.perf_counter()
        try:
            with invariant.traced(), exact.traced():
                out = fn(*args, **kwargs)
        except Exception as e:  # a graph break under fullgraph, or a failure inside the traced step
            trace.error = _why(e)
            return eager(*args, **kwargs)
        if sync:
            torch.cuda.synchronize()
        trace.seconds.append(time.perf_counter() - began)
        trace.calls += 1
        if head is not None and step.name.startswith("ar-step") and trace.head_equal is not False:
            h, apply = out[0], model.step_head()
            try:
                with invariant.traced(), exact.traced():
                    got = head(apply, h)
            except Exception as e:
                trace.error, trace.head_equal = f"head: {_why(e)}", False
                return out
            trace.head_equal = bool(torch.equal(got, _head_argmax(apply, h)))
        return out

    setattr(model, step.method, call)
    try:
        yield
    finally:
        delattr(model, step.method)  # the class's method again
        config.recompile_limit, config.fail_on_recompile_limit_hit = limit, fail
        torch._dynamo.reset()


def _head_argmax(apply: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    return apply(h).argmax(-1)


def _answers(engine: Engine, settings: dict[str, Any], gen_length: int, rows: int) -> list[tuple[str, int, int]]:
    """Each prompt's answer (text, tokens, forwards), `rows` prompts decoded side by side."""
    params = engine.params({**settings, "gen_length": gen_length, "seed": 0})
    prompts = [PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else str(i)) for i in range(rows)]
    results = engine.generate(prompts, params, batch_size=rows)
    return [(r.text, r.output_tokens, r.nfe) for r in results]


def check(engine: Engine, step: Step, gen_length: int = 16, rows: int = 2) -> dict[str, Any]:
    """One step on one model: traced whole or not, and the answers with it captured against eager ones."""
    eager = _answers(engine, step.settings, gen_length, rows)
    trace = Trace()
    with compiled(engine.model, step, trace, _counting(trace)):
        captured = _answers(engine, step.settings, gen_length, rows)
    row: dict[str, Any] = {
        "fullgraph": trace.error is None and trace.calls > 0,
        "identical": captured == eager and trace.head_equal is not False,
        "calls": trace.calls,
        "graphs": trace.graphs,
    }
    if trace.error is not None:
        row["break"] = trace.error
    elif trace.calls == 0:
        row["break"] = "the decoder made no call of this step"
    return row


def timed(
    engine: Engine, step: Step, gen_length: int, buckets: tuple[int, ...], backend: str = "inductor"
) -> dict[str, Any]:
    """The step's median time per call, eager and captured, per bucket of rows (a decode of that many prompts;
    the captured one runs twice, the first compiling and recording its graphs). Captured: inductor with CUDA
    graphs (`reduce-overhead`); another `backend` (dynamo's "eager", for a test) takes no mode."""
    sync = engine.device.type == "cuda"
    mode = "reduce-overhead" if backend == "inductor" else None
    out: dict[str, Any] = {}
    for rows in buckets:
        cell: dict[str, Any] = {}
        for name, compiler in (("eager_ms", None), ("captured_ms", backend)):
            trace = Trace()
            with compiled(engine.model, step, trace, compiler, mode if compiler else None, sync):
                for _ in range(2 if compiler else 1):
                    trace.seconds.clear()
                    _answers(engine, step.settings, gen_length, rows)
            cell[name] = round(statistics.median(trace.seconds) * 1e3, 3) if trace.seconds else None
            if trace.error is not None:
                cell["break"] = trace.error
        out[str(rows)] = cell
    return out


def models_in(paths: list[Path]) -> dict[str, str | None]:
    """Models by label: a model folder as itself; a family's folder (model folders inside) as its first model;
    a folder of families (the tests' data) as one model of each family."""

    def models(folder: Path) -> list[Path]:
        return [p for p in sorted(folder.glob("*/")) if (p / "config.json").is_file() and _has_weights(p)]

    out: dict[str, str | None] = {}
    for path in paths:
        if (path / "config.json").is_file():
            out[path.name] = str(path)
            continue
        families = [p for p in sorted(path.glob("*/")) if models(p)]
        if not families and models(path):  # a family's folder
            out.setdefault(path.name, str(models(path)[0]))
        for folder in families:
            out.setdefault(folder.name, str(models(folder)[0]))
        for folder in models(path) if families else []:  # a model beside the families: itself
            out.setdefault(folder.name, str(folder))
    return out


def _has_weights(folder: Path) -> bool:
    return any(folder.glob("*.safetensors"))


def run(
    models: dict[str, str | None],
    steps: tuple[Step, ...] = STEPS,
    device: str = "auto",
    gen_length: int = 16,
    max_rows: int = 16,
) -> dict[str, Any]:
    """Every step on every model that runs its strategy. Returns `{"steps": {NAME: {"fullgraph", "identical",
    "models": {LABEL: {...}}}}}`: a step is fullgraph / identical where it is so on every model it ran on; on
    CUDA each model's row has its times per bucket up to `max_rows`."""
    out: dict[str, Any] = {"steps": {}, "torch": torch.__version__}
    for label, folder in models.items():
        engine = load_engine(folder, device=device, cuda_graphs="off")  # its eager baseline eager; it captures
        out["device"] = str(engine.device)
        for step in steps:
            if step.settings["strategy"] not in engine.arch.strategies:
                continue
            began = time.perf_counter()
            row = check(engine, step, gen_length)
            if engine.device.type == "cuda":
                row["buckets"] = timed(engine, step, gen_length, tuple(b for b in BUCKETS if b <= max_rows))
            row["seconds"] = round(time.perf_counter() - began, 2)
            entry = out["steps"].setdefault(step.name, {"fullgraph": True, "identical": True, "models": {}})
            entry["models"][label] = row
            entry["fullgraph"] = entry["fullgraph"] and row["fullgraph"]
            entry["identical"] = entry["identical"] and row["identical"]
    return out


def render(report: dict[str, Any]) -> None:
    """The report as a table: a line per step and model."""
    import typer

    typer.echo(f"device {report.get('device')}, torch {report['torch']}")
    typer.echo(f"{'step':<22} {'model':<18} {'fullgraph':>9} {'identical':>9} {'calls':>5} {'graphs':>6}")
    for name, entry in report["steps"].items():
        for label, row in entry["models"].items():
            typer.echo(
                f"{name:<22} {label:<18} {row['fullgraph']!s:>9} {row['identical']!s:>9} {row['calls']:>5} "
                f"{row['graphs']:>6}" + (f"  {row['break']}" if "break" in row else "")
            )
