"""Randomness shared by every decoder: per-row random streams, counted rather than drawn, the order
noise that picks which positions commit first, and the logit shaping (presence penalty, min_tokens,
subword min-p). Token choice itself is `predict`'s.

An answer must depend only on its own request. So every row has its own stream, keyed by (row, block,
step) from the row's seed, its prompt and that (block, step) alone (vLLM seeds per request the same way).
The prompt is part of the seed so that a thousand prompts run with one seed do not all share one noise
sequence, which would make their answers alike. Within a stream each number is a pure function of the
key, a lane (one per use in a step) and a counter (`Draws`): every row's numbers for a step come from a
few elementwise integer operations on the device, whatever the number of rows, and what other rows do,
how many share the batch and how many numbers came before cannot change a row's numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial

import torch

from ..params import Shaping

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
    leave early (early exit) do not shift anyone's stream. `seeds` are the rows' own (`request_seed`);
    `given` the requests' seeds as given, for a decoder that draws as a family's own code does (DiffusionGemma's
    `noise: torch`)."""

    def __init__(self, seeds: Sequence[int], device: torch.device, given: Sequence[int] = ()) -> None:
        self.seeds = dict(enumerate(seeds))  # by row (a running set's: by stream, while it is in flight)
        self.device = device
        self.given = list(given)

    def at(self, rows: torch.Tensor | Sequence[int], block: int | Sequence[int], step: int | Sequence[int]) -> Draws:
        """The draws of `rows` at (block, step): one (block, step) for all of them, or one per row."""
        rs = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
        blocks = [block] * len(rs) if isinstance(block, int) else list(block)
        steps = [step] * len(rs) if isinstance(step, int) else list(step)
        return Draws([stream_seed(self.seeds[r], b, i) for r, b, i in zip(rs, blocks, steps)], self.device)


# A stream's lanes: one independent sequence per use within a step, so that the numbers that sample the
# tokens are not reused to order the positions.
SAMPLE, ORDER, TRANSFER = 0, 1, 2
_LANE = 1 << 56  # lane l's counters start at l * 2**56: no use draws that many numbers for one row

_GAMMA, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _int64(c: int) -> int:
    """The int64 with the bits of the unsigned 64-bit c."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """z's int64 bits shifted right by k, zeros shifted in (torch's >> copies the sign bit)."""
    return torch.bitwise_right_shift(z, k).bitwise_and_((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function, in place on int64 z (multiplication wraps as unsigned arithmetic)."""
    z ^= _shr(z, 30)
    z *= _int64(_MIX1)
    z ^= _shr(z, 27)
    z *= _int64(_MIX2)
    z ^= _shr(z, 31)
    return z


class Draws:
    """One step's random numbers for a set of rows, computed at once on the device: number i of a row
    in lane l is SplitMix64's output `mix(key + (l * 2**56 + i + 1) * gamma)` for the row's key
    (`stream_seed` of its seed, block and step). Each number is a pure function of (row seed, block, step,
    lane, i), a counter, never a draw in sequence: a row's numbers cannot depend on which rows, or how many,
    are drawn beside it, nor on how many numbers anyone drew before, and they are the same integers on
    every device. `keys` come one per row, in the order the rows are given."""

    def __init__(self, keys: Sequence[int], device: torch.device) -> None:
        self.keys = torch.tensor(list(keys), dtype=torch.long, device=device)

    def __len__(self) -> int:
        return self.keys.numel()

    def uniform(self, shape: tuple[int, ...], dtype: torch.dtype, lane: int) -> torch.Tensor:
        """(rows, *shape) uniforms in (0, 1): a row's numbers 0, 1, ... in row-major order over shape."""
        index = torch.arange(math.prod(shape), device=self.keys.device).view(shape)
        return _unit(_bits(self.keys.view(-1, *[1] * len(shape)), index, lane), dtype)

    def uniform_at(self, rows: torch.Tensor, index: torch.Tensor, lane: int) -> torch.Tensor:
        """float64 uniforms (N, K) in (0, 1): entry (n, c) is number index[n, c] of row rows[n]."""
        return _unit(_bits(self.keys[rows][:, None], index, lane), torch.float64)

    def gumbel(self, shape: tuple[int, ...], dtype: torch.dtype, lane: int) -> torch.Tensor:
        """Standard Gumbel noise (rows, *shape), from `uniform`."""
        return gumbel_of(self.uniform(shape, dtype, lane))


def _bits(keys: torch.Tensor, index: torch.Tensor, lane: int) -> torch.Tensor:
    """64 random bits (as int64) for each counter in `index`, keys broadcast against it."""
    return _mix(keys + (index + (lane * _LANE + 1)).mul_(_int64(_GAMMA)))


def _unit(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Uniforms in (0, 1), exact in dtype: the top 52 bits (float64) or 23 (float32) plus half a step (one
    bit more and n + 1/2 would round, up to 1 itself at the top)."""
    width = 52 if dtype == torch.float64 else 23
    return _shr(bits, 64 - width).to(dtype).add_(0.5).mul_(2.0**-width)


def gumbel_of(u: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise from uniforms in (0, 1) (the one place the transform is written)."""
    return -torch.log(-torch.log(u))


def order_scores(
    confidence: torch.Tensor, order_temperature: float, fade: float | torch.Tensor, draws: Draws
) -> torch.Tensor:
    """Scores that choose which positions a step commits: the confidence itself, or with
    order_temperature > 0 the log-confidence plus Gumbel noise of scale order_temperature * fade, where
    `fade` (a number, or one per row as (B, 1)) is the share of the block still to commit, falling from 1
    to 0 as the block fills (MaskGIT's "choice temperature", Chang et al. 2022). A confidence at or below
    zero (a `lead` whose sampled token is not the favourite) is floored, so the noise alone orders those."""
    if order_temperature == 0:
        return confidence
    log_conf = torch.log(confidence.float().clamp_min(1e-12))
    return log_conf + order_temperature * fade * draws.gumbel(tuple(log_conf.shape[1:]), log_conf.dtype, ORDER)


def shape_masked(
    logits: torch.Tensor,
    where: torch.Tensor,
    answer: torch.Tensor | None,
    offset: torch.Tensor,
    s: Shaping,
    mask_id: int,
    stop: torch.Tensor,
    temperature: float = 0.0,
    word_pieces: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits (N, V) of a block's masked positions, each one's row and block column in where (N, 2) (the
    rows of `masked.nonzero()` for a block's mask (b, T), or a part of them), given each row's answer
    so far (b, A; mask_id where nothing is committed or outside the answer; needed only for the penalty)
    and the answer position of each row's first block column (offset: (b,)): minus presence_penalty on
    every token the row has committed in its answer, no stop token at an answer position below
    min_tokens, and, when sampling at `temperature`, no piece of `word_pieces` (the ids of the pieces that
    continue a word) less likely than subword_min_p times the likeliest token."""
    if not s.active:
        return logits
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


Shaper = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, where) -> logits, `shaper`'s


def shaper(
    s: Shaping,
    answer: torch.Tensor | None,
    offset: torch.Tensor,
    mask_id: int,
    stop: torch.Tensor,
    temperature: float,
    word_pieces: torch.Tensor | None,
) -> Shaper | None:
    """`shape_masked` for a step's rows, as (logits, where) -> logits (`predict.StepLogits.shape`); None
    where the shaping changes nothing."""
    if not s.active:
        return None
    return partial(
        shape_masked, answer=answer, offset=offset, s=s, mask_id=mask_id, stop=stop,
        temperature=temperature, word_pieces=word_pieces,
    )  # fmt: skip
