"""The engine: text in, text and figures out. Loads a model folder once and decodes batches of prompts.

It knows tokenization and batching; it knows nothing about the CLI, files or queues. Decoding itself is
delegated to the pure functions in `decoding` (and `fast`), chosen by name.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from .checkpoint import load_model
from .decoding import DecodeParams
from .device import resolve_device, resolve_dtype
from .errors import ModelError, PromptTooLong, UsageError
from .fast import FastParams
from .model import LLaDAModel
from .strategies import Net, SpecialTokens, get_strategy
from .tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

DEFAULT_MODEL = "celeris-tiny"
GENERATION_CONFIG = "generation_config.json"  # the model's own default settings


def default_model_dir() -> Path:
    """The embedded model shipped inside the package."""
    path = Path(str(resources.files("celeris_cli"))) / "models" / DEFAULT_MODEL
    if not (path / "config.json").is_file():
        raise ModelError(f"the embedded model is not installed ({path}); pass --model FOLDER")
    return path


@dataclass(frozen=True)
class GenerationParams(FastParams):
    """Everything that decides an answer: the decoder's parameters, the strategy and the seed."""

    seed: int = 0
    strategy: str = "fast"

    @classmethod
    def from_mapping(cls, values: dict[str, Any], base: GenerationParams | None = None) -> GenerationParams:
        """Build from user input (CLI, config or a request), naming unknown keys and wrong types."""
        defaults = {f.name: f.default for f in fields(cls)}
        out: dict[str, Any] = {}
        for key, value in values.items():
            k = {"steps": "denoise_steps"}.get(key.replace("-", "_"), key.replace("-", "_"))
            if k not in defaults:
                raise UsageError(f"unknown generation parameter {key!r}")
            want = type(defaults[k])
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, want) or (isinstance(value, bool) and want is not bool):
                raise UsageError(f"{key} must be {_TYPE_NAMES[want]}, got {value!r}")
            out[k] = value
        return replace(base, **out) if base is not None else cls(**out)

    def decode_params(self) -> DecodeParams:
        return DecodeParams(**{f.name: getattr(self, f.name) for f in fields(DecodeParams)})

    def fast_params(self) -> FastParams:
        return FastParams(**{f.name: getattr(self, f.name) for f in fields(FastParams)})


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


