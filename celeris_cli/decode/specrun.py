"""The running set of self-speculative decoding (`spec`): rows that decode left to right exactly, drafting by
diffusion where it pays, admitted as others finish so the batch stays full.

A row joins with its prompt prefilled causally into a slot of its lane's cache (the rows joining a lane in
one round in one packed forward, each over exactly its own prompt), its first token the AR mode's; then
every round runs one forward per lane over all its rows, each at its own place: its AR step, or its
verify-and-draft columns (`selfspec.SpecRows.round`, the very round a static batch runs). A row is handed
back the round it finishes; it leaves its slot at once if a request is waiting for one (which joins at the
next round), else once a quarter of its lane has finished (leaving copies slots).

Rows of one lane share their drafting policy; their sampler, shaping, answer length and draft width are each
row's own (a drafting round pads its rows to the widest's masks, and every canvas has room for it); rows of
another policy run in a lane of their own, a forward each per round, and a lane whose rows have all left gives
its cache back. Each lane keeps its `Pace`: whether a round drafts is decided from the rows in flight in it
then, with the engine's calibrated cost of a forward (`decode.pace`) and the tokens drafting has yielded so
far. The choice changes how many forwards a row takes, never its tokens: a row's answer is its AR answer,
drawn from its own stream (`request_seed`) at its own answer positions, whoever runs beside it and whenever
it was admitted.

Decided tokens never change, so a row streams: `on_block` sees its answer so far after every round that
added to it (what `serve` sends as events), and its whole answer as it leaves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .block import OnBlock
from .pace import ForwardCost, Learned, Pace
from .runset import RowRequest, RunningSet
from .sampling import RowNoise
from .selfspec import Joining, SelfSpecPlan, SpecRows


def _lane_key(plan: SelfSpecPlan) -> tuple[Any, ...]:
    """What rows of one lane share: their drafting policy (whose `Pace` decides a round for all of them). Their
    sampler, shaping, answer length and draft width are each row's own: every row's forward has one shape."""
    return (plan.drafting.drafting,)


class SpecScheduler(RunningSet[RowRequest[SelfSpecPlan]]):
    """Decodes `RowRequest`s with at most `width` rows in flight; `run` yields (key, generated ids,
    forwards) as each row finishes. `refill` False runs static batches instead (rows admitted only when
    none is in flight). `cost`: the forward's cost model the lanes' "auto" choice weighs (calibrated from the
    network on a lane's first round if not given)."""

    def __init__(
        self,
        net: Any,
        mask_id: int,
        stop_ids: frozenset[int],
        width: int,
        device: torch.device,
        word_pieces: frozenset[int] = frozenset(),
        refill: bool = True,
        before_round: Callable[[], None] | None = None,
        cost: ForwardCost | None = None,
        on_block: OnBlock | None = None,
        learned: Callable[[SelfSpecPlan], Learned] | None = None,
    ) -> None:
        super().__init__(width, device, word_pieces, refill, before_round)
        self.net, self.mask_id, self.cost, self.on_block = net, mask_id, cost, on_block
        self.learned = learned  # what drafting has yielded at a lane's width and sampler (`Engine.learned`)
        self.stop = torch.tensor(sorted(stop_ids), device=device, dtype=torch.long)
        self.noise = RowNoise([], device)  # stream i: the i-th row admitted, its seed kept while it is in flight
        self.admitted = 0
        self.lanes: dict[tuple[Any, ...], SpecRows] = {}
        self.key_of: dict[int, int] = {}  # stream -> the caller's key
        # by lane: (slots, canvas length) its cache wants, and the longest prompt and answer and widest draft
        self.sizes: dict[tuple[Any, ...], tuple[int, int, int, int]] = {}

    def reserve(self, requests: list[RowRequest[SelfSpecPlan]]) -> None:
        # each lane's cache, allocated at its first row: as many slots as rows can run at once, as long as the
        # longest canvas (growing it on the way would copy it, and hold the old and the new at once)
        for r in requests:
            key = _lane_key(r.plan)
            rows, length, answer, wide = self.sizes.get(key, (0, 0, 0, 0))
            answer, wide = max(answer, len(r.prompt) + r.gen_length), max(wide, r.plan.drafting.width)
            self.sizes[key] = (min(rows + 1, self.width), answer + 2 * wide, answer, wide)

    def in_flight_keys(self) -> list[int]:
        return [self.key_of[s] for lane in self.lanes.values() for s in lane.idx.tolist() if s in self.key_of]

    def _drop_in_flight(self, keys: set[int]) -> None:
        for lane in self.lanes.values():
            streams = lane.idx.tolist()
            gone = [s for s in streams if s in self.key_of and self.key_of[s] in keys]
            if gone:
                self._forget(gone)
                lane.drop(torch.tensor([s in self.key_of for s in streams], dtype=torch.bool, device=self.device))

    def _forget(self, streams: list[int]) -> None:
        for s in streams:
            del self.key_of[s]

    @torch.no_grad()  # the weights may require grad: no graph may chain through the cache
    def one_round(self) -> list[tuple[int, list[int], int]]:
        joining: dict[tuple[Any, ...], list[RowRequest[SelfSpecPlan]]] = {}
        for req in self.admit():
            joining.setdefault(_lane_key(req.plan), []).append(req)
        for key, reqs in joining.items():
            self._admit(key, reqs)
        answers = []
        for lane in list(self.lanes.values()):
            answers += self._leave(lane)  # rows done at their first token never take a round
            if len(lane.idx):
                b, before = len(lane.idx), lane.seed_at
                self.occupancy.positions += lane.round()
                self.occupancy.forwards += 1
                self.occupancy.rows += b
                if self.on_block is not None:
                    self._report(lane, (lane.seed_at > before) & lane.live)
                answers += self._leave(lane)
        return answers

    def settle(self) -> None:
        for key, lane in list(self.lanes.items()):  # rows handed back and still in their lane leave now
            if not bool(lane.live.all()):
                lane.drop(lane.live.clone())
            if not len(lane.idx):
                del self.lanes[key]

    def _admit(self, key: tuple[Any, ...], reqs: list[RowRequest[SelfSpecPlan]]) -> None:
        """Rows of one lane that join this round, prefilled together (`SpecRows.join`)."""
        if key not in self.lanes:
            plan = reqs[0].plan
            policy = plan.drafting.drafting
            learned = self.learned(plan) if self.learned is not None else None
            pace = Pace(policy, plan.drafting.width, self.cost if policy == "auto" else None, self.net, learned)
            self.lanes[key] = SpecRows(self.net, plan, self.mask_id, self.stop, self.noise, pace)
        lane = self.lanes[key]
        lane.pieces = self.pieces
        if not bool(lane.live.all()):  # finished rows riding along leave first: no slot is added past them
            lane.drop(lane.live.clone())
        joining = []
        for req in reqs:
            stream = self.admitted
            self.admitted += 1
            self.noise.seeds[stream] = req.seed
            self.key_of[stream] = req.key
            plan = req.plan
            joining.append(
                Joining(req.prompt, stream, req.rule, req.gen_length, plan.drafting.width, plan.sampling, plan.shaping)
            )
        # rows of one prompt length side by side: their prefill attention is one call (`arch.packed` groups)
        joining.sort(key=lambda j: len(j.prompt))
        slots, length, _, _ = self.sizes.get(key, (1, 0, 0, 0))
        lane.join(joining, self.width, (min(slots, self.width), length))
        self.occupancy.prefills += 1
        self.occupancy.positions += sum(len(r.prompt) for r in reqs)

    def _report(self, lane: SpecRows, moved: torch.Tensor) -> None:
        """`on_block` with each row's decided answer so far, for the rows still decoding whose answer grew this
        round (a finished row's whole answer comes back as it leaves)."""
        assert self.on_block is not None
        for i in moved.nonzero().flatten().tolist():
            lo, hi = int(lane.ans[i]), int(lane.seed_at[i]) + 1
            self.on_block(self.key_of[int(lane.idx[i])], lane.x[i, lo:hi].tolist())

    def _leave(self, lane: SpecRows) -> list[tuple[int, list[int], int]]:
        """The lane's finished rows' answers. They leave the lane (freeing their slots, each later row's moving
        down) when a request is waiting for a place or a quarter of the lane has finished; till then they ride
        along, taking nothing (leaving copies slots: not one row at a time)."""
        dead = (~lane.live).nonzero().flatten().tolist()
        done = [i for i in dead if int(lane.idx[i]) in self.key_of]  # not yet handed back
        answers = [(self.key_of[int(lane.idx[i])], lane.answer(i), int(lane.forwards[i])) for i in done]
        if self.on_block is not None:
            for key, ids, _ in answers:
                self.on_block(key, ids)
        self._forget([int(lane.idx[i]) for i in done])
        if dead and (self.waiting or 4 * len(dead) >= len(lane.idx)):
            lane.drop(lane.live.clone())
        for name, empty in list(self.lanes.items()):  # a lane whose rows have all left gives its cache back at once
            if not len(empty.idx):
                del self.lanes[name]
        return answers
