"""The architecture registry: which family a model folder's config.json names, as data.

An architecture is chosen by the classes config.json lists under `architectures` first, and by its
`model_type` only where it lists none (our own folders): several families share a model_type (LLaDA-MoE says
"llada", as LLaDA-8B does), so a model_type alone never overrides a class. A variant of a family (LLaDA
trained block-causal) is told by config.json keys (`when`). Adding a family means adding its module (a
`CONFIG` with `from_dict` and a `MODEL`) and one entry here. This module does not import torch: the family's
module is imported when its config is read.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..errors import ModelError, UsageError

Attention = Literal["bidirectional", "block-causal"]


@dataclass(frozen=True)
class Architecture:
    name: str
    classes: tuple[str, ...]  # config.json "architectures" naming it
    model_types: tuple[str, ...]  # config.json "model_type", read where "architectures" is absent
    module: str  # celeris_cli.arch.<module>: its CONFIG (with from_dict) and MODEL
    layout: str  # the tensor layout, in words (for `celeris inspect`)
    attention: Attention
    strategies: tuple[str, ...]  # supported decoding strategies, the default first
    defaults: Mapping[str, Any] = field(default_factory=dict, hash=False)  # under generation_config.json
    when: Mapping[str, Any] = field(default_factory=dict, hash=False)  # config.json keys telling a variant
    generation_config: bool = True  # False: the family's code never reads its generation_config.json
    from_config: Mapping[str, str] = field(default_factory=dict, hash=False)  # knob -> config.json key (a default)

    @property
    def default_strategy(self) -> str:
        return self.strategies[0]

    def layer(self, raw: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The architecture's own defaults, under its folders' generation_config.json; with the folder's
        config.json, the settings it gives (`from_config`: DiffusionGemma's canvas is its block_length)."""
        given = {k: raw[key] for k, key in self.from_config.items() if raw is not None and key in raw}
        return {"strategy": self.default_strategy, **self.defaults, **given}

    def check_strategy(self, strategy: str) -> None:
        if strategy not in self.strategies:
            raise UsageError(
                f"strategy {strategy!r} does not run on the {self.name} architecture "
                f"(it supports {', '.join(self.strategies)})"
            )

    def _module(self) -> Any:
        return importlib.import_module(f"{__package__}.{self.module}")

    def read_config(self, raw: dict[str, Any]) -> Any:
        return self._module().CONFIG.from_dict(raw)

    @property
    def model_class(self) -> Any:
        return self._module().MODEL

    def build(self, cfg: Any) -> Any:
        return self.model_class(cfg)

    def matches(self, raw: Mapping[str, Any]) -> bool:
        return all(raw.get(k) == v for k, v in self.when.items())


