"""Nemotron-Labs-Diffusion's two decoders over one checkpoint: its AR mode (`ar`) and its diffusion mode
(`nemotron`), each over a KV cache (`arch.kv`) that holds exactly what a causal pass wrote.

Both start the same way: the prompt is run causally (each token sees itself and those before it) into the
cache, and its last position's logits choose the first answer token (the "seed").

- `ar`: one token per forward, left to right, as any causal LM (greedy at temperature 0): `decode.selfspec`'s
  AR step (self-speculation that never drafts), the one left-to-right step of every model with an AR mode.
- `nemotron` (the family's `generate` with `causal_context=True`, written down from its source): the answer
  is decoded a block at a time after the prompt. A block starts as the seed followed by block_length - 1
  masks; each step runs the block alone over the cache, bidirectionally inside the block, and commits the
  surest masked positions: the schedule's share (block_steps per block, the masks in equal shares, the
  remainder to the first steps) and, with a threshold below 1, every position at least that sure besides
  (at the family's one commit a step: always the surest; with fewer steps the block still fills). Which
  positions are "surest" is the remasking's order (`reference.commit_order`): the confidence
  (low_confidence, the family's default, with optional order noise), the leftmost masked positions first
  (sequential: the family's `leftmost` selection policy, which ignores the threshold), or a uniform draw
  from the row's own stream (random). A row whose block holds a stop token with nothing masked before it
  stops denoising.
  Then one causal pass over the block writes its keys and values into the cache, and its last position's
  logits choose the next block's seed. With block_length 1 a block is its seed alone: the AR mode.

The diffusion mode decodes in a running set (`decode.seededrun`; a static batch is one admitted at once).
The family's code stops a block for the whole batch as soon as any row has finished; there each row stops
for itself, at its own place, so a row's answer does not depend on its batch mates. Each row draws its
sampling noise from its own stream (`stream_seed`). This module keeps what the AR step and the
speculative decoder share: the causal canvas, the AR step's shaping, and the stop rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..arch.kv import KVCache
from ..params import NO_SHAPING, Blocks, Commit, Length, Ordering, Sampling, Shaping
from .block import never_empty
from .predict import Places, StepLogits, choose
from .sampling import Draws, shaper


@dataclass(frozen=True)
class ARPlan:
    """The parts of the settings the AR decoder honours."""

    length: Length
    sampling: Sampling
    shaping: Shaping = NO_SHAPING


@dataclass(frozen=True)
class SeededPlan:
    """The parts of the settings the diffusion mode honours."""

    blocks: Blocks
    sampling: Sampling
    ordering: Ordering
    commit: Commit
    shaping: Shaping = NO_SHAPING

    @property
    def gen_length(self) -> int:
        return self.blocks.gen_length


class CausalCanvas:
    """The rows' prompts (left-padded) and answers, their positions, and the cache the causal passes fill."""

    def __init__(self, net: Any, prompt: torch.Tensor, prompt_mask: torch.Tensor, gen_length: int, fill: int) -> None:
        B, P = prompt.shape
        self.net, self.P = net, P
        self.x = torch.cat([prompt, prompt.new_full((B, gen_length), fill)], dim=1)
        self.keys = torch.cat([prompt_mask, prompt_mask.new_ones(B, gen_length)], dim=1)
        self.pos = (self.keys.long().cumsum(1) - 1).clamp_min(0)  # a row's positions from its first token
        self.cache: KVCache | None = None

    def _mask(self, s: int, e: int, causal: bool) -> torch.Tensor:
        """(B, 1, e - s, e): the real keys before s, and inside [s, e) all of them or those up to the query;
        a padding query that would see nothing sees its row's first key (`block.never_empty`)."""
        q = torch.arange(s, e, device=self.x.device)[:, None]
        k = torch.arange(e, device=self.x.device)[None, :]
        seen = self.keys[:, None, :e] & (k <= q if causal else torch.ones_like(k <= q))
        return never_empty(seen, self.keys, q[:, 0])[:, None]

    def forward(self, s: int, e: int, causal: bool) -> torch.Tensor:
        """Hidden states of positions [s, e), attending over the cache before s; the cache holds their keys
        and values after (a causal pass's are the ones later positions read)."""
        ids, pos = self.x[:, s:e], self.pos[:, s:e]
        if self.cache is None:  # the prompt's prefill sizes the cache from its own keys and values
            assert s == 0
            h, kv = self.net.hidden(ids, pos, self._mask(s, e, causal))
            k = kv[0][0]
            up = getattr(self.net.model, "upcast", False)
            dtype = torch.float32 if up else k.dtype
            self.cache = KVCache.empty(len(kv), k.shape[0], k.shape[1], self.x.shape[1], k.shape[3], dtype, k.device)
            for (ck, cv), (fk, fv) in zip(self.cache.layers, kv):
                ck[:, :, :e], cv[:, :, :e] = fk, fv
            return h
        cache = self.cache.view(slice(0, self.x.shape[0]), e)
        h, _ = self.net.hidden(ids, pos, self._mask(s, e, causal), cache, s, False)
        return h

    def pick(self, h: torch.Tensor, sampling: Sampling, draws: Draws, shaped: Shaped | None = None) -> torch.Tensor:
        """One token per row from the hidden state of its last position (the next position's prediction),
        its logits shaped by `shaped` where given (`ar_shaping`)."""
        return self.logits(h, shaped).pick(sampling, draws, self.net.chunk)

    def logits(self, h: torch.Tensor, shaped: Shaped | None = None) -> Picks:
        shape, where = shaped if shaped is not None else (None, None)
        return Picks(StepLogits(self.net.step_head(), [h], 0.0, shape, where), h.shape[0])


Shaped = tuple[Any, torch.Tensor]  # a shaper and each position's (row, column), for `StepLogits`


@dataclass(frozen=True)
class Picks:
    """The logits of n positions, one token each to pick."""

    logits: StepLogits
    n: int

    def pick(self, sampling: Sampling, draws: Draws, chunk: int) -> torch.Tensor:
        places = Places.counted([1] * self.n, self.logits.hs[0].device)
        x0, _ = choose(self.logits, places, sampling, None, draws, chunk)
        return x0


def ar_shaping(
    s: Shaping,
    history: torch.Tensor,
    at: torch.Tensor,
    mask_id: int,
    stop: torch.Tensor,
    temperature: float,
    pieces: torch.Tensor,
) -> Shaped | None:
    """The logit shaping (`sampling.shape_masked`) of N positions decided left to right: position n is answer
    position at[n], after the answer history[n] (N, A; mask_id past what precedes it): the presence penalty
    on the tokens before it, no stop token below min_tokens, subword_min_p when sampling (`pieces`: the
    word-continuing pieces, a tensor). None where the shaping changes nothing."""
    shape = shaper(s, history, at, mask_id, stop, temperature, pieces)
    if shape is None:
        return None
    n = history.shape[0]
    where = torch.stack(
        [torch.arange(n, device=history.device), torch.zeros(n, dtype=torch.long, device=history.device)], 1
    )
    return shape, where


def stop_after(x: torch.Tensor, start: int, stop: torch.Tensor) -> None:
    """Fill each row's answer after its first stop token with that token (what the engine cuts)."""
    ans = x[:, start:]
    hit = torch.isin(ans, stop)
    for b in hit.any(1).nonzero().flatten().tolist():
        first = int(hit[b].int().argmax())
        ans[b, first + 1 :] = ans[b, first]
