"""A model folder, read once: config.json and the architecture it names, generation_config.json (the
model's layer of settings, its extra stop ids and its presets per script), the tokenizer and the weight
files. Every place that opens a model folder goes through `ModelFolder`; nothing outside `arch/` reads
config.json or generation_config.json itself.

Released folders disagree about where a fact lives, so one rule reads them (docs/models.md): the end-of-text
id is config.json's `eos_token_id`, else generation_config.json's, else the tokenizer's `eos_token`
(tokenizer_config.json, then special_tokens_map.json), as transformers reads it; a list names the eos first
and further stop ids after it. config.json keys a family does not read are ignored and listed by `celeris
inspect`; a key that would change what the weights mean and that no family reads (`quantization`) is refused
by name.

Opening a folder reads the two JSON files and chooses the architecture without importing torch (so
`--help` can show the embedded model's defaults); the family's config is read on first use.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, fields, replace
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
TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json")  # where a tokenizer names its eos

# config.json keys that change what the weights mean and that Celeris does not read: refused by name, never
# ignored (a pre-quantized conversion's packed tensors would load as garbage or not at all)
REFUSED = {
    "quantization": "the weights are pre-quantized (an MLX-style conversion), which Celeris does not read; "
    "load the original checkpoint (--quantize int8|int4 quantizes it as it loads)",
    "quantization_config": "the weights are pre-quantized (GPTQ/AWQ/bitsandbytes style), which Celeris does not "
    "read; load the original checkpoint (--quantize int8|int4 quantizes it as it loads)",
}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ModelError(f"{path}: expected a JSON object")
    return raw


def _token_ids(raw: Any) -> list[int] | None:
    """An `eos_token_id` value (an id or a list of them) as a list; None where it is unset."""
    ids = raw if isinstance(raw, list) else None if raw is None else [raw]
    if ids is not None and not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ModelError(f"eos_token_id must be a token id or a list of them, got {raw!r}")
    return ids or None


def _named_token(folder: Path, key: str) -> tuple[str, str] | None:
    """The piece a tokenizer file names for `key` ("eos_token"), and the file: tokenizer_config.json first."""
    for name in TOKENIZER_FILES:
        path = folder / name
        if path.is_file():
            value = _read_json(path).get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                return value, name
    return None


class _Reads(dict[str, Any]):
    """config.json as a family's reader sees it, noting every key it looks at (for `ignored_keys`)."""

    def __init__(self, raw: dict[str, Any]) -> None:
        super().__init__(raw)
        self.seen: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self.seen.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.seen.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.seen.add(str(key))
        return super().__contains__(key)


@dataclass(frozen=True)
class ModelFolder:
    path: Path
    config: dict[str, Any]  # config.json as saved
    generation: dict[str, Any]  # generation_config.json as saved ({} where the folder has none)
    arch: Architecture
    eos_ids: tuple[int, ...] = ()  # the end-of-text id first, then further stop ids; () leaves it to the tokenizer
    eos_source: str = "the tokenizer"  # the file eos_ids came from

    @classmethod
    def open(cls, path: Path | str) -> ModelFolder:
        path = Path(path)
        if not path.is_dir():
            raise ModelError(f"model folder not found: {path}")
        if not (path / CONFIG).is_file():
            raise ModelError(f"{path} is not a model folder: {CONFIG} is missing")
        config = _read_json(path / CONFIG)
        for key, why in REFUSED.items():
            if config.get(key) is not None:
                raise ModelError(f"{path / CONFIG}: {key} is not supported: {why}")
        arch = architecture_of(config, path / CONFIG)
        gen = path / GENERATION_CONFIG
        generation = _read_json(gen) if gen.is_file() and arch.generation_config else {}
        if gen.is_file() and not arch.generation_config:
            log.info("%s: not read (%s's own code never reads it)", gen, arch.name)
        for source, raw in ((CONFIG, config), (GENERATION_CONFIG, generation)):
            try:
                ids = _token_ids(raw.get("eos_token_id"))
            except ModelError as e:
                raise ModelError(f"{path / source}: {e}") from None
            if ids:
                return cls(path, config, generation, arch, tuple(ids), source)
        return cls(path, config, generation, arch)

    @property
    def family_config(self) -> dict[str, Any]:
        """config.json as the family reads it: `eos_token_id` the single end-of-text id this folder's files
        give (see the module's rule), or absent where only the tokenizer names it."""
        raw = {k: v for k, v in self.config.items() if k != "eos_token_id"}
        return raw | ({"eos_token_id": self.eos_ids[0]} if self.eos_ids else {})

    @functools.cached_property
    def cfg(self) -> ArchConfig:
        """The family's typed config (its special ids and sizes)."""
        result: ArchConfig = self.arch.read_config(self.family_config)
        return result

    @functools.cached_property
    def ignored_keys(self) -> list[str]:
        """config.json's keys the family's reader never looked at and that are no field of its config:
        bookkeeping (`transformers_version`, `auto_map`), training-only keys (`use_deepep`), a multimodal
        wrapper's (`vision_config`, `image_token_id`). Shown by `celeris inspect`."""
        seen = _Reads(self.family_config)
        cfg = self.arch.read_config(seen)
        known = {f.name for f in fields(cfg)} | seen.seen | {"architectures", "model_type", "eos_token_id"}
        return sorted(k for k in self.config if k not in known)

    def eos_named(self) -> str:
        """Where the end-of-text id comes from, in words (for `celeris inspect`)."""
        if self.eos_ids:
            return f"{list(self.eos_ids)} from {self.eos_source}"
        named = _named_token(self.path, "eos_token")
        return f"{named[0]!r} from {named[1]}" if named else "none named"

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
            params = GenerationParams.defaults_from(self.arch.layer(self.config), self._layer[0])
            return replace(params, strategies=(params.strategy, *self.arch.strategies))
        except UsageError as e:
            raise ModelError(f"{self.path / GENERATION_CONFIG}: {e}") from None

    @property
    def extra_stops(self) -> frozenset[int]:
        """Stop ids beside the end-of-text id: the rest of config.json's `eos_token_id` list (DiffusionGemma's
        `[1, 106]`) and generation_config.json's (an id or a list)."""
        return self._layer[1] | frozenset(self.eos_ids)

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
