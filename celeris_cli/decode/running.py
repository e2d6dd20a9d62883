"""Continuous batching for block diffusion: a running set of rows that admits waiting requests as rows
finish, each row at its own place, so the batch stays full while answers of every length run through it.

Each row owns a slot of a preallocated `KVCache` and its own positions: its prompt's whole blocks are
prefilled into its slot when it joins, then every round runs one block-wide window per row, at the row's
own start, over its own slot (key j is seen by a row's window when j is before the end of the row's
block: causal between blocks, bidirectional inside one). A window is either a denoising step of the row's
current block, or the store pass of a block it has just completed, which writes that block's final keys
and values before the row's next block reads them (SDAR's and JetEngine's "one store pass when a block is
full"). Rows of one block width share a lane (a cache and one forward per round); rows of another width
run in their own lane's forward in the same round. So no window is ever padded, and a row's forward has
the same shape beside any batch mates as alone: only the number of rows changes, which the kernels'
per-row results do not depend on in float32 (the property the static batches have always had).

Every block-diffusion decode runs here, guided or not: a batch alone is a running set admitted at once, and
`refill=False` gives static batches for comparison. Rows of `block-fast` read an exact cache; rows of
`block` (LLaDA2's reference decoder, `block.ReferenceBlockPlan`) keep none: every round, each one's prefix to
the end of its block is recomputed as its own segment of one packed forward (`arch.packed`, block-causal),
whatever its width, and it moves on to its next block with no store pass. Both kinds step by one rule
(`_advance`).

A row's answer is what it would be alone: its noise comes from its own stream at its own (block, step)
(`RowNoise`), its schedule is its own (`Blocks`), and the commit step runs per group of rows that share
their settings and block width, on their own unpadded blocks. So requests with different samplers,
shaping, steps, lengths, block widths and guidance share one running set. A guided row's second view,
the unconditional one (its prompt masked), has a slot in a second cache beside its lane (the lane's shadow),
prefilled and stepped in the same round as its first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch

from ..arch.kv import KVCache
from ..arch.packed import packed_hidden
from ..params import NO_STRUCTURE, Blocks
from ..structured.commit import Rules
from .block import BlockNet, BlockPlan, OnBlock, block_mask, commit_step, top_choice
from .reference import finished_rows
from .runset import Lane, RowRequest, RunningSet, admitted_at_once, give_back
from .sampling import Draws, RowNoise, stream_seed


@dataclass
class _Row:
    req: RowRequest[BlockPlan]
    x: torch.Tensor  # (end,) the row's canvas in its own positions: prompt, then masks to its last block's end
    transfers: list[list[int]]  # tokens each step of each generated block commits
    first: int  # the row's first generated block (it may hold the prompt's tail)
    block: int  # the block being decoded, or stored
    commit: BlockPlan  # the settings its commit step reads: rows sharing them commit together
    step: int = 0
    storing: bool = False  # the next window stores the block just completed
    forwards: int = 0  # forwards the row took part in, its prefill included
    post: int = 0  # token editing: steps begun with the block full
    began_full: bool = False  # token editing: this step began with nothing masked in the block
    edited: bool = False  # token editing: this step rewrote a decided token

    @property
    def width(self) -> int:
        return self.req.plan.blocks.block_length

    @property
    def start(self) -> int:
        return self.block * self.width

    @property
    def gen(self) -> int:
        return len(self.req.prompt)

    @property
    def cached(self) -> int:
        """The positions of its slot written so far: up to the end of its current block."""
        return self.start + self.width

    @property
    def guided(self) -> bool:
        """Under guidance: an unconditional view beside it, in a slot of its lane's shadow."""
        return bool(self.req.plan.guidance.cfg_scale > 0)

    def unconditional(self, lo: int, hi: int, mask_id: int) -> torch.Tensor:
        """Its canvas [lo, hi) as guidance's unconditional view shows it: the prompt masked."""
        ids = self.x[lo:hi].clone()
        ids[: max(0, self.gen - lo)] = mask_id
        return ids

    def answer(self) -> list[int]:
        """The generated part: gen_length ids (the canvas always runs past them)."""
        return self.x[self.gen : self.gen + self.req.plan.blocks.gen_length].tolist()


