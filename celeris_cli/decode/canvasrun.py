"""The running set of DiffusionGemma's canvases (`decode.diffusion_gemma`): rows admitted as others finish, each
at its own canvas and step, so the batch stays full while answers of every length run through it.

A row owns a slot of its lane's cache (rows of one canvas length share a lane). When it joins, its prompt's
causal pass writes the slot's first positions (a forward of its own, as alone); then each round runs one
decoder forward over every row's canvas in the lane, each against its own slot, followed by each row's own
denoising step (`_Canvas`: `denoise_canvas`'s loop for a batch of one, a step at a time). A row whose canvas
ends keeps it (its argmax, or under a constraint its committed prefix), ends its answer at a stop id, and
otherwise takes the canvas's commit pass at the end of the round (one causal forward for the lane's rows
committing then), which writes it into the row's slot before its next canvas starts.

A row's answer is the one it gets alone, token for token in float32: its draws come from its own stream at its
own (canvas, step) (`RowNoise`, or under `noise: torch` its own generator, drawn in its generate's order), its
settings are its own, and in every forward each row's attention runs over exactly its own keys, with the mask a
batch of one would use (`gemma4.Attention.forward`'s rows): nothing is padded. Only the number of rows in the
other layers' products changes, which their per-row results do not depend on (the static batches' property,
`tests/test_diffusion_gemma_running.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..arch.canvas_memory import canvas_chunk
from ..arch.kv import KVCache
from ..errors import UsageError
from ..structured.commit import Rule
from .block import OnBlock
from .canvas_step import CanvasDraws, canvas_step
from .diffusion_gemma import INIT, RENOISE, DiffusionGemmaPlan, Held, pass_masks, temperature
from .runset import Lane, RowRequest, RunningSet, give_back
from .sampling import RowNoise


class _Canvas:
    """One canvas of one row being denoised: `denoise_canvas`'s loop for a batch of one, a step at a time."""

    def __init__(self, x: torch.Tensor, steps: int, plan: DiffusionGemmaPlan, j: int, rule: Rule | None) -> None:
        L = x.shape[1]
        self.x, self.argmax = x, x  # (1, L) each
        self.signal: torch.Tensor | None = None  # (1, L, d): the last step's self-conditioning input
        self.steps, self.plan, self.j, self.i = steps, plan, j, 0
        d = plan.denoising
        self.history = torch.full((d.stability_threshold, 1, L), -1, dtype=x.dtype, device=x.device)
        self.held = Held(rule, j * L) if rule is not None and rule.constrained else None
        self.done = False

    def step(self, model: Any, h: torch.Tensor, draws: CanvasDraws, chunk: int) -> None:
        """One step from the decoder's hidden states h (1, L, d) of the canvas."""
        d, L, i, j = self.plan.denoising, self.x.shape[1], self.i, self.j
        held = self.held
        T = temperature(d, max(self.steps - i, 1), self.steps).to(self.x.device)
        whole = {0} if held is not None and not held.closed(L) else set()
        step = canvas_step(model, h, self.x, self.signal, T, draws, [0], j, i + 1, chunk, whole)
        low, order = torch.sort(step.entropy, dim=-1)
        keep = torch.zeros(1, L, dtype=torch.bool, device=self.x.device)
        keep = keep.scatter(1, order, low.cumsum(-1) - low <= d.entropy_bound)
        fresh = draws.tokens([0], j, i + 1, RENOISE, L)
        x, argmax = torch.where(keep, step.drawn, fresh), step.argmax
        if held is not None:
            if not held.closed(L):
                raw, scaled, probs = step.whole[0]
                held.step(0, scaled, probs, step.drawn[0], keep[0], draws, j, i + 1, raw)
            x[0, : len(held.ids)] = torch.tensor(held.ids, dtype=x.dtype, device=x.device)
        if d.confidence_threshold is not None:
            if d.stability_threshold == 0:
                stable = True
            else:
                stable = bool((self.history == argmax[None]).all(-1).all(0))
                self.history = torch.roll(self.history, -1, 0)
                self.history[-1] = argmax
            self.done = self.done or (stable and bool(step.entropy.mean(-1)[0] < d.confidence_threshold))
        if held is not None:  # a constrained canvas ends when it is committed, not when stable
            self.done = held.closed(L)
        self.x, self.argmax, self.signal, self.i = x, argmax, step.signal, i + 1
        # past its schedule only a constrained canvas still open goes on, for at most L more steps
        open_ = held is not None and not held.closed(L)
        if self.i >= self.steps + (L if held is not None else 0) or (self.i >= self.steps and not open_):
            self.done = True

    def kept(self) -> torch.Tensor:
        """The canvas kept (1, L): the last argmax, or under a constraint the committed prefix."""
        if self.held is None:
            return self.argmax
        L = self.x.shape[1]
        return torch.tensor([self.held.filled(L)], dtype=self.x.dtype, device=self.x.device)


