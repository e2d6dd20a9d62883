"""Token choice for every decoder that samples as LLaDA does (reference, fast, the block decoders,
Nemotron's): which tokens sampling may pick, the draw among them, and the confidence of the pick. Computed
only where it is used: the masked positions, and for sampling only the tokens the filters leave.

The filters, on scores = logits / temperature in float64 (low-precision Gumbel sampling lowers the
effective temperature: Zheng et al. 2024, "Masked Diffusion Models are Secretly Time-Agnostic Masked Models
and Exploit Inaccurate Categorical Sampling"), in this order: top-k keeps the k likeliest; top-p the
smallest set holding p of the (top-k filtered) mass; min-p (Nguyen et al. 2024) drops tokens less likely
than min_p times the top one. A draw among the survivors alone samples softmax(scores) restricted to them,
the distribution of the whole vocabulary with the others at -inf; it takes one random number per position
(`draw`, by inverse CDF), number j of the row's own stream for its j-th masked position (`sampling.Draws`),
so what a row draws depends only on its own positions and candidates (README, "Reproducible answers").

The confidence of x0 (higher is surer): prob = p(x0); margin = p(top1) - p(top2) (Dream's, blind to
which token was sampled); lead = p(x0) minus the largest probability of any other token, so a sampled
token that is not the favourite has a negative lead and waits for more context (at temperature 0, lead =
margin); entropy = exp(-H(p)). The whole-vocabulary definitions of the filters and the confidence are kept
as the tests' oracles (tests/oracles.py).

A step's logits are made from the hidden states of the positions it predicts a chunk at a time
(`StepLogits`, `choose`, `in_chunks`): a wide batch on a long block holds at most `Net.chunk` positions'
logits at once (`arch.memory_sizes.logit_chunk`), and nothing a position gets depends on the chunks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..params import Confidence, Sampling
from .sampling import SAMPLE, Draws


def candidates(logits: torch.Tensor, s: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """For logits (N, V): token ids (N, K) by falling logit (min-p alone: by token id) and their float64
    scores (logit / temperature) with the tokens that top-k, top-p and min-p exclude at -inf, as
    the filters (above) decide over the whole vocabulary. Positions whose last candidate survives
    are redone with four times as many, until it does not: every filter keeps a prefix of the tokens
    sorted by score, so then no survivor is left out."""
    if s.min_p > 0 and s.top_k == 0 and s.top_p == 1.0:
        return _min_p_candidates(logits, s)
    V = logits.shape[-1]
    K = min(V, s.top_k + 1 if s.top_k > 0 else 16)  # top-k: one past the k-th, so a tie there shows
    ids, scores = _sorted_candidates(logits, s, K)
    redo = torch.nonzero(scores[:, -1] > float("-inf")).flatten()
    while redo.numel() and K < V:
        K = min(V, K * 4)
        more_ids, more_scores = _sorted_candidates(logits[redo], s, K)
        width = more_ids.shape[1] - ids.shape[1]
        ids = torch.cat([ids, ids.new_zeros(ids.shape[0], width)], 1).index_copy(0, redo, more_ids)
        scores = torch.cat([scores, scores.new_full((scores.shape[0], width), float("-inf"))], 1)
        scores = scores.index_copy(0, redo, more_scores)
        redo = redo[more_scores[:, -1] > float("-inf")]
    return ids, scores


def _min_p_candidates(logits: torch.Tensor, s: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """min-p alone keeps the tokens within log(min_p) of the top score: found by one comparison over the
    vocabulary (a float32 superset, then the exact float64 test on it), no top-k. Candidates come in
    token-id order, padded with -inf: an order that does not depend on the batch either."""
    top = logits.amax(-1, keepdim=True)
    rows, cols = torch.nonzero(logits >= top + s.temperature * math.log(s.min_p) - 1e-3, as_tuple=True)
    N = logits.shape[0]
    count = torch.bincount(rows, minlength=N)
    slot = torch.arange(rows.numel(), device=rows.device) - (count.cumsum(0) - count)[rows]
    width = int(count.max())
    ids = rows.new_zeros(N, width)
    ids[rows, slot] = cols
    scores = torch.full((N, width), float("-inf"), dtype=torch.float64, device=logits.device)
    scores[rows, slot] = logits[rows, cols].double() / s.temperature
    floor = top.double() / s.temperature + math.log(s.min_p)  # max score + log(min_p), in float64
    return ids, scores.masked_fill(scores < floor, float("-inf"))


def _sorted_candidates(logits: torch.Tensor, s: Sampling, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top K of each row in a canonical order (falling logit, then rising id, so that ties rank alike
    whatever K and the batch are), with their filtered float64 scores."""
    values, ids = logits.topk(K, dim=-1)
    ids, perm = ids.sort(-1)
    values, perm = values.gather(-1, perm).sort(dim=-1, descending=True, stable=True)
    return ids.gather(-1, perm), _filter_sorted(values.double() / s.temperature, logits, s)


