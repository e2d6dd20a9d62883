"""The settings `generate --help` shows as defaults: the built-in ones (params.KNOBS) under the embedded
model's generation_config.json, read as JSON, without torch, so help tells what a run will use."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from ..params import KNOBS, model_layer

EMBEDDED_CONFIG = Path(__file__).parents[1] / "models" / "celeris-tiny" / "generation_config.json"


@functools.cache
def effective_defaults(path: Path = EMBEDDED_CONFIG) -> dict[str, Any]:
    values = {name: knob.default for name, knob in KNOBS.items()}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        settings, _, _ = model_layer(raw) if isinstance(raw, dict) else ({}, None, None)
    except (OSError, ValueError):
        return values  # a broken embedded model is reported when it loads, not in help
    values.update({("denoise_steps" if k == "steps" else k): v for k, v in settings.items()})
    return values


def knob_help(name: str, text: str) -> str:
    """`text` plus the value the embedded model runs with when the option is not given."""
    value = effective_defaults()[name]
    shown = ("on" if value else "off") if isinstance(value, bool) else str(value)
    return f"{text}  [default: {shown}]"
