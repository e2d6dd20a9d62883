"""Reference masked-diffusion decoding (LLaDA `generate.py`), as pure functions on token ids.

Nothing here knows about text, files or devices: a decoder takes the model as a `CanvasNet` (hidden states
predicting a span of the canvas, and the LM head; `FullLogits` makes one of a plain `model_fn(ids,
key_mask) -> logits`), a left-padded prompt, its settings and the rows' random streams (`RowNoise`), and
returns the canvas. The head runs on the positions a step predicts only, a chunk at a time.

Canvas: [prompt | MASK x gen_length]. The generation part is split into semi-autoregressive blocks of
`block_length`, decoded left to right. Each step predicts every masked position of the active block and
commits the `k` most confident; k follows a linear schedule. Committed tokens are never remasked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ..params import Guidance, Ordering, Sampling, Schedule
from .predict import Places, StepLogits, choose
from .sampling import ORDER, Draws, RowNoise, order_scores

ModelFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids (B,L), key_mask (B,L)) -> (B,L,V)


class CanvasNet(Protocol):
    """The model as the whole-canvas decoders (reference, Dream, RND1) call it (`strategies.Net`)."""

    chunk: int  # positions whose logits are computed at a time (`predict.in_chunks`)

    def canvas_hidden(self, ids: torch.Tensor, key_mask: torch.Tensor, s: int, e: int) -> torch.Tensor:
        """(B, e - s, d): what predicts positions [s, e) of the canvas ids (B, L), from a full forward."""
        ...

    def step_head(self) -> Callable[[torch.Tensor], torch.Tensor]: ...


WHOLE = 2**31  # a chunk no step reaches: every position's logits at once


class FullLogits:
    """A plain model_fn(ids, key_mask) -> logits (B, L, V) as a CanvasNet: its logits stand for the
    hidden states and the head passes them through (a test's fake, another project's model)."""

    def __init__(self, model_fn: ModelFn, chunk: int = WHOLE) -> None:
        self.model_fn, self.chunk = model_fn, chunk

    def canvas_hidden(self, ids: torch.Tensor, key_mask: torch.Tensor, s: int, e: int) -> torch.Tensor:
        return self.model_fn(ids, key_mask)[:, s:e]

    def step_head(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return _identity


def _identity(h: torch.Tensor) -> torch.Tensor:
    return h


@dataclass(frozen=True)
class ReferencePlan:
    """The parts of the settings the reference decoder honours (see `strategy.STRATEGIES`)."""

    schedule: Schedule
    sampling: Sampling
    ordering: Ordering
    guidance: Guidance


def num_transfer_tokens(mask_count: torch.Tensor, steps: int) -> torch.Tensor:
    """Linear schedule: (B,) masked counts -> (B, steps) tokens to commit per step (LLaDA)."""
    base = mask_count // steps
    remainder = mask_count % steps
    sched = base[:, None].repeat(1, steps)
    sched += (torch.arange(steps, device=mask_count.device)[None, :] < remainder[:, None]).long()
    return sched


def select_top_k(confidence: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Boolean mask of the k[b] highest-confidence positions per row; ties go to the leftmost.
    confidence: (B, T) with -inf on positions that may not be chosen."""
    order = confidence.argsort(dim=1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
    return (rank < k[:, None]) & (confidence > float("-inf"))


def unconditional(x: torch.Tensor, key_mask: torch.Tensor, prompt_len: int, mask_id: int) -> torch.Tensor:
    """The canvas as classifier-free guidance's unconditional pass sees it: the prompt masked, padding kept."""
    un = x.clone()
    un[:, :prompt_len] = torch.where(key_mask[:, :prompt_len], mask_id, x[:, :prompt_len])
    return un


def finished_rows(gen: torch.Tensor, mask_id: int, stop: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose generated ids (B, G) hold a committed stop token with no mask before it, and the
    position of that first stop token (G where there is none)."""
    G = gen.shape[1]
    idx = torch.arange(G, device=gen.device).expand_as(gen)
    first_stop = torch.where(torch.isin(gen, stop), idx, G).min(1).values
    first_mask = torch.where(gen == mask_id, idx, G).min(1).values
    return (first_stop < G) & (first_mask > first_stop), first_stop


def leave_when_finished(
    x: torch.Tensor, xa: torch.Tensor, active: torch.Tensor, P: int, s: int, e: int, mask_id: int, stop: torch.Tensor
) -> torch.Tensor | None:
    """Early exit. xa: the canvas of the rows still decoding (`active`: their indices in x), decoded up to
    the end of block [s, e). Each of them whose answer is finished is written back into x, its remaining
    masks filled with its first stop token. Returns which rows of xa stay, or None when none finished."""
    done, first_stop = finished_rows(xa[:, P:e], mask_id, stop)
    if not done.any():
        return None
    fill = xa[:, P:e].gather(1, first_stop.clamp_max(e - P - 1)[:, None])
    out = xa[done]
    out[:, s:] = torch.where(out[:, s:] == mask_id, fill[done], out[:, s:])
    x[active[done]] = out
    return ~done


def commit_order(conf: torch.Tensor, ordering: Ordering, fade: float | torch.Tensor, draws: Draws) -> torch.Tensor:
    """(B, T) scores ranking positions for the scheduled commits: the confidence (with order noise scaled
    by `fade`, the share of the block still to commit), for `random` remasking a uniform draw from each
    row's own stream, for `sequential` the position itself (the leftmost first)."""
    if ordering.remasking == "random":
        return draws.uniform(tuple(conf.shape[1:]), torch.float32, ORDER)
    if ordering.remasking == "sequential":
        return -torch.arange(conf.shape[1], device=conf.device, dtype=torch.float32).expand(conf.shape)
    return order_scores(conf, ordering.order_temperature, fade, draws).float()


@torch.no_grad()
def generate_reference(
    net: CanvasNet,
    prompt: torch.Tensor,
    prompt_mask: torch.Tensor,
    plan: ReferencePlan,
    mask_id: int,
    noise: RowNoise,
    stop_ids: frozenset[int] = frozenset(),
) -> torch.Tensor:
    """LLaDA reference decoding. prompt: (B, P) left-padded ids; prompt_mask: (B, P) True on real tokens.
    Returns the canvas (B, P + gen_length) with no mask left.

    stop_ids (for measurement, never a user's setting: `celeris bench` times the reference as LLaDA runs
    it): a row whose answer is finished leaves the batch at once, the rest of its canvas its stop token.
    Its answer up to that stop token is the one it would have had: nothing before it is masked any more,
    and every row draws from its own streams."""
    B, P = prompt.shape
    G = plan.schedule.gen_length
    x = torch.cat([prompt, prompt.new_full((B, G), mask_id)], dim=1)
    key_mask = torch.cat([prompt_mask, prompt_mask.new_ones(B, G)], dim=1)
    stop = torch.tensor(sorted(stop_ids), device=x.device, dtype=x.dtype)
    rows = list(range(B))  # rows still decoding (indices of x), on the host: their streams read no device tensor
    xa, km = x, key_mask  # their canvas: x itself until a row leaves
    for j, ((bs, be), steps) in enumerate(zip(plan.schedule.block_spans, plan.schedule.steps_per_block)):
        if not rows:
            break
        s, e = P + bs, P + be
        schedule = num_transfer_tokens((xa[:, s:e] == mask_id).sum(1), steps)
        for i in range(steps):
            masked = xa[:, s:e] == mask_id  # only masked positions can commit: only they are predicted
            hs = [net.canvas_hidden(xa, km, s, e)[masked]]
            if plan.guidance.cfg_scale > 0:  # a second forward pass, counted as one by the model boundary
                hs.append(net.canvas_hidden(unconditional(xa, km, P, mask_id), km, s, e)[masked])
            draws = noise.at(rows, j, i)
            places = Places.counted(masked.sum(1).tolist(), x.device)
            logits = StepLogits(net.step_head(), hs, plan.guidance.cfg_scale)
            picked, picked_conf = choose(logits, places, plan.sampling, "prob", draws, net.chunk)  # (N,), row order
            x0 = xa[:, s:e].masked_scatter(masked, picked)
            conf = torch.zeros(masked.shape, device=x.device).masked_scatter(masked, picked_conf)
            rank = commit_order(conf, plan.ordering, 1 - i / steps, draws)
            commit = select_top_k(torch.where(masked, rank, float("-inf")), schedule[:, i])
            xa[:, s:e] = torch.where(commit, x0, xa[:, s:e])
            if stop.numel():
                keep = leave_when_finished(x, xa, torch.tensor(rows, device=x.device), P, s, e, mask_id, stop)
                if keep is not None:
                    xa, km, schedule = xa[keep], km[keep], schedule[keep]
                    rows = [r for r, stays in zip(rows, keep.tolist()) if stays]
                    if not rows:
                        break
    if xa is not x:
        x[rows] = xa
    return x
