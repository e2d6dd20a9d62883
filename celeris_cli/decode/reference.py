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
from .wholerun import Tokens, whole_batch

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

    @property
    def gen_length(self) -> int:
        return self.schedule.gen_length

    @property
    def forwards(self) -> int:
        """A forward a step (steps spread over the blocks), two under guidance (its unconditional view)."""
        return sum(self.schedule.steps_per_block) * (2 if self.guidance.cfg_scale > 0 else 1)

    def row(self, prompt: torch.Tensor, noise: RowNoise, tokens: Tokens) -> ReferenceRow:
        return ReferenceRow(prompt, self, noise, tokens)


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


class ReferenceRow:
    """One row of the reference decoder (`decode.wholerun`): its canvas, its block and step, that block's
    schedule of commits, and its stream."""

    def __init__(self, prompt: torch.Tensor, plan: ReferencePlan, noise: RowNoise, tokens: Tokens) -> None:
        self.plan, self.noise, self.tokens = plan, noise, tokens
        self.prompt = len(prompt)
        self.canvas = torch.cat([prompt, prompt.new_full((plan.schedule.gen_length,), tokens.mask_id)])
        self.block, self.i = 0, 0  # block j, step i of it
        self.schedule = torch.zeros(1, 0, dtype=torch.long)

    def _span(self) -> tuple[int, int]:
        bs, be = self.plan.schedule.block_spans[self.block]
        return self.prompt + bs, self.prompt + be

    def views(self) -> list[torch.Tensor]:
        """Its canvas, and under guidance the canvas with its prompt masked (a second forward, counted as one
        of its own)."""
        if self.plan.guidance.cfg_scale <= 0:
            return [self.canvas]
        ones = torch.ones(1, len(self.canvas), dtype=torch.bool, device=self.canvas.device)
        return [self.canvas, unconditional(self.canvas[None], ones, self.prompt, self.tokens.mask_id)[0]]

    def wanted(self) -> torch.Tensor:
        """The masked positions of its block: only they can commit, so only they are predicted."""
        s, e = self._span()
        out = torch.zeros(len(self.canvas) - self.prompt, dtype=torch.bool, device=self.canvas.device)
        out[s - self.prompt : e - self.prompt] = self.canvas[s:e] == self.tokens.mask_id
        return out

    def step(self, hs: list[torch.Tensor], net: CanvasNet) -> bool:
        """Step i of block j: every masked position of the block predicted, the scheduled number of them
        committed, the most confident first (`commit_order`). Done after the last block's last step, or with
        stop ids once its answer is finished (`leave_when_finished`)."""
        plan, mask_id, j, i = self.plan, self.tokens.mask_id, self.block, self.i
        steps = plan.schedule.steps_per_block[j]
        s, e = self._span()
        block = self.canvas[None, s:e]
        masked = block == mask_id
        if i == 0:
            self.schedule = num_transfer_tokens(masked.sum(1), steps)
        draws = self.noise.at([0], j, i)
        places = Places.counted([int(masked.sum())], block.device)
        logits = StepLogits(net.step_head(), hs, plan.guidance.cfg_scale)
        picked, picked_conf = choose(logits, places, plan.sampling, "prob", draws, net.chunk)
        x0 = block.masked_scatter(masked, picked)
        conf = torch.zeros(masked.shape, device=block.device).masked_scatter(masked, picked_conf)
        rank = commit_order(conf, plan.ordering, 1 - i / steps, draws)
        commit = select_top_k(torch.where(masked, rank, float("-inf")), self.schedule[:, i])
        self.canvas[s:e] = torch.where(commit, x0, block)[0]
        stop, row = self.tokens.stop, self.canvas[None]  # (the row's canvas as a batch of one, written through)
        here = torch.zeros(1, dtype=torch.long, device=row.device)
        if stop.numel() and leave_when_finished(row, row, here, self.prompt, s, e, mask_id, stop) is not None:
            return True
        self.i += 1
        if self.i == steps:
            self.block, self.i = j + 1, 0
        return self.block == len(plan.schedule.block_spans)


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
    Returns the canvas (B, P + gen_length) with no mask left: the running set (`decode.wholerun`) with every
    row admitted at once.

    stop_ids (for measurement, never a user's setting: `celeris bench` times the reference as LLaDA runs
    it): a row whose answer is finished leaves the batch at once, the rest of its canvas its stop token.
    Its answer up to that stop token is the one it would have had: nothing before it is masked any more,
    and every row draws from its own streams."""
    return whole_batch(net, prompt, prompt_mask, plan, mask_id, mask_id, noise, stop_ids)
