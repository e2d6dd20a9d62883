"""The engine: text in, text and figures out. Loads a model folder once and decodes batches of prompts.

It knows tokenization and batching; it knows nothing about the CLI, files or queues. Decoding itself is
delegated to the pure functions in `decoding` (and `fast`), chosen by name.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from .arch import invariant
from .arch.checkpoint import load_model, read_folder
from .arch.layers import Model
from .arch.registry import ARCHITECTURES, Architecture
from .arch.tokenizer import Tokenizer, load_tokenizer
from .decode.sampling import RowNoise, request_seed
from .decode.strategies import Net, SpecialTokens, get_strategy
from .device import resolve_device, resolve_dtype
from .errors import ModelError, PromptTooLong, UsageError
from .params import GenerationParams, model_layer, script_layers, script_of

log = logging.getLogger(__name__)

DEFAULT_MODEL = "celeris-block"
GENERATION_CONFIG = "generation_config.json"  # the model's own default settings


def embedded_models() -> dict[str, Path]:
    """The models shipped inside the package, by name."""
    root = Path(str(resources.files("celeris_cli"))) / "models"
    return {p.name: p for p in sorted(root.iterdir()) if (p / "config.json").is_file()} if root.is_dir() else {}


def default_model_dir() -> Path:
    """The embedded model shipped inside the package."""
    path = Path(str(resources.files("celeris_cli"))) / "models" / DEFAULT_MODEL
    if not (path / "config.json").is_file():
        raise ModelError(f"the embedded model is not installed ({path}); pass --model FOLDER")
    return path


def model_dir(model: str | Path | None) -> Path:
    """The folder a --model value names: the default embedded model for None, a folder as given, or the
    name of an embedded model (`celeris-tiny`) where no folder of that name exists here."""
    if model is None or str(model) == "":
        return default_model_dir()
    path = Path(model)
    if not path.exists() and str(model) in embedded_models():
        return embedded_models()[str(model)]
    return path


@dataclass(frozen=True)
class Result:
    """One prompt's answer and the figures of the batch it was decoded in."""

    prompt: str
    text: str
    finish_reason: str  # "stop" (EOS / end of turn) or "length"
    prompt_tokens: int
    output_tokens: int
    denoise_steps: int  # steps scheduled (the sum of steps_per_block); threshold decoders may need fewer
    steps_per_block: list[int]
    nfe: int  # forward passes run for the batch, counted at the model boundary (guidance included)
    wall_s: float
    tokens_per_s: float
    batch_size: int
    device: str
    dtype: str
    seed: int = 0
    settings: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Engine:
    def __init__(
        self,
        model: Model,
        tokenizer: Tokenizer,
        device: torch.device,
        dtype: torch.dtype,
        model_dir: Path | None = None,
        arch: Architecture = ARCHITECTURES[0],
    ) -> None:
        self.model = model
        self.arch = arch
        self.tokenizer = tokenizer
        self.device = device
        self.dtype = dtype
        self.model_dir = model_dir
        self.max_length = model.cfg.max_sequence_length
        self.defaults, extra_stops = read_generation_config(model_dir, arch)
        self.by_script = read_script_layers(model_dir)
        outside = sorted(i for i in extra_stops if i >= model.cfg.rows)
        if outside:
            raise ModelError(f"{GENERATION_CONFIG}: eos_token_id {outside[0]} is outside the embedding table")
        self.special = SpecialTokens(tokenizer.mask_id, tokenizer.stop_ids | extra_stops, tokenizer.pad_id)
        self.positions_computed = 0  # positions through the network over every decode (for `bench`)

    def with_defaults(self, settings: dict[str, Any]) -> Engine:
        """Replace this engine's model-folder layer of defaults with `settings`, a generation_config.json's
        content, script presets included (for tests and tools)."""
        layer, _, _ = model_layer(settings)
        self.defaults = GenerationParams.defaults_from(self.arch.layer(), layer)
        self.by_script = script_layers(settings)
        return self

    def params_for(self, prompt: str, params: GenerationParams) -> GenerationParams:
        """The settings a prompt runs with: `params` with the model's preset for the prompt's script (if
        any) beneath the user's layers."""
        preset = self.by_script.get(script_of(prompt) or "")
        return params.under(preset) if preset else params

    def params(self, overrides: dict[str, Any] | None = None) -> GenerationParams:
        """Settings in the documented order: built-in defaults, the model folder's generation_config.json,
        then `overrides` (a config's, a request's or the command line's), validated, for a strategy this
        model's architecture supports."""
        params = GenerationParams.from_mapping(overrides or {}, self.defaults)
        self.arch.check_strategy(params.strategy)
        if params.subword_min_p > 0:
            self.tokenizer.require_word_pieces()
        return params

    # -- token level -------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str, chat: bool = False) -> list[int]:
        text = self.tokenizer.render_chat(prompt) if chat else prompt
        ids = self.tokenizer.encode(text)
        if not ids:
            raise UsageError("empty prompt")
        return ids

    def check_fits(self, n_prompt: int, params: GenerationParams) -> None:
        if n_prompt + params.gen_length > self.max_length:
            raise PromptTooLong(
                f"prompt of {n_prompt} tokens plus gen-length {params.gen_length} exceeds the "
                f"model's context of {self.max_length} tokens"
            )

    def decode_ids(
        self, batch: Sequence[list[int]], params: GenerationParams, seeds: Sequence[int] | None = None
    ) -> tuple[list[list[int]], int]:
        """Decode one batch of token-id prompts; returns each row's generated ids (uncut) and the NFE. Row
        b draws its randomness from seeds[b] and its own prompt alone (default seed: params.seed)."""
        decode = get_strategy(params.strategy)
        self.arch.check_strategy(params.strategy)
        P = max(len(ids) for ids in batch)
        pad = self.tokenizer.pad_id
        prompt = torch.tensor([[pad] * (P - len(ids)) + ids for ids in batch], device=self.device)
        prompt_mask = torch.tensor([[False] * (P - len(ids)) + [True] * len(ids) for ids in batch], device=self.device)
        seeds = seeds if seeds is not None else [params.seed] * len(batch)
        noise = RowNoise([request_seed(s, ids) for s, ids in zip(seeds, batch)], self.device)
        net = Net(self.model)
        with invariant.enabled(params.deterministic):
            out = decode(net, prompt, prompt_mask, params, self._special(params), noise)
        self.positions_computed += net.positions_computed
        return out[:, P:].tolist(), net.nfe

    def _special(self, params: GenerationParams) -> SpecialTokens:
        """The special tokens, with the word-continuing pieces when subword_min_p needs them (found once,
        on first use: a large vocabulary takes a moment)."""
        if params.subword_min_p == 0:
            return self.special
        return replace(self.special, word_pieces=self.tokenizer.require_word_pieces())

    def finish(self, ids: list[int], stop: Sequence[str] = (), prompt: Sequence[int] = ()) -> tuple[str, int, str]:
        """(text, output tokens, finish reason): the text `ids` continue `prompt` with, cut at the first stop
        token, then at the first stop string (which is left out of the text, as OpenAI does)."""
        reason = "length"
        for i, t in enumerate(ids):
            if t in self.special.stop_ids:
                ids, reason = ids[:i], "stop"
                break
        text = self.tokenizer.continuation(prompt, ids)
        cuts = [text.find(s) for s in stop if s in text]
        if cuts:
            text, reason = text[: min(cuts)], "stop"
            lo, hi = 1, len(ids)  # the fewest tokens whose text holds a stop string (binary search)
            while lo < hi:
                mid = (lo + hi) // 2
                if any(s in self.tokenizer.continuation(prompt, ids[:mid]) for s in stop):
                    hi = mid
                else:
                    lo = mid + 1
            ids = ids[:lo]
        return text, len(ids), reason

    def decode_batch(
        self,
        prompts: Sequence[str],
        encoded: Sequence[list[int]],
        params: GenerationParams,
        seeds: Sequence[int] | None = None,
        presets: bool = True,
    ) -> list[Result]:
        """Decode prompts (already encoded and checked) as one batch; one Result per prompt. Rows whose
        script presets give them different settings are decoded as separate sub-batches. presets=False:
        `params` are final for every row (the queue's rows, whose presets were applied as they were
        prepared, each under its own request's settings)."""
        seeds = list(seeds) if seeds is not None else [params.seed] * len(encoded)
        if not presets:
            return self._decode_group(prompts, encoded, params, seeds)
        groups: dict[GenerationParams, list[int]] = {}
        for i, prompt in enumerate(prompts):
            groups.setdefault(self.params_for(prompt, params), []).append(i)
        results: list[Result | None] = [None] * len(prompts)
        for group, idx in groups.items():
            sub = self._decode_group(
                [prompts[i] for i in idx], [encoded[i] for i in idx], group, [seeds[i] for i in idx]
            )
            for i, r in zip(idx, sub):
                results[i] = r
        return [r for r in results if r is not None]

    def _decode_group(
        self, prompts: Sequence[str], encoded: Sequence[list[int]], params: GenerationParams, seeds: list[int]
    ) -> list[Result]:
        t0 = time.perf_counter()
        outs, nfe = self.decode_ids(encoded, params, seeds)
        wall = time.perf_counter() - t0
        settings = params.report()
        results = []
        for prompt, ids_in, out, seed in zip(prompts, encoded, outs, seeds):
            text, n_out, reason = self.finish(out, params.stop, ids_in)
            steps = params.steps_for(len(ids_in))
            results.append(
                Result(
                    prompt=prompt,
                    text=text,
                    finish_reason=reason,
                    prompt_tokens=len(ids_in),
                    output_tokens=n_out,
                    denoise_steps=sum(steps),
                    steps_per_block=steps,
                    nfe=nfe,
                    wall_s=round(wall, 4),
                    tokens_per_s=round(n_out / wall, 2) if wall > 0 else 0.0,
                    batch_size=len(encoded),
                    device=str(self.device),
                    dtype=str(self.dtype).replace("torch.", ""),
                    seed=seed,
                    settings={**settings, "seed": seed},
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
        seeds: Sequence[int] | None = None,
    ) -> list[Result]:
        """Generate an answer for each prompt, in order, with the model's defaults unless `params` is
        given. Prompt i draws its randomness from seeds[i] (default: params.seed), so its answer does not
        depend on the other prompts or the batch size. Prompts are grouped into batches of similar length
        so one long prompt does not pad a whole batch."""
        params = params or self.params()
        seeds = list(seeds) if seeds is not None else [params.seed] * len(prompts)
        if len(seeds) != len(prompts):
            raise UsageError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        if batch_size < 1:
            raise UsageError(f"batch-size must be a positive integer, got {batch_size}")
        encoded = [self.encode_prompt(p, chat) for p in prompts]
        for ids in encoded:
            self.check_fits(len(ids), params)
        order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
        results: list[Result | None] = [None] * len(prompts)
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            batch = self.decode_batch(
                [prompts[i] for i in idx], [encoded[i] for i in idx], params, [seeds[i] for i in idx]
            )
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
    folder = model_dir(model)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    arch, cfg = read_folder(folder)
    tok = load_tokenizer(folder, cfg)  # a mismatched tokenizer fails before the weights are read
    m: Model = load_model(folder, dev, dt)  # type: ignore[assignment]
    log.info("loaded %s (%s) on %s (%s)", folder, arch.name, dev, dt)
    return Engine(m, tok, dev, dt, folder, arch)


def read_script_layers(model_dir: Path | None) -> dict[str, dict[str, Any]]:
    """The model folder's settings per script of the prompt (`by_script` in its generation_config.json)."""
    path = model_dir / GENERATION_CONFIG if model_dir is not None else None
    if path is None or not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        return script_layers(raw) if isinstance(raw, dict) else {}
    except (json.JSONDecodeError, UnicodeDecodeError, UsageError) as e:
        raise ModelError(f"{path}: {e}") from None


def read_generation_config(model_dir: Path | None, arch: Architecture) -> tuple[GenerationParams, frozenset[int]]:
    """The model folder's layer of settings over the built-in defaults and the architecture's own (its
    default strategy first), and any extra stop ids. Accepts both Celeris's own keys and the file
    `transformers` writes; keys neither knows are ignored (logged)."""
    path = model_dir / GENERATION_CONFIG if model_dir is not None else None
    if path is None or not path.is_file():
        return GenerationParams.defaults_from(arch.layer()), frozenset()
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(raw, dict):
            raise UsageError("expected a JSON object")
        settings, stops, ignored = model_layer(raw)
        if ignored:
            log.debug("%s: ignoring %s", path, ", ".join(ignored))
        return GenerationParams.defaults_from(arch.layer(), settings), stops
    except (json.JSONDecodeError, UnicodeDecodeError, UsageError) as e:
        raise ModelError(f"{path}: {e}") from None
