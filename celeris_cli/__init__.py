"""Celeris: batch generation with masked diffusion language models.

The library is the product; the `celeris` CLI is one client of it:

    from celeris_cli import load_engine
    engine = load_engine()                       # the embedded model, or load_engine("path/to/model")
    [result] = engine.generate(["床前明月光，"], engine.params({"denoise_steps": 20}))
    print(result.text, result.tokens_per_s)

Torch is imported only when an engine is loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["load_engine", "Engine", "GenerationParams", "Result", "CelerisError"]

from .errors import CelerisError

if TYPE_CHECKING:
    from .engine import Engine, GenerationParams, Result, load_engine


def __getattr__(name: str) -> Any:
    if name in ("load_engine", "Engine", "GenerationParams", "Result"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(name)
