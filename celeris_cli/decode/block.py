"""Block diffusion (LLaDA2, SDAR, Fast-dLLM v2): blocks decoded left to right, attention causal between
blocks and bidirectional inside one, so a committed block never changes again and nothing to its right
is computed.

Both decoders share the layout and the step rule; they differ only in what each forward recomputes:

- `generate_block` is LLaDA2's reference (`generate` in its modeling file): every step recomputes the whole
  prefix up to the end of the current block. It is the running set's (`decode.running`), every row admitted
  at once: each row's prefix is its own segment of one packed forward (`arch.packed`), block-causal.
- `generate_block_cached` keeps the keys and values of committed blocks, which are exact under block-causal
  attention: the prompt is prefilled once, each step computes the current block only, and a committed
  block's final keys and values are computed in the same forward as the next block's first step.

Layout (as LLaDA2's): a row's blocks start at its own position 0, so the first generated block may hold the
prompt's last tokens; the canvas runs to the end of the block holding gen_length (decoded in full, as the
reference does). In a batch, each row is left-padded by whole blocks so its first generated block lines up
with everyone's; padding is never attended to. Rows leave as soon as they have committed a stop token with
nothing masked before it; their later blocks cannot change what came before.

Step rule: the block's scheduled number of masked positions (`Blocks.transfers`) commit, the most
confident first (or at random, or with order noise: `Ordering`), together with every masked position whose
confidence is above `threshold` (LLaDA2's rule, written as one union). Each row has its own schedule: with
`denoise_steps` in total, how many blocks a row decodes depends on its prompt's length.

Classifier-free guidance runs a second view of the canvas with the prompt masked (LLaDA's formula, as the
fast decoder), through the same forwards, with its own cache in `generate_block_cached`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import ClassVar, Protocol

import torch

from ..arch.kv import KV, KVCache, LayerKV
from ..params import NO_STRUCTURE, Blocks, Commit, Editing, Guidance, Ordering, Sampling, Shaping, Structure
from ..structured.commit import Rules, settle
from .predict import Places, StepLogits, choose, in_chunks, sample_with_probability
from .reference import commit_order, select_top_k
from .sampling import Draws, RowNoise, shaper


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


@dataclass
class Canvas:
    """The batch's canvas in block-aligned coordinates. x: (B, C) ids; real: (B, C) positions that exist
    for the row (prompt and its blocks); pos: (B, C) the row's own positions; gen: (B,) where each row's
    generation starts; end: (B,) where its last block ends; first: (B,) the row's own index of the
    canvas's first generated block."""

    x: torch.Tensor
    real: torch.Tensor
    pos: torch.Tensor
    gen: torch.Tensor
    end: torch.Tensor
    first: torch.Tensor
    start_block: int  # the canvas block where generation starts
    num_blocks: int  # canvas blocks in all
    width: int  # block_length


