"""The queue's only view of the model: a small interface, so the queue never imports torch and tests can
put a fake at this boundary.

`prepare` validates one request (its parameters, its length) and says which requests may share a batch;
`run` decodes one batch of prepared requests into OpenAI-style response bodies. `Preparer` is `prepare`
without the weights (tokenizer, context length and the model's default settings), for a daemon whose
batches run elsewhere (Ray actors).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import CelerisError, ConfigError, UsageError
from ..params import check_fits, script_of
from .formats import Request


@dataclass(frozen=True)
class Prepared:
    request: Request
    group: Any  # requests with equal groups can be decoded together
    cost: int  # canvas tokens: prompt + generation length
    payload: Any = None


class Backend(Protocol):
    def prepare(self, request: Request) -> Prepared:
        """Raise CelerisError (a user error, not retryable) for a request that can never run."""
        ...

    def run(self, batch: list[Prepared]) -> list[dict[str, Any]]:
        """Response bodies in batch order. Exceptions fail the whole batch as retryable."""
        ...


class Preparer:
    """Requests to Prepared rows with a tokenizer, a context length and settings over the model's defaults;
    what the engine's own encode_prompt and check_fits do, so the queue's rows are the same with or
    without the weights loaded here."""

    def __init__(
        self,
        tokenizer: Any,
        max_length: int,
        base: Any,
        arch: Any = None,
        by_script: dict | None = None,
        rows: int | None = None,
        stops: frozenset[int] = frozenset(),
    ) -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.base = base  # GenerationParams: the config's `generation:` over the model's defaults
        self.arch = arch  # the model's architecture: which strategies it runs (None: any)
        self.by_script = by_script or {}  # the model's presets per script of the prompt, under the user's layers
        self.rows = rows  # the model's logits (its embedding rows): a constraint is checked against them
        self.stops = stops  # the ids beyond the tokenizer's own that end an answer (`Engine.answer_stops`)

    @classmethod
    def load(cls, model: str | None, generation: dict[str, Any]) -> Preparer:
        """From a model folder without its weights (they are only checked to be there)."""

        from ..arch.folder import ModelFolder
        from ..engine import model_dir
        from ..params import GenerationParams

        folder = ModelFolder.open(model_dir(model))
        tokenizer = folder.tokenizer()
        _ = folder.weight_files  # only checked to be there
        defaults = folder.defaults()
        base = _settings(lambda: GenerationParams.from_mapping(generation, defaults))
        _settings(lambda: folder.arch.check_strategy(base.strategy))
        if base.subword_min_p > 0:  # the daemon refuses it at startup, not batch by batch
            _settings(tokenizer.require_word_pieces)
        stops = frozenset(folder.extra_stops | {tokenizer.pad_id})  # as the engine's `answer_stops`
        if base.structured_outputs is not None:
            _settings(lambda: _check_structure(base, tokenizer, folder.cfg.rows, stops))
        arch, max_length = folder.arch, folder.cfg.max_sequence_length
        return cls(tokenizer, max_length, base, arch, folder.by_script(), folder.cfg.rows, stops)

    @classmethod
    def of(cls, engine: Any, base: Any) -> Preparer:
        """The Preparer of a loaded engine, with `base` settings (the queue's backend and serve's runner)."""
        rows, stops = engine.model.cfg.rows, engine.answer_stops()
        return cls(engine.tokenizer, engine.max_length, base, engine.arch, engine.by_script, rows, stops)

    def prepare(self, request: Request) -> Prepared:
        params = self.base.with_(**request.params)
        if self.arch is not None:
            self.arch.check_strategy(params.strategy)
        if params.subword_min_p > 0:
            self.tokenizer.require_word_pieces()
        if request.messages is not None:
            if self.tokenizer.chat_template:
                ids = self.tokenizer.encode(self.tokenizer.render_chat(request.messages, request.chat_template_kwargs))
            elif request.chat_template_kwargs:
                raise UsageError("chat_template_kwargs: this model has no chat template to take them")
            else:  # a completion model: the conversation's text is the prompt
                ids = self.tokenizer.encode_prompt("\n".join(m["content"] for m in request.messages))
            text = request.messages[-1]["content"]
        else:
            assert request.prompt is not None
            ids, text = self.tokenizer.encode_prompt(request.prompt), request.prompt
        preset = self.by_script.get(script_of(text) or "")
        params = params.under(preset) if preset else params  # packed with the rows that run the same settings
        check_fits(len(ids), params.gen_length, self.max_length)
        if params.structured_outputs is not None and self.rows is not None:
            _check_structure(params, self.tokenizer, self.rows, self.stops)
        bad = sorted({t for c in params.initial_canvases for t in c if self.rows is not None and t >= self.rows})
        if bad:  # refused before the row joins a running set, as the decoder alone would refuse it
            raise UsageError(f"initial_canvases: token id {bad[0]} is outside the vocabulary of {self.rows}")
        # requests that differ only in their seed share a batch: each row draws from its own seed
        return Prepared(request, params.batch_key(), len(ids) + params.gen_length, (text, ids, params.seed))


def _check_structure(params: Any, tokenizer: Any, rows: int, stops: frozenset[int]) -> None:
    from ..structured.grammar import vocabulary
    from ..structured.template import check_structure

    check_structure(params, vocabulary(tokenizer, rows, stops))


def _settings(build: Callable[[], Any]) -> Any:
    """The config's `generation:` over the model's defaults; a bad combination is the config's error."""
    try:
        return build()
    except CelerisError as e:
        raise ConfigError(f"generation: {e}") from None