class _Row:
    """A request in flight: its answer so far, how much of its slot is written, and its canvas in hand."""

    def __init__(
        self, req: RowRequest[DiffusionGemmaPlan], draws: CanvasDraws, stops: torch.Tensor, pad_id: int
    ) -> None:
        self.req, self.draws, self.stop, self.pad_id = req, draws, stops, pad_id
        self.schedule = req.plan.blocks.canvas_steps()
        L = _width(req)
        self.out = torch.full((len(self.schedule) * L,), pad_id, dtype=torch.long, device=stops.device)
        self.cached = 0  # positions of its slot written: the prompt and the canvases committed
        self.j = 0  # the canvas in hand
        self.canvas: _Canvas | None = None
        self.forwards = 0
        self.finished = False  # a stop id ended its answer, or its last canvas is kept
        self.committing: torch.Tensor | None = None  # a kept canvas (1, L) whose commit pass is due

    def start(self) -> None:
        """Canvas j's starting canvas: uniform draws (its randint, drawn even where it is pinned), or pinned."""
        L, pinned = _width(self.req), self.req.plan.noise.initial_canvases
        x = self.draws.tokens([0], self.j, 0, INIT, L)
        if self.j < len(pinned):
            x = torch.tensor([pinned[self.j]], dtype=x.dtype, device=x.device)
        self.canvas = _Canvas(x, self.schedule[self.j], self.req.plan, self.j, self.req.rule)

    def keep(self) -> None:
        """The canvas in hand has ended: into the answer, cut after its first stop id; then a commit pass or
        the end."""
        assert self.canvas is not None
        L, j = _width(self.req), self.j
        canvas = self.canvas.kept()
        part = canvas[0].clone()
        hit = torch.isin(part, self.stop)
        after = (hit.cumsum(-1) > 0) & ~((hit.cumsum(-1) == 1) & hit)
        part[after] = self.pad_id
        self.out[j * L : (j + 1) * L] = part
        self.canvas = None
        self.finished = bool(hit.any()) or j + 1 == len(self.schedule)
        if not self.finished:
            self.committing = canvas


