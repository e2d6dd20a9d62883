"""Randomness and token choice shared by every decoder: per-row random streams, Gumbel sampling with
min-p / top-k / top-p, and the order noise that picks which positions commit first.

An answer must depend only on its own request. So every row draws from its own stream, and the stream for
(row, block, step) is seeded from the row's seed, its prompt and that (block, step) alone: what other rows
do, how many rows share the batch and how many draws came before cannot change a row's draws (vLLM seeds
per request the same way). The prompt is part of the seed so that a thousand prompts run with one seed
do not all share one noise sequence, which would make their answers alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..params import Sampling, Shaping

_MASK64 = 2**64 - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def stream_seed(seed: int, block: int, step: int) -> int:
    """A 63-bit seed for one row's draws at (block, step); distinct inputs give unrelated streams."""
    return _splitmix64(_splitmix64(_splitmix64(seed) ^ block) ^ step) >> 1


def request_seed(seed: int, prompt_ids: Sequence[int]) -> int:
    """The row's seed: the request's seed mixed with its prompt's token ids."""
    h = _splitmix64(seed)
    for t in prompt_ids:
        h = _splitmix64(h ^ t)
    return h


class RowNoise:
    """Per-row random streams for one batch. `rows` index the batch as it was first given, so rows that
    leave early (early exit) do not shift anyone's stream. `seeds` are the rows' own (`request_seed`)."""

    def __init__(self, seeds: Sequence[int], device: torch.device) -> None:
        self.seeds = list(seeds)
        self.device = device

    def at(self, rows: torch.Tensor | Sequence[int], block: int, step: int) -> list[torch.Generator]:
        return [
            torch.Generator(device=self.device).manual_seed(stream_seed(self.seeds[r], block, step))
            for r in (rows.tolist() if isinstance(rows, torch.Tensor) else rows)
        ]


def uniform(
    shape: tuple[int, ...], gens: list[torch.Generator], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """(len(gens), *shape) uniform draws, row b from gens[b]."""
    return torch.stack([torch.rand(shape, dtype=dtype, device=device, generator=g) for g in gens])


def gumbel(
    shape: tuple[int, ...], gens: list[torch.Generator], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Standard Gumbel noise, (len(gens), *shape), row b from gens[b]."""
    u = uniform(shape, gens, dtype, device)
    return -torch.log(-torch.log(u.clamp_min(torch.finfo(dtype).tiny)))


def filtered_scores(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """log-probabilities up to a constant at temperature s.temperature, with the tokens that top-k, top-p
    and min-p exclude set to -inf. In float64: low-precision Gumbel sampling lowers the effective
    temperature (Zheng et al. 2024, "Masked Diffusion Models are Secretly Time-Agnostic Masked Models and
    Exploit Inaccurate Categorical Sampling"). min-p (Nguyen et al. 2024) drops tokens less likely than
    min_p times the top one; top-k keeps the k likeliest; top-p the smallest set holding p of the mass."""
    scores = logits.double() / s.temperature
    if s.top_k > 0 and s.top_k < scores.shape[-1]:
        kth = scores.topk(s.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        probs = sorted_scores.softmax(-1)
        drop = probs.cumsum(-1) - probs >= s.top_p  # mass before this token already reaches top_p
        scores = scores.scatter(-1, order, sorted_scores.masked_fill(drop, float("-inf")))
    if s.min_p > 0:
        floor = scores.amax(-1, keepdim=True) + math.log(s.min_p)
        scores = scores.masked_fill(scores < floor, float("-inf"))
    return scores


def sample_tokens(logits: torch.Tensor, s: Sampling, gens: list[torch.Generator]) -> torch.Tensor:
    """x0 (B, T) for logits (B, T, V): argmax at temperature 0, else Gumbel-max over the filtered scores,
    which samples softmax(logits / temperature) restricted to the surviving tokens."""
    if s.temperature == 0:
        return logits.argmax(-1)
    scores = filtered_scores(logits, s)
    return (scores + gumbel(tuple(scores.shape[1:]), gens, scores.dtype, scores.device)).argmax(-1)


def order_scores(
    confidence: torch.Tensor, order_temperature: float, fade: float | torch.Tensor, gens: list[torch.Generator]
) -> torch.Tensor:
    """Scores that choose which positions a step commits: the confidence itself, or with
    order_temperature > 0 the log-confidence plus Gumbel noise of scale order_temperature * fade, where
    `fade` (a number, or one per row as (B, 1)) is the share of the block still to commit, falling from 1
    to 0 as the block fills (MaskGIT's "choice temperature", Chang et al. 2022). A confidence at or below
    zero (a `lead` whose sampled token is not the favourite) is floored, so the noise alone orders those."""
    if order_temperature == 0:
        return confidence
    log_conf = torch.log(confidence.float().clamp_min(1e-12))
    noise = gumbel(tuple(log_conf.shape[1:]), gens, log_conf.dtype, log_conf.device)
    return log_conf + order_temperature * fade * noise


def shape_masked(
    logits: torch.Tensor,
    masked: torch.Tensor,
    answer: torch.Tensor | None,
    offset: torch.Tensor,
    s: Shaping,
    mask_id: int,
    stop: torch.Tensor,
    temperature: float = 0.0,
    word_pieces: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits (N, V) of a block's masked positions in row order (masked: (b, T)), given each row's answer
    so far (b, A; mask_id where nothing is committed or outside the answer; needed only for the penalty)
    and the answer position of each row's first block column (offset: (b,)): minus presence_penalty on
    every token the row has committed in its answer, no stop token at an answer position below
    min_tokens, and, when sampling at `temperature`, no piece of `word_pieces` (the ids of the pieces that
    continue a word) less likely than subword_min_p times the likeliest token."""
    if not s.active:
        return logits
    where = masked.nonzero()  # (N, 2): row and column of each logit row, row-major as the logits are
    V = logits.shape[-1]
    if s.presence_penalty > 0:
        assert answer is not None, "the presence penalty needs the answer so far"
        committed = torch.where(answer == mask_id, V, answer).clamp_max(V)  # masks land in a spare column
        seen = torch.zeros(answer.shape[0], V + 1, device=logits.device).scatter_(1, committed, 1.0)[:, :V]
        logits = logits.float() - s.presence_penalty * seen[where[:, 0]]
    if s.min_tokens > 0:
        early = offset[where[:, 0]] + where[:, 1] < s.min_tokens  # (N,)
        banned = torch.zeros(V, dtype=torch.bool, device=logits.device)
        banned[stop[stop < V]] = True
        logits = logits.masked_fill(early[:, None] & banned[None, :], float("-inf"))
    if s.subword_min_p > 0 and temperature > 0 and word_pieces is not None and word_pieces.numel():
        # min-p's test on the sampled distribution: p / p_max < m  <=>  logit < max + temperature * log(m)
        piece = torch.zeros(V, dtype=torch.bool, device=logits.device)
        piece[word_pieces[word_pieces < V]] = True
        scores = logits.float()  # one cast: the floor and the test read the same values
        floor = scores.amax(-1, keepdim=True) + temperature * math.log(s.subword_min_p)
        logits = scores.masked_fill(piece[None, :] & (scores < floor), float("-inf"))
    return logits
