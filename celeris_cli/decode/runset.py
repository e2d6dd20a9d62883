"""What every running set is, whatever its rows: requests waiting, at most `width` rows in flight, lanes of
rows that share a cache, and what it did. Block diffusion's rows (`decode.running`) and the fast decoder's
bidirectional rows (`decode.waves`) are kinds of it.

The running set owns its width and its slots. Its width changes only through `resize` (the memory planner's
answer, or the out-of-memory rule, both in `engine.LiveRun`); a lane adds slots itself as rows join it
(`Lane.join`), so a running set widened while rows are in flight never hands a row a slot its cache does
not have. Nothing outside writes its attributes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import torch

from ..arch.kv import KVCache
from ..structured.commit import Rule
from .sampling import RowNoise


@dataclass
class Occupancy:
    """What the running set did: its decoding forwards (steps and stores), rows per such forward, and
    prompt prefills (forwards of their own)."""

    forwards: int = 0
    rows: int = 0  # summed over forwards
    positions: int = 0  # through the network, prefills included
    prefills: int = 0  # prefill forwards (a kind that packs its joining rows' prompts runs one a round)
    rounds: int = 0  # each running row advances once per round
    in_flight: int = 0  # summed over rounds

    @property
    def mean_rows(self) -> float:
        """Rows per decoding forward."""
        return self.rows / self.forwards if self.forwards else 0.0

    @property
    def mean_in_flight(self) -> float:
        """Rows in the running set per round."""
        return self.in_flight / self.rounds if self.rounds else 0.0


class Lane:
    """Running rows that share their forwards, and their cache: row i owns slot i. A row names how much of
    its slot holds its keys and values (`cached`), which is what moves when an earlier row leaves. The block
    running set has a lane per block width; `decode.waves` one per cache mode and block width."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.rows: list[Any] = []

    def ensure(self, length: int, rows: int = 0) -> None:
        """At least `length` positions a slot and `rows` slots."""
        if length > self.cache.length or rows > self.cache.rows:
            longer = max(length, 2 * self.cache.length) if length > self.cache.length else length
            self.cache.grow(longer, len(self.rows), rows)

    def join(self, row: Any, length: int, width: int) -> int:
        """`row` takes the next slot, of at least `length` positions; returns the slot. With no slot free, the
        slots double, up to `width` (the running set's), and at least to the rows now here."""
        slots = len(self.rows) + 1
        if slots > self.cache.rows:
            slots = max(slots, min(width, 2 * self.cache.rows))
        self.ensure(length, slots)
        self.rows.append(row)
        return len(self.rows) - 1

    def drop(self, gone: set[int]) -> None:
        """Rows whose id() is in `gone` leave; each later row moves into the first free slot."""
        kept: list[Any] = []
        for slot, r in enumerate(self.rows):
            if id(r) not in gone:
                if slot != len(kept):
                    self.cache.move(slot, len(kept), min(r.cached, self.cache.length))
                kept.append(r)
        self.rows = kept


def give_back(lanes: dict[Any, Lane]) -> None:
    """Every lane with no rows left gives its cache back at once: the running set holds the caches of the
    lanes in use and no others (a later row of that shape makes its lane anew)."""
    for key in [key for key, lane in lanes.items() if not lane.rows]:
        del lanes[key]


class Request(Protocol):
    @property
    def key(self) -> int: ...

    @property
    def gen_length(self) -> int: ...


R = TypeVar("R", bound=Request)


class Plan(Protocol):
    @property
    def gen_length(self) -> int: ...


P = TypeVar("P", bound=Plan)


@dataclass(frozen=True)
class RowRequest(Generic[P]):
    """One request for a running set of any kind (the kind is its plan's: `strategy.Strategy.running`): its
    prompt ids, its settings, its row seed (`request_seed`), its constraint and log-probability record if
    any, and the seed as given (what DiffusionGemma's `noise: torch` seeds its generator with)."""

    key: int  # the caller's name for it, handed back with the answer
    prompt: list[int]
    plan: P
    seed: int
    rule: Rule | None = field(default=None, compare=False)
    given: int = 0

    @property
    def gen_length(self) -> int:
        return self.plan.gen_length


