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

The family's code stops a block for the whole batch as soon as any row has finished; here each row stops
for itself, so a row's answer does not depend on its batch mates. Its own code masks no padding; here left
padding is masked and positions count from a row's first token, so a row answers in a batch as it does
alone. Each row draws its sampling noise from its own stream (`RowNoise`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..arch.kv import KVCache
from ..params import NO_SHAPING, Blocks, Commit, Length, Ordering, Sampling, Shaping
from .block import never_empty
from .predict import Places, StepLogits, choose
from .reference import commit_order, finished_rows, num_transfer_tokens, select_top_k
from .sampling import Draws, RowNoise, shaper


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
    word_pieces: frozenset[int],
) -> Shaped | None:
    """The logit shaping (`sampling.shape_masked`) of N positions decided left to right: position n is answer
    position at[n], after the answer history[n] (N, A; mask_id past what precedes it): the presence penalty
    on the tokens before it, no stop token below min_tokens, subword_min_p when sampling. None where the
    shaping changes nothing."""
    pieces = torch.tensor(sorted(word_pieces), device=history.device, dtype=torch.long)
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


@torch.no_grad()
def generate_seeded(
    net: Any,
    prompt: torch.Tensor,
    prompt_mask: torch.Tensor,
    plan: SeededPlan,
    mask_id: int,
    stop_ids: frozenset[int],
    noise: RowNoise,
    word_pieces: frozenset[int] = frozenset(),
) -> torch.Tensor:
    """The diffusion mode (see the module's text): prompt (B, P) left-padded -> the canvas (B, P + gen_length).
    The shaping (presence penalty, min_tokens, subword_min_p; `sampling.shape_masked`) shapes the seed's
    logits and each step's, from the row's answer so far (its committed positions)."""
    B, P = prompt.shape
    blocks, sampling, threshold = plan.blocks, plan.sampling, plan.commit.threshold
    G, W = blocks.gen_length, blocks.block_length
    cv = CausalCanvas(net, prompt, prompt_mask, G, mask_id)
    stop = torch.tensor(sorted(stop_ids), device=prompt.device, dtype=prompt.dtype)
    pieces = torch.tensor(sorted(word_pieces), device=prompt.device, dtype=torch.long)
    t = sampling.temperature
    rows = list(range(B))
    h = cv.forward(0, P, causal=True)[:, -1]
    for j, steps in enumerate(blocks.seeded_steps()):
        s = P + j * W
        e = min(s + W, P + G)
        at = torch.full((B,), s - P, device=prompt.device)  # the answer position of the block's first column
        seed_shape = ar_shaping(plan.shaping, cv.x[:, P:], at, mask_id, stop, t, word_pieces)
        cv.x[:, s] = cv.pick(h, sampling, noise.at(rows, j, 0), seed_shape)  # the seed
        done = finished_rows(cv.x[:, P:e], mask_id, stop)[0]
        schedule = num_transfer_tokens(torch.tensor([e - s - 1]), steps)[0].tolist() if steps else []
        for i, k in enumerate(schedule):
            block = cv.x[:, s:e]
            masked = (block == mask_id) & ~done[:, None]  # a finished row commits no more
            if not masked.any():
                break
            hs = cv.forward(s, e, causal=False)
            draws = noise.at(rows, j, i + 1)  # the sampling's lane and the order's, from each row's stream
            places = Places.counted(masked.sum(1).tolist(), block.device)
            shape = shaper(plan.shaping, cv.x[:, P:e], at, mask_id, stop, t, pieces)
            logits = StepLogits(net.step_head(), [hs[masked]], 0.0, shape, masked.nonzero() if shape else None)
            x0, conf = choose(logits, places, sampling, None, draws, net.chunk)
            confidence = torch.full(block.shape, float("-inf"), device=block.device).masked_scatter(masked, conf)
            fade = masked.sum(1, keepdim=True) / max(e - s - 1, 1)  # the share of the block still masked
            rank = torch.where(masked, commit_order(confidence, plan.ordering, fade, draws), float("-inf"))
            # the schedule's share: the k first-ranked; with a threshold, also every position at least that sure
            # (at one commit a step, the family's: always the first-ranked; with fewer steps the block still fills)
            chosen = select_top_k(rank, torch.full((B,), k, device=block.device)) & masked
            if threshold < 1:
                chosen |= masked & (confidence >= threshold)
            block[chosen] = x0[chosen[masked]]
            done |= finished_rows(cv.x[:, P:e], mask_id, stop)[0]
        if bool(done.all()) or e == P + G:
            break
        h = cv.forward(s, e, causal=True)[:, -1]  # the commit pass: the block's keys and values, causally
    stop_after(cv.x, P, stop)
    return cv.x
