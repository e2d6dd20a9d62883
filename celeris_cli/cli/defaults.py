"""The settings `generate --help` shows as defaults: the built-in ones (params.KNOBS) under the embedded
model's generation_config.json, read as JSON, without torch, so help tells what a run will use."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from ..arch.folder import ModelFolder
from ..errors import CelerisError
from ..params import PER_REQUEST, GenerationParams, honoured
from ..strategy import STRATEGIES

EMBEDDED = Path(__file__).parents[1] / "models" / "celeris-spec"


@functools.cache
def effective_defaults(path: Path = EMBEDDED) -> GenerationParams:
    """The embedded model's layer of defaults over the built-in ones, layered as the engine layers it (so
    its spelling of the steps, `steps_total`, is decided by the same rule)."""
    try:
        return ModelFolder.open(path).defaults()
    except CelerisError:
        return GenerationParams()  # a broken embedded model is reported when it loads, not in help


@functools.cache
def script_defaults(path: Path = EMBEDDED) -> dict[str, dict[str, Any]]:
    """The embedded model's settings per script of the prompt (`by_script`)."""
    try:
        return ModelFolder.open(path).by_script()
    except CelerisError:
        return {}


def _shown(value: Any) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def knob_help(name: str, text: str) -> str:
    """`text`, led by the strategies that honour the knob when not all do, and the value the embedded model
    runs with when the option is not given (and the value for prompts of a script whose preset sets it);
    for a knob its strategy does not use, no default: help never shows a default the model refuses."""
    users = [s for s in STRATEGIES if name in PER_REQUEST or name in honoured(s)]
    lead = "" if len(users) == len(STRATEGIES) else f"{', '.join(users)}: "
    if text.startswith(lead):  # the knob's own help already names its strategies
        lead = ""
    defaults = effective_defaults()
    strategy = defaults.strategy
    if name not in PER_REQUEST and name not in honoured(strategy):
        return f"{lead}{text}  [not used by the default model's {strategy} strategy]"
    per_script = "".join(
        f"; {script} prompts: {_shown(layer[name])}" for script, layer in script_defaults().items() if name in layer
    )
    value = getattr(defaults, name)
    if value == () or value is None:
        return f"{lead}{text}"  # an empty list, or none (no constraint): nothing to show
    shown = _shown(value)
    if name == "denoise_steps" and "block_steps" in honoured(strategy) and not defaults.steps_total:
        shown, per_script = f"{defaults.block_steps} per block (--block-steps)", ""
    return f"{lead}{text}  [default: {shown}{per_script}]"
