"""Decode steps run captured (`--cuda-graphs`): the model's step method replaced by its `torch.compile`.

A decode step is the call a decoder makes every round over its cache: `DiffusionLM.step` (the layers over the
cache, after `hidden` has done what reads the host) and DiffusionGemma's canvas pass (`hidden`, every call a
denoising step). `Capture` replaces that method on one model with a function that sends each step call through
`torch.compile(fullgraph=True)` (inductor with CUDA graphs, `mode="reduce-overhead"`) and every other
call (a prefill, a calibration forward) to the eager method. A step that fails to compile is said once on the
log and runs eagerly from then on: never silently. `measure.graphs` checks the same steps with the same
predicate (`is_step`), and times them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ..backoff import is_out_of_memory
from ..errors import UsageError
from . import exact, invariant
from .kv import LayerKV
from .packed import PackedLayer

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
RECOMPILE_LIMIT = 64


def resolve(name: str, device: torch.device) -> bool:
    """`--cuda-graphs`: on needs a CUDA device (a usage error that names the option where the device is not
    one). auto is off, on CUDA too, until a card has shown captured steps answer as eager ones (docs/gpu.md:
    no GPU has run this yet; a default that changes a decode's arithmetic, and makes a first answer wait for a
    compile, must be measured first)."""
    if name not in MODES:
        raise UsageError(f"--cuda-graphs: must be auto, on or off, got {name!r}")
    if name == "on" and device.type != "cuda":
        raise UsageError(
            f"--cuda-graphs on (in a queue config, cuda_graphs: on) needs a CUDA device, and this run decodes on "
            f"{device.type}: choose the device cuda on a machine with CUDA, or cuda_graphs auto or off"
        )
    return name == "on"


def method_of(model: Any) -> str:
    """The model's step method: `step`, or `hidden` for a model that has no `step` (DiffusionGemma's canvas)."""
    return "step" if hasattr(model, "step") else "hidden"


def is_step(method: str, args: tuple[Any, ...], wide: bool | None = None) -> bool:
    """Whether this model call is a decode step, not a prefill or a calibration forward. `wide`: True for a step
    of several positions a row only, False for one position only, None: either."""
    if method != "step":  # the canvas pass: every call is a denoising step
        return True
    cache = args[3]
    if not cache:
        return False
    if isinstance(cache[0], PackedLayer):  # a running set's tick; a packed causal prefill is no step
        if any(s.causal for s in cache[0].segments):
            return False
    elif not isinstance(cache[0], LayerKV):
        return False
    return wide is None or wide == (args[0].shape[1] > 1)


def _owned(out: Any) -> Any:
    """A step's output copied out of the graph's memory, which the next replay overwrites."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (list, tuple)):
        return type(out)(_owned(o) for o in out)
    return out


class Capture:
    """One model's step method, captured: installed on the model until `remove`."""

    def __init__(self, model: Any, backend: Any = "inductor", mode: str | None = "reduce-overhead") -> None:
        self.model, self.method = model, method_of(model)
        # a graph per shape and per plan of Python numbers the step specialises on (`measure.graphs`): past
        # dynamo's default of 8 a fullgraph step fails (said, and eager from then on); 64 holds a decode's
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
        self.eager: Callable[..., Any] = getattr(model, self.method)
        self.compiled = torch.compile(self.eager, fullgraph=True, backend=backend, mode=mode)
        self.graphed = mode == "reduce-overhead"
        self.calls = 0  # step calls that ran captured
        self.error: str | None = None  # why capture stopped (the step runs eagerly since)
        setattr(model, self.method, self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.error is not None or not is_step(self.method, args):
            return self.eager(*args, **kwargs)
        try:
            if self.graphed:
                torch.compiler.cudagraph_mark_step_begin()
            with invariant.traced(), exact.traced():
                out = self.compiled(*args, **kwargs)
        except Exception as e:  # a graph break under fullgraph, or a failure in the compiler
            if is_out_of_memory(e):  # the back-off's to handle (a smaller batch): not a reason to stop capturing
                raise
            self.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
            log.warning("--cuda-graphs: the decode step could not be captured, it runs eagerly (%s)", self.error)
            return self.eager(*args, **kwargs)
        self.calls += 1
        return _owned(out) if self.graphed else out

    def remove(self) -> None:
        """The model's own method again."""
        if self.model.__dict__.get(self.method) is self:
            delattr(self.model, self.method)