def _filter_sorted(scores: torch.Tensor, logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """The filters on the top-K scores (N, K) sorted falling; `logits` (N, V) give top-p its mass."""
    kth = None
    if 0 < s.top_k < logits.shape[-1]:
        kth = scores[:, s.top_k - 1 : s.top_k]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if s.top_p < 1.0:  # the mass is that of the whole (top-k filtered) vocabulary, in float64
        full = logits.double() / s.temperature
        if kth is not None:
            full = full.masked_fill(full < kth, float("-inf"))
        probs = (scores - full.logsumexp(-1, keepdim=True)).exp()
        drop = probs.cumsum(-1) - probs >= s.top_p  # mass before this token already reaches top_p
        scores = scores.masked_fill(drop, float("-inf"))
    if s.min_p > 0:
        scores = scores.masked_fill(scores < scores[:, :1] + math.log(s.min_p), float("-inf"))
    return scores


def survivors(logits: torch.Tensor, s: Sampling) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The tokens sampling may pick and their float64 scores (logit / temperature, excluded ones at
    -inf): `candidates`, or with no filter every token id (ids None: a score's column is its id)."""
    if s.top_k == 0 and s.top_p == 1.0 and s.min_p == 0:
        return None, logits.double() / s.temperature
    return candidates(logits, s)


@dataclass(frozen=True)
class Places:
    """Where each of N positions laid out flat sits: its row in the step's batch, and which number of that
    row's stream it draws with (its place among the row's masked positions, or its column where a decoder
    draws by column). Sliced with its positions, so a chunk of them keeps its numbers."""

    row: torch.Tensor  # (N,) long
    nth: torch.Tensor  # (N,) long

    @staticmethod
    def counted(counts: list[int], device: torch.device) -> Places:
        """Rows after rows, row b with counts[b] positions numbered 0, 1, ... in it."""
        counts_t = torch.tensor(counts, device=device, dtype=torch.long)
        N = sum(counts)
        row = torch.repeat_interleave(torch.arange(len(counts), device=device), counts_t, output_size=N)
        return Places(row, torch.arange(N, device=device) - (counts_t.cumsum(0) - counts_t)[row])

    @staticmethod
    def columns(where: torch.Tensor) -> Places:
        """From `mask.nonzero()` (N, 2): each position numbered by its column."""
        return Places(where[:, 0], where[:, 1])

    def __len__(self) -> int:
        return self.row.shape[0]

    def __getitem__(self, part: slice) -> Places:
        return Places(self.row[part], self.nth[part])


def guide(cond: torch.Tensor, un: torch.Tensor, cfg_scale: float) -> torch.Tensor:
    """Classifier-free guidance (LLaDA): un + (s + 1) * (cond - un)."""
    return un + (cfg_scale + 1) * (cond - un)


@dataclass(frozen=True)
class StepLogits:
    """The logits of a step's N predicted positions, made a part at a time from their hidden states (N, d)
    in each view: the canvas's, guided under classifier-free guidance by the unconditional view's (hs[1]),
    then shaped by `shape(logits, where[part])` (`sampling.shape_masked`; where: (N, 2), each position's
    row and block column)."""

    head: Callable[[torch.Tensor], torch.Tensor]
    hs: list[torch.Tensor]
    cfg_scale: float = 0.0
    shape: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    where: torch.Tensor | None = None

    def __call__(self, part: slice) -> torch.Tensor:
        logits = self.head(self.hs[0][part])
        if len(self.hs) > 1:
            logits = guide(logits, self.head(self.hs[1][part]), self.cfg_scale)
        if self.shape is not None:
            assert self.where is not None, "shaping needs each position's row and column"
            logits = self.shape(logits, self.where[part])
        return logits


def choose(
    logits: StepLogits, places: Places, s: Sampling, confidence: Confidence | None, draws: Draws, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """x0 and its confidence, (N,) each, for the positions at `places`, their logits made `chunk` positions
    at a time (`in_chunks`): `sample_masked` and the confidence `confidence` of the whole vocabulary, or
    with None `sample_with_probability` (the probability under the filtered distribution)."""

    def step(part: slice) -> tuple[torch.Tensor, ...]:
        scores = logits(part)
        if confidence is None:
            return sample_with_probability(scores, s, places[part], draws)
        x0 = sample_masked(scores, s, places[part], draws)
        return x0, confidence_masked(scores, x0, confidence)

    x0, conf = in_chunks(len(places), chunk, step)
    return x0, conf


def in_chunks(n: int, size: int, step: Callable[[slice], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """step(part) over the positions [0, n) in parts of at most `size`, each output concatenated in order:
    a step's LM head and sampling hold the logits of `size` positions at a time, never of all n at once
    (`arch.memory_sizes.logit_chunk`). Nothing a position gets depends on the parts: its draw is numbered by its
    `Places`, and its logits are its own row of the head, the same bit for bit in any chunk under the
    batch-invariant mode (`deterministic`; otherwise a matmul's float32 rounding may change with its number
    of rows, as it may with a batch's)."""
    if n <= size:
        return step(slice(0, n))
    parts = [step(slice(i, min(i + size, n))) for i in range(0, n, size)]
    return tuple(torch.cat(outs) for outs in zip(*parts))


def draw(scores: torch.Tensor, places: Places, draws: Draws) -> torch.Tensor:
    """The column (N,) drawn from softmax(scores) at each position, scores (N, K) float64 with excluded
    candidates at -inf: by inverse CDF, the first column whose running mass reaches u times the
    position's whole mass, u being the number its `places` give it in its row's stream. One number per
    position, however many candidates: what a row draws does not depend on K, which its batch mates'
    candidates can widen. Exact in float64 as Gumbel-max is (Zheng et al.'s warning is against low
    precision, not the method), at a cost of one pass over the candidates instead of a random number and
    two logarithms for each."""
    u = draws.uniform_at(places.row, places.nth[:, None], SAMPLE)  # (N, 1), in (0, 1)
    mass = (scores - scores.amax(-1, keepdim=True)).exp().cumsum(-1)  # an excluded candidate adds nothing
    return torch.searchsorted(mass, u * mass[:, -1:]).squeeze(-1).clamp_max(scores.shape[1] - 1)


def sample_masked(logits: torch.Tensor, s: Sampling, places: Places, draws: Draws) -> torch.Tensor:
    """x0 (N,) for the logits (N, V) of masked positions at `places`: argmax at temperature 0, else a draw
    among the survivors (`draw`)."""
    assert len(places) == logits.shape[0] or s.temperature == 0
    if s.temperature == 0:
        return logits.argmax(-1)
    ids, scores = survivors(logits, s)
    choice = draw(scores, places, draws)
    return choice if ids is None else ids.gather(-1, choice[:, None]).squeeze(-1)


def sample_with_probability(
    logits: torch.Tensor, s: Sampling, places: Places, draws: Draws
) -> tuple[torch.Tensor, torch.Tensor]:
    """x0 (N,) as `sample_masked`, and its probability under the filtered distribution (the survivors
    renormalised; at temperature 0 the filters apply at temperature 1), from the same candidates."""
    t = s.temperature if s.temperature > 0 else 1.0
    ids, scores = survivors(logits, s if s.temperature > 0 else replace(s, temperature=t))
    col = scores.argmax(-1) if s.temperature == 0 else draw(scores, places, draws)
    prob = (scores.gather(-1, col[:, None]).squeeze(-1) - scores.logsumexp(-1)).exp().float()
    return (col if ids is None else ids.gather(-1, col[:, None]).squeeze(-1)), prob


def confidence_masked(logits: torch.Tensor, x0: torch.Tensor, kind: Confidence) -> torch.Tensor:
    """The confidence `kind` of x0 (N,) under logits (N, V) (see above), from a log-normaliser and a top-2 instead of a
    softmax over the vocabulary (entropy alone needs the full distribution)."""
    logp = logits.float().log_softmax(-1)  # of the whole vocabulary, as the confidence is defined
    if kind == "entropy":  # p log p is 0 where p is 0 (a token banned by min_tokens has logit -inf)
        return torch.special.xlogy(logp.exp(), logp.exp()).sum(-1).exp()
    chosen = logp.gather(-1, x0[:, None]).squeeze(-1).exp()
    if kind == "prob":
        return chosen
    top2 = logp.topk(2, dim=-1)
    first, second = top2.values.exp().unbind(-1)
    if kind == "margin":
        return first - second
    return chosen - torch.where(x0 == top2.indices[:, 0], second, first)  # lead: p(x0) minus its best rival
