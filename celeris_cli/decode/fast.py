"""Fast masked-diffusion decoding: KV cache, confidence-threshold parallel commits and early exit.

Pure functions on token ids, like `reference`, but they need a cache-aware model boundary (`Net`):
`span_hidden(ids, positions, key_mask, s, e, cache, end) -> (hidden states predicting [s, e), kv)`, the LM
head, and `chunk`, the positions whose logits it computes at a time.

- Threshold decoding (Fast-dLLM): each step commits every masked position of the active block whose
  confidence is >= `threshold`, and always at least the schedule's share (at least one), so the step
  count never exceeds the block's steps. Vectorised over the batch.
- KV cache (Fast-dLLM, block-wise approximate): at the start of each block one full forward refreshes
  keys/values of the whole canvas; the following steps recompute only the block and the suffix
  (`prefix`), or only the block (`dual`), attending to the cached rest.
- Classifier-free guidance runs the unconditional view (prompt masked) through the same cache logic with
  a cache of its own; both views' forwards are counted.
- Early exit (dInfer): a row whose committed text holds a stop token with everything before it decoded
  is finished; its remaining masks are filled with that stop token, and it leaves the batch at once, with
  its rows of the cache, mid-block. When every row is finished, decoding stops.
- Bounded canvas (`suffix_window` N > 0; DPad's suffix dropout): the model sees the prompt, the blocks
  decoded, the active block and at most N masked positions after it; the all-mask rest is left out of
  every forward, the cache refresh included.
- The LM head, sampling and confidence run only on the masked positions of the active block, a chunk of
  them at a time (`predict.choose`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ..arch.kv import KV, KVCache, LayerKV
from ..params import NO_STRUCTURE, Guidance, Ordering, Parallel, Sampling, Schedule, Shaping, Structure
from ..structured.commit import Rules, settle
from .predict import Places, StepLogits, choose, sample_masked
from .reference import commit_order, leave_when_finished, num_transfer_tokens, select_top_k, unconditional
from .sampling import Draws, RowNoise, Shaper, shaper


@dataclass(frozen=True)
class FastPlan:
    """The parts of the settings the fast decoder honours (see `strategy.STRATEGIES`)."""

    schedule: Schedule
    sampling: Sampling
    ordering: Ordering
    guidance: Guidance
    parallel: Parallel
    shaping: Shaping
    structure: Structure = NO_STRUCTURE  # the rows' rules come per row (`structured.commit`)

    @property
    def gen_length(self) -> int:
        return self.schedule.gen_length


class CachedNet(Protocol):
    chunk: int

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
    ) -> tuple[torch.Tensor, list[KV]]: ...

    def cache_of(self, kv: list[KV]) -> KVCache: ...

    def step_head(self) -> Callable[[torch.Tensor], torch.Tensor]: ...


class _View:
    """One view of the active rows' canvas for the model (conditional, or unconditional under guidance),
    with its own block-wise KV cache."""

    def __init__(self, prompt_part: torch.Tensor | None) -> None:
        self.prompt_part = prompt_part  # (B, P): the prompt as this view shows it; None: the canvas's own
        self.cache: KVCache | None = None  # made once per block, by its first (full-canvas) forward

    def hidden(
        self,
        net: CachedNet,
        x: torch.Tensor,
        pos: torch.Tensor,
        km: torch.Tensor,
        s: int,
        e: int,
        mode: str,
        refresh: bool,
        select: torch.Tensor,
    ) -> torch.Tensor:
        """Hidden states (N, d) of the `select`ed positions of the block [s, e): a full-canvas forward (which
        refreshes the cache), or the block (dual) or the block and suffix (prefix) against the cached rest."""
        # this view's canvas (guidance masks the prompt); the cached path needs it too, since a shifted
        # model's window starts at s-1, which may be the prompt's last token
        canvas = x if self.prompt_part is None else torch.cat([self.prompt_part, x[:, self.prompt_part.shape[1] :]], 1)
        if mode == "none" or refresh:
            h, kv = net.span_hidden(canvas, pos, km, s, e, select=select, keep_kv=mode != "none")
            if mode != "none":
                self.cache = net.cache_of(kv)
            return h
        assert self.cache is not None
        end = x.shape[1] if mode == "prefix" else e
        return net.span_hidden(canvas, pos, km, s, e, self.cache.view(), end, select)[0]

    def keep(self, rows: torch.Tensor) -> None:
        """Only these rows stay (the others have finished)."""
        if self.prompt_part is not None:
            self.prompt_part = self.prompt_part[rows]
        if self.cache is not None:
            self.cache.keep(rows)


@torch.no_grad()
def generate_fast(
    net: CachedNet,
    prompt: torch.Tensor,
    prompt_mask: torch.Tensor,
    plan: FastPlan,
    mask_id: int,
    stop_ids: frozenset[int],
    noise: RowNoise,
    word_pieces: frozenset[int] = frozenset(),
) -> torch.Tensor:
    """prompt: (B, P) left-padded; prompt_mask: (B, P). Returns the canvas (B, P + gen_length).
    word_pieces: the tokenizer's pieces that continue a word (for subword_min_p)."""
    B, P = prompt.shape
    G, par = plan.schedule.gen_length, plan.parallel
    x = torch.cat([prompt, prompt.new_full((B, G), mask_id)], dim=1)
    key_mask = torch.cat([prompt_mask, prompt_mask.new_ones(B, G)], dim=1)
    positions = (key_mask.long().cumsum(1) - 1).clamp_min(0)  # per-row RoPE positions, padding-proof
    views = [_View(None)]
    if plan.guidance.cfg_scale > 0:
        views.append(_View(unconditional(x, key_mask, P, mask_id)[:, :P]))
    stop = torch.tensor(sorted(stop_ids), device=x.device, dtype=x.dtype)
    pieces = torch.tensor(sorted(word_pieces), device=x.device, dtype=torch.long)
    active = torch.arange(B, device=x.device)  # rows still decoding, as indices of the original batch
    xa, km, pos = x.clone(), key_mask, positions  # the active rows' canvas; a row is written back as it leaves
    for j, ((bs, be), steps) in enumerate(zip(plan.schedule.block_spans, plan.schedule.steps_per_block)):
        if active.numel() == 0:
            break
        s, e = P + bs, P + be
        w = x.shape[1] if par.suffix_window == 0 else min(x.shape[1], e + par.suffix_window)  # bounded canvas
        schedule = num_transfer_tokens((xa[:, s:e] == mask_id).sum(1), steps)
        offset = torch.tensor([bs], device=x.device)  # the block's first answer position
        for i in range(steps):
            block = xa[:, s:e]
            masked = block == mask_id  # (b, T): the only positions predicted
            hs = [v.hidden(net, xa[:, :w], pos[:, :w], km[:, :w], s, e, par.cache, i == 0, masked) for v in views]
            t = plan.sampling.temperature
            shape = shaper(plan.shaping, xa[:, P:], offset.expand(len(xa)), mask_id, stop, t, pieces)
            xa[:, s:e] = commit_step(block, hs, net, plan, schedule[:, i], mask_id, noise.at(active, j, i), shape)
            if par.early_exit:  # a finished row leaves at once; the rest of its canvas is its stop token
                keep = leave_when_finished(x, xa, active, P, s, e, mask_id, stop)
                if keep is not None:
                    xa, km, pos, active, schedule = xa[keep], km[keep], pos[keep], active[keep], schedule[keep]
                    for v in views:
                        v.keep(keep)
                    if active.numel() == 0:
                        break
            if not (xa[:, s:e] == mask_id).any():
                break
    x[active] = xa
    return x


