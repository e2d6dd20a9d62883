"""Reference masked-diffusion decoding (LLaDA `generate.py`), as pure functions on token ids.

Nothing here knows about text, files or devices: a decoder takes a `model_fn(ids, key_mask) -> logits`,
a left-padded prompt, its parameters and a `torch.Generator`, and returns the finished canvas.

Canvas: [prompt | MASK x gen_length]. The generation part is split into semi-autoregressive blocks of
`block_length`, decoded left to right. Each step predicts every masked position of the active block and
commits the `k` most confident; k follows a linear schedule. Committed tokens are never remasked.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from .errors import UsageError

ModelFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids (B,L), key_mask (B,L)) -> (B,L,V)
Remasking = Literal["low_confidence", "random"]
REMASKING = ("low_confidence", "random")


@dataclass(frozen=True)
class DecodeParams:
    gen_length: int = 64
    block_length: int = 32
    denoise_steps: int = 64
    temperature: float = 0.0
    remasking: Remasking = "low_confidence"
    cfg_scale: float = 0.0
    min_p: float = 0.0
    order_temperature: float = 0.0

    def __post_init__(self) -> None:
        for name in ("gen_length", "block_length", "denoise_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UsageError(f"{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if not self.temperature >= 0:
            raise UsageError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 <= self.min_p < 1:
            raise UsageError(f"min-p must be in [0, 1), got {self.min_p!r}")
        if not self.order_temperature >= 0:
            raise UsageError(f"order-temperature must be >= 0, got {self.order_temperature!r}")
        if not self.cfg_scale >= 0:
            raise UsageError(f"cfg-scale must be >= 0, got {self.cfg_scale!r}")
        if self.remasking not in REMASKING:
            raise UsageError(f"unknown remasking {self.remasking!r} (choose {' or '.join(REMASKING)})")

    @property
    def block_spans(self) -> list[tuple[int, int]]:
        """(start, end) of each block within the generation part; the last block may be shorter."""
        b = min(self.block_length, self.gen_length)
        return [(s, min(s + b, self.gen_length)) for s in range(0, self.gen_length, b)]

    @property
    def steps_per_block(self) -> list[int]:
        return split_steps(self.denoise_steps, len(self.block_spans))


def split_steps(steps: int, num_blocks: int) -> list[int]:
    """Spread `steps` over the blocks: equal shares, the remainder to the first blocks, and at least one
    step per block (so fewer steps than blocks runs one step per block)."""
    base, extra = divmod(steps, num_blocks)
    return [max(1, base + (1 if i < extra else 0)) for i in range(num_blocks)]


def num_transfer_tokens(mask_count: torch.Tensor, steps: int) -> torch.Tensor:
    """Linear schedule: (B,) masked counts -> (B, steps) tokens to commit per step (LLaDA)."""
    base = mask_count // steps
    remainder = mask_count % steps
    sched = base[:, None].repeat(1, steps)
    sched += (torch.arange(steps, device=mask_count.device)[None, :] < remainder[:, None]).long()
    return sched


def add_gumbel_noise(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None, min_p: float = 0.0
) -> torch.Tensor:
    """Perturbed scores whose argmax samples softmax(logits / temperature), restricted by min-p.

    The noise is drawn in float64: low-precision Gumbel sampling lowers the effective temperature and
    hurts diversity (Zheng et al. 2024, "Masked Diffusion Models are Secretly Time-Agnostic Masked Models
    and Exploit Inaccurate Categorical Sampling"). min-p (Nguyen et al. 2024, "Turning Up the Heat: Min-p
    Sampling") drops every token whose tempered probability is below min_p times the top token's, which
    cuts the misspelt tail a high temperature lets in and keeps the spread among plausible tokens; it is a
    comparison with the row maximum, no sort. At temperature 0 the logits are returned as they are.
    """
    if temperature == 0:
        return logits
    scores = logits.double() / temperature
    if min_p > 0:
        floor = scores.amax(-1, keepdim=True) + math.log(min_p)
        scores = scores.masked_fill(scores < floor, float("-inf"))
    return scores + gumbel_like(scores, generator)


def gumbel_like(t: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Standard Gumbel noise of t's shape, dtype and device."""
    u = torch.rand(t.shape, dtype=t.dtype, device=t.device, generator=generator)
    return -torch.log(-torch.log(u.clamp_min(torch.finfo(t.dtype).tiny)))


def order_scores(
    confidence: torch.Tensor, order_temperature: float, step: int, steps: int, generator: torch.Generator | None
) -> torch.Tensor:
    """Scores that choose which positions a step commits: the confidence itself, or with
    order_temperature > 0 the log-confidence plus Gumbel noise whose scale falls linearly to 0 over the
    block's steps (MaskGIT's "choice temperature", Chang et al. 2022). Committing strictly the most
    confident positions first fills a wide block with its safest, most generic tokens; the noise lets less
    certain positions go early while the last commits of a block stay confidence-ordered. A confidence at
    or below zero (a `lead` whose sampled token is not the favourite) is floored, so those positions share
    the bottom rank and the noise alone orders them."""
    if order_temperature == 0:
        return confidence
    tau = order_temperature * (1 - step / steps)
    log_conf = torch.log(confidence.float().clamp_min(1e-12))
    return log_conf + tau * gumbel_like(log_conf, generator)


def select_top_k(confidence: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Boolean mask of the k[b] highest-confidence positions per row; ties go to the leftmost.
    confidence: (B, T) with -inf on positions that may not be chosen."""
    order = confidence.argsort(dim=1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
    return (rank < k[:, None]) & (confidence > float("-inf"))


def guided_logits(
    model_fn: ModelFn, x: torch.Tensor, key_mask: torch.Tensor, prompt_len: int, cfg_scale: float, mask_id: int
) -> torch.Tensor:
    """Logits, with classifier-free guidance when cfg_scale > 0: un + (s + 1) * (cond - un), where the
    unconditional pass sees the prompt masked."""
    if cfg_scale == 0:
        return model_fn(x, key_mask)
    un_x = x.clone()
    un_x[:, :prompt_len] = torch.where(key_mask[:, :prompt_len], mask_id, x[:, :prompt_len])
    logits = model_fn(torch.cat([x, un_x]), torch.cat([key_mask, key_mask]))
    cond, un = logits.chunk(2)
    return un + (cfg_scale + 1) * (cond - un)


@torch.no_grad()
def generate_reference(
    model_fn: ModelFn,
    prompt: torch.Tensor,
    prompt_mask: torch.Tensor,
    params: DecodeParams,
    mask_id: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """LLaDA reference decoding. prompt: (B, P) left-padded ids; prompt_mask: (B, P) True on real tokens.
    Returns the canvas (B, P + gen_length) with no mask left."""
    B, P = prompt.shape
    x = torch.cat([prompt, prompt.new_full((B, params.gen_length), mask_id)], dim=1)
    key_mask = torch.cat([prompt_mask, prompt_mask.new_ones(B, params.gen_length)], dim=1)
    for (bs, be), steps in zip(params.block_spans, params.steps_per_block):
        s, e = P + bs, P + be
        schedule = num_transfer_tokens((x[:, s:e] == mask_id).sum(1), steps)
        for i in range(steps):
            logits = guided_logits(model_fn, x, key_mask, P, params.cfg_scale, mask_id)[:, s:e]
            x0 = add_gumbel_noise(logits, params.temperature, generator, params.min_p).argmax(-1)  # (B, T)
            if params.remasking == "low_confidence":
                probs = F.softmax(logits.float(), dim=-1)
                confidence = probs.gather(-1, x0[..., None]).squeeze(-1)
                confidence = order_scores(confidence, params.order_temperature, i, steps, generator)
            else:
                confidence = torch.rand(x0.shape, device=x.device, generator=generator)
            masked = x[:, s:e] == mask_id
            confidence = torch.where(masked, confidence.float(), float("-inf"))
            commit = select_top_k(confidence, schedule[:, i])
            x[:, s:e] = torch.where(commit, x0, x[:, s:e])
    return x
