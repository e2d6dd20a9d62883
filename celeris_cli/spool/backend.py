"""The queue's only view of the model: a small interface, so the queue never imports torch and tests can
put a fake at this boundary.

`prepare` validates one request (its parameters, its length) and says which requests may share a batch;
`run` decodes one batch of prepared requests into OpenAI-style response bodies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import CelerisError, ConfigError
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


class EngineBackend:
    """The real backend over `celeris_cli.engine` (imported here, lazily, not by the queue)."""

    def __init__(
        self, model: str | None, device: str, dtype: str, threads: int | None, generation: dict[str, Any]
    ) -> None:
        from ..engine import load_engine

        self.engine = load_engine(model, device, dtype, threads)
        try:
            self.base = self.engine.params(generation)
        except CelerisError as e:
            raise ConfigError(f"generation: {e}") from None

    def prepare(self, request: Request) -> Prepared:
        params = self.base.with_(**request.params)
        if request.messages is not None:
            if self.engine.tokenizer.chat_template:
                ids = self.engine.tokenizer.encode(self.engine.tokenizer.render_chat(request.messages))
            else:  # a completion model: the conversation's text is the prompt
                ids = self.engine.encode_prompt("\n".join(m["content"] for m in request.messages))
            text = request.messages[-1]["content"]
        else:
            assert request.prompt is not None
            ids, text = self.engine.encode_prompt(request.prompt), request.prompt
        self.engine.check_fits(len(ids), params)
        # requests that differ only in their seed share a batch: each row draws from its own seed
        return Prepared(request, params.batch_key(), len(ids) + params.gen_length, (text, ids, params.seed))

    def run(self, batch: list[Prepared]) -> list[dict[str, Any]]:
        params = batch[0].group
        results = self.engine.decode_batch(
            [p.payload[0] for p in batch], [p.payload[1] for p in batch], params, [p.payload[2] for p in batch]
        )
        return [
            {
                "text": r.text,
                "finish_reason": r.finish_reason,
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
                },
                "settings": r.settings,
            }
            for r in results
        ]
