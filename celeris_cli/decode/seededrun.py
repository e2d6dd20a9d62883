"""Nemotron's diffusion mode (`decode.nemotron`, the default model's strategy) as a running set: rows join as
others finish, each at its own place, so a batch of answers of every length keeps its places busy.

A row owns a slot of its lane's cache (rows of one block width share a lane, as block diffusion's do,
`decode.running`). It joins with its prompt run causally into its slot (a forward of its own), and the last
prompt position's logits choose its first block's seed. Each round is one forward per lane over every row's
block-wide window at its own place, over its own slot; a row's window is one of

- a denoising step of its block: the seed and the rest of the block, bidirectional inside the block, over
  the keys before it; its surest masked positions are committed (`commit_step`);
- the commit pass of a block just completed: the block causally (each position over those before it), which
  writes the block's final keys and values into the slot, and whose last position chooses the next block's
  seed.

So one forward holds both kinds of window: its mask is per row and per query, and each row's attention runs
over exactly its own keys (`LayerKV.exact`), a step's with no mask at all, never beside a row of another
mask (`invariant.plan`), as alone. A row's last block may be shorter than its lane's width: its window is
padded with `pad_id` positions that no real position sees and that are never committed, so its forward has
its lane's shape alone or beside anyone.

A row's answer is what it is alone: its noise comes from its own stream at its own (block, step)
(`stream_seed`; step 0 is the seed's draw), its schedule is its own (`Blocks.seeded_steps`), and the commit
step and the seed choice run per group of rows sharing their settings. `generate_seeded` (a static batch) is
this running set admitted at once; `tests/test_seeded_running.py` checks it against a plain loop that
recomputes the whole sequence at every step, with no cache and no running set.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ..params import Blocks
from .nemotron import Picks, SeededPlan
from .predict import Places, StepLogits, choose
from .reference import commit_order, finished_rows, num_transfer_tokens, select_top_k
from .running import BlockRequest, LaneSet
from .runset import Lane
from .sampling import Draws, RowNoise, shaper, stream_seed


@dataclass
class _Row:
    req: BlockRequest[SeededPlan]
    x: torch.Tensor  # (end,) prompt, answer (masks until committed), pad_id to its last window's end
    schedule: list[list[int]]  # tokens each step of each block commits
    commit: SeededPlan  # the settings its commit step reads: rows sharing them commit together
    stop: torch.Tensor  # the stop ids
    block: int = 0  # the block being denoised, or committed
    step: int = 0
    storing: bool = False  # the next window is the block's commit pass
    forwards: int = 0  # forwards the row took part in, its prefill included
    finished: bool = False

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

    def masked(self, mask_id: int) -> bool:
        return bool((self.x[self.start : self.end] == mask_id).any())

    def answer(self) -> list[int]:
        """Its gen_length ids, each after its first stop token that token again (what the engine cuts)."""
        ans = self.x[self.gen : self.gen + self.plan.blocks.gen_length].clone()
        hit = torch.isin(ans, self.stop)
        if bool(hit.any()):
            first = int(hit.int().argmax())
            ans[first + 1 :] = ans[first]
        return ans.tolist()


class SeededScheduler(LaneSet[BlockRequest[SeededPlan]]):
    """Decodes `BlockRequest`s whose plan is a `SeededPlan` with at most `width` rows in flight; `run` yields
    (key, generated ids, forwards) as each row finishes. `refill` False gives static batches through the same
    loop. The lanes, their slots, `add`, `drop` and `run` are block diffusion's (`LaneSet`); the rows, their
    windows and their commits are the diffusion mode's."""

    @staticmethod
    def _end(req: BlockRequest[SeededPlan]) -> int:
        """Its prompt, then its answer's blocks, the last one padded to a whole window."""
        blocks = req.plan.blocks
        return len(req.prompt) + -(-blocks.gen_length // blocks.block_length) * blocks.block_length

    def _admit(self, req: BlockRequest[SeededPlan]) -> None:
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
        lane = self._lane(self.lanes, W, end)
        slot = lane.join(row, end, self.width)
        # the prompt's causal pass, into the row's slot; its last position chooses the first seed
        causal = torch.ones(P, P, dtype=torch.bool, device=self.device).tril()[None, None]
        pos = torch.arange(P, device=self.device)[None]
        h, _ = self.net.hidden(x[None, :P], pos, causal, lane.cache.view(slot, P), 0, False)
        row.forwards += 1
        self.occupancy.prefills += 1
        self.occupancy.positions += P
        self._seed([row], h[:, -1])

    def _round(self, lane: Lane) -> list[Any]:
        """One forward over the lane's rows, each its own window (a step or a commit pass) at its own place;
        then the stepping rows' commits and the committing rows' next seeds. Returns the rows that are done."""
        rows: list[_Row] = lane.rows
        ready = [r for r in rows if r.finished]  # done as it joined (its seed a stop token, or all its answer)
        if ready:
            return ready
        W = rows[0].width
        starts = torch.tensor([r.start for r in rows], device=self.device)
        ends = torch.tensor([r.end for r in rows], device=self.device)
        storing = torch.tensor([r.storing for r in rows], device=self.device)
        L = int(starts.max()) + W
        lane.ensure(L)
        positions = starts[:, None] + torch.arange(W, device=self.device)[None, :]
        keys = torch.arange(L, device=self.device)
        # a key is seen when it is before the block's real end; in a commit pass, only up to the query
        seen = (keys[None, None, :] < ends[:, None, None]) & (
            ~storing[:, None, None] | (keys[None, None, :] <= positions[:, :, None])
        )
        windows = torch.stack([r.x[r.start : r.start + W] for r in rows])
        cache = lane.cache.view(slice(0, len(rows)), L, exact=True)  # each row's attention over its own keys
        h, _ = self.net.hidden(windows, positions, seen[:, None], cache, starts, False)
        self.occupancy.forwards += 1
        self.occupancy.rows += len(rows)
        self.occupancy.positions += len(rows) * W
        for r in rows:
            r.forwards += 1
        stepping = [b for b, r in enumerate(rows) if not r.storing]
        committing = [b for b, r in enumerate(rows) if r.storing]
        groups: dict[SeededPlan, list[int]] = {}
        for b in stepping:
            groups.setdefault(rows[b].commit, []).append(b)
        for plan, members in groups.items():
            self._commit([rows[b] for b in members], h[members], plan)
        for b in stepping:
            rows[b].step += 1
            self._settle(rows[b])
        if committing:
            for b in committing:
                rows[b].storing, rows[b].block, rows[b].step = False, rows[b].block + 1, 0
            last = torch.tensor([rows[b].width - 1 for b in committing], device=self.device)
            self._seed([rows[b] for b in committing], h[committing, last])
        return [r for r in rows if r.finished]

    def _seed(self, rows: list[_Row], h: torch.Tensor) -> None:
        """Each row's block starts with the token its last decided position predicts (at its stream's
        (block, 0)), its logits shaped as an AR step's; then where the row stands (`_settle`)."""
        groups: dict[SeededPlan, list[int]] = {}
        for b, r in enumerate(rows):
            groups.setdefault(r.commit, []).append(b)
        for plan, members in groups.items():
            group = [rows[b] for b in members]
            n = len(group)
            shape = self._shaper(group, plan, [r.start for r in group])
            where = None
            if shape is not None:
                where = torch.stack([torch.arange(n), torch.zeros(n, dtype=torch.long)], 1).to(self.device)
            draws = Draws([stream_seed(r.req.seed, r.block, 0) for r in group], self.device)
            logits = StepLogits(self.net.step_head(), [h[members]], 0.0, shape, where)
            picked = Picks(logits, n).pick(plan.sampling, draws, self.net.chunk)
            for r, t in zip(group, picked):
                r.x[r.start] = t
        for r in rows:
            self._settle(r)

    def _settle(self, r: _Row) -> None:
        """After a seed or a step: done (a stop token with nothing masked before it, or its last block
        complete), on to its block's commit pass (the block complete), or on with its steps."""
        stopped = finished_rows(r.x[None, r.gen : r.end], self.mask_id, self.stop)[0]
        complete = r.step >= len(r.schedule[r.block]) or not r.masked(self.mask_id)
        if bool(stopped) or (complete and r.last):
            r.finished = True
        elif complete:
            r.storing = True

    def _shaper(self, rows: list[_Row], plan: SeededPlan, at: list[int]) -> Any:
        """The logit shaping of positions after each row's answer so far (masks where undecided, padded with
        masks to the longest), the answer position of column 0 at each row's `at`."""
        if not plan.shaping.active:
            return None
        history = torch.full((len(rows), max(r.end - r.gen for r in rows)), self.mask_id, device=self.device)
        for b, r in enumerate(rows):
            history[b, : r.end - r.gen] = r.x[r.gen : r.end]
        offset = torch.tensor([a - r.gen for a, r in zip(at, rows)], device=self.device)
        t = plan.sampling.temperature
        return shaper(plan.shaping, history, offset, self.mask_id, self.stop, t, self.pieces)

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
        shape = self._shaper(rows, plan, [r.start for r in rows])
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
    B, P = prompt.shape
    scheduler = SeededScheduler(net, mask_id, stop_ids, pad_id, B, prompt.device, word_pieces)
    requests = [BlockRequest(b, prompt[b][prompt_mask[b]].tolist(), plan, noise.seeds[b]) for b in range(B)]
    out = torch.cat([prompt, prompt.new_full((B, plan.blocks.gen_length), mask_id)], 1)
    for b, ids, _ in scheduler.run(requests):
        out[b, P:] = torch.tensor(ids, device=prompt.device)
    return out
