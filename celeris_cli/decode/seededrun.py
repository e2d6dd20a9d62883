"""Nemotron's diffusion mode (`decode.nemotron`, the default model's strategy) as a running set: rows join as
others finish, each at its own place, so a batch of answers of every length keeps its places busy.

A row owns a slot of its lane's cache (rows of one block width share a lane, `running.LaneSet`, as block
diffusion's do). Each round is one packed forward (`arch.packed`: the rows end to end, no padding, each
row's attention over exactly its own keys) in which every row in flight runs one window at its own place,
over its own slot:

- a joining row's prompt, causally from 0; its last position chooses the first block's seed;
- a denoising step of its block: the seed and the rest of the block, bidirectional inside the block, over
  the keys before it; its surest masked positions are committed (`_commit`, the mode's one commit step);
- the commit pass of a block just completed: the block causally (each position over those before it), which
  writes the block's final keys and values into the slot; its last position chooses the next block's seed.

A window is as wide as the row's block (a last block may be shorter), so a row's forward has the shapes it
has alone, and steps and causal windows never share an attention call.

A row's answer is what it is alone: its noise comes from its own stream at its own (block, step)
(`stream_seed`; step 0 is the seed's draw), its schedule is its own (`Blocks.seeded_steps`), and the commit
step and the seed choice run per group of rows sharing their settings. Admission takes the requests with the
most forwards first (`rounds`). `generate_seeded` (a static batch) is this running set admitted at once;
`tests/test_seeded_running.py` checks it against a plain loop that recomputes the whole sequence at every
step, with no cache and no running set.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ..arch.packed import Segment, packed_layers
from ..params import Blocks
from .nemotron import Picks, SeededPlan, ar_shaping, stop_after
from .predict import Places, StepLogits, choose
from .reference import commit_order, finished_rows, num_transfer_tokens, select_top_k
from .running import LaneSet
from .runset import RowRequest, admitted_at_once
from .sampling import Draws, RowNoise, shaper, stream_seed


@dataclass
class _Row:
    req: RowRequest[SeededPlan]
    x: torch.Tensor  # (end,) prompt, answer (masks until committed), pad_id to its last window's end
    schedule: list[list[int]]  # tokens each step of each block commits
    commit: SeededPlan  # the settings its commit step reads: rows sharing them commit together
    stop: torch.Tensor  # the stop ids
    block: int = 0  # the block being denoised, or committed
    step: int = 0
    storing: bool = False  # the next window is the block's commit pass
    forwards: int = 0  # forwards the row took part in, its prefill included
    finished: bool = False
    prefilled: bool = False  # its prompt's keys and values are in its slot, and its first seed chosen

    @property
    def plan(self) -> SeededPlan:
        return self.req.plan

    @property
    def gen(self) -> int:
        """Where its answer starts: after its prompt."""
        return len(self.req.prompt)

    @property
    def width(self) -> int:
        return self.plan.blocks.block_length

    @property
    def start(self) -> int:
        return self.gen + self.block * self.width

    @property
    def end(self) -> int:
        """One past its block's last answer position (its last block's may come before the window's end)."""
        return min(self.start + self.width, self.gen + self.plan.blocks.gen_length)

    @property
    def cached(self) -> int:
        """The positions of its slot written so far: up to its window's end."""
        return self.start + self.width

    @property
    def last(self) -> bool:
        return self.end == self.gen + self.plan.blocks.gen_length

    def answer(self) -> list[int]:
        """Its gen_length ids, each after its first stop token that token again (what the engine cuts)."""
        ans = self.x[None, self.gen : self.gen + self.plan.blocks.gen_length].clone()
        stop_after(ans, 0, self.stop)
        return ans[0].tolist()


