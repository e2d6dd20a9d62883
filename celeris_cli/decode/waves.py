"""Continuous batching for bidirectional models (LLaDA, celeris-tiny: the `fast` strategy): a running set
that admits a waiting request whenever a row leaves, with every row at its own block and step.

The fast decoder's cache is exact only within one block: each block starts with a full-canvas forward that
refreshes every key and value (attention is bidirectional, so a later block's cache is not an extension of
an earlier one), and the block's later steps recompute only the block (`dual`) or the block and the
suffix (`prefix`) against that cache. So a row's cache is its own and lives for one block: the rule for
joining is that a row joins, and moves to its next block, with a refresh forward of its own canvas.

Each tick advances every row by one step, in one forward of every row in flight laid end to end
(`arch.packed`: no padding, whatever the rows' widths and places):
- a row starting a block (just admitted, or done with its last one) takes its refresh: its canvas from
  column 0 as it would be alone, its keys and values written into a slot of its lane (cache mode and block
  width) as the forward runs;
- a row in a lane takes its step: its window at its own block (`dual`: the block; `prefix`: the block and
  what it sees past it), over its own slot of the lane's cache, its fresh keys and values written there;
- every row then commits, per group of rows sharing their settings; a row whose block is done leaves its
  lane for the next tick's refreshes, a finished row (early exit, or its last block) is handed back, and
  its place goes to the next waiting request at once.
Rows with different samplers, thresholds, shaping, steps, lengths, block widths, cache modes and guidance
share the running set: a guided row's unconditional view (its prompt masked) is a second segment of its own
in every tick, with a slot in a lane of its own (view 1), as `generate_fast` runs its second view.

A row's forwards are those it would take alone, its attention over exactly its own keys (SDPA's float32
result for a row changes with the number of keys even where the extra ones are masked), so its answer does
not depend on its batch mates in float32, and bit for bit with `deterministic` on. Its noise comes from its
own stream at its own (block, step), as in `generate_fast`. `refill=False` gives static batches through
the same loop, for `bench workload mixed`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..arch.kv import DeferredKVCache, KVCache
from ..arch.packed import Segment, packed_layers
from .fast import FastPlan, commit_step
from .reference import finished_rows, num_transfer_tokens
from .runset import Lane, RowRequest, RunningSet, give_back
from .sampling import Draws, shaper, stream_seed
from .strategies import Net


@dataclass
class _Row:
    req: RowRequest[FastPlan]
    x: torch.Tensor  # (P + G,) the row's canvas: prompt, then its answer
    mask: int  # the mask token's id
    block: int = 0  # index into its schedule's blocks
    step: int = 0  # within the block
    forwards: int = 0
    schedule: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # this block's
    spans: list[tuple[int, int]] = field(default_factory=list)  # each block's columns in the canvas

    def __post_init__(self) -> None:
        self.P = len(self.req.prompt)
        self.spans = [(self.P + bs, self.P + be) for bs, be in self.req.plan.schedule.block_spans]

    @property
    def span(self) -> tuple[int, int]:
        """The active block's columns in the row's canvas."""
        return self.spans[self.block]

    @property
    def steps(self) -> int:
        return self.req.plan.schedule.steps_per_block[self.block]

    @property
    def width(self) -> int:
        """How much of its canvas the model sees: all of it, or up to `suffix_window` past the block."""
        window = self.req.plan.parallel.suffix_window
        return len(self.x) if window == 0 else min(len(self.x), self.span[1] + window)

    @property
    def cached(self) -> int:
        """The positions of its lane slot that hold its keys and values (its refresh's)."""
        return self.width

    @property
    def mode(self) -> str:
        return self.req.plan.parallel.cache

    def lane(self, view: int) -> tuple[str, int, int]:
        """The lane of one of its views: cache mode, block width, view (0: its canvas; 1: guidance's
        unconditional view, its prompt masked)."""
        s, e = self.span
        return self.mode, e - s, view

    @property
    def views(self) -> range:
        """Its views: its canvas, and under guidance the unconditional one (each a slot of its own)."""
        return range(2 if self.req.plan.guidance.cfg_scale > 0 else 1)

    def canvas(self, view: int) -> torch.Tensor:
        """The canvas one of its views shows the model: its own, or with the prompt masked (view 1)."""
        if view == 0:
            return self.x
        un = self.x.clone()
        un[: self.P] = self.mask
        return un

    @property
    def commit(self) -> tuple[Any, ...]:
        """What its commit step reads besides its block (rows sharing it commit together)."""
        p = self.req.plan
        return p.sampling, p.ordering, p.parallel, p.shaping, p.guidance, self.span[1] - self.span[0]

    @property
    def last_block(self) -> bool:
        return self.block == len(self.spans) - 1


@dataclass
class _Stepped:
    """A row's part of this tick: its block as the forward saw it and the hidden states of its masked
    positions (the LM head's input)."""

    row: _Row
    block: torch.Tensor  # (T,)
    hidden: list[torch.Tensor]  # per view: (masked, d)


class WaveScheduler(RunningSet[RowRequest[FastPlan]]):
    """Decodes `RowRequest`s with at most `width` rows in flight; `run` yields (key, generated ids,
    forwards taken part in) as each row finishes. `add` feeds it while it runs (`Engine.live`: the queue,
    `celeris batch` and serve)."""

    def __init__(
        self,
        net: Net,
        mask_id: int,
        stop_ids: frozenset[int],
        width: int,
        device: torch.device,
        word_pieces: frozenset[int] = frozenset(),
        refill: bool = True,
        before_round: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(width, device, word_pieces, refill, before_round)
        self.net = net
        self.mask_id = mask_id
        self.stop = torch.tensor(sorted(stop_ids), device=device, dtype=torch.long)
        self.lanes: dict[tuple[str, int, int], Lane] = {}  # by cache mode, block width and view
        self.fresh: list[_Row] = []  # rows whose block starts next tick (a refresh forward), or with no cache
        model: Any = getattr(net, "model", net)
        self.n_layers = len(model.parts()[1])  # what a packed forward passes, one per layer

    def in_flight_keys(self) -> list[int]:
        """Rows admitted and not yet handed back."""
        held = [r.req.key for key, lane in self.lanes.items() if key[2] == 0 for r in lane.rows]
        return [r.req.key for r in self.fresh] + held

    def _drop_in_flight(self, keys: set[int]) -> None:
        self.fresh = [r for r in self.fresh if r.req.key not in keys]
        for lane in self.lanes.values():
            lane.drop({id(r) for r in lane.rows if r.req.key in keys})

    @torch.no_grad()  # the weights may require grad: no graph may chain through the caches
    def one_round(self) -> list[tuple[int, list[int], int]]:
        joining = self.admit()  # (it may drop rows cancelled meanwhile: `fresh` is replaced then)
        self.fresh.extend(self._admit(req) for req in joining)
        if not self.in_flight:  # the last rows in flight were dropped, and none waits
            return []
        stepped = self._tick(self.fresh)
        self._commit(stepped)
        self.fresh = []  # those starting a block this tick are in their lanes now, or stepped without one
        answers = []
        for r, outcome in self._advance([part.row for part in stepped]):
            if outcome in ("next", "again"):
                self.fresh.append(r)
            else:
                answers.append((r.req.key, r.x[r.P :].tolist(), r.forwards))
        return answers

    def settle(self) -> None:
        # every cache back once no row is in flight (not between rounds: a row moving to its next block leaves its
        # lane and joins it again in the next forward, so a lane empty between rounds is about to be used)
        give_back(self.lanes)

    def _admit(self, req: RowRequest[FastPlan]) -> _Row:
        G = req.plan.schedule.gen_length
        x = torch.full((len(req.prompt) + G,), self.mask_id, dtype=torch.long, device=self.device)
        x[: len(req.prompt)] = torch.tensor(req.prompt, dtype=torch.long, device=self.device)
        if req.rule is not None:
            req.rule.lay(x, len(req.prompt))  # a template's fixed tokens
        return _Row(req, x, self.mask_id)

    # -- the forward -------------------------------------------------------------------------------
    def _tick(self, fresh: list[_Row]) -> list[_Stepped]:
        """One forward for every row in flight, laid end to end (`arch.packed`): each lane row's window at
        its own block over its own slot of the lane's cache (the block, `dual`, or the block and what it sees
        past it, `prefix`), recomputed against the block's cache; and each row starting a block, its whole
        canvas from column 0, whose keys and values fill a slot of its lane as the forward runs (cache mode
        `none`: over its own fresh keys only, every step)."""
        shift = self.net.shift
        segments: list[Segment] = []
        ids: list[torch.Tensor] = []
        at: list[int] = []  # each segment's canvas position of its first token
        seen: list[tuple[_Row, int]] = []  # each segment's row and view
        for (_, _, view), lane in self.lanes.items():
            if lane.rows:
                lane.ensure(max(r.width for r in lane.rows))
            for slot, r in enumerate(lane.rows):
                start = r.span[0] - shift
                end = r.span[1] if r.mode == "dual" else r.width  # dual: the suffix's keys stay the cache's
                seen.append((r, view))
                at.append(start)
                segments.append(self._segment(segments, end - start, lane.cache, slot, start, r.width))
                ids.append(r.canvas(view)[start:end])
        for r in fresh:
            if r.step == 0:
                T = r.span[1] - r.span[0]
                r.schedule = num_transfer_tokens(torch.tensor([T], device=self.device), r.steps)[0]
            for view in r.views:
                if r.mode == "none":
                    segments.append(self._segment(segments, r.width))
                else:
                    lane = self._lane(r, view)
                    slot = lane.join(r, r.width, self.width)  # slots added here as the set widens
                    segments.append(self._segment(segments, r.width, lane.cache, slot, 0, r.width))
                seen.append((r, view))
                at.append(0)
                ids.append(r.canvas(view)[: r.width])
        N = segments[-1].end
        positions = torch.cat([torch.arange(a, a + len(t), device=self.device) for a, t in zip(at, ids)])
        cache = packed_layers(segments, self.n_layers, self.device)
        h, _ = self.net.hidden(torch.cat(ids)[None], positions[None], None, cache, 0, False)
        self.occupancy.forwards += 1
        self.occupancy.rows += len({id(r) for r, _ in seen})
        self.occupancy.positions += N
        picks = []
        for r in {id(r): r for r, _ in seen}.values():  # one packed forward, whatever the row's views
            r.forwards += 1
        for (r, _), seg, a in zip(seen, segments, at):
            s, e = r.span
            lo = seg.begin + s - shift - a  # the hidden state predicting the block's first column
            picks.append(torch.arange(lo, lo + e - s, device=self.device)[r.x[s:e] == self.mask_id])
        parts = h[0, torch.cat(picks)].split([len(p) for p in picks])
        views: dict[int, tuple[_Row, dict[int, torch.Tensor]]] = {}  # each row's hidden states by view
        for (r, view), part in zip(seen, parts):
            views.setdefault(id(r), (r, {}))[1][view] = part
        stepped = []
        for r, by_view in views.values():
            s, e = r.span
            stepped.append(_Stepped(r, r.x[s:e].clone(), [by_view[v] for v in r.views]))
        return stepped

    @staticmethod
    def _segment(
        segments: list[Segment], length: int, cache: KVCache | None = None, slot: int = 0, at: int = 0, keys: int = 0
    ) -> Segment:
        begin = segments[-1].end if segments else 0
        return Segment(begin, begin + length, cache, slot, at, keys)

    def _lane(self, r: _Row, view: int) -> Lane:
        key = r.lane(view)
        if key not in self.lanes:
            # its layout comes with the first keys written into it: no forward runs only to find it out
            self.lanes[key] = Lane(DeferredKVCache(self.width, max(r.width, 64)))
        return self.lanes[key]

    # -- commits -------------------------------------------------------------------------------------
    def _commit(self, stepped: list[_Stepped]) -> None:
        """The fast decoder's commit step (`fast.commit_step`) for every row that took a step, per group sharing
        its settings."""
        groups: dict[tuple[Any, ...], list[_Stepped]] = {}
        for part in stepped:
            groups.setdefault(part.row.commit, []).append(part)
        for parts in groups.values():
            rows = [p.row for p in parts]
            plan = rows[0].req.plan
            block = torch.stack([p.block for p in parts])
            shape = None
            if plan.shaping.active:
                t = plan.sampling.temperature
                shape = shaper(plan.shaping, *self._answer(rows), self.mask_id, self.stop, t, self.pieces)
            draws = Draws([stream_seed(r.req.seed, r.block, r.step) for r in rows], self.device)
            # past its steps (a row under a constraint, its block not yet full) a row commits one token a step
            k = torch.stack([r.schedule[r.step] if r.step < len(r.schedule) else r.schedule.new_ones(()) for r in rows])
            hidden = [torch.cat([p.hidden[v] for p in parts]) for v in rows[0].views]
            rules = [r.req.rule for r in rows]
            offsets = [r.span[0] - r.P for r in rows]
            new = commit_step(block, hidden, self.net, plan, k, self.mask_id, draws, shape, rules, offsets)
            for r, row_block in zip(rows, new):
                s, e = r.span
                r.x[s:e] = row_block

    def _answer(self, rows: list[_Row]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's answer so far (padded with masks to the longest) and its block's first answer position."""
        G = max(r.req.plan.schedule.gen_length for r in rows)
        answer = torch.full((len(rows), G), self.mask_id, dtype=torch.long, device=self.device)
        for b, r in enumerate(rows):
            answer[b, : len(r.x) - r.P] = r.x[r.P :]
        offset = torch.tensor([r.span[0] - r.P for r in rows], device=self.device)
        return answer, offset

    # -- after the commits ---------------------------------------------------------------------------
    def _advance(self, rows: list[_Row]) -> Iterator[tuple[_Row, str]]:
        """Each row that stepped: "done" (finished early, or its last block is), "next" (on to its next
        block, refreshed next tick), "again" (no cache: its next step is a full forward too), or nothing
        (its block goes on, in its lane)."""
        finished = self._finished(rows)
        gone: dict[tuple[str, int, int], set[int]] = {}
        for r, done in zip(rows, finished):
            r.step += 1
            s, e = r.span
            # a block ends with no masks left or after its steps (a model may predict the mask token itself,
            # which commits nothing; the static decoder's blocks end after their steps too)
            # (a row under a constraint commits at least one token a step: its block ends full)
            constrained = r.req.rule is not None and r.req.rule.constrained
            over = r.step >= r.steps and not constrained
            complete = done or over or not bool((r.x[s:e] == self.mask_id).any())
            if not complete:
                if r.mode == "none":  # no cache to step against: its next step is a full forward again
                    yield r, "again"
                continue
            if r.mode != "none":
                for view in r.views:
                    gone.setdefault(r.lane(view), set()).add(id(r))
            if done:
                self._fill(r)
                yield r, "done"
            elif r.last_block:
                yield r, "done"
            else:
                r.block, r.step = r.block + 1, 0
                yield r, "next"
        for key, ids in gone.items():
            self.lanes[key].drop(ids)

    def _finished(self, rows: list[_Row]) -> list[bool]:
        """For each row with early exit: its answer up to its block's end holds a stop token with nothing
        masked before it (`reference.finished_rows`, on the answers padded with masks)."""
        check = [b for b, r in enumerate(rows) if r.req.plan.parallel.early_exit]
        out = [False] * len(rows)
        if not check:
            return out
        spans = [(rows[b].P, rows[b].span[1]) for b in check]
        gen = torch.full((len(check), max(e - p for p, e in spans)), self.mask_id, dtype=torch.long, device=self.device)
        for i, (b, (p, e)) in enumerate(zip(check, spans)):
            gen[i, : e - p] = rows[b].x[p:e]
        done, _ = finished_rows(gen, self.mask_id, self.stop)
        for b, d in zip(check, done.tolist()):
            out[b] = d
        return out

    def _fill(self, r: _Row) -> None:
        """A finished row's remaining masks from its block on take its first stop token
        (`reference.leave_when_finished`)."""
        s, e = r.span
        gen = r.x[r.P : e]
        _, first_stop = finished_rows(gen[None], self.mask_id, self.stop)
        fill = gen[int(first_stop.clamp_max(e - r.P - 1))]
        r.x[s:] = torch.where(r.x[s:] == self.mask_id, fill, r.x[s:])
