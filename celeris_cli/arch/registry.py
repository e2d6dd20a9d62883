"""The architecture registry: a model folder's config.json (`model_type`, else `architectures`) chooses one.

Each architecture is a module of its own (its config keys, tensor names and special ids); adding a family
means adding that module and one entry here. `strategies` lists the decoding strategies it supports, the
first being its default.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from ..errors import ModelError, UsageError
from .dream import DreamConfig, DreamModel
from .layers import ArchConfig
from .llada import LLaDAModel, ModelConfig
from .llada2 import LLaDA2Config, LLaDA2MoeModel


@dataclass(frozen=True)
class Architecture:
    name: str
    model_types: tuple[str, ...]  # config.json "model_type"
    classes: tuple[str, ...]  # config.json "architectures"
    read_config: Callable[[dict[str, Any]], Any]
    build: Callable[[Any], nn.Module]
    strategies: tuple[str, ...]  # supported decoding strategies, the default first
    optional: Callable[[Any], frozenset[str]] = lambda cfg: frozenset()  # tensors a folder may carry or not
    defaults: tuple[tuple[str, Any], ...] = ()  # settings under the folder's generation_config.json
    when: Callable[[dict[str, Any]], bool] = lambda raw: True  # a variant of a model_type, told by its config

    @property
    def default_strategy(self) -> str:
        return self.strategies[0]

    def layer(self) -> dict[str, Any]:
        """The architecture's own defaults, under its folders' generation_config.json."""
        return {"strategy": self.default_strategy, **dict(self.defaults)}

    def check_strategy(self, strategy: str) -> None:
        if strategy not in self.strategies:
            raise UsageError(
                f"strategy {strategy!r} does not run on the {self.name} architecture "
                f"(it supports {', '.join(self.strategies)})"
            )


def _tied_head(cfg: Any) -> frozenset[str]:
    return frozenset({"lm_head.weight"}) if cfg.tie_word_embeddings else frozenset()


def _block_causal(raw: dict[str, Any]) -> bool:
    return raw.get("block_causal") is True


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture(
        "llada", ("llada",), ("LLaDAModelLM",), ModelConfig.from_dict, LLaDAModel, ("fast", "reference", "dream")
    ),
    # LLaDA's layout trained as block diffusion (`celeris train --block-size`): causal between blocks, so only
    # the block decoders run it (a bidirectional decoder would show it blocks it never saw in training)
    Architecture(
        "llada_block",
        ("llada",),
        ("LLaDAModelLM",),
        ModelConfig.from_dict,
        LLaDAModel,
        ("block-fast", "block"),
        defaults=(("block_length", 8), ("block_steps", 8), ("threshold", 0.9)),
        when=_block_causal,
    ),
    Architecture(
        "dream",
        ("Dream",),
        ("DreamModel",),
        DreamConfig.from_dict,
        DreamModel,
        ("fast", "dream", "reference"),
        _tied_head,
    ),
    Architecture(
        "llada2_moe",
        ("llada2_moe",),
        ("LLaDA2MoeModelLM",),
        LLaDA2Config.from_dict,
        LLaDA2MoeModel,
        ("block-fast", "block"),
        _tied_head,
        # LLaDA2's own generate() defaults
        (("block_length", 32), ("block_steps", 32), ("threshold", 0.95)),
    ),
)


_VARIANTS = {"llada_block"}


def supported() -> str:
    return ", ".join(dict.fromkeys(t for a in ARCHITECTURES for t in a.model_types))


def architecture_of(raw: dict[str, Any], path: Path | str = "config.json") -> Architecture:
    """The architecture a config.json names. A config naming neither a model_type nor an architecture is
    read as LLaDA's (the format of our own models before the registry)."""
    model_type, classes = raw.get("model_type"), raw.get("architectures") or []
    variants = sorted(ARCHITECTURES, key=lambda a: a.name not in _VARIANTS)  # a variant before its base
    for arch in variants:
        if model_type in arch.model_types and arch.when(raw):
            return arch
    if model_type is None:
        for arch in variants:
            if arch.when(raw) and any(c in arch.classes for c in classes if isinstance(c, str)):
                return arch
        if not classes:
            return next(a for a in variants if a.when(raw) and "llada" in a.model_types)
    named = f"model_type {model_type!r}" if model_type is not None else f"architectures {classes!r}"
    raise ModelError(f"{path}: {named} is not supported (supported model types: {supported()})")


def read_arch_config(raw: dict[str, Any], path: Path | str = "config.json") -> tuple[Architecture, ArchConfig]:
    arch = architecture_of(raw, path)
    return arch, arch.read_config(raw)
