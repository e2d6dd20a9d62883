"""Self-speculative decoding (`spec`): one network decoded left to right exactly, in fewer forwards where
drafting pays. The answer is the AR mode's token for token (the `ar` strategy: this decoder never drafting), whatever is
drafted and whether a round drafts at all.

The network has two modes (`celeris train --ar-weight`, or Nemotron-Labs-Diffusion): causally, position i
predicts token i + 1 (the AR mode); a block of masks after some text, attending to that text and to each
other, predicts its own positions (the diffusion mode). Each row holds a seed (its last decided token, not yet
in the cache) and a draft of k tokens after it (k may be 0). A round is one forward per row, over

    [seed, draft_1 .. draft_k]  causally: each position's prediction is the AR mode's next token, and
    [mask x m]                  where the round drafts: the masks see the cache, the seed, the draft and
                                each other (m = the draft width, `Drafting.width`).

The AR predictions are accepted while the draft agrees with them, and one more (the first disagreement's own,
or the bonus after the last draft token): 1 to k + 1 tokens. Every accepted token at answer position t is
drawn from the row's stream (block 0, step t), as the AR mode draws token t, so at any temperature the answer
is the AR mode's. The forward wrote the keys and values of the seed and the draft causally; those of accepted
text are what a causal pass writes, the rest is overwritten later. Where the whole draft was accepted, the
masks after it become the next draft (their first is the bonus's place, which the AR mode has decided; the
others are drawn from the diffusion mode's distribution with the very number the AR mode will draw that
position with, so that close distributions give the same token); after a disagreement the next round starts
with no draft.

Rows that finish wait in the batch, computing their last token again and taking nothing, until a quarter
of the batch has finished; then they leave together (leaving copies the cache, so not one at a time).

Drafting costs positions: a drafting round computes 1 + k + m positions per row, an AR step 1. Where a
forward's time is its fixed cost (a small batch, a GPU), a round that yields more than one token per row is
faster; where it is its positions (a wide batch on a CPU), one position per token is. Each round decides from
the width in flight, by `Pace`: the engine's calibrated cost of a forward (`decode.pace`) and the tokens the
rounds that drafted have yielded per row so far. The choice changes how many forwards an answer takes,
never its tokens. `drafting` "always" or "never" fixes it (never: the AR mode, one token a forward).

A row under a constraint or asking for log probabilities (`structured.commit.Rule`) has its verify columns
decided one after the other, as the AR mode would decide them: each under its grammar's mask after the text
before it (the accepted answer, then the draft), the grammar taking the token, until the first column that
disagrees with the draft; a grammar that allows nothing ends the answer with its end of text and says why.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..arch.exact import exactly
from ..arch.kv import KVCache
from ..arch.packed import Segment, packed_layers
from ..params import NO_SHAPING, NO_STRUCTURE, Drafting, Sampling, Shaping, Structure
from ..structured.commit import Rule, Rules, note, short_error, under_mask
from .nemotron import CausalCanvas, ar_shaping, stop_after
from .pace import ForwardCost, Learned, Pace
from .predict import Places, StepLogits, choose, sample_with_probability
from .sampling import RowNoise


@dataclass(frozen=True)
class Joining:
    """A row joining a running lane (`SpecRows.join`): its prompt, its stream, its rule, its answer's length."""

    prompt: list[int]
    stream: int
    rule: Rule | None
    gen_length: int
    width: int  # its draft width (`Drafting.width`)
    sampling: Sampling
    shaping: Shaping = NO_SHAPING


@dataclass(frozen=True)
class SelfSpecPlan:
    """The parts of the settings self-speculative decoding honours."""

    drafting: Drafting
    sampling: Sampling
    shaping: Shaping = NO_SHAPING
    structure: Structure = NO_STRUCTURE  # the rows' rules come per row (`structured.commit`)

    @property
    def gen_length(self) -> int:
        return self.drafting.gen_length