ReqT = TypeVar("ReqT", bound=RowRequest[Any])


class LaneSet(RunningSet[ReqT]):
    """A running set whose rows share lanes by block width, each lane a cache of slots (`Lane`): the lanes,
    their sizes, the round, `reserve` and handing rows back. A kind says how a row joins (`_admit`), what one
    round of a lane does (`_round`; the seeded set runs all its lanes in one forward, its own `one_round`) and
    where a row's slot ends (`_end`); its rows have `req`, `width`,
    `cached` and `answer()`. on_block(key, generated ids so far): called as each row's block is complete.

    `add` gives it more requests while it runs, between the rows `run` yields (the queue's files arriving
    while others decode); they wait behind those already waiting, and a lane's cache grows (slots, length)
    if they need it."""

    def __init__(
        self,
        net: BlockNet,
        mask_id: int,
        stop_ids: frozenset[int],
        pad_id: int,
        width: int,
        device: torch.device,
        word_pieces: frozenset[int] = frozenset(),
        refill: bool = True,
        on_block: OnBlock | None = None,
        before_round: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(width, device, word_pieces, refill, before_round)
        self.net, self.mask_id, self.pad_id, self.on_block = net, mask_id, pad_id, on_block
        self.stop = torch.tensor(sorted(stop_ids), device=device)
        self.lanes: dict[int, Lane] = {}  # by block width
        self.sizes: dict[int, tuple[int, int]] = {}  # by block width: (slots, length) of its cache

    def in_flight_keys(self) -> list[int]:
        return [r.req.key for lane in self.lanes.values() for r in lane.rows]

    def _drop_in_flight(self, keys: set[int]) -> None:
        for W, lane in list(self.lanes.items()):
            self._drop(W, {id(r) for r in lane.rows if r.req.key in keys})

    def _drop(self, W: int, gone: set[int]) -> None:
        """Rows whose id() is in `gone` leave their lane of width W."""
        self.lanes[W].drop(gone)

    # -- the loop ------------------------------------------------------------------------------------
    def one_round(self) -> list[tuple[int, list[int], int]]:
        for req in self.admit():
            self._admit(req)
        self._give_back()
        answers = []
        for lane in list(self.lanes.values()):
            if lane.rows:
                answers += self._leave(lane, self._round(lane))
        return answers + self._uncached_round()

    def settle(self) -> None:
        self._give_back()

    def _uncached_round(self) -> list[tuple[int, list[int], int]]:
        """One round of the rows that keep no cache (a kind with such rows says how); returns those done."""
        return []

    def _give_back(self) -> None:
        """The caches of lanes whose rows have all left, once this round's rows have joined."""
        give_back(self.lanes)

    def reserve(self, requests: list[ReqT]) -> None:
        # each width's cache, allocated once: as many slots as rows can run at once, as long as the longest
        # canvas (growing it on the way would hold the old and the new at once, and double its length)
        for r in requests:
            if getattr(r.plan, "recomputes", False):  # no cache of its own
                continue
            W = r.plan.blocks.block_length
            rows, length = self.sizes.get(W, (0, 0))
            self.sizes[W] = (min(rows + 1, self.width), max(length, self._end(r)))

    def _lane(self, lanes: dict[int, Lane], W: int, end: int) -> Lane:
        """The lane of width W in `lanes` (made with the size `add` worked out), long enough for `end`."""
        if W not in lanes:
            rows, length = self.sizes.get(W, (self.width, end))
            lanes[W] = Lane(self._allocate(rows, max(length, end)))
        lane = lanes[W]
        lane.ensure(end, min(self.sizes.get(W, (0, 0))[0], self.width))
        return lane

    def _admit(self, req: ReqT) -> None:
        raise NotImplementedError

    def _round(self, lane: Lane) -> list[Any]:
        """One round of a lane's rows; returns the rows that are done."""
        raise NotImplementedError

    @staticmethod
    def _end(req: ReqT) -> int:
        """Where a request's slot ends."""
        raise NotImplementedError

    def _leave(self, lane: Lane, done: list[Any]) -> list[tuple[int, list[int], int]]:
        """Finished rows' answers; their slots freed."""
        answers = [(r.req.key, r.answer(), r.forwards) for r in done]
        if done:
            self._drop(done[0].width, {id(r) for r in done})
        return answers

    def _allocate(self, rows: int, length: int) -> KVCache:
        """The cache's layers, heads, head size and dtype, from a one-token forward of the model itself (not
        counted); float32 where attention runs in float32 under low-precision weights (`Net.cache_of`)."""
        one = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        model: Any = getattr(self.net, "model", self.net)
        _, kv = model.hidden(one, one, None, None, 0, True)
        up = getattr(model, "upcast", False)
        k = kv[0][0]
        dtype = torch.float32 if up else k.dtype
        return KVCache.empty(len(kv), rows, k.shape[1], length, k.shape[3], dtype, self.device)


class BlockScheduler(LaneSet[RowRequest[BlockPlan]]):
    """Decodes `RowRequest`s with at most `width` rows in flight; `run` yields (key, generated ids,
    forwards) as each row finishes, in the order they finish. `refill` False runs static batches instead:
    up to `width` rows are admitted only once the running set is empty (the comparison `bench` makes).
    on_block(key, generated ids so far): called as each row's block is committed (streaming)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shadows: dict[int, Lane] = {}  # by block width: guided rows' unconditional views, their own cache
        self.recomputing: list[_Row] = []  # rows that keep no cache (LLaDA2's reference decoder), any width
        model: Any = getattr(self.net, "model", None)
        # what a packed forward passes, one per layer (None: a test's net with no packed forward)
        self.n_layers = len(model.parts()[1]) if hasattr(model, "parts") else None

    def in_flight_keys(self) -> list[int]:
        return super().in_flight_keys() + [r.req.key for r in self.recomputing]

    def _drop_in_flight(self, keys: set[int]) -> None:
        super()._drop_in_flight(keys)
        self.recomputing = [r for r in self.recomputing if r.req.key not in keys]

    def _give_back(self) -> None:
        give_back(self.lanes)
        give_back(self.shadows)

    def _drop(self, W: int, gone: set[int]) -> None:
        """Rows whose id() is in `gone` leave their lane of width W, and its shadow."""
        self.lanes[W].drop(gone)
        if W in self.shadows:
            self.shadows[W].drop(gone)

    def _admit(self, req: RowRequest[BlockPlan]) -> None:
        blocks = req.plan.blocks
        P, W = len(req.prompt), blocks.block_length
        end = self._end(req)
        x = torch.full((end,), self.mask_id, dtype=torch.long, device=self.device)
        x[:P] = torch.tensor(req.prompt, device=self.device)
        if req.rule is not None:
            req.rule.lay(x, P)  # a template's fixed tokens
        transfers = [blocks.transfers(n, m) for n, m in zip(blocks.steps_for(P), blocks.masked(P))]
        commit = replace(req.plan, blocks=_NO_BLOCKS, structure=NO_STRUCTURE)  # a row's rule comes with the row
        row = _Row(req, x, transfers, first=P // W, block=P // W, commit=commit)
        if req.plan.recomputes:  # no cache: each step recomputes its prefix (`_uncached_round`)
            self.recomputing.append(row)
            return
        views = [(self.lanes, x)]
        if row.guided:  # its unconditional view: a slot of the lane's shadow, the prompt masked
            views.append((self.shadows, row.unconditional(0, end, self.mask_id)))
        for lanes, ids in views:
            lane = self._lane(lanes, W, end)
            slot = lane.join(row, end, self.width)
            s0 = row.first * W
            if s0 > 0:  # the prompt's whole blocks, into the row's slot
                real = torch.ones(1, s0, dtype=torch.bool, device=self.device)
                pos = torch.arange(s0, device=self.device)[None]
                mask = block_mask(real, 0, s0, s0, W)
                self.net.hidden(ids[None, :s0], pos, mask, lane.cache.view(slot, s0), 0, False)
                row.forwards += 1
                self.occupancy.prefills += 1
                self.occupancy.positions += s0

    def _round(self, lane: Lane) -> list[_Row]:
        """One forward over the lane's rows, each its own window at its own place (and one over its shadow's
        unconditional views), then each stepping row's commit; returns the rows that are done."""
        rows = lane.rows
        W = rows[0].width
        h = self._forward(lane, [r.x[r.start : r.start + W] for r in rows])
        hidden = {id(r): [h[b]] for b, r in enumerate(rows)}
        shadow = self.shadows.get(W)
        if shadow is not None and shadow.rows:
            hu = self._forward(shadow, [r.unconditional(r.start, r.start + W, self.mask_id) for r in shadow.rows])
            for b, r in enumerate(shadow.rows):
                hidden[id(r)].append(hu[b])
        return self._advance(rows, hidden)

    def _uncached_round(self) -> list[tuple[int, list[int], int]]:
        """The rows with no cache: one packed forward of each one's prefix to the end of its block (`_recompute`;
        a second of the guided rows' unconditional views), then each one's commit; returns those done."""
        rows = self.recomputing
        if not rows:
            return []
        hidden: dict[int, list[torch.Tensor]] = {id(r): [] for r in rows}
        for batch, unconditional in ((rows, False), ([r for r in rows if r.guided], True)):
            if batch:
                for r, h in zip(batch, self._recompute(batch, unconditional)):
                    hidden[id(r)].append(h)
        done = self._advance(rows, hidden)
        gone = {id(r) for r in done}
        self.recomputing = [r for r in self.recomputing if id(r) not in gone]
        return [(r.req.key, r.answer(), r.forwards) for r in done]

    def _advance(self, rows: list[_Row], hidden: dict[int, list[torch.Tensor]]) -> list[_Row]:
        """After a round's forwards (each stepping row's hidden states (W, d) of its block in each view, by
        id): storing rows move on to their next block, stepping rows commit, in groups that share their
        settings and width; returns the rows that are done."""
        stepping = [r for r in rows if not r.storing]
        for r in rows:
            if r.storing:  # its block's final keys and values are in place: on to the next block
                r.storing, r.block, r.step, r.post = False, r.block + 1, 0, 0
            else:
                r.began_full = not bool((r.x[r.start : r.start + r.width] == self.mask_id).any())
        groups: dict[tuple[BlockPlan, int], list[_Row]] = {}
        for r in stepping:
            groups.setdefault((r.commit, r.width), []).append(r)
        for (plan, _), members in groups.items():
            views = 2 if plan.guidance.cfg_scale > 0 else 1
            self._commit(members, [torch.stack([hidden[id(r)][v] for r in members]) for v in range(views)], plan)
        done = []
        for r, finished in zip(stepping, self._finished(stepping)):
            r.step += 1
            W = r.width
            s, e = r.start, r.start + W
            # a block ends when nothing in it is masked, or after its own steps: a model may predict the mask
            # token itself, which commits nothing (the static decoders stop there too)
            full = not bool((r.x[s:e] == self.mask_id).any())
            steps = len(r.transfers[r.block - r.first])
            ed = r.req.plan.editing
            if ed.active:  # `block._edit_block`'s rule, per row
                live = not (r.began_full and not r.edited)  # a step that began full and edited nothing ends it
                if live and full:
                    r.post += 1
                    live = r.post <= ed.max_post_edit_steps
                # past its steps a block commits one mask a step; a model that predicts the mask token itself
                # would never fill it, so it also ends after W more (the static decoder would loop on)
                complete = not live or r.step >= steps + W + ed.max_post_edit_steps
                finished = finished and complete  # an edit may still rewrite its stop token
            else:  # a row under a constraint commits at least one token a step: its block ends full
                constrained = r.req.rule is not None and r.req.rule.constrained
                complete = full or (r.step >= steps and not constrained)
            if self.on_block is not None and (finished or complete):
                self.on_block(r.req.key, r.x[r.gen : min(e, r.gen + r.req.plan.blocks.gen_length)].tolist())
            if finished or (complete and e >= len(r.x)):
                done.append(r)
            elif complete and r.req.plan.recomputes:  # nothing to store: its next step reads the block anew
                r.block, r.step, r.post = r.block + 1, 0, 0
            elif complete:
                r.storing = True
        return done

    def _recompute(self, rows: list[_Row], unconditional: bool) -> list[torch.Tensor]:
        """The hidden states (W, d) of each row's current block, from one packed forward (`arch.packed`) of
        every row's canvas from its position 0 to the end of that block (or of its unconditional view),
        block-causal in its own blocks, each over exactly its own keys (the shapes it has alone); a net with no
        packed forward runs each row alone."""
        windows = [r.unconditional(0, r.cached, self.mask_id) if unconditional else r.x[: r.cached] for r in rows]
        for r in rows:
            r.forwards += 1
        self.occupancy.forwards += 1
        self.occupancy.rows += len(rows)
        self.occupancy.positions += sum(len(w) for w in windows)
        if self.n_layers is None:
            out = []
            for r, w in zip(rows, windows):
                real = torch.ones(1, len(w), dtype=torch.bool, device=self.device)
                pos = torch.arange(len(w), device=self.device)[None]
                mask = block_mask(real, 0, len(w), len(w), r.width)
                out.append(self.net.hidden(w[None], pos, mask, keep_kv=False)[0][0, r.start :])
            return out
        h, segments = packed_hidden(self.net, windows, [r.width for r in rows], self.n_layers, self.device)
        return [h[s.end - r.width : s.end] for r, s in zip(rows, segments)]

    def _forward(self, lane: Lane, windows: list[torch.Tensor]) -> torch.Tensor:
        """One forward over a lane's rows (these ids: each its block-wide window at its own place), over
        the lane's cache; returns the hidden states (n, W, d)."""
        rows, n = lane.rows, len(lane.rows)
        W = rows[0].width
        starts = torch.tensor([r.start for r in rows], device=self.device)
        L = int(starts.max()) + W
        lane.ensure(L)
        positions = starts[:, None] + torch.arange(W, device=self.device)[None, :]
        key_mask = (torch.arange(L, device=self.device)[None, :] < (starts + W)[:, None])[:, None, None, :]
        cache = lane.cache.view(slice(0, n), L, exact=True)  # a row's attention over its own keys only
        h, _ = self.net.hidden(torch.stack(windows), positions, key_mask, cache, starts, False)
        self.occupancy.forwards += 1
        self.occupancy.rows += n
        self.occupancy.positions += n * W
        for r in rows:
            r.forwards += 1
        return h

    def _commit(self, rows: list[_Row], hs: list[torch.Tensor], plan: BlockPlan) -> None:
        """commit_step for rows sharing their settings and width, on their own blocks (b, W), from their
        hidden states in each view (under guidance, the unconditional view's too)."""
        W = rows[0].width
        block = torch.stack([r.x[r.start : r.start + W] for r in rows])
        k = torch.tensor([_transfer(r) for r in rows], dtype=torch.long, device=self.device)
        draws = Draws([stream_seed(r.req.seed, r.block, r.step) for r in rows], self.device)
        answer = self._answer(rows, plan)
        rules = [r.req.rule for r in rows]
        offsets = [r.start - r.gen for r in rows]
        args = (self.mask_id, draws, answer, self.stop, self.pieces, rules, offsets)
        out = commit_step(block, hs, self.net, plan, k, *args)
        if plan.editing.active:  # LLaDA2.1: from the same forward, rewrite decided answer tokens the model doubts
            p, x0 = top_choice(self.net, hs[0])
            cols = torch.stack([torch.arange(r.start, r.start + W, device=self.device) for r in rows])
            answer_pos = cols >= torch.tensor([r.gen for r in rows], device=self.device)[:, None]
            edit = (block != self.mask_id) & answer_pos & (x0 != block) & (p > plan.editing.edit_threshold)
            out[edit] = x0[edit]
            for r, e in zip(rows, edit.any(1).tolist()):
                r.edited = e
        for r, new in zip(rows, out):
            r.x[r.start : r.start + W] = new

    def _answer(self, rows: list[_Row], plan: BlockPlan) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """`block._answer` for rows at their own places: each row's answer so far (masks elsewhere, padded
        with masks to the longest) and the answer position of its block's first column."""
        if not plan.shaping.active:
            return None
        offset = torch.tensor([r.start - r.gen for r in rows], device=self.device)
        if plan.shaping.presence_penalty == 0:
            return None, offset
        e = max(r.start + r.width for r in rows)
        answer = torch.full((len(rows), e), self.mask_id, dtype=torch.long, device=self.device)
        for b, r in enumerate(rows):
            answer[b, r.gen : r.start + r.width] = r.x[r.gen : r.start + r.width]
        return answer, offset

    def _finished(self, rows: list[_Row]) -> list[bool]:
        """For each row: a stop token committed in its answer up to its block's end, with nothing masked
        before it (`reference.finished_rows`, on the answers padded with masks after their ends)."""
        if not rows:
            return []
        spans = [(r.gen, r.start + r.width) for r in rows]
        gen = torch.full((len(rows), max(e - g for g, e in spans)), self.mask_id, device=self.device)
        for b, (r, (g, e)) in enumerate(zip(rows, spans)):
            gen[b, : e - g] = r.x[g:e]
        done, _ = finished_rows(gen, self.mask_id, self.stop)
        return done.tolist()

    # -- bookkeeping ---------------------------------------------------------------------------------
    @staticmethod
    def _end(req: RowRequest[BlockPlan]) -> int:
        """The end of a request's slot: its last block's (`_aligned_end`)."""
        return _aligned_end(req)