_BLOCK = ("block-fast", "block")
_DREAM = ("dream", "fast", "reference")  # Dream-style families: their own algorithm first
# SDAR's own generate.py: block 4, 4 denoising steps per block, low_confidence_dynamic at 0.85
_SDAR_GENERATE = {"block_length": 4, "block_steps": 4, "threshold": 0.85}
_ENTRIES = (
    Architecture(
        name="llada",
        classes=("LLaDAModelLM",),
        model_types=("llada",),
        module="llada",
        layout="LLaDA (OLMo names)",
        attention="bidirectional",
        strategies=("fast", "reference", "dream"),
    ),
    # LLaDA's layout trained as block diffusion (`celeris train --block-size`): causal between blocks, so only
    # the block decoders run it (a bidirectional decoder would show it blocks it never saw in training)
    Architecture(
        name="llada_block",
        classes=("LLaDAModelLM",),
        model_types=("llada",),
        module="llada",
        layout="LLaDA (OLMo names)",
        attention="block-causal",
        strategies=_BLOCK,
        defaults={"block_length": 8, "block_steps": 8, "threshold": 0.9},
        when={"block_causal": True, "causal_context": None},
    ),
    # LLaDA's layout trained jointly as a causal LM and block diffusion over a causal cache (`celeris train
    # --ar-weight`): its AR mode, self-speculation over it (the architecture's default: the AR answer, drafted
    # where it pays) and Nemotron's diffusion mode (a seed, then a block of masks over the causal cache; the
    # embedded celeris-spec's default, by its generation_config.json)
    Architecture(
        name="llada_spec",
        classes=("LLaDAModelLM",),
        model_types=("llada",),
        module="llada",
        layout="LLaDA (OLMo names)",
        attention="block-causal",
        strategies=("spec", "ar", "nemotron"),
        defaults={"denoise_steps": 16, "block_length": 4, "threshold": 1.0},
        when={"block_causal": True, "causal_context": True},
    ),
    Architecture(
        name="dream",
        classes=("DreamModel",),
        model_types=("Dream",),
        module="dream",
        layout="Qwen2 (q/k/v bias)",
        attention="bidirectional",
        strategies=("fast", "dream", "reference"),
    ),
    Architecture(
        name="llada2_moe",
        classes=("LLaDA2MoeModelLM",),
        model_types=("llada2_moe",),
        module="llada2",
        layout="LLaDA2-MoE (fused qkv, sigmoid router)",
        attention="block-causal",
        strategies=_BLOCK,
        defaults={"block_length": 32, "block_steps": 32, "threshold": 0.95},  # LLaDA2's own generate() defaults
    ),
    Architecture(
        name="llada_moe",
        classes=("LLaDAMoEModelLM",),
        model_types=("lladamoe",),  # its config class's; the configs it saves say "llada"
        module="llada_moe",
        layout="OLMoE (q/k norm per head, softmax router)",
        attention="bidirectional",
        strategies=("fast", "reference"),
    ),
    Architecture(
        name="coda",
        classes=("CoDALanguageModel",),
        model_types=("CoDA",),
        module="coda",
        layout="Qwen3 (q/k norm per head)",
        attention="bidirectional",
        strategies=_DREAM,
        generation_config=False,
    ),
    Architecture(
        name="rnd1",
        classes=("RND1LM",),
        model_types=("rnd1",),
        module="rnd1",
        layout="Qwen3-MoE (q/k norm per head, softmax router)",
        attention="bidirectional",
        strategies=("rnd1", *_DREAM),  # its own sampler first
    ),
    # one checkpoint, three decoders: its diffusion mode (a seed token, then bidirectional denoising over a
    # causal cache), its AR mode and its speculative decoding (diffusion drafts, causal verification);
    # block 32 as its config's block_size, one token per step, no threshold
    Architecture(
        name="nemotron_labs_diffusion",
        classes=("NemotronLabsDiffusionModel",),
        model_types=("nemotron_labs_diffusion",),
        module="nemotron",
        layout="Ministral-3 (YaRN, Llama-4 query scale; encoder., diffusion_head)",
        attention="block-causal",
        strategies=("spec", "nemotron", "ar", "nemotron-spec"),
        defaults={"block_length": 32, "block_steps": 32, "threshold": 1.0},
    ),
    # Gemma 4 run as a causal encoder (prompt, then each finished canvas) and a bidirectional decoder that
    # denoises a canvas of uniformly random tokens over its cache; its generate's released defaults
    Architecture(
        name="diffusion_gemma",
        classes=("DiffusionGemmaForBlockDiffusion",),
        model_types=("diffusion_gemma",),
        module="diffusion_gemma",
        layout="Gemma 4 (MoE beside a dense MLP, sliding and full layers; model.decoder.*)",
        attention="block-causal",
        strategies=("diffusion-gemma",),
        defaults={
            "gen_length": 256,
            "block_length": 256,
            "block_steps": 48,
            "entropy_bound": 0.1,
            "temperature": 0.8,
            "temperature_final": 0.4,
            "stability_threshold": 1,
            "confidence_threshold": 0.005,
        },
        from_config={"block_length": "canvas_length"},
    ),
    Architecture(
        name="sdar",
        classes=("SDARForCausalLM",),
        model_types=("sdar",),
        module="sdar",
        layout="Qwen3 (q/k norm per head)",
        attention="block-causal",
        strategies=_BLOCK,
        defaults=_SDAR_GENERATE,
    ),
    Architecture(
        name="sdar_moe",
        classes=("SDARMoeForCausalLM",),
        model_types=("sdar_moe",),
        module="sdar",
        layout="Qwen3-MoE (q/k norm per head, softmax router)",
        attention="block-causal",
        strategies=_BLOCK,
        defaults=_SDAR_GENERATE,
    ),
)

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in _ENTRIES}


def supported() -> str:
    """Every architecture by its class and model type, for error messages."""
    return ", ".join(dict.fromkeys(f"{c} ({a.model_types[0]})" for a in _ENTRIES for c in a.classes))


def _choose(candidates: list[Architecture], raw: Mapping[str, Any]) -> Architecture | None:
    """The variant whose `when` holds, else the base (the one with no `when`)."""
    told = [a for a in candidates if a.when and a.matches(raw)]
    if told:
        assert len(told) == 1, [a.name for a in told]
        return told[0]
    return next((a for a in candidates if not a.when), None)


def architecture_of(raw: Mapping[str, Any], path: Path | str = "config.json") -> Architecture:
    """The architecture a config.json names: by `architectures` where it lists any, else by `model_type`. A
    config naming neither is read as LLaDA's (the format of our own models before the registry)."""
    model_type, classes = raw.get("model_type"), raw.get("architectures") or []
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise ModelError(f"{path}: architectures must be a list of class names, got {classes!r}")
    if classes:
        arch = _choose([a for a in _ENTRIES if any(c in a.classes for c in classes)], raw)
    elif model_type is not None:
        arch = _choose([a for a in _ENTRIES if model_type in a.model_types], raw)
    else:
        arch = _choose([a for a in _ENTRIES if "llada" in a.model_types], raw)
    if arch is None:
        raise ModelError(
            f"{path}: architectures {classes!r} with model_type {model_type!r} is not supported "
            f"(supported: {supported()})"
        )
    if arch.module == "llada" and raw.get("num_experts"):
        # LLaDA-MoE's released config says model_type "llada", as the dense LLaDA's does (users of other tools
        # are told to edit it): its experts tell the layout apart, whatever class it names
        return ARCHITECTURES["llada_moe"]
    return arch