class RunningSet(Generic[R]):
    """The part every kind of running set shares: the waiting requests (longest answer first, so the last
    rows to run are short and the tail is brief), the width, the word pieces its shaping reads, and the
    admission rule. `refill` False gives static batches through the same loop (up to `width` rows admitted
    only when none is in flight: `bench workload mixed`'s comparison). A kind says which keys are in flight,
    what one round does (`one_round`) and what it reserves for a request (`reserve`)."""

    def __init__(
        self,
        width: int,
        device: torch.device,
        word_pieces: frozenset[int],
        refill: bool,
        before_round: Callable[[], None] | None = None,
    ) -> None:
        self._width = max(1, width)
        self.device = device
        self.refill = refill
        self.pieces = torch.tensor(sorted(word_pieces), device=device, dtype=torch.long)
        self.waiting: deque[R] = deque()
        self.occupancy = Occupancy()
        self.before_round = before_round  # called as each round begins (where a caller drops rows)
        self._leaving: set[int] = set()

    @property
    def width(self) -> int:
        """Rows in flight at most."""
        return self._width

    def resize(self, width: int) -> None:
        """At most `width` rows in flight from the next round (at least one): rows in flight past it finish,
        none joins meanwhile; a wider set's lanes add their slots as rows join them."""
        self._width = max(1, width)

    def use_word_pieces(self, pieces: frozenset[int]) -> None:
        """The tokenizer's word-continuing pieces, for rows whose shaping needs them (`subword_min_p`)."""
        if pieces and not self.pieces.numel():
            self.pieces = torch.tensor(sorted(pieces), device=self.device, dtype=torch.long)

    def in_flight_keys(self) -> list[int]:
        """The keys of the rows admitted and not yet handed back."""
        raise NotImplementedError

    def drop(self, keys: Iterable[int]) -> None:
        """Rows whose callers no longer want them (a client that left): waiting ones leave at once, those in
        flight as the next round begins, their slots freed; none is handed back."""
        gone = set(keys)
        self.waiting = deque(r for r in self.waiting if r.key not in gone)
        self._leaving |= gone

    def wanted(self, key: int) -> bool:
        """Whether a row that has just finished is handed back: not if it was dropped meanwhile (its round's
        answers are handed back one at a time, and a caller may drop a row between two of them)."""
        return key not in self._leaving

    def _drop_in_flight(self, keys: set[int]) -> None:
        """The kind's rows in flight under these keys leave (their lanes' `drop`)."""
        raise NotImplementedError

    @property
    def in_flight(self) -> int:
        return len(self.in_flight_keys())

    def add(self, requests: Iterable[R]) -> None:
        """Requests to decode, behind those waiting; among them the longest answers first (stable). Rows may
        be added while `run` goes on (between two of its answers)."""
        new = list(requests)
        self.reserve(new)
        self._queue(new)

    def reserve(self, requests: list[R]) -> None:
        """What the kind will hold for these requests, worked out as they are added, before any of them joins
        (a lane's cache is allocated once, with the slots and length its rows will need: growing it on the way
        would copy it and hold the old and the new at once); a request's own sizes are checked here."""

    def _queue(self, requests: list[R]) -> None:
        self.waiting.extend(sorted(requests, key=lambda r: -self.rounds(r)))

    def rounds(self, request: R) -> int:
        """What admission sorts by, the most first: how many rounds the request is expected to take (here its
        answer's length; a kind whose forwards are set otherwise says so)."""
        return request.gen_length

    def admit(self) -> list[R]:
        """The requests that join this round: while fewer than `width` rows are in flight (static batches:
        only when none is), the first waiting; the round is counted with them. Rows dropped since the last
        round leave first."""
        if self.before_round is not None:
            self.before_round()
        if self._leaving:
            self._drop_in_flight(self._leaving)
            self._leaving = set()
        joining: list[R] = []
        n = self.in_flight
        if self.refill or n == 0:
            while self.waiting and n < self._width:
                joining.append(self.waiting.popleft())
                n += 1
        self.occupancy.rounds += 1
        self.occupancy.in_flight += n
        return joining

    @torch.no_grad()  # the weights may require grad: no graph may chain through the caches
    def run(self, requests: Iterable[R] = ()) -> Iterator[tuple[int, list[int], int]]:
        """(key, generated ids, forwards taken part in) as each row finishes, until none waits or runs: one
        round after another (`one_round`), its answers handed back one at a time, a row dropped meanwhile not
        (`wanted`). Rows may be added and dropped between two answers; they join or leave as the next round
        begins."""
        self.add(requests)
        while self.waiting or self.in_flight:
            for answer in self.one_round():
                if self.wanted(answer[0]):
                    yield answer
        self.settle()

    def one_round(self) -> list[tuple[int, list[int], int]]:
        """One round: the rows that join (`admit`), then every row in flight advanced once; returns the rows
        done, as (key, generated ids, forwards taken part in)."""
        raise NotImplementedError

    def settle(self) -> None:
        """Once no row waits or runs: what the kind still holds, given back."""