def lay_out(prompts: list[torch.Tensor], gen_length: int, width: int, mask_id: int, pad_id: int) -> Canvas:
    device = prompts[0].device
    own_prefill = [len(p) // width for p in prompts]  # whole blocks of prompt, per row
    own_blocks = [-(-(len(p) + gen_length) // width) for p in prompts]
    K = max(own_prefill)
    total = K + max(n - k for n, k in zip(own_blocks, own_prefill))
    B, C = len(prompts), total * width
    x = torch.full((B, C), pad_id, dtype=torch.long, device=device)
    real = torch.zeros(B, C, dtype=torch.bool, device=device)
    pos = torch.zeros(B, C, dtype=torch.long, device=device)
    gen = torch.empty(B, dtype=torch.long, device=device)
    ends = torch.empty(B, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        off = (K - own_prefill[b]) * width
        end = off + own_blocks[b] * width
        x[b, off : off + len(p)] = p
        x[b, off + len(p) : end] = mask_id
        real[b, off:end] = True
        pos[b, off:end] = torch.arange(end - off, device=device)
        gen[b], ends[b] = off + len(p), end
    first = torch.tensor(own_prefill, device=device)
    return Canvas(x, real, pos, gen, ends, first, K, total, width)


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


def schedule(cv: Canvas, prompt_tokens: list[int], blocks: Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's steps in each generated block, (B, n), and the tokens each step commits, (B, n, S), zero
    past the row's steps and blocks (`Blocks.steps_for`, `Blocks.transfers`)."""
    n = cv.num_blocks - cv.start_block
    steps = [blocks.steps_for(p) for p in prompt_tokens]
    S = max(max(row) for row in steps)
    ks = torch.zeros(len(steps), n, S, dtype=torch.long)
    for b, (row, masked) in enumerate(zip(steps, (blocks.masked(p) for p in prompt_tokens))):
        for g, (count, m) in enumerate(zip(row, masked)):
            ks[b, g, :count] = torch.tensor(blocks.transfers(count, m))
    padded = [row + [0] * (n - len(row)) for row in steps]
    return torch.tensor(padded, device=cv.x.device), ks.to(cv.x.device)


class _View:
    """One view of the canvas for the model: the canvas itself, or (`hide`: (B, C) positions shown as
    masks) guidance's unconditional view, with the prompt masked; and its cache of committed blocks (over
    the whole canvas, not zeroed: a step reads only positions before its block's end, all written by then)."""

    def __init__(self, hide: torch.Tensor | None) -> None:
        self.hide = hide
        self.cache: KVCache | None = None  # exact before `pending` (generate_block_cached)

    def ids(self, cv: Canvas, rows: torch.Tensor, lo: int, hi: int, mask_id: int) -> torch.Tensor:
        ids = cv.x[rows, lo:hi]
        return ids if self.hide is None else torch.where(self.hide[rows, lo:hi], mask_id, ids)


def _views(cv: Canvas, plan: BlockPlan) -> list[_View]:
    if plan.guidance.cfg_scale == 0:
        return [_View(None)]
    idx = torch.arange(cv.x.shape[1], device=cv.x.device)
    return [_View(None), _View(cv.real & (idx[None, :] < cv.gen[:, None]))]


def finished(cv: Canvas, rows: torch.Tensor, upto: int, mask_id: int, stop: torch.Tensor) -> torch.Tensor:
    """Among `rows`, those whose generated part up to canvas index `upto` holds a stop token with nothing
    masked before it."""
    x = cv.x[rows, :upto]
    idx = torch.arange(upto, device=x.device).expand_as(x)
    gen = idx >= cv.gen[rows, None]
    first_stop = torch.where(gen & torch.isin(x, stop), idx, upto).min(1).values
    first_mask = torch.where(gen & (x == mask_id), idx, upto).min(1).values
    return (first_stop < upto) & (first_mask > first_stop)


def _noise(noise: RowNoise, cv: Canvas, rows: torch.Tensor, j: int, step: int) -> Draws:
    """Each row draws from its own block number, whatever its place in the batch's canvas."""
    return noise.at(rows, (cv.first[rows] + j - cv.start_block).tolist(), step)


def _answer(
    cv: Canvas, rows: torch.Tensor, s: int, e: int, mask_id: int, shaping: Shaping
) -> tuple[torch.Tensor | None, torch.Tensor] | None:
    """For `shape_masked`: the rows' canvas up to e with everything before their answers masked out (only
    the presence penalty reads it), and the answer position of the block's first column (negative where
    the block still holds the prompt's tail); None when no rule is on (the hot path skips the work)."""
    if not shaping.active:
        return None
    gen = cv.gen[rows]
    if shaping.presence_penalty == 0:
        return None, s - gen
    x = cv.x[rows, :e]
    answer = torch.where(torch.arange(e, device=x.device)[None, :] >= gen[:, None], x, mask_id)
    return answer, s - gen


def _result(cv: Canvas, prompt: torch.Tensor, gen_length: int, fill: int) -> torch.Tensor:
    """(B, P + gen_length): the left-padded prompt as given, then each row's generated part."""
    out = []
    for b in range(prompt.shape[0]):
        g = cv.x[b, cv.gen[b] : cv.gen[b] + gen_length]
        out.append(torch.cat([g, g.new_full((gen_length - len(g),), fill)]))
    return torch.cat([prompt, torch.stack(out)], dim=1)


def _committed(cv: Canvas, rows: torch.Tensor, e: int, gen_length: int, on_block: OnBlock | None) -> None:
    """Hand each of `rows` its generated ids up to canvas index `e` (streaming; no-op without a hook)."""
    if on_block is not None:
        for b in rows.tolist():
            g = int(cv.gen[b])
            on_block(b, cv.x[b, g : min(e, g + gen_length)].tolist())


@torch.no_grad()
def generate_block_cached(
    net: BlockNet,
    prompt: torch.Tensor,
    prompt_mask: torch.Tensor,
    plan: BlockPlan,
    mask_id: int,
    stop_ids: frozenset[int],
    noise: RowNoise,
    word_pieces: frozenset[int] = frozenset(),
    on_block: OnBlock | None = None,
) -> torch.Tensor:
    """Block decoding over an exact cache of committed blocks; rows leave at the step they finish. (Rows
    under a constraint or recording log probabilities decode in the running set, `decode.running`.)"""
    cv = _canvas(prompt, prompt_mask, plan, mask_id)
    steps, ks = schedule(cv, prompt_mask.sum(1).tolist(), plan.blocks)
    stop = torch.tensor(sorted(stop_ids), device=prompt.device)
    pieces = torch.tensor(sorted(word_pieces), device=prompt.device, dtype=torch.long)
    views = _views(cv, plan)
    rows = torch.arange(prompt.shape[0], device=prompt.device)
    W = cv.width
    s0 = cv.start_block * W
    if s0 > 0:  # the prompt's whole blocks, once
        for v in views:
            _, kv = net.hidden(v.ids(cv, rows, 0, s0, mask_id), cv.pos[:, :s0], block_mask(cv.real, 0, s0, s0, W))
            v.cache = KVCache.of(kv, cv.num_blocks * W)
    pending = s0  # keys/values are exact before this canvas index
    for j in range(cv.start_block, cv.num_blocks):
        s, e, g = j * W, (j + 1) * W, j - cv.start_block
        out = cv.end[rows] <= s  # rows whose blocks are all decoded leave
        if out.any():
            for v in views:
                if v.cache is not None:
                    v.cache.keep(~out, pending)
            rows = rows[~out]
        active = rows
        for i in range(int(steps[rows, g].max()) if rows.numel() else 0):
            if rows.numel() == 0 or not (cv.x[rows, s:e] == mask_id).any():
                break
            # the committed block(s) not yet cached are recomputed with this step's block, once
            lo = pending if i == 0 else s
            mask = block_mask(cv.real[rows], lo, e, e, W)
            hs = []
            for v in views:
                seen = None if v.cache is None else v.cache.view(length=e)
                h, kv = net.hidden(v.ids(cv, rows, lo, e, mask_id), cv.pos[rows, lo:e], mask, seen, lo)
                if v.cache is None:
                    v.cache = KVCache.of(kv, cv.num_blocks * W)
                hs.append(h[:, s - lo :])
            pending = s
            draws, answer = _noise(noise, cv, rows, j, i), _answer(cv, rows, s, e, mask_id, plan.shaping)
            block = commit_step(cv.x[rows, s:e], hs, net, plan, ks[rows, g, i], mask_id, draws, answer, stop, pieces)
            cv.x[rows, s:e] = block
            done = finished(cv, rows, e, mask_id, stop)
            if done.any():  # finished rows leave at once; the batch and its caches shrink
                for v in views:
                    if v.cache is not None:
                        v.cache.keep(~done, pending)
                rows = rows[~done]
        _committed(cv, active, e, plan.blocks.gen_length, on_block)
        if rows.numel() == 0:
            break
    return _result(cv, prompt, plan.blocks.gen_length, mask_id)


def _canvas(prompt: torch.Tensor, prompt_mask: torch.Tensor, plan: BlockPlan, mask_id: int) -> Canvas:
    prompts = [row[m] for row, m in zip(prompt, prompt_mask)]
    pad = int(prompt[~prompt_mask][0]) if (~prompt_mask).any() else mask_id
    return lay_out(prompts, plan.blocks.gen_length, plan.blocks.block_length, mask_id, pad)
