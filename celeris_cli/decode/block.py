"""Block diffusion (LLaDA2, SDAR, Fast-dLLM v2): blocks decoded left to right, attention causal between
blocks and bidirectional inside one, so a committed block never changes again and nothing to its right
is computed. This module holds what both of its decoders share: their settings (`BlockPlan`), the
block-causal mask and the step rule (`commit_step`). Every block decode runs in the block running set
(`decode.running`), whose rows differ only in what each forward recomputes:

- `block` (`ReferenceBlockPlan`) is LLaDA2's reference (`generate` in its modeling file): every step
  recomputes the row's whole prefix up to the end of its current block, as its own segment of one packed
  forward (`arch.packed`), block-causal.
- `block-fast` (`BlockPlan`) keeps the keys and values of committed blocks, which are exact under
  block-causal attention: the prompt's whole blocks are prefilled once, each step computes the current block
  only, and a completed block's final keys and values are written by a store pass before the next block.

Layout (as LLaDA2's): a row's blocks start at its own position 0, so the first generated block may hold the
prompt's last tokens; the canvas runs to the end of the block holding gen_length (decoded in full, as the
reference does). Rows leave as soon as they have committed a stop token with nothing masked before it; their
later blocks cannot change what came before.

Step rule: the block's scheduled number of masked positions (`Blocks.transfers`) commit, the most
confident first (or at random, or with order noise: `Ordering`), together with every masked position whose
confidence is above `threshold` (LLaDA2's rule, written as one union). Each row has its own schedule: with
`denoise_steps` in total, how many blocks a row decodes depends on its prompt's length.

Classifier-free guidance runs a second view of the canvas with the prompt masked (LLaDA's formula, as the
fast decoder), through the same forwards (with its own cache for `block-fast` rows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import ClassVar, Protocol

import torch

from ..arch.kv import KV, LayerKV
from ..params import NO_STRUCTURE, Blocks, Commit, Editing, Guidance, Ordering, Sampling, Shaping, Structure
from ..structured.commit import Rules, settle
from .predict import Places, StepLogits, choose, in_chunks, sample_with_probability
from .reference import commit_order, select_top_k
from .sampling import Draws, shaper


@dataclass(frozen=True)
class BlockPlan:
    """The parts of the settings the block decoders honour (see `strategy.STRATEGIES`)."""

    blocks: Blocks
    sampling: Sampling
    ordering: Ordering
    guidance: Guidance
    commit: Commit
    shaping: Shaping
    editing: Editing = Editing(1.0, 0)  # the block strategy's alone (LLaDA2.1); off
    structure: Structure = NO_STRUCTURE  # the rows' rules come per row (`structured.commit`)

    recomputes: ClassVar[bool] = False  # each step recomputes the row's prefix: no cache (`ReferenceBlockPlan`)

    @property
    def gen_length(self) -> int:
        return self.blocks.gen_length


@dataclass(frozen=True)
class ReferenceBlockPlan(BlockPlan):
    """The `block` strategy's settings: LLaDA2's reference decoder, whose every step recomputes the row's
    prefix up to the end of its block under block-causal attention (`decode.running.generate_block`)."""

    recomputes: ClassVar[bool] = True


# Called once a block is committed, for each row that decoded it: (row, the row's generated ids so far).
# For streaming: a committed block never changes again.
OnBlock = Callable[[int, list[int]], None]


class BlockNet(Protocol):
    chunk: int  # positions whose logits a step computes at a time

    def hidden(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        key_mask: torch.Tensor,
        cache: list[LayerKV] | None = None,
        start: int | torch.Tensor = 0,
        keep_kv: bool = True,
    ) -> tuple[torch.Tensor, list[KV]]: ...

    def step_head(self) -> Callable[[torch.Tensor], torch.Tensor]: ...


def block_mask(real: torch.Tensor, q_lo: int, q_hi: int, k_hi: int, width: int) -> torch.Tensor:
    """(B, 1, q_hi - q_lo, k_hi): query c sees key c' when c' exists and its block is not after c's; a
    padding query that would see nothing sees its row's first key (`never_empty`)."""
    q_idx = torch.arange(q_lo, q_hi, device=real.device)
    k_idx = torch.arange(k_hi, device=real.device)
    causal = (k_idx // width)[None, :] <= (q_idx // width)[:, None]  # (Tq, Tk)
    return never_empty(causal[None] & real[:, None, :k_hi], real, q_idx)[:, None]


def never_empty(seen: torch.Tensor, real: torch.Tensor, q_idx: torch.Tensor) -> torch.Tensor:
    """`seen` (B, Tq, Tk; queries at canvas positions q_idx, keys at 0..Tk) with no empty row: a query that
    sees nothing (left padding before its row's first real key, in a causal pass) sees the row's first real
    key instead (itself in a row with none). Some kernels give NaN for an empty row; and a padding key is then
    seen by no query, so the batch-invariant attention (`arch.invariant.plan`) slices a row's left padding
    off, keys and queries, and computes the row in the shapes it has alone. What a padding query computes is
    never read."""
    Tk = seen.shape[-1]
    mine = real[:, :Tk]
    k_idx = torch.arange(Tk, device=seen.device)
    first = torch.where(mine.any(1)[:, None], mine.int().argmax(1)[:, None], q_idx[None, :])  # (B, Tq)
    return seen | (~seen.any(-1, keepdim=True) & (k_idx[None, None, :] == first[:, :, None]))


def commit_step(
    block: torch.Tensor,
    hs: list[torch.Tensor],
    net: BlockNet,
    plan: BlockPlan,
    k: torch.Tensor,
    mask_id: int,
    draws: Draws,
    answer: tuple[torch.Tensor | None, torch.Tensor] | None,
    stop: torch.Tensor,
    pieces: torch.Tensor | None = None,
    rules: Rules | None = None,
    offsets: list[int] | None = None,
) -> torch.Tensor:
    """The block (B, W) after one step, from its hidden states (B, W, d) in each view (the canvas, and
    under guidance the unconditional view): for each row b, its k[b] first-ranked masked positions, and
    every masked one above the threshold, take their predicted tokens. The LM head and the sampling run on
    the masked positions only; the confidence is the sampled token's probability under the filtered
    distribution (top-k, top-p and min-p renormalise it even at temperature 0, where they change only the
    threshold's decisions: LLaDA2's own generate returns the unfiltered probability there; filtering keeps
    these options meaningful, as Dream's generate does). The presence penalty and min_tokens shape the
    logits first, from the rows' answers so far. `rules`: each row's constraint and log-probability record
    (`structured.commit`; offsets[b]: the answer position of row b's first column), or None."""
    masked = block == mask_id
    if not bool(masked.any()):  # nothing to decide (a template's fixed tokens fill the block)
        return block.clone()
    t = plan.sampling.temperature
    shape = None if answer is None else shaper(plan.shaping, *answer, mask_id, stop, t, pieces)
    where = masked.nonzero() if shape else None
    logits = StepLogits(net.step_head(), [h[masked] for h in hs], plan.guidance.cfg_scale, shape, where)
    left = masked.sum(1)
    places = Places.counted(left.tolist(), block.device)
    x0, conf = choose(logits, places, plan.sampling, None, draws, net.chunk)
    confidence = torch.zeros(block.shape, device=block.device).masked_scatter(masked, conf.float())
    fade = left[:, None] / block.shape[1]  # the share of the block still masked
    rank = torch.where(masked, commit_order(confidence, plan.ordering, fade, draws), float("-inf"))
    chosen = select_top_k(rank, k) | (masked & (confidence > plan.commit.threshold))
    out = block.clone()
    out[masked] = torch.where(chosen[masked], x0, mask_id)
    if rules is None or all(r is None for r in rules):
        return out
    proposal = block.masked_scatter(masked, x0)

    def one(scores: torch.Tensor, i: int) -> torch.Tensor:
        return sample_with_probability(scores, plan.sampling, places[i : i + 1], draws)[0]

    assert offsets is not None, "rules need each row's answer offset"
    return settle(block, proposal, chosen, logits, one, rules, offsets, mask_id)


def top_choice(net: BlockNet, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The likeliest token at every position of hidden states (b, W, d), and its probability (float32),
    the LM head running on a chunk of positions at a time (what editing rewrites a decided token with)."""
    flat = h.flatten(0, 1)
    p, x0 = in_chunks(flat.shape[0], net.chunk, partial(_top, net.step_head(), flat))
    return p.view(h.shape[:2]), x0.view(h.shape[:2])


def _top(head: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, part: slice) -> tuple[torch.Tensor, ...]:
    p, x0 = head(h[part]).float().softmax(-1).max(-1)
    return p, x0
