"""Nemotron-Labs-Diffusion's linear speculative decoding (`nemotron-spec`): the checkpoint drafts a block by
diffusion and checks it as the causal LM it also is, so the answer is the AR mode's (`decode.nemotron`) in
fewer forwards.

Written down from the family's `linear_spec_generate`. After a causal prefill, each row holds a decided
token not yet in the cache (the seed: at first the prompt's next token). An iteration, for each row:

1. Draft: a block of block_length positions, the seed then masks, run over the cache bidirectionally inside
   the block; each forward fills every masked position at least `draft_threshold` sure and always the
   surest (0: the whole block in one forward, the family's default).
2. Verify: one causal forward over the drafted block. Its position i predicts the token after draft[i],
   as the AR mode would after the same text; those predictions are accepted while the draft agrees with
   them (draft[i + 1] equal to prediction i), and one more: the first disagreement's own prediction, or the
   last position's (the bonus token). An iteration decides 1 to block_length tokens.
3. The verify pass wrote the keys and values of the whole block; the seed and the agreeing draft tokens
   are committed text, written causally, so they are exactly what a causal pass over the text writes. The
   positions after them are overwritten by the next iteration, whose block starts at the last accepted
   token, the new seed.

The family's code runs one row; here rows run side by side, each at its own place (per-row cache offsets),
and a row leaves the batch when its answer holds a stop token or is full. Every accepted token at answer
position t is drawn from the row's stream (block 0, step t), the stream the AR mode draws token t from, so
at any temperature the answer is the AR mode's (greedy: lossless speculative decoding); the draft only
decides how many forwards it takes, and draws from streams of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..arch.exact import exactly
from ..arch.kv import KVCache
from ..params import Draft, Sampling
from .nemotron import CausalCanvas, stop_after
from .predict import Places, StepLogits, choose
from .sampling import RowNoise


@dataclass(frozen=True)
class SpecPlan:
    """The parts of the settings speculative decoding honours."""

    draft: Draft
    sampling: Sampling


class _Rows:
    """The rows still decoding: their indices in the batch, the canvas index of each one's seed (its last
    decided token, not yet in the cache) and the cache over their slots, in the same order."""

    def __init__(self, cv: CausalCanvas, cache: KVCache, P: int) -> None:
        B = cv.x.shape[0]
        self.cv, self.cache = cv, cache
        self.idx = torch.arange(B, device=cv.x.device)
        self.seed_at = torch.full((B,), P, dtype=torch.long, device=cv.x.device)

    def forward(self, ids: torch.Tensor, causal: bool) -> torch.Tensor:
        """Hidden states (b, W, d) of each row's block `ids` at its own place, over its cache before it;
        the block's keys and values are written into the cache there."""
        W = ids.shape[1]
        s, cols = self.seed_at, torch.arange(W, device=ids.device)
        at = s[:, None] + cols[None, :]  # (b, W) canvas indices of the block
        L = int(s.max()) + W
        k = torch.arange(L, device=ids.device)[None, None, :]  # (1, 1, L)
        before = self.cv.keys[self.idx, :L][:, None, :] & (k < s[:, None, None])  # the row's cached real keys
        inside = (k >= s[:, None, None]) & (k < s[:, None, None] + W)
        if causal:
            inside = inside & (k <= at[:, :, None])
        pos = self.cv.pos[self.idx[:, None], at]
        h, _ = self.cv.net.hidden(ids, pos, (before | inside)[:, None], self.cache.view(slice(None), L), s, False)
        return h

    def keep(self, stays: torch.Tensor) -> None:
        self.idx, self.seed_at = self.idx[stays], self.seed_at[stays]
        self.cache.keep(stays)


