"""The running set of the whole-canvas samplers (LLaDA's reference decoder and Dream's and RND1's own:
`decode.reference`, `decode.dream`, `decode.rnd1`): rows admitted as others finish, each at its own step, so
the batch stays full while answers of every length and schedule run through it.

These samplers keep no cache: every step recomputes a row's whole canvas (its prompt and its answer so far,
attention both ways) and reads the hidden states at the answer positions it decides from. So a row needs
nothing but its canvas to join or to leave, and a round is one packed forward (`arch.packed`; under guidance
a second of the unconditional views) of every row in flight, each over exactly its own canvas from position
0 (its attention over its own keys only, the shapes it has alone), followed by each row's own step
(`WholeRow.step`: its family's rule, drawing from the row's own stream at its own step). Nothing is padded
and no row reads another's numbers, so a row's answer is the one it gets alone, whoever runs beside it and
whenever it joined (bit for bit under `deterministic`, whose linear layers tile their rows: otherwise a
matmul's float32 rounding may change with its number of rows). `generate_reference`, `generate_dream` and
`generate_rnd1` are this set with every row admitted at once: the samplers have this one copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..arch.packed import packed_hidden
from .runset import RowRequest, RunningSet, admitted_at_once
from .sampling import RowNoise


class WholeRow(Protocol):
    """One row of a whole-canvas sampler: its canvas (its prompt, then its answer) and its step."""

    canvas: torch.Tensor  # (P + N,) ids
    prompt: int  # P

    def views(self) -> list[torch.Tensor]:
        """The canvases its next step reads a forward of: its canvas, and under guidance its unconditional
        view (each (P + N,))."""
        ...

    def wanted(self) -> torch.Tensor:
        """(N,) bool: the answer positions whose hidden states its next step reads (none: its step needs no
        forward)."""
        ...

    def step(self, hs: list[torch.Tensor], net: Any) -> bool:
        """Its step, from the hidden states (n, d) predicting its `wanted` positions in each view; True when
        its answer is done."""
        ...


class WholePlan(Protocol):
    """A whole-canvas sampler's settings (`DreamPlan`, `RND1Plan`): how long its answer is, how many forwards
    it takes at most, and its row."""

    @property
    def gen_length(self) -> int: ...

    @property
    def forwards(self) -> int: ...

    def row(self, prompt: torch.Tensor, noise: RowNoise, tokens: Tokens) -> WholeRow: ...


@dataclass(frozen=True)
class Tokens:
    """The ids a row's canvas and step need: the mask, the pad (RND1's last position) and the stop ids a row
    leaves at (empty: every row runs to its last step, as the families' own code does)."""

    mask_id: int
    pad_id: int
    stop: torch.Tensor


@dataclass
class _Running:
    key: int
    row: WholeRow
    forwards: int = 0


class WholeScheduler(RunningSet[RowRequest[WholePlan]]):
    """Decodes `RowRequest`s with at most `width` rows in flight; `run` yields (key, answer ids, forwards)
    as each row finishes. `refill` False runs static batches instead (rows admitted only when none is in
    flight). `stop_ids`: a row whose answer holds a stop token with no mask before it leaves at once, the rest
    of its answer that token (only the reference decoder honours it: `generate_reference`'s measurement). A net
    with no packed forward (a test's `FullLogits`) runs each row's views alone."""

    def __init__(
        self,
        net: Any,
        mask_id: int,
        pad_id: int,
        width: int,
        device: torch.device,
        refill: bool = True,
        before_round: Callable[[], None] | None = None,
        stop_ids: frozenset[int] = frozenset(),
    ) -> None:
        super().__init__(width, device, frozenset(), refill, before_round)
        self.net = net
        stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
        self.tokens = Tokens(mask_id, pad_id, stop)
        model: Any = getattr(net, "model", None)
        # what a packed forward passes, one per layer (None: no packed forward)
        self.n_layers = len(model.parts()[1]) if hasattr(model, "parts") else None
        self.rows: list[_Running] = []

    def rounds(self, request: RowRequest[WholePlan]) -> int:
        """Its forwards at most (its steps): what admission orders by."""
        return request.plan.forwards

    def in_flight_keys(self) -> list[int]:
        return [r.key for r in self.rows]

    def _drop_in_flight(self, keys: set[int]) -> None:
        self.rows = [r for r in self.rows if r.key not in keys]

    def one_round(self) -> list[tuple[int, list[int], int]]:
        for req in self.admit():
            noise = RowNoise([req.seed], self.device)
            prompt = torch.tensor(req.prompt, dtype=torch.long, device=self.device)
            self.rows.append(_Running(req.key, req.plan.row(prompt, noise, self.tokens)))
        done = self._round()
        self.rows = [r for r in self.rows if id(r) not in done]
        return [(r.key, r.row.canvas[r.row.prompt :].tolist(), r.forwards) for r in done.values()]

    def _round(self) -> dict[int, _Running]:
        """Every row's step, after the forwards of the rows that read one: one packed forward of their
        canvases, and under guidance a second of their unconditional views (each view a forward of its own, as
        this project counts guidance: docs/settings.md); returns the rows done (by id)."""
        wanted = [(r, r.row.wanted().nonzero().flatten()) for r in self.rows]
        computed = [(r, at, r.row.views()) for r, at in wanted if len(at)]
        hidden: dict[int, list[torch.Tensor]] = {id(r): [] for r, _ in wanted}
        forward = self._packed if self.n_layers is not None else self._padded
        for v in range(max((len(views) for _, _, views in computed), default=0)):
            batch = [(r, at, views[v]) for r, at, views in computed if len(views) > v]
            for (r, _, _), h in zip(batch, forward(batch)):
                hidden[id(r)].append(h)
                r.forwards += 1
            self.occupancy.forwards += 1
            self.occupancy.rows += len(batch)
            self.occupancy.positions += sum(len(c) for _, _, c in batch)
        done: dict[int, _Running] = {}
        for group, positions in self._head_groups([(r, len(at)) for r, at in wanted]):
            for r, hs, net in self._heads(group, positions, hidden):
                if r.row.step(hs, net):
                    done[id(r)] = r
        return done

    def _head_groups(self, rows: list[tuple[_Running, int]]) -> Iterator[tuple[list[_Running], int]]:
        """The rows in order, in groups of at most `net.chunk` predicted positions (a larger row alone), each
        with its positions: the rows whose LM head one call computes."""
        chunk = getattr(self.net, "chunk", 0)
        group: list[_Running] = []
        held = 0
        for r, n in rows:
            if group and held + n > chunk:
                yield group, held
                group, held = [], 0
            group.append(r)
            held += n
        if group:
            yield group, held

    def _heads(
        self, group: list[_Running], positions: int, hidden: dict[int, list[torch.Tensor]]
    ) -> list[tuple[_Running, list[torch.Tensor], Any]]:
        """Each row of `group` with what its step reads and the net it reads it through: the logits of its
        predicted positions in each view from one head call for the whole group, through a head that takes
        them as they are (`_Applied`). A row of more positions than a chunk (alone in its group), or a net
        with no step head, reads its hidden states through the net itself, whose step computes the head a
        chunk at a time: no step holds the logits of more than a chunk. One call for many rows instead of one
        each: a row's few last masked positions no longer cost a head call of their own (under
        `deterministic`, each row's logits are the same bit for bit in any group: `invariant.linear`)."""
        if not hasattr(self.net, "step_head") or positions > self.net.chunk:
            return [(r, hidden[id(r)], self.net) for r in group]
        head = self.net.step_head()
        logits: dict[int, list[torch.Tensor]] = {id(r): [] for r in group}
        for v in range(max(len(hidden[id(r)]) for r in group)):
            having = [r for r in group if len(hidden[id(r)]) > v]
            out = head(torch.cat([hidden[id(r)][v] for r in having]))
            begin = 0
            for r in having:
                n = len(hidden[id(r)][v])
                logits[id(r)].append(out[begin : begin + n])
                begin += n
        applied = _Applied(self.net.chunk)
        return [(r, logits[id(r)], applied) for r in group]

    def _packed(self, batch: list[tuple[_Running, torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """One packed forward of the canvases (row, wanted positions, canvas) in `batch`, each over exactly its
        own keys; each one's hidden states predicting its wanted positions."""
        assert self.n_layers is not None
        h, segments = packed_hidden(self.net, [c for _, _, c in batch], [0] * len(batch), self.n_layers, self.device)
        out: list[torch.Tensor] = []
        for (r, at, _), s in zip(batch, segments):
            assert r.row.prompt >= self.net.shift, "a shifted model's row needs a prompt token to predict from"
            out.append(h[s.begin + r.row.prompt + at - self.net.shift])  # shift: position j - 1 predicts j
        return out

    def _padded(self, batch: list[tuple[_Running, torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """The same from one left-padded forward (`CanvasNet.canvas_hidden`, the padding masked): for a net
        with no packed forward."""
        L = max(len(c) for _, _, c in batch)
        x = torch.full((len(batch), L), self.tokens.pad_id, dtype=torch.long, device=self.device)
        keys = torch.zeros(len(batch), L, dtype=torch.bool, device=self.device)
        for b, (_, _, c) in enumerate(batch):
            x[b, L - len(c) :], keys[b, L - len(c) :] = c, True
        starts = [L - len(c) + r.row.prompt for r, _, c in batch]  # each answer's first column
        h = self.net.canvas_hidden(x, keys, min(starts), L)
        return [h[b, starts[b] - min(starts) + at] for b, (_, at, _) in enumerate(batch)]


@dataclass(frozen=True)
class _Applied:
    """The net a row's step reads its logits through once the round has computed them (`_heads`): its head
    takes them as they are, in parts of `chunk` as the net's would."""

    chunk: int

    def step_head(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda logits: logits


def whole_batch(
    net: Any,
    prompt: torch.Tensor,
    prompt_mask: torch.Tensor,
    plan: WholePlan,
    mask_id: int,
    pad_id: int,
    noise: RowNoise,
    stop_ids: frozenset[int] = frozenset(),
) -> torch.Tensor:
    """A static batch through the running set, every row admitted at once: prompt (B, P) left-padded ->
    the canvas (B, P + gen_length), row b drawing from stream b of `noise` (`stop_ids`: `WholeScheduler`'s)."""
    rows = WholeScheduler(net, mask_id, pad_id, len(prompt), prompt.device, stop_ids=stop_ids)
    return admitted_at_once(rows, prompt, prompt_mask, plan, mask_id, noise)