@dataclass(frozen=True)
class Result:
    """One prompt's answer and the figures of the batch it was decoded in."""

    prompt: str
    text: str
    finish_reason: str  # "stop" (EOS / end of turn) or "length"
    prompt_tokens: int
    output_tokens: int
    denoise_steps: int
    nfe: int
    wall_s: float
    tokens_per_s: float
    batch_size: int
    device: str
    dtype: str
    settings: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Engine:
    def __init__(
        self,
        model: LLaDAModel,
        tokenizer: Tokenizer,
        device: torch.device,
        dtype: torch.dtype,
        model_dir: Path | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.dtype = dtype
        self.model_dir = model_dir
        self.max_length = model.cfg.max_sequence_length
        self.special = SpecialTokens(tokenizer.mask_id, tokenizer.stop_ids, tokenizer.pad_id)
        self.defaults = GenerationParams()
        gc = model_dir / GENERATION_CONFIG if model_dir is not None else None
        if gc is not None and gc.is_file():
            try:
                raw = json.loads(gc.read_text(encoding="utf-8"))
                self.defaults = GenerationParams.from_mapping(raw)
            except (json.JSONDecodeError, AttributeError, UsageError) as e:
                raise ModelError(f"{gc}: {e}") from None

    def params(self, overrides: dict[str, Any] | None = None) -> GenerationParams:
        """The model's default generation settings with `overrides` applied and validated."""
        return GenerationParams.from_mapping(overrides or {}, self.defaults)

    # -- token level -------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str, chat: bool = False) -> list[int]:
        text = self.tokenizer.render_chat(prompt) if chat else prompt
        ids = self.tokenizer.encode(text)
        if not ids:
            raise UsageError("empty prompt")
        return ids

    def check_fits(self, n_prompt: int, params: DecodeParams) -> None:
        if n_prompt + params.gen_length > self.max_length:
            raise PromptTooLong(
                f"prompt of {n_prompt} tokens plus gen-length {params.gen_length} exceeds the "
                f"model's context of {self.max_length} tokens"
            )

    def decode_ids(
        self, batch: Sequence[list[int]], params: GenerationParams, generator: torch.Generator
    ) -> tuple[list[list[int]], int]:
        """Decode one batch of token-id prompts; returns each row's generated ids (uncut) and the NFE."""
        decode = get_strategy(params.strategy)
        P = max(len(ids) for ids in batch)
        pad = self.tokenizer.pad_id
        prompt = torch.tensor([[pad] * (P - len(ids)) + ids for ids in batch], device=self.device)
        prompt_mask = torch.tensor([[False] * (P - len(ids)) + [True] * len(ids) for ids in batch], device=self.device)
        net = Net(self.model)
        out = decode(net, prompt, prompt_mask, params, self.special, generator)
        return out[:, P:].tolist(), net.nfe * (2 if params.cfg_scale > 0 else 1)

    def cut(self, ids: list[int]) -> tuple[list[int], str]:
        for i, t in enumerate(ids):
            if t in self.tokenizer.stop_ids:
                return ids[:i], "stop"
        return ids, "length"

    def decode_batch(
        self,
        prompts: Sequence[str],
        encoded: Sequence[list[int]],
        params: GenerationParams,
        generator: torch.Generator | None = None,
    ) -> list[Result]:
        """Decode prompts (already encoded and checked) as one batch; one Result per prompt."""
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        t0 = time.perf_counter()
        outs, nfe = self.decode_ids(encoded, params, generator)
        wall = time.perf_counter() - t0
        settings = asdict(params)
        results = []
        for prompt, ids_in, out in zip(prompts, encoded, outs):
            ids, reason = self.cut(out)
            results.append(
                Result(
                    prompt=prompt,
                    text=self.tokenizer.decode(ids),
                    finish_reason=reason,
                    prompt_tokens=len(ids_in),
                    output_tokens=len(ids),
                    denoise_steps=params.denoise_steps,
                    nfe=nfe,
                    wall_s=round(wall, 4),
                    tokens_per_s=round(len(ids) / wall, 2) if wall > 0 else 0.0,
                    batch_size=len(encoded),
                    device=str(self.device),
                    dtype=str(self.dtype).replace("torch.", ""),
                    settings=settings,
                )
            )
        return results

    # -- text level --------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[str],
        params: GenerationParams | None = None,
        batch_size: int = 16,
        chat: bool = False,
        on_batch: Callable[[int], None] | None = None,
    ) -> list[Result]:
        """Generate an answer for each prompt, in order. Prompts are grouped into batches of similar
        length so one long prompt does not pad a whole batch."""
        params = params or GenerationParams()
        if batch_size < 1:
            raise UsageError(f"batch-size must be a positive integer, got {batch_size}")
        encoded = [self.encode_prompt(p, chat) for p in prompts]
        for ids in encoded:
            self.check_fits(len(ids), params)
        order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
        results: list[Result | None] = [None] * len(prompts)
        generator = torch.Generator(device=self.device).manual_seed(params.seed)
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            batch = self.decode_batch([prompts[i] for i in idx], [encoded[i] for i in idx], params, generator)
            for i, r in zip(idx, batch):
                results[i] = r
            if on_batch is not None:
                on_batch(len(idx))
        return [r for r in results if r is not None]


def load_engine(
    model: str | Path | None = None, device: str = "auto", dtype: str = "auto", threads: int | None = None
) -> Engine:
    """Load a model folder (default: the embedded model) onto a device, ready to generate."""
    if threads:
        torch.set_num_threads(threads)
    folder = Path(model) if model is not None else default_model_dir()
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    m = load_model(folder, dev, dt)
    tok = load_tokenizer(folder, m.cfg)
    log.info("loaded %s on %s (%s)", folder, dev, dt)
    return Engine(m, tok, dev, dt, folder)
