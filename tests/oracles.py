"""The sampling maths over the whole vocabulary, as each quantity is defined: the oracles that the
decoders' lean versions (`decode.predict`: survivors only, masked positions only) are tested against."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from celeris_cli.decode.sampling import SAMPLE, Draws
from celeris_cli.params import Confidence, Sampling


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


def sample_tokens(logits: torch.Tensor, s: Sampling, draws: Draws) -> torch.Tensor:
    """x0 (B, T) for logits (B, T, V): argmax at temperature 0, else Gumbel-max over the filtered scores,
    which samples softmax(logits / temperature) restricted to the surviving tokens."""
    if s.temperature == 0:
        return logits.argmax(-1)
    scores = filtered_scores(logits, s)
    return (scores + draws.gumbel(tuple(scores.shape[1:]), scores.dtype, SAMPLE)).argmax(-1)


def confidence_of(logits: torch.Tensor, x0: torch.Tensor, kind: Confidence) -> torch.Tensor:
    """How sure the model is of x0, per position; higher is surer. prob = p(x0); margin = p(top1) -
    p(top2) (Dream's, blind to which token was sampled); lead = p(x0) minus the largest probability of any
    other token, so a sampled token that is not the favourite has a negative lead and waits for more
    context (at temperature 0, lead = margin); entropy = exp(-H(p))."""
    probs = F.softmax(logits.float(), dim=-1)
    if kind == "prob":
        return probs.gather(-1, x0[..., None]).squeeze(-1)
    if kind in ("margin", "lead"):
        top2 = probs.topk(2, dim=-1)
        first, second = top2.values.unbind(-1)
        if kind == "margin":
            return first - second
        chosen = probs.gather(-1, x0[..., None]).squeeze(-1)  # its best rival: the runner-up or the favourite
        return chosen - torch.where(x0 == top2.indices[..., 0], second, first)
    return torch.exp((probs * torch.log(probs.clamp_min(1e-12))).sum(-1))