class CanvasScheduler(RunningSet[RowRequest[DiffusionGemmaPlan]]):
    """Decodes `RowRequest`s with at most `width` rows in flight; `run` yields (key, generated ids,
    forwards) as each row finishes. `refill` False runs static batches instead. on_block(key, generated ids so
    far): as each row's canvas is kept (streaming)."""

    def __init__(
        self,
        net: Any,
        stop_ids: frozenset[int],
        pad_id: int,
        width: int,
        device: torch.device,
        refill: bool = True,
        on_block: OnBlock | None = None,
        before_round: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(width, device, frozenset(), refill, before_round)
        self.net, self.model, self.pad_id, self.on_block = net, net.model, pad_id, on_block
        self.stop_ids = stop_ids
        self.lanes: dict[int, Lane] = {}  # by canvas length
        self.sizes: dict[int, tuple[int, int]] = {}  # by canvas length: (slots, positions) its cache is made with

    def in_flight_keys(self) -> list[int]:
        return [r.req.key for lane in self.lanes.values() for r in lane.rows]

    def _drop_in_flight(self, keys: set[int]) -> None:
        for lane in self.lanes.values():
            lane.drop({id(r) for r in lane.rows if r.req.key in keys})

    def reserve(self, requests: list[RowRequest[DiffusionGemmaPlan]]) -> None:
        new = requests
        V = self.model.cfg.vocab_size
        for r in new:
            bad = sorted({t for c in r.plan.noise.initial_canvases for t in c if t >= V})
            if bad:
                raise UsageError(f"initial_canvases: token id {bad[0]} is outside the vocabulary of {V}")
        for r in new:  # each lane's cache, made once: a slot for each row that can run, as long as the longest
            rows, length = self.sizes.get(_width(r), (0, 0))
            self.sizes[_width(r)] = (min(rows + 1, self.width), max(length, _length(r)))

    @torch.no_grad()
    def one_round(self) -> list[tuple[int, list[int], int]]:
        for req in self.admit():
            self._admit(req)
        give_back(self.lanes)
        answers = []
        for lane in list(self.lanes.values()):
            if lane.rows:
                answers += self._leave(lane, self._round(lane))
        return answers

    def settle(self) -> None:
        give_back(self.lanes)

    def _admit(self, req: RowRequest[DiffusionGemmaPlan]) -> None:
        """The row's prompt pass, into a slot of its lane (as alone: a batch of one over nothing cached)."""
        V, P = self.model.cfg.vocab_size, len(req.prompt)
        stops = req.plan.stops.stop_token_ids or tuple(sorted(self.stop_ids))
        seeds = [req.given] if req.plan.noise.noise == "torch" else None
        draws = CanvasDraws(RowNoise([req.seed], self.device, [req.given]), seeds, V, self.device)
        row = _Row(req, draws, torch.tensor(stops, dtype=torch.long, device=self.device), self.pad_id)
        ids = torch.tensor([req.prompt], dtype=torch.long, device=self.device)
        real = torch.ones(1, P, dtype=torch.bool, device=self.device)
        positions = torch.arange(P, device=self.device)[None]
        fresh = self._pass(ids, positions, [pass_masks(self.model, real, P, True)], None)
        self.occupancy.prefills += 1
        self.occupancy.positions += P
        row.forwards += 1
        W = _width(req)
        if W not in self.lanes:
            slots, length = self.sizes.get(W, (self.width, _length(req)))
            self.lanes[W] = Lane(_allocate(fresh, slots, max(length, _length(req))))
        lane = self.lanes[W]
        slot = lane.join(row, _length(req), self.width)
        _write(lane.cache, [slot], [0], fresh)
        row.cached = P
        row.start()

    def _round(self, lane: Lane) -> list[_Row]:
        """One decoder forward over the lane's rows, each its canvas against its own slot, then each row's
        step; then the commit pass of the canvases kept; returns the rows that are done."""
        rows: list[_Row] = lane.rows
        canvases = [r.canvas for r in rows if r.canvas is not None]
        assert len(canvases) == len(rows), "every row in flight has a canvas in hand"
        x = torch.cat([c.x for c in canvases])
        L = x.shape[1]
        positions = self._positions([r.cached for r in rows], L)
        signals = [c.signal for c in canvases]
        first = next((s for s in signals if s is not None), None)
        signal = None  # a row at its first step has none: zeros, as `hidden` gives a batch of one
        if first is not None:
            d = self.model.cfg.hidden_size
            signal = torch.cat([first.new_zeros(1, L, d) if s is None else s for s in signals])
        masks = [{True: "all", False: "all"} for _ in rows]  # a batch of one's decoder pass: nothing hidden
        h = self.model.hidden(x, positions, masks, self._pasts(lane), signal)
        self.net.nfe += 1
        self.net.positions_computed += x.numel()
        self._count(rows, L)
        done = []
        V = self.model.cfg.vocab_size
        for b, r in enumerate(rows):
            c = r.canvas
            assert c is not None
            chunk = L if r.draws.gens is not None else canvas_chunk(V, L)
            c.step(self.model, h[b : b + 1], r.draws, chunk)
            if c.done:
                r.keep()
                if self.on_block is not None:
                    self.on_block(r.req.key, r.out[: (r.j + 1) * L].tolist())
                if r.finished:
                    done.append(r)
        self._commit(lane, [r for r in rows if r.committing is not None])
        return done

    def _commit(self, lane: Lane, rows: list[_Row]) -> None:
        """The commit pass of the rows' kept canvases (n, L), each causal over its own slot, into its slot; then
        each row's next canvas starts."""
        if not rows:
            return
        x = torch.cat([r.committing for r in rows if r.committing is not None])
        L = x.shape[1]
        at = [r.cached for r in rows]
        positions = self._positions(at, L)
        real = [torch.ones(1, s + L, dtype=torch.bool, device=self.device) for s in at]  # a batch of one's keys
        masks = [pass_masks(self.model, keys, L, True) for keys in real]
        slots = [lane.rows.index(r) for r in rows]
        fresh = self._pass(x, positions, masks, self._pasts(lane, slots))
        _write(lane.cache, slots, at, fresh)
        self._count(rows, L)
        for r in rows:
            r.cached += L
            r.committing = None
            r.j += 1
            r.start()

    def _pass(self, ids: torch.Tensor, positions: torch.Tensor, masks: Any, pasts: Any) -> Any:
        """The encoder's causal pass over ids (n, T), each row over its own past: its fresh keys and values."""
        self.net.nfe += 1
        self.net.positions_computed += ids.numel()
        return self.model.fresh(ids, positions, masks, pasts)

    def _pasts(self, lane: Lane, slots: list[int] | None = None) -> list[list[Any]]:
        """Per layer, each row's cached keys and values: its slot's first `cached` positions."""
        slots = list(range(len(lane.rows))) if slots is None else slots
        rows = [lane.rows[s] for s in slots]
        out = []
        for k, v in lane.cache.layers:
            out.append([(k[s : s + 1, :, : r.cached], v[s : s + 1, :, : r.cached]) for s, r in zip(slots, rows)])
        return out

    def _positions(self, starts: list[int], L: int) -> torch.Tensor:
        """(n, L): each row's L positions from its start (positions count from a row's first token)."""
        return torch.tensor(starts, device=self.device)[:, None] + torch.arange(L, device=self.device)[None]

    def _count(self, rows: list[_Row], L: int) -> None:
        self.occupancy.forwards += 1
        self.occupancy.rows += len(rows)
        self.occupancy.positions += len(rows) * L
        for r in rows:
            r.forwards += 1

    def _leave(self, lane: Lane, done: list[_Row]) -> list[tuple[int, list[int], int]]:
        """Finished rows' answers; their slots freed."""
        answers = [(r.req.key, r.out.tolist(), r.forwards) for r in done]
        if done:
            lane.drop({id(r) for r in done})
        return answers


def _width(req: RowRequest[DiffusionGemmaPlan]) -> int:
    """Its canvas's length: one block."""
    return req.plan.blocks.block_length


def _length(req: RowRequest[DiffusionGemmaPlan]) -> int:
    """The positions a row's slot holds at most: its prompt and every canvas but the last (never committed)."""
    return len(req.prompt) + (len(req.plan.blocks.canvas_steps()) - 1) * _width(req)


def _allocate(fresh: list[Any], rows: int, length: int) -> KVCache:
    """A zeroed cache of `rows` slots and `length` positions, each layer shaped as its fresh keys and values
    (a full layer's heads and head size are not a sliding layer's)."""

    def one(t: torch.Tensor) -> torch.Tensor:
        return t.new_zeros(rows, t.shape[1], length, t.shape[3])

    return KVCache([(one(k), one(v)) for k, v in fresh])


def _write(cache: KVCache, slots: list[int], at: list[int], fresh: list[Any]) -> None:
    """Each row b's fresh keys and values (n, heads, T, dim a layer) into slot slots[b] from position at[b]."""
    for (K, Vs), (k, v) in zip(cache.layers, fresh):
        T = k.shape[2]
        for b, (s, a) in enumerate(zip(slots, at)):
            K[s, :, a : a + T] = k[b]
            Vs[s, :, a : a + T] = v[b]