def _aligned_end(req: RowRequest[BlockPlan]) -> int:
    """The end of a request's last block: its canvas, block-aligned."""
    W = req.plan.blocks.block_length
    return -(-(len(req.prompt) + req.plan.blocks.gen_length) // W) * W


def _transfer(r: _Row) -> int:
    """The tokens this step of the row's block commits by schedule (`Blocks.transfers`); past its steps
    (token editing goes on), one."""
    steps = r.transfers[r.block - r.first]
    return steps[r.step] if r.step < len(steps) else 1


# commit_step reads every part of a plan but its blocks: rows group by the rest (their width apart)
_NO_BLOCKS = Blocks(gen_length=0, block_length=0, block_steps=0, denoise_steps=0, steps_total=False)


@torch.no_grad()
def generate_block(
    net: BlockNet,
    prompt: torch.Tensor,
    prompt_mask: torch.Tensor,
    plan: BlockPlan,
    mask_id: int,
    stop_ids: frozenset[int],
    noise: RowNoise,
    word_pieces: frozenset[int] = frozenset(),
    on_block: OnBlock | None = None,
    rules: Rules | None = None,
) -> torch.Tensor:
    """Block decoding as the running set with every row admitted at once: LLaDA2's reference decoder for a
    `block.ReferenceBlockPlan` (every step recomputes the row's prefix), over an exact cache for a `BlockPlan`
    (`block-fast`). prompt: (B, P) left-padded; returns (B, P +
    gen_length), masks after a row's stop. word_pieces: the tokenizer's pieces that continue a word (for
    subword_min_p). rules: each row's constraint and log-probability record (`structured.commit`); a row under
    a constraint commits at least one token a step until its block is full. on_block(row, generated ids so
    far) as each row's block is committed."""
    rows = BlockScheduler(net, mask_id, stop_ids, mask_id, len(prompt), prompt.device, word_pieces, on_block=on_block)
    return admitted_at_once(rows, prompt, prompt_mask, plan, mask_id, noise, rules)
