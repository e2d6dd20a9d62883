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

from ..params import NO_SHAPING, NO_STRUCTURE, Drafting, Sampling, Shaping, Structure
from ..structured.commit import Rule, Rules, note, short_error, under_mask
from .nemotron import CausalCanvas, ar_shaping, stop_after
from .pace import ForwardCost, Pace
from .predict import Places, StepLogits, choose, sample_with_probability
from .sampling import RowNoise


@dataclass(frozen=True)
class SelfSpecPlan:
    """The parts of the settings self-speculative decoding honours."""

    drafting: Drafting
    sampling: Sampling
    shaping: Shaping = NO_SHAPING
    structure: Structure = NO_STRUCTURE  # the rows' rules come per row (`structured.commit`)


class _Rows:
    """The rows still decoding: their batch indices, the canvas index of each one's seed, its draft (b, width)
    of which the first `k` are real, and the cache over their slots, in the same order."""

    def __init__(self, cv: CausalCanvas, P: int, width: int) -> None:
        B = cv.x.shape[0]
        assert cv.cache is not None
        self.cv, self.cache = cv, cv.cache
        self.idx = torch.arange(B, device=cv.x.device)
        self.seed_at = torch.full((B,), P, dtype=torch.long, device=cv.x.device)
        self.draft = torch.zeros(B, max(width - 1, 1), dtype=torch.long, device=cv.x.device)
        self.k = torch.zeros(B, dtype=torch.long, device=cv.x.device)
        self.keys, self.pos = cv.keys, cv.pos  # the rows' real keys and positions over the canvas

    def keep(self, stays: torch.Tensor) -> None:
        self.idx, self.seed_at, self.draft, self.k = (t[stays] for t in (self.idx, self.seed_at, self.draft, self.k))
        self.keys, self.pos = self.keys[stays], self.pos[stays]
        self.cache.keep(stays)

    def step(self, seeds: torch.Tensor) -> torch.Tensor:
        """Hidden states (b, d) of each row's seed alone over its cache (a round that neither drafts nor
        verifies: the AR mode's step, with as little around the forward as it needs)."""
        s = self.seed_at
        L = int(s.max()) + 1
        k = torch.arange(L, device=seeds.device)[None, :]
        seen = (self.keys[:, :L] & (k < s[:, None])) | (k == s[:, None])
        pos = self.pos.gather(1, s[:, None])
        view = self.cache.view(slice(None), L)
        start = int(s[0]) if bool((s == s[0]).all()) else s  # rows side by side: one write into the cache
        h, _ = self.cv.net.hidden(seeds[:, None], pos, seen[:, None, None, :], view, start, False)
        return h[:, 0]

    def forward(self, ids: torch.Tensor, v: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """Hidden states (b, T) of each row's round `ids` at its own place over its cache: columns [0, v)
        causal (the seed and the draft), [v, e) the masks (all of [0, e)), the rest padding (itself only)."""
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
        view = self.cache.view(slice(None), L)
        h, _ = self.cv.net.hidden(ids, pos, (before | causal | masks | pad)[:, None], view, s, False)
        return h


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
) -> torch.Tensor:
    """Self-speculative decoding (see the module's text): prompt (B, P) left-padded -> the canvas
    (B, P + gen_length), the rest of a finished row its stop token. `cost`: the forward's cost model for the
    "auto" choice (calibrated here from `net` if not given). `rules`: each row's constraint and log-probability
    record, or None. The logit shaping (`nemotron.ar_shaping`) reads, at each verify column, the answer before
    it: the accepted text, then the draft up to that column, as the AR mode's history."""
    B, P = prompt.shape
    G, W = plan.drafting.gen_length, plan.drafting.width
    sampling = plan.sampling
    dev = prompt.device
    cv = CausalCanvas(net, prompt, prompt_mask, G + 2 * W, mask_id)  # room for a round past the answer's end
    stop = torch.tensor(sorted(stop_ids), device=dev, dtype=prompt.dtype)
    h = cv.forward(0, P, causal=True)[:, -1]
    t, shaping = sampling.temperature, plan.shaping
    zero = torch.zeros(B, dtype=torch.long, device=dev)
    opening = cv.logits(h, ar_shaping(shaping, cv.x[:, P : P + G], zero, mask_id, stop, t, word_pieces))
    cv.x[:, P] = opening.pick(sampling, noise.at(list(range(B)), 0, 0), net.chunk)  # the AR mode's first token
    ruled = [b for b, r in enumerate(rules or []) if r is not None]
    for b in ruled:  # the first token again, under the row's rule
        assert rules is not None and rules[b] is not None
        cv.x[b, P] = _ruled(opening.logits, b, rules[b], sampling, noise, b, 0)  # type: ignore[arg-type]
    rows = _Rows(cv, P, W)
    pace = Pace(plan.drafting.drafting, W, cost if cost is not None or plan.drafting.drafting != "auto" else None, net)
    stays = ~torch.isin(cv.x[:, P], stop) & torch.full((B,), G > 1, device=dev)

    def guesser(hm: torch.Tensor, at_rows: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """The diffusion mode's guesses, each drawn with the number the AR mode will draw its position with
        (the same row, block 0, step t): where the two distributions are close the two draws pick the same
        token, so a sampled answer's drafts are accepted about as often as a greedy one's."""
        n, w = hm.shape[:2]
        r = at_rows.repeat_interleave(w)
        t = (first[:, None] + torch.arange(w, device=dev)[None, :]).flatten().clamp_max(G - 1)
        history = cv.x[r, P : P + G]  # the accepted answer (the guesses before each one are not in it)
        shaped = ar_shaping(shaping, history, t, mask_id, stop, sampling.temperature, word_pieces)
        logits = StepLogits(net.step_head(), [hm.flatten(0, 1)], 0.0, *(shaped or (None, None)))
        x0, _ = choose(
            logits, Places.counted([1] * (n * w), dev), sampling, None, noise.at(r, 0, t.tolist()), net.chunk
        )
        return x0.view(n, w)

    live = stays
    while bool(live.any()):
        if int((~live).sum()) * 4 >= len(live):  # finished rows leave a quarter at a time (each copies the cache)
            rows.keep(live)
            live = live[live]
        b = len(rows.idx)
        began = time.perf_counter()
        drafts = pace.drafts(b, rows.k)
        if not drafts and not ruled:  # the AR mode's step: each row's seed in, its next token out
            seeds = cv.x[rows.idx, rows.seed_at]
            t_row = rows.seed_at - P + 1
            shaped = None
            if shaping.active:
                shaped = ar_shaping(shaping, cv.x[rows.idx, P : P + G], t_row, mask_id, stop, t, word_pieces)
            picks = StepLogits(net.step_head(), [rows.step(seeds)], 0.0, *(shaped or (None, None)))
            places = Places.counted([1] * b, dev)
            token, _ = choose(picks, places, sampling, None, noise.at(rows.idx, 0, t_row.tolist()), net.chunk)
            at = (rows.seed_at + 1).clamp_max(P + G - 1)
            cv.x[rows.idx, at] = torch.where(live, token.to(cv.x.dtype), cv.x[rows.idx, at])
            rows.seed_at = (rows.seed_at + 1).clamp_max(P + G - 1)  # finished rows too: the rows stay side by side
            rows.k = torch.zeros_like(rows.k)  # a draft in hand is dropped: it would be verified a round late
            live = live & ~torch.isin(token, stop) & (rows.seed_at < P + G - 1)
            pace.took(False, b, time.perf_counter() - began)  # `live` was read: the round's work is done
            continue
        room = (P + G - 1 - rows.seed_at).clamp_min(1)  # answer positions after each seed
        none = torch.zeros_like(rows.k)
        k = torch.where(live, torch.minimum(rows.k, room - 1), 0) if drafts else none
        m = torch.where(live, torch.clamp(room - k, max=W), 0) if drafts else none  # the bonus's place first
        m = torch.where(m >= 2, m, 0)  # a single mask drafts nothing: its place is the bonus's
        v, e = 1 + k, 1 + k + m
        T = int(e.max())
        cols = torch.arange(T, device=dev)[None, :]
        ids = torch.full((b, T), mask_id, device=dev, dtype=prompt.dtype)
        ids[:, 0] = cv.x[rows.idx, rows.seed_at]
        if T > 1:
            draft_cols = (cols >= 1) & (cols < v[:, None])
            padded = torch.cat([rows.draft, rows.draft.new_zeros(b, T)], 1)[:, : T - 1]
            ids[:, 1:] = torch.where(draft_cols[:, 1:], padded, mask_id)
        h = rows.forward(ids, v, e)
        # the AR mode's token after each causal column: answer position (seed's) + 1 + column
        verify = cols < v[:, None]
        r_of, c_of = verify.nonzero(as_tuple=True)
        t_of = rows.seed_at[r_of] - P + 1 + c_of
        draws = noise.at(rows.idx[r_of], 0, t_of.tolist())
        places = Places.counted([1] * len(r_of), dev)
        shaped = None
        if shaping.active:  # each column's history: the accepted answer, then the draft before it
            history = cv.x[rows.idx[r_of], P : P + G].clone()
            seed = rows.seed_at[r_of] - P
            for j in range(1, T):
                sel = c_of >= j
                history[sel, seed[sel] + j] = ids[r_of[sel], j]
            shaped = ar_shaping(shaping, history, t_of, mask_id, stop, t, word_pieces)
        logits = StepLogits(net.step_head(), [h[r_of, c_of]], 0.0, *(shaped or (None, None)))
        x0, _ = choose(logits, places, sampling, None, draws, net.chunk)
        ar = torch.full((b, T), -1, device=dev, dtype=torch.long)
        ar[r_of, c_of] = x0
        flat = torch.cumsum(v, 0) - v  # each row's first verify column in the flat order of r_of, c_of
        for i in [i for i, r in enumerate(rows.idx.tolist()) if r in ruled and live[i]]:  # rules: column by column
            rule, start = rules[int(rows.idx[i])], int(rows.seed_at[i]) - P + 1  # type: ignore[index]
            assert rule is not None
            ar[i] = -1
            for c in range(int(v[i])):
                n = int(flat[i]) + c
                ar[i, c] = _ruled(logits, n, rule, sampling, noise, int(rows.idx[i]), start + c)
                if c + 1 == int(v[i]) or int(ar[i, c]) != int(ids[i, c + 1]) or rule.ended:
                    break
        agree = (ar[:, : T - 1] == ids[:, 1:]) & (cols[:, 1:] < v[:, None])
        a = agree.long().cumprod(1).sum(1) if T > 1 else torch.zeros(b, dtype=torch.long, device=dev)
        accepted = (a + 1) * live  # a finished row waiting to leave computes its seed again and takes nothing
        written = cols < accepted[:, None]
        at = (rows.seed_at[:, None] + 1 + cols).clamp_max(cv.x.shape[1] - 1)
        cv.x[rows.idx[:, None], at] = torch.where(written, ar.to(cv.x.dtype), cv.x[rows.idx[:, None], at])
        new = written & (at < P + G)
        if hasattr(net, "drafted"):
            net.drafted += int(k.sum())
            net.accepted += int(a.sum())
        pace.saw(int(live.sum()), int(accepted.sum()), drafts and bool(k.any()))
        # the next draft: the masks after the bonus's place, where the whole draft was accepted
        rows.k = torch.zeros_like(k)
        whole = (a == k) & (m >= 2) & live
        if bool(whole.any()):
            r = whole.nonzero().flatten()
            span = torch.arange(1, W, device=dev)[None, :]  # mask columns after the bonus's place
            mcol = (v[r, None] + span).clamp_max(T - 1)
            first = rows.seed_at[r] + accepted[r] + 1 - P  # answer position of each next draft's first token
            rows.draft[r] = _guess(net, h[r[:, None], mcol], rows.idx[r], first, guesser)
            rows.k[r] = m[r] - 1
        rows.seed_at = rows.seed_at + accepted
        live = live & ~(torch.isin(ar, stop) & new).any(1) & (rows.seed_at < P + G - 1)
        pace.took(drafts, b * T, time.perf_counter() - began)
    stop_after(cv.x[:, : P + G], P, stop)
    return cv.x[:, : P + G]