def _draft(
    rows: _Rows, block: torch.Tensor, plan: SpecPlan, mask_id: int, noise: RowNoise, answer_at: list[int]
) -> torch.Tensor:
    """Fill the masks of each row's block (b, W) by diffusion over its cache (see the module's text)."""
    threshold, step = plan.draft.draft_threshold, 0
    while bool((masked := block == mask_id).any()):
        h = rows.forward(block, causal=False)
        # streams of the draft's own: block 1 + the seed's answer position, never 0 (the accepted tokens')
        draws = noise.at(rows.idx, [1 + t for t in answer_at], step)
        net, places = rows.cv.net, Places.counted(masked.sum(1).tolist(), block.device)
        x0, conf = choose(StepLogits(net.step_head(), [h[masked]]), places, plan.sampling, None, draws, net.chunk)
        confidence = torch.full(block.shape, float("-inf"), device=block.device).masked_scatter(masked, conf)
        chosen = masked & (confidence >= threshold)
        best = confidence.argmax(1, keepdim=True)
        chosen.scatter_(1, best, masked.gather(1, best))
        block[chosen] = x0[chosen[masked]]
        step += 1
    return block


@torch.no_grad()
def generate_speculative(
    net: Any,
    prompt: torch.Tensor,
    prompt_mask: torch.Tensor,
    plan: SpecPlan,
    mask_id: int,
    stop_ids: frozenset[int],
    noise: RowNoise,
) -> torch.Tensor:
    """Speculative decoding (see the module's text): prompt (B, P) left-padded -> the canvas (B, P + gen_length),
    the rest of a finished row its stop token. Computed as `ar` computes (`arch.exact.exactly`): a position's
    logits are the same bits in a verify pass as in the AR mode's step, so the answer is `ar`'s at any
    temperature, whatever its batch mates."""
    with exactly():
        return _generate_speculative(net, prompt, prompt_mask, plan, mask_id, stop_ids, noise)


def _generate_speculative(
    net: Any,
    prompt: torch.Tensor,
    prompt_mask: torch.Tensor,
    plan: SpecPlan,
    mask_id: int,
    stop_ids: frozenset[int],
    noise: RowNoise,
) -> torch.Tensor:
    B, P = prompt.shape
    G, W = plan.draft.gen_length, plan.draft.block_length
    cv = CausalCanvas(net, prompt, prompt_mask, G + W, mask_id)  # room for a block drafted at the answer's end
    stop = torch.tensor(sorted(stop_ids), device=prompt.device, dtype=prompt.dtype)
    h = cv.forward(0, P, causal=True)[:, -1]
    cv.x[:, P] = cv.pick(h, plan.sampling, noise.at(list(range(B)), 0, 0))  # as the AR mode's first token
    assert cv.cache is not None
    rows = _Rows(cv, cv.cache, P)
    stays = ~torch.isin(cv.x[:, P], stop) & torch.full((B,), G > 1, device=prompt.device)
    cols = torch.arange(W, device=prompt.device)
    while bool(stays.any()):
        if not bool(stays.all()):
            rows.keep(stays)
        at = rows.seed_at[:, None] + cols[None, :]  # (b, W)
        answer_at = (rows.seed_at - P).tolist()  # each seed's answer position
        block = torch.where(cols[None, :] == 0, cv.x[rows.idx[:, None], at], mask_id)
        block = _draft(rows, block, plan, mask_id, noise, answer_at)
        h = rows.forward(block, causal=True)  # the verify pass: every position's next token, as the AR mode's
        own = [(r, t + 1 + i) for r, t in zip(rows.idx.tolist(), answer_at) for i in range(W)]
        draws = noise.at([r for r, _ in own], 0, [t for _, t in own])
        places = Places.counted([1] * len(own), prompt.device)
        x0, _ = choose(StepLogits(net.step_head(), [h.flatten(0, 1)]), places, plan.sampling, None, draws, net.chunk)
        ar = x0.view(-1, W)  # ar[:, i]: the token after block[:, i]
        agree = (ar[:, :-1] == block[:, 1:]).long().cumprod(1).sum(1)  # the draft's tokens confirmed
        accepted = agree + 1  # and the verifier's next one
        cv.x[rows.idx[:, None], at + 1] = torch.where(cols[None, :] < accepted[:, None], ar, mask_id)
        new = (cols[None, :] < accepted[:, None]) & (at + 1 < P + G)  # decided answer positions of this pass
        rows.seed_at = rows.seed_at + accepted
        stays = ~(torch.isin(ar, stop) & new).any(1) & (rows.seed_at < P + G - 1)
    stop_after(cv.x[:, : P + G], P, stop)
    return cv.x[:, : P + G]
