"""The table of decoding strategies, and `Net`, the model boundary they call.

A strategy has the form `(net, prompt, prompt_mask, params, tokens, noise) -> canvas`; it hands its decoder
only the parts of the settings the strategy declares. `net` gives the hidden states a decoder asks for (a
span of a full-canvas forward, or a window against a cache) and the LM head apart, so that the head runs
on the positions a step predicts only, a chunk at a time (`Net.chunk`); it counts every forward pass where
it happens, the unconditional passes of guidance included. Choosing a strategy by an unknown name is a
user error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from ..arch.kv import KV, KVCache, LayerKV
from ..arch.layers import Model
from ..arch.memory_sizes import logit_chunk
from ..arch.packed import PackedLayer
from ..errors import UsageError
from ..params import Drafting, GenerationParams
from ..strategy import STRATEGIES
from ..structured.commit import Rules
from .block import BlockPlan, OnBlock, ReferenceBlockPlan
from .diffusion_gemma import DiffusionGemmaPlan, generate_diffusion_gemma
from .dream import DreamPlan, generate_dream
from .fast import FastPlan, generate_fast
from .nemotron import ARPlan, SeededPlan
from .pace import ForwardCost, Learned
from .reference import ReferencePlan, generate_reference
from .rnd1 import RND1Plan, generate_rnd1
from .running import generate_block
from .sampling import RowNoise
from .seededrun import generate_seeded
from .selfspec import SelfSpecPlan, generate_self_spec
from .speculative import SpecPlan, generate_speculative


@dataclass(frozen=True)
class SpecialTokens:
    mask_id: int
    stop_ids: frozenset[int]
    pad_id: int
    word_pieces: frozenset[int] = frozenset()  # pieces that continue a word (Tokenizer.word_pieces)


class Net:
    """Wraps the model for decoders: per-row RoPE positions from the key mask (so left padding changes
    nothing), forward counting (NFE), the cache-aware calls used by the fast decoders, and the logit shift
    of families whose position j-1 predicts position j (Dream), so no decoder needs to know of it."""

    def __init__(self, model: Model, chunk: int | None = None) -> None:
        self.model = model
        # positions whose logits a step computes at a time (`predict.in_chunks`): within the logit budget
        self.chunk = logit_chunk(model.cfg.rows) if chunk is None else chunk
        self.nfe = 0
        self.positions_computed = 0  # positions (rows x tokens) through the network, over every forward
        self.drafted = 0  # draft tokens put to a verify pass (self-speculative decoding)
        self.accepted = 0  # of them, those the AR mode confirmed
        self.cost: ForwardCost | None = None  # a forward's cost model, for self-speculation's choice
        self.learned: Learned | None = None  # what drafting has yielded so far, kept by the engine
        self.shift = model.logit_shift

    @staticmethod
    def positions(key_mask: torch.Tensor) -> torch.Tensor:
        return (key_mask.long().cumsum(1) - 1).clamp_min(0)

    def canvas_hidden(self, ids: torch.Tensor, key_mask: torch.Tensor, s: int, e: int) -> torch.Tensor:
        """Hidden states (B, e - s, d) predicting positions [s, e) of the canvas `ids` (B, L), from a
        full-canvas forward (the LM head of them: the full forward's logits there, shifted where the
        family's position j-1 predicts position j)."""
        assert s >= self.shift, "a shifted model's first position has no prediction of its own"
        h, _ = self.hidden(ids, self.positions(key_mask), key_mask, keep_kv=False)
        return h[:, s - self.shift : e - self.shift]

    def hidden(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        key_mask: torch.Tensor | None,
        cache: Sequence[LayerKV | PackedLayer] | None = None,
        start: int | torch.Tensor = 0,
        keep_kv: bool = True,
    ) -> tuple[torch.Tensor, list[KV]]:
        self.nfe += 1
        self.positions_computed += ids.numel()
        return self.model.hidden(ids, positions, key_mask, cache, start, keep_kv)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.head(h)

    def step_head(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The head for one step's chunks, its matrix made ready once (`DiffusionLM.step_head`)."""
        return self.model.step_head()

    def cache_of(self, kv: list[KV]) -> KVCache:
        """A cache made of a full forward's keys/values: contiguous, one copy each, and in float32 where
        the model computes attention in float32 under low-precision weights (`upcast`), so that no later
        step casts the whole cache again. The values are the same the cast at every step gave."""
        up = getattr(self.model, "upcast", False)

        def keep(t: torch.Tensor) -> torch.Tensor:
            return t.to(torch.float32 if up else t.dtype, memory_format=torch.contiguous_format)

        return KVCache([(keep(k), keep(v)) for k, v in kv])

    def span_hidden(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        key_mask: torch.Tensor,
        s: int,
        e: int,
        cache: list[LayerKV] | None = None,
        end: int | None = None,
        select: torch.Tensor | None = None,
        keep_kv: bool = True,
    ) -> tuple[torch.Tensor, list[KV]]:
        """Hidden states predicting positions [s, e) of the canvas `ids` (B, L), s >= 1: a full-canvas
        forward (no cache; returns every layer's keys/values unless keep_kv is False), or the window [s, end)
        recomputed against `cache` (`KVCache.view`; end defaults to e; its fresh keys/values are the
        window's only). With a logit shift the window starts one position earlier. `select` (B, e - s) bool:
        those positions only, flat, (N, d) in row order (the LM head's input)."""
        lo = s - self.shift
        if cache is None:
            h, kv = self.hidden(ids, positions, key_mask, keep_kv=keep_kv)
            h = h[:, lo : e - self.shift]
        else:
            end = e if end is None else end
            h, kv = self.hidden(ids[:, lo:end], positions[:, lo:end], key_mask, cache, lo)
            h = h[:, : e - s]
        return (h if select is None else h[select]), kv


Decode = Callable[[Net, torch.Tensor, torch.Tensor, GenerationParams, SpecialTokens, RowNoise], torch.Tensor]


def _plan(cls: type, params: GenerationParams) -> Any:
    """The decoder's settings: exactly the parts its strategy declares (`strategy.STRATEGIES`)."""
    return cls(**{name: params.part(name) for name in STRATEGIES[params.strategy].parts})


def plan_of(params: GenerationParams) -> BlockPlan:
    """The block decoders' settings (for the running set, `decode.running`)."""
    plan: BlockPlan = plan_for(params)
    return plan


def fast_plan_of(params: GenerationParams) -> FastPlan:
    """The fast decoder's settings (for the bidirectional running set, `decode.waves`)."""
    plan: FastPlan = _plan(FastPlan, params)
    return plan


def _reference(
    net: Net,
    prompt: torch.Tensor,
    prompt_mask: torch.Tensor,
    params: GenerationParams,
    tokens: SpecialTokens,
    noise: RowNoise,
    until_finished: bool = False,
) -> torch.Tensor:
    stop = tokens.stop_ids if until_finished else frozenset()
    return generate_reference(net, prompt, prompt_mask, _plan(ReferencePlan, params), tokens.mask_id, noise, stop)


# The reference decoder with each row leaving the batch once its answer is finished: the same answers at
# a fraction of the cost, for measuring the reference's quality over many seeds
# (`scripts/distinct_by_length.py`). Not in DECODERS: `celeris bench` times the reference as LLaDA runs
# it, every row to the end of the canvas.
reference_until_finished: Decode = partial(_reference, until_finished=True)


def _fast(
    net: Net,
    prompt: torch.Tensor,
    prompt_mask: torch.Tensor,
    params: GenerationParams,
    tokens: SpecialTokens,
    noise: RowNoise,
) -> torch.Tensor:
    plan = _plan(FastPlan, params)
    return generate_fast(net, prompt, prompt_mask, plan, tokens.mask_id, tokens.stop_ids, noise, tokens.word_pieces)


def _dream(
    net: Net,
    prompt: torch.Tensor,
    prompt_mask: torch.Tensor,
    params: GenerationParams,
    tokens: SpecialTokens,
    noise: RowNoise,
) -> torch.Tensor:
    return generate_dream(net, prompt, prompt_mask, _plan(DreamPlan, params), tokens.mask_id, noise)


def _rnd1(
    net: Net,
    prompt: torch.Tensor,
    prompt_mask: torch.Tensor,
    params: GenerationParams,
    tokens: SpecialTokens,
    noise: RowNoise,
) -> torch.Tensor:
    return generate_rnd1(net, prompt, prompt_mask, _plan(RND1Plan, params), tokens.mask_id, tokens.pad_id, noise)


def _blocks(decode: Callable[..., torch.Tensor], plan: type[BlockPlan]) -> Callable[..., torch.Tensor]:
    """The block decoder (`running.generate_block`) fed its plan (which says what each step recomputes) and
    tokens, with `on_block`."""

    def run(
        net: Net,
        prompt: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: GenerationParams,
        tokens: SpecialTokens,
        noise: RowNoise,
        on_block: OnBlock | None = None,
        rules: Rules | None = None,
    ) -> torch.Tensor:
        args = (tokens.mask_id, tokens.stop_ids, noise, tokens.word_pieces, on_block)
        if rules is not None and any(r is not None for r in rules):
            return decode(net, prompt, prompt_mask, _plan(plan, params), *args, rules=rules)
        return decode(net, prompt, prompt_mask, _plan(plan, params), *args)

    return run


def _stopping(decode: Callable[..., torch.Tensor], plan: type) -> Decode:
    """A decoder of the form (net, prompt, prompt_mask, plan, mask_id, stop_ids, noise): Nemotron's three."""

    def run(
        net: Net,
        prompt: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: GenerationParams,
        tokens: SpecialTokens,
        noise: RowNoise,
    ) -> torch.Tensor:
        return decode(net, prompt, prompt_mask, _plan(plan, params), tokens.mask_id, tokens.stop_ids, noise)

    return run


def _seeded(
    net: Net,
    prompt: torch.Tensor,
    prompt_mask: torch.Tensor,
    params: GenerationParams,
    tokens: SpecialTokens,
    noise: RowNoise,
) -> torch.Tensor:
    plan = _plan(SeededPlan, params)
    special = (tokens.mask_id, tokens.stop_ids, tokens.pad_id, tokens.word_pieces)
    return generate_seeded(net, prompt, prompt_mask, plan, special, noise)


def _ar(
    net: Net,
    prompt: torch.Tensor,
    prompt_mask: torch.Tensor,
    params: GenerationParams,
    tokens: SpecialTokens,
    noise: RowNoise,
) -> torch.Tensor:
    """The AR mode: self-speculation that never drafts (`decode.selfspec`'s AR step, one token a forward), so
    the yardstick and the default share one left-to-right step."""
    ar = _plan(ARPlan, params)
    G = ar.length.gen_length
    plan = SelfSpecPlan(Drafting(G, G, "never"), ar.sampling, ar.shaping)
    return generate_self_spec(
        net, prompt, prompt_mask, plan, tokens.mask_id, tokens.stop_ids, noise, None, None, tokens.word_pieces
    )


def _self_spec(
    net: Net,
    prompt: torch.Tensor,
    prompt_mask: torch.Tensor,
    params: GenerationParams,
    tokens: SpecialTokens,
    noise: RowNoise,
    on_block: OnBlock | None = None,
    rules: Rules | None = None,
) -> torch.Tensor:
    assert on_block is None, "spec streams through its running set (`decode.specrun`)"
    plan = _plan(SelfSpecPlan, params)
    return generate_self_spec(
        net,
        prompt,
        prompt_mask,
        plan,
        tokens.mask_id,
        tokens.stop_ids,
        noise,
        net.cost,
        rules,
        tokens.word_pieces,
        net.learned,
    )


def _diffusion_gemma(
    net: Net,
    prompt: torch.Tensor,
    prompt_mask: torch.Tensor,
    params: GenerationParams,
    tokens: SpecialTokens,
    noise: RowNoise,
    on_block: OnBlock | None = None,
    rules: Rules | None = None,
) -> torch.Tensor:
    plan = _plan(DiffusionGemmaPlan, params)
    args = (tokens.stop_ids, tokens.pad_id, noise, rules)
    return generate_diffusion_gemma(net, prompt, prompt_mask, plan, *args, on_block=on_block)


@dataclass(frozen=True)
class Decoder:
    """A decoder as the strategies name it (`strategy.Strategy.decoder`): its settings' class, fed exactly
    its strategy's parts, and the call."""

    plan: type
    run: Decode


DECODERS: dict[str, Decoder] = {
    "reference": Decoder(ReferencePlan, _reference),
    "fast": Decoder(FastPlan, _fast),
    "dream": Decoder(DreamPlan, _dream),
    "rnd1": Decoder(RND1Plan, _rnd1),
    "block": Decoder(ReferenceBlockPlan, _blocks(generate_block, ReferenceBlockPlan)),
    "block-cached": Decoder(BlockPlan, _blocks(generate_block, BlockPlan)),
    "seeded": Decoder(SeededPlan, _seeded),
    "ar": Decoder(ARPlan, _ar),
    "speculative": Decoder(SpecPlan, _stopping(generate_speculative, SpecPlan)),
    "self-spec": Decoder(SelfSpecPlan, _self_spec),
    "diffusion-gemma": Decoder(DiffusionGemmaPlan, _diffusion_gemma),
}


def _decoder(name: str) -> Decoder:
    if name not in STRATEGIES:
        raise UsageError(f"unknown decoding strategy {name!r} (choose {', '.join(sorted(STRATEGIES))})")
    return DECODERS[STRATEGIES[name].decoder]


def plan_for(params: GenerationParams) -> Any:
    """The settings its strategy's decoder receives."""
    return _plan(_decoder(params.strategy).plan, params)


def get_strategy(name: str) -> Decode:
    """The decoder of the strategy `name`; an unknown name is a user error."""
    return _decoder(name).run