def admitted_at_once(
    scheduler: RunningSet[RowRequest[Any]],
    prompt: torch.Tensor,
    prompt_mask: torch.Tensor,
    plan: Plan,
    fill: int,
    noise: RowNoise,
    rules: list[Rule | None] | None = None,
) -> torch.Tensor:
    """A static batch as a running set of as many rows, all admitted at once: prompt (B, P) left-padded ->
    the canvas (B, P + gen_length), row b's request its own prompt ids drawing from stream b of `noise` (under
    rules[b] if given), its answer written after the batch's prompt columns (`fill` where an answer is shorter
    than gen_length)."""
    B, P = prompt.shape
    rule = rules or [None] * B
    requests = [RowRequest(b, prompt[b][prompt_mask[b]].tolist(), plan, noise.seeds[b], rule[b]) for b in range(B)]
    out = torch.cat([prompt, prompt.new_full((B, plan.gen_length), fill)], 1)
    for b, ids, _ in scheduler.run(requests):
        out[b, P : P + len(ids)] = torch.tensor(ids, dtype=out.dtype, device=out.device)
    return out


class KindSet(RunningSet[RowRequest[Any]]):
    """Rows of every kind in one running set: a running set of each kind (`strategy.Strategy.running`: block,
    waves, spec, canvas, seeded, whole), made as its first request comes (`make(kind)`), and in each round of
    this set every kind with rows advances one round of its own. Admission is this set's, across kinds: the
    waiting requests in one queue (the most rounds first, as each kind counts them), at most `width` rows in
    flight in all, a request handed to its kind's set only when it joins, which admits it in the same round.
    So a server or the queue given requests of several strategies at once decodes them side by side, each
    row's answer its own; rows of different kinds share no forward (their forwards have other shapes).
    `kind_of(request)` names a request's kind."""

    def __init__(
        self,
        make: Callable[[str], RunningSet[Any]],
        kind_of: Callable[[RowRequest[Any]], str],
        width: int,
        device: torch.device,
        refill: bool = True,
        before_round: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(width, device, frozenset(), refill, before_round)
        self.make, self.kind_of = make, kind_of
        self.kinds: dict[str, RunningSet[Any]] = {}

    def _kind(self, request: RowRequest[Any]) -> RunningSet[Any]:
        kind = self.kind_of(request)
        if kind not in self.kinds:
            self.kinds[kind] = made = self.make(kind)
            made.resize(self.width)
            if self.pieces.numel():
                made.pieces = self.pieces
        return self.kinds[kind]

    def rounds(self, request: RowRequest[Any]) -> int:
        return self._kind(request).rounds(request)

    def reserve(self, requests: list[RowRequest[Any]]) -> None:
        for r in requests:  # each kind sizes its caches for every request it will get, as they come here
            self._kind(r).reserve([r])

    def resize(self, width: int) -> None:
        super().resize(width)
        for s in self.kinds.values():  # each kind may take every place; this set's admission keeps the sum
            s.resize(self.width)

    def use_word_pieces(self, pieces: frozenset[int]) -> None:
        super().use_word_pieces(pieces)
        for s in self.kinds.values():
            s.use_word_pieces(pieces)

    def in_flight_keys(self) -> list[int]:
        """Rows admitted here: in flight in a kind's set, or handed to it this round."""
        return [k for s in self.kinds.values() for k in s.in_flight_keys()] + [
            r.key for s in self.kinds.values() for r in s.waiting
        ]

    def _drop_in_flight(self, keys: set[int]) -> None:
        for s in self.kinds.values():
            s.drop(keys)

    def one_round(self) -> list[tuple[int, list[int], int]]:
        for req in self.admit():
            self._kind(req)._queue([req])  # (reserved as it was added here)
        answers: list[tuple[int, list[int], int]] = []
        for name, s in list(self.kinds.items()):
            if s.waiting or s.in_flight:
                answers += s.one_round()
                if not (s.waiting or s.in_flight) and not self._queued(name):  # its rows have all left, none to come
                    s.settle()  # its caches back now, not when every kind is done
        for name in ("forwards", "rows", "positions", "prefills"):  # the kinds' forwards, this set's rounds
            setattr(self.occupancy, name, sum(getattr(s.occupancy, name) for s in self.kinds.values()))
        return answers

    def _queued(self, kind: str) -> bool:
        """Whether a request of this kind waits here (read only as a kind goes idle: the queue may be long)."""
        return any(self.kind_of(r) == kind for r in self.waiting)

    def settle(self) -> None:
        for s in self.kinds.values():
            s.settle()