class SeededScheduler(LaneSet[RowRequest[SeededPlan]]):
    """Decodes `RowRequest`s whose plan is a `SeededPlan` with at most `width` rows in flight; `run` yields
    (key, generated ids, forwards) as each row finishes. `refill` False gives static batches through the same
    loop. The lanes, their slots, `add`, `drop` and `run` are block diffusion's (`LaneSet`); the rows, their
    windows and their commits are the diffusion mode's."""

    @staticmethod
    def _end(req: RowRequest[SeededPlan]) -> int:
        """Its prompt, then its answer's blocks, the last one padded to a whole window (never computed: the
        commit step lays every row's block in one (rows, width) tensor)."""
        blocks = req.plan.blocks
        return len(req.prompt) + -(-blocks.gen_length // blocks.block_length) * blocks.block_length

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        model: Any = getattr(self.net, "model", self.net)
        self.n_layers = len(model.parts()[1])  # what a packed forward passes, one per layer

    def rounds(self, request: RowRequest[SeededPlan]) -> int:
        """Its forwards if no stop token ends it early: its steps, a commit pass between blocks, and its
        prefill. (A total of steps spread over the blocks makes a short answer take as many as a long one.)"""
        steps = request.plan.blocks.seeded_steps()
        return sum(steps) + len(steps)

    def _admit(self, req: RowRequest[SeededPlan]) -> None:
        """A slot of its lane; its prompt is run in the round's forward (`_tick`)."""
        plan = req.plan
        P, G, W = len(req.prompt), plan.blocks.gen_length, plan.blocks.block_length
        end = self._end(req)
        x = torch.full((end,), self.mask_id, dtype=torch.long, device=self.device)
        x[:P] = torch.tensor(req.prompt, device=self.device)
        x[P + G :] = self.pad_id
        masked = [min(W, G - s) - 1 for s in range(0, G, W)]
        schedule = [
            num_transfer_tokens(torch.tensor([m]), n)[0].tolist() if n else []
            for m, n in zip(masked, plan.blocks.seeded_steps())
        ]
        row = _Row(req, x, schedule, replace(plan, blocks=_NO_BLOCKS), self.stop)
        self._lane(self.lanes, W, end).join(row, end, self.width)

    @torch.no_grad()  # the weights may require grad: no graph may chain through the caches
    def one_round(self) -> list[tuple[int, list[int], int]]:
        for req in self.admit():
            self._admit(req)
        self._give_back()
        done = self._tick()
        answers = []
        for W in sorted({r.width for r in done}):
            answers += self._leave(self.lanes[W], [r for r in done if r.width == W])
        return answers

    def _tick(self) -> list[_Row]:
        """One round: one packed forward (`arch.packed`: rows end to end, no padding, each row's attention
        over exactly its own keys) of every row in flight, each its own window at its own place over its own
        slot: a joining row's prompt (causal, from 0), a denoising step of its block (bidirectional inside
        the block), or a completed block's commit pass (causal). Then the stepping rows' commits, and the
        next seed of each row that ran its prompt or a commit pass. Returns the rows that are done."""
        done = [r for lane in self.lanes.values() for r in lane.rows if r.finished]
        segments: list[Segment] = []
        ids: list[torch.Tensor] = []
        positions: list[torch.Tensor] = []
        rows: list[_Row] = []
        for lane in self.lanes.values():
            for slot, r in enumerate(lane.rows):
                if r.finished:
                    continue
                s, e = (0, r.gen) if not r.prefilled else (r.start, r.end)
                begin = segments[-1].end if segments else 0
                causal = r.storing or not r.prefilled
                segments.append(Segment(begin, begin + e - s, lane.cache, slot, s, e, causal=causal))
                ids.append(r.x[s:e])
                positions.append(torch.arange(s, e, device=self.device))
                rows.append(r)
        if not rows:
            return done
        cache = packed_layers(segments, self.n_layers, self.device)
        net: Any = self.net  # a packed forward's layers stand in for its cache
        h, _ = net.hidden(torch.cat(ids)[None], torch.cat(positions)[None], None, cache, 0, False)
        h = h[0]
        self.occupancy.forwards += 1
        self.occupancy.rows += len(rows)
        self.occupancy.positions += segments[-1].end
        for r in rows:
            r.forwards += 1
        stepping = [b for b, r in enumerate(rows) if r.prefilled and not r.storing]
        seeding = [b for b, r in enumerate(rows) if not r.prefilled or r.storing]  # its last position: a seed
        groups: dict[tuple[SeededPlan, int], list[int]] = {}
        for b in stepping:
            groups.setdefault((rows[b].commit, rows[b].width), []).append(b)
        for (plan, W), members in groups.items():
            hs = h.new_zeros(len(members), W, h.shape[-1])  # each row's block, a short last one padded
            for i, b in enumerate(members):
                hs[i, : segments[b].end - segments[b].begin] = h[segments[b].begin : segments[b].end]
            self._commit([rows[b] for b in members], hs, plan)
        for b in stepping:
            rows[b].step += 1
        self._settle([rows[b] for b in stepping])
        for b in seeding:
            r = rows[b]
            if r.storing:  # its block's final keys and values are in place: on to the next block
                r.storing, r.block, r.step = False, r.block + 1, 0
            r.prefilled = True
        if seeding:
            self._seed([rows[b] for b in seeding], h[[segments[b].end - 1 for b in seeding]])
        return done + [r for r in rows if r.finished]

    def _seed(self, rows: list[_Row], h: torch.Tensor) -> None:
        """Each row's block starts with the token its last decided position predicts (at its stream's
        (block, 0)), its logits shaped as an AR step's; then where the row stands (`_settle`)."""
        groups: dict[SeededPlan, list[int]] = {}
        for b, r in enumerate(rows):
            groups.setdefault(r.commit, []).append(b)
        for plan, members in groups.items():
            group = [rows[b] for b in members]
            t = plan.sampling.temperature
            shaped = None
            if plan.shaping.active:
                history, at = self._answers(group)
                shaped = ar_shaping(plan.shaping, history, at, self.mask_id, self.stop, t, self.pieces)
            draws = Draws([stream_seed(r.req.seed, r.block, 0) for r in group], self.device)
            picked = self._picks(h[members], shaped).pick(plan.sampling, draws, self.net.chunk)
            for r, token in zip(group, picked):
                r.x[r.start] = token
        self._settle(rows)

    def _picks(self, h: torch.Tensor, shaped: Any) -> Picks:
        shape, where = shaped if shaped is not None else (None, None)
        return Picks(StepLogits(self.net.step_head(), [h], 0.0, shape, where), h.shape[0])

    def _settle(self, rows: list[_Row]) -> None:
        """After a seed or a step, for each row: done (a stop token with nothing masked before it, or its
        last block complete), on to its block's commit pass (the block complete), or on with its steps.
        One read of the host for all of them."""
        if not rows:
            return
        answers, at = self._answers(rows)
        stopped = finished_rows(answers, self.mask_id, self.stop)[0]
        cols = torch.arange(answers.shape[1], device=self.device)[None, :]
        ends = torch.tensor([r.end - r.gen for r in rows], device=self.device)[:, None]
        masked = ((answers == self.mask_id) & (cols >= at[:, None]) & (cols < ends)).any(1)
        for r, (stop, left) in zip(rows, torch.stack([stopped, masked], 1).tolist()):
            complete = r.step >= len(r.schedule[r.block]) or not left
            if stop or (complete and r.last):
                r.finished = True
            elif complete:
                r.storing = True
            if self.on_block is not None and (r.finished or r.storing):
                self.on_block(r.req.key, r.x[r.gen : r.end].tolist())

    def _answers(self, rows: list[_Row]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's answer up to its block's end (masks where undecided, padded with masks to the longest),
        and the answer position of its block's first column."""
        answers = torch.full((len(rows), max(r.end - r.gen for r in rows)), self.mask_id, device=self.device)
        for b, r in enumerate(rows):
            answers[b, : r.end - r.gen] = r.x[r.gen : r.end]
        return answers, torch.tensor([r.start - r.gen for r in rows], device=self.device)

    def _commit(self, rows: list[_Row], h: torch.Tensor, plan: SeededPlan) -> None:
        """One denoising step for rows sharing their settings: their masked positions' tokens and confidences,
        then the schedule's share of the surest (by the remasking's order) and, under a threshold below 1,
        every position at least that sure (the diffusion mode's commit step, its one copy)."""
        W = rows[0].width
        block = torch.stack([r.x[r.start : r.start + W] for r in rows])
        real = torch.arange(W, device=self.device)[None, :] < torch.tensor([r.end - r.start for r in rows])[:, None]
        masked = (block == self.mask_id) & real
        k = torch.tensor([r.schedule[r.block][r.step] for r in rows], device=self.device)
        draws = Draws([stream_seed(r.req.seed, r.block, r.step + 1) for r in rows], self.device)
        places = Places.counted(masked.sum(1).tolist(), self.device)
        shape = None
        if plan.shaping.active:
            history, at = self._answers(rows)
            shape = shaper(plan.shaping, history, at, self.mask_id, self.stop, plan.sampling.temperature, self.pieces)
        where = masked.nonzero() if shape is not None else None
        x0, conf = choose(StepLogits(self.net.step_head(), [h[masked]], 0.0, shape, where), places, plan.sampling,
                          None, draws, self.net.chunk)  # fmt: skip
        confidence = torch.full(block.shape, float("-inf"), device=self.device).masked_scatter(masked, conf)
        span = torch.tensor([max(r.end - r.start - 1, 1) for r in rows], device=self.device)[:, None]
        fade = masked.sum(1, keepdim=True) / span  # the share of the block still masked
        rank = torch.where(masked, commit_order(confidence, plan.ordering, fade, draws), float("-inf"))
        chosen = select_top_k(rank, k) & masked
        if plan.commit.threshold < 1:
            chosen |= masked & (confidence >= plan.commit.threshold)
        block[chosen] = x0[chosen[masked]]
        for r, new in zip(rows, block):
            r.x[r.start : r.start + W] = new


_NO_BLOCKS = Blocks(gen_length=0, block_length=0, block_steps=0, denoise_steps=0, steps_total=False)


@torch.no_grad()
def generate_seeded(
    net: Any,
    prompt: torch.Tensor,
    prompt_mask: torch.Tensor,
    plan: SeededPlan,
    tokens: tuple[int, frozenset[int], int, frozenset[int]],
    noise: RowNoise,
) -> torch.Tensor:
    """A static batch: prompt (B, P) left-padded -> the canvas (B, P + gen_length), each row decoded in a
    running set of B rows admitted at once. tokens: (mask_id, stop_ids, pad_id, word_pieces)."""
    mask_id, stop_ids, pad_id, word_pieces = tokens
    scheduler = SeededScheduler(net, mask_id, stop_ids, pad_id, len(prompt), prompt.device, word_pieces)
    return admitted_at_once(scheduler, prompt, prompt_mask, plan, mask_id, noise)
