"""The static block decoder with an exact cache of committed blocks, as it was before every block decode ran
in the running set (`decode.running`): the batch laid out in block-aligned columns (each row left-padded by
whole blocks), the prompt's whole blocks prefilled once, then each step a forward of the current block over
the cache, committed by the decoders' one rule (`block.commit_step`); rows leave at the step they finish.
Kept here as the oracle the running set's `block-fast` rows are tested against (`conftest.decoded_alone`):
another layout, another loop, another cache over the same rule, which LLaDA2's own `generate` pins
(`test_llada2.py`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from celeris_cli.arch.kv import KVCache
from celeris_cli.decode.block import BlockNet, BlockPlan, OnBlock, block_mask, commit_step
from celeris_cli.decode.sampling import Draws, RowNoise
from celeris_cli.params import Blocks, Shaping


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
def block_cached_alone(
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