class SpecRows:
    """Rows decoding side by side under one drafting policy, each under its own sampler and shaping (`settings`,
    by stream; a static batch's all the plan's): each its canvas at its own positions (its prompt, then its
    answer from `ans` to `end`, then room for a round past it), its seed (the canvas index of its last
    decided token, not yet in the cache), its draft (the first `k` of `draft` real), whether it is still
    decoding (`live`), and its slot of the cache (row i owns slot i). `generate_self_spec` lays a batch in at
    once (`lay_batch`, one prefill of the left-padded prompts); the running set (`SpecScheduler`) adds rows as
    they come (`join`, a prefill each) and drops them as they finish (`drop`). A round (`round`) is the
    same for both. `idx` names each row's random stream in `noise` (and its rule in `rules`): the batch
    index, or the running set's admission count."""

    def __init__(
        self,
        net: Any,
        plan: SelfSpecPlan,
        mask_id: int,
        stop: torch.Tensor,
        noise: RowNoise,
        pace: Pace,
        word_pieces: frozenset[int] = frozenset(),
    ) -> None:
        self.net, self.plan, self.mask_id, self.stop, self.noise, self.pace = net, plan, mask_id, stop, noise, pace
        self.pieces = torch.tensor(sorted(word_pieces), device=noise.device, dtype=torch.long)
        self.W = plan.drafting.width  # a static batch's draft width; running rows bring their own (`widths`)
        self.rules: dict[int, Rule] = {}
        self.settings: dict[int, tuple[Sampling, Shaping]] = {}  # by stream: each row's sampler and shaping
        self.cache: KVCache | None = None
        dev = noise.device
        self.device = dev

        def empty(dtype: torch.dtype, *shape: int) -> torch.Tensor:
            return torch.zeros(0, *shape, dtype=dtype, device=dev)

        self.x, self.keys, self.pos = empty(torch.long, 0), empty(torch.bool, 0), empty(torch.long, 0)
        self.ans, self.end, self.idx, self.seed_at = (empty(torch.long) for _ in range(4))
        self.k, self.forwards, self.widths = empty(torch.long), empty(torch.long), empty(torch.long)
        self.draft = empty(torch.long, max(self.W - 1, 1))
        self.live = empty(torch.bool)

    def lay_batch(self, prompt: torch.Tensor, prompt_mask: torch.Tensor, rules: Rules | None) -> None:
        """A static batch into these (empty) rows: the left-padded prompts (B, P), prefilled in one causal
        forward; row b is stream b."""
        with exactly():
            self._lay_batch(prompt, prompt_mask, rules)

    def _lay_batch(self, prompt: torch.Tensor, prompt_mask: torch.Tensor, rules: Rules | None) -> None:
        B, P = prompt.shape
        G = self.plan.drafting.gen_length
        cv = CausalCanvas(self.net, prompt, prompt_mask, G + 2 * self.W, self.mask_id)  # room for a round past it
        h = cv.forward(0, P, causal=True)[:, -1]
        assert cv.cache is not None
        self.cache, self.x, self.keys, self.pos = cv.cache, cv.x, cv.keys, cv.pos
        self.rules = {b: r for b, r in enumerate(rules or []) if r is not None}
        self.settings = {b: (self.plan.sampling, self.plan.shaping) for b in range(B)}
        full = torch.full((B,), P, dtype=torch.long, device=prompt.device)
        self._lay(torch.arange(B, device=prompt.device), full, full + G, full * 0 + self.W, h, 0, 1)

    def join(self, joining: list[Joining], slots: int, first: tuple[int, int]) -> None:
        """Rows that join this round: their prompts prefilled causally into the next slots, at positions from
        0, in one packed forward (`arch.packed`: each row's attention over exactly its own prompt, as alone).
        The cache is allocated at the first rows with `first` (slots, length: what the rows on their way
        need), at least what these need; with too few slots they double, up to `slots` (the running set's
        width), and a canvas longer than the cache holds doubles its length."""
        with exactly():
            self._join(joining, slots, first)

    def _join(self, joining: list[Joining], slots: int, first: tuple[int, int]) -> None:
        dev, b, n = self.device, len(self.idx), len(joining)
        # every canvas has room past its answer for a round of the lane's widest row: a drafting round pads all
        # rows to its 1 + 2 x width - 1 columns, a finished row's too
        wide = max([j.width for j in joining] + self.widths.tolist())
        C = max([len(j.prompt) + j.gen_length for j in joining] + self.end.tolist()) + 2 * wide
        if self.cache is None:
            self.cache = allocate_cache(self.net, max(first[0], b + n), max(first[1], C), dev)
        if C > self.cache.length or b + n > self.cache.rows:
            longer = max(C, 2 * self.cache.length) if C > self.cache.length else self.cache.length
            more = max(b + n, min(slots, 2 * self.cache.rows)) if b + n > self.cache.rows else self.cache.rows
            self.cache.grow(longer, b, more)
        if C > self.x.shape[1]:  # the canvases widen to the longest
            extra = C - self.x.shape[1]
            self.x = torch.cat([self.x, self.x.new_full((b, extra), self.mask_id)], 1)
            self.keys = torch.cat([self.keys, self.keys.new_ones(b, extra)], 1)
            self.pos = torch.arange(C, device=dev).expand(b, C).clone()  # a joining row's place is its column
        guesses = max(j.width for j in joining) - 1
        if guesses > self.draft.shape[1]:  # the drafts widen to the widest row's
            self.draft = torch.cat([self.draft, self.draft.new_zeros(b, guesses - self.draft.shape[1])], 1)
        width = self.x.shape[1]
        x = torch.full((n, width), self.mask_id, dtype=torch.long, device=dev)
        segments: list[Segment] = []
        for i, j in enumerate(joining):
            P = len(j.prompt)
            x[i, :P] = torch.tensor(j.prompt, device=dev)
            begin = segments[-1].end if segments else 0
            segments.append(Segment(begin, begin + P, self.cache, b + i, 0, P, causal=True))
            if j.rule is not None:
                self.rules[j.stream] = j.rule
            self.settings[j.stream] = (j.sampling, j.shaping)
        ids = torch.cat([x[i, : len(j.prompt)] for i, j in enumerate(joining)])
        pos = torch.cat([torch.arange(len(j.prompt), device=dev) for j in joining])
        layers = packed_layers(segments, len(self.cache.layers), dev)
        h, _ = self.net.hidden(ids[None], pos[None], None, layers, 0, False)
        last = torch.tensor([seg.end - 1 for seg in segments], device=dev)
        self.x = torch.cat([self.x, x])
        self.keys = torch.cat([self.keys, torch.ones(n, width, dtype=torch.bool, device=dev)])
        self.pos = torch.cat([self.pos, torch.arange(width, device=dev).expand(n, width)])
        ans = torch.tensor([len(j.prompt) for j in joining], device=dev)
        end = ans + torch.tensor([j.gen_length for j in joining], device=dev)
        streams = torch.tensor([j.stream for j in joining], device=dev)
        widths = torch.tensor([j.width for j in joining], device=dev)
        self._lay(streams, ans, end, widths, h[0, last], b, 1)

    def _lay(
        self,
        idx: torch.Tensor,
        ans: torch.Tensor,
        end: torch.Tensor,
        widths: torch.Tensor,
        h: torch.Tensor,
        joined: int,
        prefills: int,
    ) -> None:
        """Rows from `joined` on: their streams, answer spans, draft widths and first tokens (the AR mode's,
        from `h`, the hidden state of each one's last prompt position); `prefills`: the forwards each has taken
        part in."""
        n = len(idx)
        zero = torch.zeros(n, dtype=torch.long, device=self.device)
        fresh = torch.full((n, int((end - ans).max())), self.mask_id, dtype=torch.long, device=self.device)
        first, picked = self._pick(idx, h, lambda: fresh, zero)
        for i, stream in enumerate(idx.tolist()):  # the first token again, under the row's rule
            if stream in self.rules:
                logits, j, sampling = picked[i]
                first[i] = _ruled(logits, j, self.rules[stream], sampling, self.noise, stream, 0)
        rows = torch.arange(joined, joined + n, device=self.device)
        self.x[rows, ans] = first.to(self.x.dtype)
        self.idx, self.ans, self.end = (
            torch.cat([self.idx, idx]),
            torch.cat([self.ans, ans]),
            torch.cat([self.end, end]),
        )
        self.seed_at = torch.cat([self.seed_at, ans])
        self.widths = torch.cat([self.widths, widths])
        self.draft = torch.cat([self.draft, self.draft.new_zeros(n, self.draft.shape[1])])
        self.k = torch.cat([self.k, zero])
        self.forwards = torch.cat([self.forwards, zero + prefills])
        self.live = torch.cat([self.live, ~torch.isin(first, self.stop) & (end - ans > 1)])

    def drop(self, stays: torch.Tensor) -> None:
        """Only rows `stays` (a bool mask) go on, in their order; each moves into the first free slot."""
        assert self.cache is not None
        kept = stays.nonzero().flatten().tolist()
        for slot, src in enumerate(kept):
            if src != slot:
                self.cache.move(src, slot, min(int(self.seed_at[src]) + 1, self.cache.length))
        for name in ("x", "keys", "pos", "ans", "end", "idx", "seed_at", "k", "forwards", "draft", "live", "widths"):
            setattr(self, name, getattr(self, name)[stays])
        staying = set(self.idx.tolist())
        for stream in set(self.rules) - staying:
            del self.rules[stream]
        for stream in set(self.settings) - staying:
            del self.settings[stream]
            self.noise.seeds.pop(stream, None)  # (a running set's streams are never reused)

    def _pick(
        self, streams: torch.Tensor, h: torch.Tensor, history: Callable[[], torch.Tensor], at: torch.Tensor
    ) -> tuple[torch.Tensor, list[tuple[StepLogits, int, Sampling]]]:
        """The AR mode's token at N positions: position n of row `streams[n]` at answer position at[n], from its
        hidden state h[n], under its row's sampler and shaping (after the answer `history()[n]`, made only where
        a row shapes), drawn with the row's number for that position (stream, block 0, step at[n]). Rows of one
        sampler and shaping are chosen together. Returns the tokens (N,) and, for each position, its logits,
        its index in them and its sampler (what a rule redecides it from, `_ruled`)."""
        n, dev, head = len(streams), self.device, self.net.step_head()
        groups: dict[tuple[Sampling, Shaping], list[int]] = {}
        for i, stream in enumerate(streams.tolist()):
            groups.setdefault(self.settings[stream], []).append(i)
        tokens = torch.zeros(n, dtype=torch.long, device=dev)
        picked: list[tuple[StepLogits, int, Sampling]] = [None] * n  # type: ignore[list-item]
        past = history() if any(shaping.active for _, shaping in groups) else None
        for (sampling, shaping), members in groups.items():
            sel = torch.tensor(members, device=dev)
            shaped = None
            if shaping.active:
                assert past is not None
                t = sampling.temperature
                shaped = ar_shaping(shaping, past[sel], at[sel], self.mask_id, self.stop, t, self.pieces)
            logits = StepLogits(head, [h[sel]], 0.0, *(shaped or (None, None)))
            draws = self.noise.at(streams[sel], 0, at[sel].tolist())
            places = Places.counted([1] * len(members), dev)
            tokens[sel], _ = choose(logits, places, sampling, None, draws, self.net.chunk)
            for j, i in enumerate(members):
                picked[i] = (logits, j, sampling)
        return tokens, picked

    def answers(self) -> torch.Tensor:
        """Each row's answer so far (b, the longest answer), masks past its decided part and its end."""
        G = int((self.end - self.ans).max())
        cols = self.ans[:, None] + torch.arange(G, device=self.device)[None, :]
        out = self.x.gather(1, cols.clamp_max(self.x.shape[1] - 1))
        return out.masked_fill(cols >= self.end[:, None], self.mask_id)

    def answer(self, i: int) -> list[int]:
        """Row i's answer, every position after its first stop token that token (what the engine cuts)."""
        out = self.x[i : i + 1, int(self.ans[i]) : int(self.end[i])].clone()
        stop_after(out, 0, self.stop)
        return out[0].tolist()

    def _step(self, seeds: torch.Tensor) -> torch.Tensor:
        """Hidden states (b, d) of each row's seed alone over its cache (a round that neither drafts nor
        verifies: the AR mode's step, with as little around the forward as it needs)."""
        assert self.cache is not None
        s = self.seed_at
        L = int(s.max()) + 1
        k = torch.arange(L, device=seeds.device)[None, :]
        seen = (self.keys[:, :L] & (k < s[:, None])) | (k == s[:, None])
        pos = self.pos.gather(1, s[:, None])
        view = self.cache.view(slice(0, len(s)), L)
        start = int(s[0]) if bool((s == s[0]).all()) else s  # rows side by side: one write into the cache
        h, _ = self.net.hidden(seeds[:, None], pos, seen[:, None, None, :], view, start, False)
        return h[:, 0]

    def _forward(self, ids: torch.Tensor, v: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """Hidden states (b, T) of each row's round `ids` at its own place over its cache: columns [0, v)
        causal (the seed and the draft), [v, e) the masks (all of [0, e)), the rest padding (itself only)."""
        assert self.cache is not None
        T = ids.shape[1]
        s = self.seed_at
        L = int(s.max()) + T
        k = torch.arange(L, device=ids.device)[None, None, :]  # (1, 1, L) key index
        c = torch.arange(T, device=ids.device)[None, :, None]  # (1, T, 1) query column
        j = k - s[:, None, None]  # (b, 1, L) key column inside the round
        v, e = v[:, None, None], e[:, None, None]
        before = self.keys[:, :L][:, None, :] & (j < 0) & (c < e)
        causal = (c < v) & (j >= 0) & (j <= c)
        masks = (c >= v) & (c < e) & (j >= 0) & (j < e)
        pad = (c >= e) & (j == c)
        at = (s[:, None] + torch.arange(T, device=ids.device)[None, :]).clamp_max(self.pos.shape[1] - 1)
        pos = self.pos.gather(1, at)
        view = self.cache.view(slice(0, len(s)), L)
        h, _ = self.net.hidden(ids, pos, (before | causal | masks | pad)[:, None], view, s, False)
        return h

    def round(self) -> int:
        """One round: each row's AR step, or its verify-and-draft forward (`Pace`'s choice); returns the
        positions it computed."""
        with exactly():
            return self._round()

    def _round(self) -> int:
        b, dev = len(self.idx), self.device
        mask_id, stop, live, noise, net = self.mask_id, self.stop, self.live, self.noise, self.net
        began = time.perf_counter()
        self.pace.width = int(self.widths.max())  # the widest row's masks: what a drafting round pads to
        drafts = self.pace.drafts(b, self.k)
        ruled = [i for i, r in enumerate(self.idx.tolist()) if r in self.rules and bool(live[i])]
        self.forwards += 1
        lanes = torch.arange(b, device=dev)
        if not drafts and not ruled:  # the AR mode's step: each row's seed in, its next token out
            seeds = self.x[lanes, self.seed_at]
            t_row = self.seed_at - self.ans + 1
            token, _ = self._pick(self.idx, self._step(seeds), self.answers, t_row)
            at = torch.minimum(self.seed_at + 1, self.end - 1)
            self.x[lanes, at] = torch.where(live, token.to(self.x.dtype), self.x[lanes, at])
            self.seed_at = at  # finished rows too: the rows stay side by side
            self.k = torch.zeros_like(self.k)  # a draft in hand is dropped: it would be verified a round late
            self.live = live & ~torch.isin(token, stop) & (self.seed_at < self.end - 1)
            self.pace.took(False, b, time.perf_counter() - began)  # `live` was read: the round's work is done
            return b
        room = (self.end - 1 - self.seed_at).clamp_min(1)  # answer positions after each seed
        none = torch.zeros_like(self.k)
        k = torch.where(live, torch.minimum(self.k, room - 1), 0) if drafts else none
        m = torch.where(live, torch.minimum(room - k, self.widths), 0) if drafts else none  # the bonus's place first
        m = torch.where(m >= 2, m, 0)  # a single mask drafts nothing: its place is the bonus's
        v, e = 1 + k, 1 + k + m
        T = int(e.max())
        cols = torch.arange(T, device=dev)[None, :]
        ids = torch.full((b, T), mask_id, device=dev, dtype=self.x.dtype)
        ids[:, 0] = self.x[lanes, self.seed_at]
        if T > 1:
            draft_cols = (cols >= 1) & (cols < v[:, None])
            padded = torch.cat([self.draft, self.draft.new_zeros(b, T)], 1)[:, : T - 1]
            ids[:, 1:] = torch.where(draft_cols[:, 1:], padded, mask_id)
        h = self._forward(ids, v, e)
        # the AR mode's token after each causal column: answer position (seed's) + 1 + column
        verify = cols < v[:, None]
        r_of, c_of = verify.nonzero(as_tuple=True)
        t_of = self.seed_at[r_of] - self.ans[r_of] + 1 + c_of

        def history() -> torch.Tensor:  # each column's: the accepted answer, then the draft before it
            past = self.answers()[r_of].clone()
            seed = self.seed_at[r_of] - self.ans[r_of]
            for j in range(1, T):
                sel = c_of >= j
                past[sel, seed[sel] + j] = ids[r_of[sel], j]
            return past

        x0, picked = self._pick(self.idx[r_of], h[r_of, c_of], history, t_of)
        ar = torch.full((b, T), -1, device=dev, dtype=torch.long)
        ar[r_of, c_of] = x0
        flat = torch.cumsum(v, 0) - v  # each row's first verify column in the flat order of r_of, c_of
        for i in ruled:  # rules: column by column
            stream = int(self.idx[i])
            rule, start = self.rules[stream], int(self.seed_at[i] - self.ans[i]) + 1
            ar[i] = -1
            for c in range(int(v[i])):
                logits, j, sampling = picked[int(flat[i]) + c]
                ar[i, c] = _ruled(logits, j, rule, sampling, noise, stream, start + c)
                if c + 1 == int(v[i]) or int(ar[i, c]) != int(ids[i, c + 1]) or rule.ended:
                    break
        agree = (ar[:, : T - 1] == ids[:, 1:]) & (cols[:, 1:] < v[:, None])
        a = agree.long().cumprod(1).sum(1) if T > 1 else torch.zeros(b, dtype=torch.long, device=dev)
        accepted = (a + 1) * live  # a finished row waiting to leave computes its seed again and takes nothing
        written = cols < accepted[:, None]
        at = (self.seed_at[:, None] + 1 + cols).clamp_max(self.x.shape[1] - 1)
        self.x[lanes[:, None], at] = torch.where(written, ar.to(self.x.dtype), self.x[lanes[:, None], at])
        new = written & (at < self.end[:, None])
        if hasattr(net, "drafted"):
            net.drafted += int(k.sum())
            net.accepted += int(a.sum())
        self.pace.saw(int(live.sum()), int(accepted.sum()), drafts and bool(k.any()))
        # the next draft: the masks after the bonus's place, where the whole draft was accepted
        self.k = torch.zeros_like(k)
        whole = (a == k) & (m >= 2) & live
        if bool(whole.any()):
            r = whole.nonzero().flatten()
            span = torch.arange(1, self.draft.shape[1] + 1, device=dev)[None, :]  # mask columns after the bonus's
            mcol = (v[r, None] + span).clamp_max(T - 1)
            first = self.seed_at[r] + accepted[r] + 1 - self.ans[r]  # answer position of each next draft's first
            self.draft[r] = _guess(net, h[r[:, None], mcol], self.idx[r], first, self._guesser)
            self.k[r] = m[r] - 1
        self.seed_at = self.seed_at + accepted
        self.live = live & ~(torch.isin(ar, stop) & new).any(1) & (self.seed_at < self.end - 1)
        self.pace.took(drafts, b * T, time.perf_counter() - began)
        return b * T

    def _guesser(self, hm: torch.Tensor, streams: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """The diffusion mode's guesses, each drawn with the number the AR mode will draw its position with
        (the same stream, block 0, step t): where the two distributions are close the two draws pick the same
        token, so a sampled answer's drafts are accepted about as often as a greedy one's."""
        n, w = hm.shape[:2]
        dev = hm.device
        order = {s: i for i, s in enumerate(self.idx.tolist())}
        rows = torch.tensor([order[s] for s in streams.tolist()], device=dev).repeat_interleave(w)
        span = (self.end - self.ans)[rows]
        t = (first.repeat_interleave(w) + torch.arange(w, device=dev).repeat(n)).clamp_max(span - 1)
        # the accepted answer is each guess's history (the guesses before it are not in it)
        x0, _ = self._pick(streams.repeat_interleave(w), hm.flatten(0, 1), lambda: self.answers()[rows], t)
        return x0.view(n, w)


def _ruled(logits: StepLogits, n: int, rule: Rule, sampling: Sampling, noise: RowNoise, row: int, t: int) -> int:
    """Answer position t of batch row `row`, flat position n of `logits`, under the row's rule: its grammar's
    mask (taken; a dead end ends the answer; where the shaping forbids every token the grammar allows, the
    grammar wins, as in `structured.commit`), its log probability noted; drawn from the stream the AR mode
    draws position t from."""
    if rule.grammar is None:
        scores: torch.Tensor | None = logits(slice(n, n + 1)).float()
    else:
        scores = under_mask(logits, n, rule.grammar.allowed(noise.device))
        if scores is None:
            rule.dead = short_error(rule.grammar.error()) or "the grammar allows no token here"
            rule.ended = True
            return rule.grammar.vocab.eos_id
    assert scores is not None
    places = Places.counted([1], scores.device)
    token = int(sample_with_probability(scores, sampling, places, noise.at([row], 0, t))[0])
    if rule.grammar is not None:
        rule.grammar.take(token)
    if rule.record is not None:
        note(rule.record, scores, token, t)
    return token


def _guess(net: Any, h: torch.Tensor, rows: torch.Tensor, first: torch.Tensor, pick: Guesser) -> torch.Tensor:
    """The next draft (n, W - 1) from the masks' hidden states (n, W - 1, d), drawn by `pick` (the rows' batch
    indices and the answer position of their first drafted token serve a test's oracle)."""
    return pick(h, rows, first)


# (hidden states (n, W - 1, d), batch rows (n,), answer position of each first guess (n,)) -> tokens (n, W - 1)
Guesser = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@torch.no_grad()
def generate_self_spec(
    net: Any,
    prompt: torch.Tensor,
    prompt_mask: torch.Tensor,
    plan: SelfSpecPlan,
    mask_id: int,
    stop_ids: frozenset[int],
    noise: RowNoise,
    cost: ForwardCost | None = None,
    rules: Rules | None = None,
    word_pieces: frozenset[int] = frozenset(),
    learned: Learned | None = None,
) -> torch.Tensor:
    """Self-speculative decoding of a static batch (see the module's text): prompt (B, P) left-padded -> the
    canvas (B, P + gen_length), the rest of a finished row its stop token. `cost`: the forward's cost model for
    the "auto" choice (calibrated here from `net` if not given). `rules`: each row's constraint and
    log-probability record, or None. `learned`: what drafting has yielded in earlier decodes (`pace.Learned`).
    The logit shaping (`nemotron.ar_shaping`) reads, at each verify column,
    the answer before it: the accepted text, then the draft up to that column, as the AR mode's history.
    Finished rows wait in the batch until a quarter of it has finished, then leave together."""
    B, P = prompt.shape
    G = plan.drafting.gen_length
    stop = torch.tensor(sorted(stop_ids), device=prompt.device, dtype=prompt.dtype)
    policy = plan.drafting.drafting
    pace = Pace(policy, plan.drafting.width, cost if cost is not None or policy != "auto" else None, net, learned)
    rows = SpecRows(net, plan, mask_id, stop, noise, pace, word_pieces)
    rows.lay_batch(prompt, prompt_mask, rules)
    out = rows.x[:, : P + G].clone()
    while bool(rows.live.any()):
        if int((~rows.live).sum()) * 4 >= len(rows.live):  # finished rows leave a quarter at a time
            _keep(rows, out, P + G)
        rows.round()
    _keep(rows, out, P + G)
    stop_after(out, P, stop)
    return out


def _keep(rows: SpecRows, out: torch.Tensor, end: int) -> None:
    """Finished rows' canvases into `out` (by stream), and out of the batch."""
    gone = ~rows.live
    if bool(gone.any()):
        out[rows.idx[gone]] = rows.x[gone, :end]
        rows.drop(rows.live)


def allocate_cache(net: Any, rows: int, length: int, device: torch.device) -> KVCache:
    """An empty cache of `rows` slots and `length` positions, its layers, heads, head size and dtype from a
    one-token forward of the model itself (not counted); float32 where attention runs in float32 under
    low-precision weights (`Net.cache_of`)."""
    one = torch.zeros(1, 1, dtype=torch.long, device=device)
    model: Any = getattr(net, "model", net)
    _, kv = model.hidden(one, one, None, None, 0, True)
    k = kv[0][0]
    dtype = torch.float32 if getattr(model, "upcast", False) else k.dtype
    return KVCache.empty(len(kv), rows, k.shape[1], length, k.shape[3], dtype, device)