class EngineBackend:
    """The real backend over `celeris_cli.engine` (imported here, lazily, not by the queue)."""

    def __init__(
        self,
        model: str | None,
        device: str,
        dtype: str,
        threads: int | None,
        generation: dict[str, Any],
        quantize: str = "none",
        max_memory: str | None = None,
        cuda_graphs: str = "auto",
    ) -> None:
        from ..engine import load_engine

        self.engine = load_engine(model, device, dtype, threads, quantize, max_memory, cuda_graphs)
        self.base = _settings(lambda: self.engine.params(generation))

    def prepare(self, request: Request) -> Prepared:
        # built per request (cheap): measure.bench sets `engine` and `base` on a bare EngineBackend
        return Preparer.of(self.engine, self.base).prepare(request)

    def run(self, batch: list[Prepared]) -> list[dict[str, Any]]:
        params = batch[0].group  # final: the rows' presets were applied as each was prepared
        results = self.engine.decode_batch(
            [p.payload[0] for p in batch],
            [p.payload[1] for p in batch],
            params,
            [p.payload[2] for p in batch],
            presets=False,
        )
        return [body_of(r) for r in results]


def body_of(r: Any) -> dict[str, Any]:
    """A response body: an engine `Result` as the queue writes it; `logprobs` (OpenAI chat's shape:
    {"content": [...]}) where the request asked for them, `error` where a constrained answer ended unfinished."""
    extra: dict[str, Any] = {}
    if getattr(r, "logprobs", None) is not None:
        extra["logprobs"] = {"content": r.logprobs}
    if getattr(r, "error", None) is not None:
        extra["error"] = r.error
    return {
        "text": r.text,
        "finish_reason": r.finish_reason,
        **extra,
        "usage": {
            "prompt_tokens": r.prompt_tokens,
            "completion_tokens": r.output_tokens,
            "total_tokens": r.prompt_tokens + r.output_tokens,
        },
        "timing": {
            "wall_s": r.wall_s,
            "batch_size": r.batch_size,
            "nfe": r.nfe,
            "denoise_steps": r.denoise_steps,
            "steps_per_block": r.steps_per_block,
            "tokens_per_s": r.tokens_per_s,
            "device": r.device,
            "dtype": r.dtype,
            "peak_memory_mb": r.peak_memory_mb,
        },
        "settings": r.settings,
    }
