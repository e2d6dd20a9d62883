"""A model folder, read once: config.json and the architecture it names, generation_config.json (the
model's layer of settings, its extra stop ids and its presets per script), the tokenizer and the weight
files. Every place that opens a model folder goes through `ModelFolder`; nothing outside `arch/` reads
config.json or generation_config.json itself.

Opening a folder reads the two JSON files and chooses the architecture without importing torch (so
`--help` can show the embedded model's defaults); the family's config is read on first use.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ModelError, UsageError
from ..params import GenerationParams, model_layer, script_layers
from .registry import Architecture, architecture_of

if TYPE_CHECKING:
    from .layers import ArchConfig
    from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"  # the model's own default settings
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ModelError(f"{path}: expected a JSON object")
    return raw


@dataclass(frozen=True)
class ModelFolder:
    path: Path
    config: dict[str, Any]  # config.json as saved
    generation: dict[str, Any]  # generation_config.json as saved ({} where the folder has none)
    arch: Architecture

    @classmethod
    def open(cls, path: Path | str) -> ModelFolder:
        path = Path(path)
        if not path.is_dir():
            raise ModelError(f"model folder not found: {path}")
        if not (path / CONFIG).is_file():
            raise ModelError(f"{path} is not a model folder: {CONFIG} is missing")
        config = _read_json(path / CONFIG)
        arch = architecture_of(config, path / CONFIG)
        gen = path / GENERATION_CONFIG
        generation = _read_json(gen) if gen.is_file() and arch.generation_config else {}
        if gen.is_file() and not arch.generation_config:
            log.info("%s: not read (%s's own code never reads it)", gen, arch.name)
        return cls(path, config, generation, arch)

    @functools.cached_property
    def cfg(self) -> ArchConfig:
        """The family's typed config (its special ids and sizes)."""
        result: ArchConfig = self.arch.read_config(self.config)
        return result

    def tokenizer(self) -> Tokenizer:
        from .tokenizer import load_tokenizer

        return load_tokenizer(self.path, self.cfg)

    @functools.cached_property
    def weight_files(self) -> list[Path]:
        """The safetensors files: the single file, or the shards its index lists (all present)."""
        folder = self.path
        if (folder / SINGLE).is_file():
            return [folder / SINGLE]
        index = folder / INDEX
        if index.is_file():
            try:
                weight_map = _read_json(index)["weight_map"]
                files = [folder / name for name in dict.fromkeys(weight_map.values())]
            except (KeyError, TypeError, AttributeError) as e:
                raise ModelError(f"{index}: not a safetensors index ({e})") from None
            absent = [f.name for f in files if not f.is_file()]
            if absent:
                raise ModelError(f"{folder} is incomplete: missing shard(s) {', '.join(absent)}")
            return files
        if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
            raise ModelError(f"{folder}: only safetensors weights are loaded (pickle files are never read)")
        raise ModelError(f"{folder} is incomplete: no {SINGLE} or {INDEX}")

    @functools.cached_property
    def _layer(self) -> tuple[dict[str, Any], frozenset[int]]:
        try:
            settings, stops, ignored = model_layer(self.generation)
        except UsageError as e:
            raise ModelError(f"{self.path / GENERATION_CONFIG}: {e}") from None
        if ignored:
            log.debug("%s: ignoring %s", self.path / GENERATION_CONFIG, ", ".join(ignored))
        return settings, stops

    def defaults(self) -> GenerationParams:
        """The folder's layer of settings over the built-in defaults and the architecture's own (its default
        strategy first). Accepts both Celeris's own keys and the file `transformers` writes; keys neither
        knows are ignored (logged)."""
        try:
            return GenerationParams.defaults_from(self.arch.layer(self.config), self._layer[0])
        except UsageError as e:
            raise ModelError(f"{self.path / GENERATION_CONFIG}: {e}") from None

    @property
    def extra_stops(self) -> frozenset[int]:
        """Stop ids generation_config.json adds (`eos_token_id`, an id or a list)."""
        return self._layer[1]

    def by_script(self) -> dict[str, dict[str, Any]]:
        """The folder's settings per script of the prompt (`by_script` in its generation_config.json)."""
        try:
            return script_layers(self.generation)
        except UsageError as e:
            raise ModelError(f"{self.path / GENERATION_CONFIG}: {e}") from None

    def check(self, generation: dict[str, Any]) -> GenerationParams:
        """What a run will load, checked without the weights: the tokenizer matches the config, the weight
        files are there, and `generation` over the folder's defaults is valid for a strategy this
        architecture runs. Returns those settings."""
        self.tokenizer()
        _ = self.weight_files
        params = GenerationParams.from_mapping(generation, self.defaults())
        self.arch.check_strategy(params.strategy)
        return params