def commit_step(
    block: torch.Tensor,
    hs: list[torch.Tensor],
    net: CachedNet,
    plan: FastPlan,
    k: torch.Tensor,
    mask_id: int,
    draws: Draws,
    shape: Shaper | None,
    rules: Rules | None = None,
    offsets: list[int] | None = None,
) -> torch.Tensor:
    """The fast decoder's step, for rows alone (`generate_fast`) and in the running set (`decode.waves`): the
    block (b, T) after one step, from the hidden states of its masked positions in each view (row order;
    under guidance the unconditional view too). Each row commits its k[b] (at least one) first-ranked masked
    positions, and every masked one whose confidence reaches the threshold (not under `sequential`
    remasking, which commits in order). `shape`: the step's logit shaping (`sampling.shaper`), or None.
    `rules`: each row's constraint and log-probability record (`structured.commit`; offsets[b]: the answer
    position of row b's first column), or None."""
    masked = block == mask_id  # (b, T): the only positions predicted
    if not bool(masked.any()):  # nothing to decide (a template's fixed tokens fill the block)
        return block.clone()
    where = masked.nonzero() if shape else None
    logits = StepLogits(net.step_head(), hs, plan.guidance.cfg_scale, shape, where)
    left = masked.sum(1)  # masked positions per row
    places = Places.counted(left.tolist(), block.device)
    x0, picked = choose(logits, places, plan.sampling, plan.parallel.confidence, draws, net.chunk)  # row order
    conf = block.new_zeros(block.shape, dtype=torch.float32).masked_scatter(masked, picked)
    proposal = block.masked_scatter(masked, x0)
    # the order noise fades with the share of the block still masked, as the reference's does over its steps
    # (one commit each): by steps it would stay near full strength while thresholds fill the block
    fade = left[:, None] / block.shape[1]
    rank = torch.where(masked, commit_order(conf, plan.ordering, fade, draws), float("-inf"))
    commit = select_top_k(rank, k.clamp_min(1))  # at least one commit per row that still has masks
    if plan.ordering.remasking != "sequential":  # sequential commits in order: no threshold (even 1.0 >= 1)
        commit |= masked & (conf >= plan.parallel.threshold)
    if rules is None or all(r is None for r in rules):
        return torch.where(commit, proposal, block)

    def one(scores: torch.Tensor, i: int) -> torch.Tensor:
        return sample_masked(scores, plan.sampling, places[i : i + 1], draws)

    assert offsets is not None, "rules need each row's answer offset"
    return settle(block, proposal, commit, logits, one, rules, offsets, mask_id)
