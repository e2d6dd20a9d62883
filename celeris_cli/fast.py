"""Fast masked-diffusion decoding: KV cache, confidence-threshold parallel commits and early exit.

Pure functions on token ids, like `decoding`, but they need a cache-aware model boundary (`Net`):
`hidden(ids, positions, key_mask, cache, start) -> (h, kv)` and `head(h) -> logits`.

- Threshold decoding (Fast-dLLM): each step commits every masked position of the active block whose
  confidence is >= `threshold`, and always at least the schedule's share (at least one), so the step
  count never exceeds `denoise_steps`. Vectorised over the batch; no per-row Python loop.
- KV cache (Fast-dLLM, block-wise approximate): at the start of each block one full forward refreshes
  keys/values of the whole canvas; the following steps recompute only the block and the suffix
  (`prefix`), or only the block (`dual`), attending to the cached rest.
- Early exit (dInfer): a row whose committed text holds a stop token with everything before it decoded
  is finished; its remaining masks are filled with that stop token, and it leaves the batch at the next
  block boundary. When every row is finished, decoding stops.
- The LM head runs only on the active block; at temperature 0 there is no float64 and no Gumbel noise on
  the tokens (an order temperature, when set, still draws the order noise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn.functional as F

from .decoding import DecodeParams, add_gumbel_noise, num_transfer_tokens, order_scores, select_top_k
from .errors import UsageError
from .model import KV

CacheMode = Literal["none", "prefix", "dual"]
Confidence = Literal["prob", "margin", "lead", "entropy"]
CACHE_MODES = ("none", "prefix", "dual")
CONFIDENCES = ("prob", "margin", "lead", "entropy")


@dataclass(frozen=True)
class FastParams(DecodeParams):
    threshold: float = 0.9
    cache: CacheMode = "dual"
    confidence: Confidence = "prob"
    early_exit: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.threshold <= 1.0:
            raise UsageError(f"threshold must be between 0 and 1, got {self.threshold!r}")
        if self.cache not in CACHE_MODES:
            raise UsageError(f"unknown cache {self.cache!r} (choose {', '.join(CACHE_MODES)})")
        if self.confidence not in CONFIDENCES:
            raise UsageError(f"unknown confidence {self.confidence!r} (choose {', '.join(CONFIDENCES)})")


class CachedNet(Protocol):
    def hidden(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        key_mask: torch.Tensor,
        cache: list[KV] | None = None,
        start: int = 0,
    ) -> tuple[torch.Tensor, list[KV]]: ...

    def head(self, h: torch.Tensor) -> torch.Tensor: ...


def predict(
    logits: torch.Tensor,
    temperature: float,
    confidence: Confidence,
    generator: torch.Generator | None,
    min_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x0, confidence) for block logits (B, T, V); higher is surer. prob = p(x0); margin = p(top1) -
    p(top2) (Dream's, blind to which token was sampled); lead = p(x0) minus the largest probability of any
    other token, so a sampled token that is not the favourite has a negative lead and waits for more
    context (at temperature 0, lead = margin); entropy = exp(-H(p))."""
    logits = logits.float()
    if temperature == 0:
        x0 = logits.argmax(-1)
    else:
        x0 = add_gumbel_noise(logits, temperature, generator, min_p).argmax(-1)
    probs = F.softmax(logits, dim=-1)
    if confidence == "prob":
        conf = probs.gather(-1, x0[..., None]).squeeze(-1)
    elif confidence in ("margin", "lead"):
        top2 = probs.topk(2, dim=-1)
        first, second = top2.values.unbind(-1)
        if confidence == "margin":
            conf = first - second
        else:  # the best rival of x0 is the runner-up when x0 is the favourite, else the favourite
            chosen = probs.gather(-1, x0[..., None]).squeeze(-1)
            conf = chosen - torch.where(x0 == top2.indices[..., 0], second, first)
    else:
        conf = torch.exp((probs * torch.log(probs.clamp_min(1e-12))).sum(-1))
    return x0, conf


def finished_rows(gen: torch.Tensor, mask_id: int, stop: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose generated ids (B, G) hold a committed stop token with no mask before it, and the
    position of that first stop token (G where there is none)."""
    G = gen.shape[1]
    idx = torch.arange(G, device=gen.device).expand_as(gen)
    is_stop = torch.isin(gen, stop)
    first_stop = torch.where(is_stop, idx, G).min(1).values
    first_mask = torch.where(gen == mask_id, idx, G).min(1).values
    return (first_stop < G) & (first_mask > first_stop), first_stop


def _finished(xa: torch.Tensor, P: int, e: int, mask_id: int, stop: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows finished within the generated part decoded so far, and each row's stop token (B, 1)."""
    done, first_stop = finished_rows(xa[:, P:e], mask_id, stop)
    return done, xa[:, P:e].gather(1, first_stop.clamp_max(e - P - 1)[:, None])


@torch.no_grad()
def generate_fast(
    net: CachedNet,
    prompt: torch.Tensor,
    prompt_mask: torch.Tensor,
    params: FastParams,
    mask_id: int,
    stop_ids: frozenset[int],
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """prompt: (B, P) left-padded; prompt_mask: (B, P). Returns the canvas (B, P + gen_length)."""
    B, P = prompt.shape
    x = torch.cat([prompt, prompt.new_full((B, params.gen_length), mask_id)], dim=1)
    key_mask = torch.cat([prompt_mask, prompt_mask.new_ones(B, params.gen_length)], dim=1)
    positions = (key_mask.long().cumsum(1) - 1).clamp_min(0)  # per-row RoPE positions, padding-proof
    stop = torch.tensor(sorted(stop_ids), device=x.device, dtype=x.dtype)
    active = torch.arange(B, device=x.device)
    for (bs, be), steps in zip(params.block_spans, params.steps_per_block):
        if active.numel() == 0:
            break
        s, e = P + bs, P + be
        xa, km, pos = x[active], key_mask[active], positions[active]
        schedule = num_transfer_tokens((xa[:, s:e] == mask_id).sum(1), steps)
        cache: list[KV] | None = None
        for i in range(steps):
            if params.cache == "none" or i == 0:
                h, kv = net.hidden(xa, pos, km)  # full canvas; with a cache this is the block's refresh
                h = h[:, s:e]
                if params.cache != "none":
                    cache = [(k.contiguous(), v.contiguous()) for k, v in kv]
            elif params.cache == "prefix":
                h, _ = net.hidden(xa[:, s:], pos[:, s:], km, cache, s)
                h = h[:, : e - s]
            else:
                h, _ = net.hidden(xa[:, s:e], pos[:, s:e], km, cache, s)
            x0, conf = predict(net.head(h), params.temperature, params.confidence, generator, params.min_p)
            block = xa[:, s:e]
            masked = block == mask_id
            rank = torch.where(masked, order_scores(conf, params.order_temperature, i, steps, generator), float("-inf"))
            k = schedule[:, i].clamp_min(1)  # at least one commit per row that still has masks
            commit = select_top_k(rank, k) | (masked & (conf >= params.threshold))
            xa[:, s:e] = torch.where(commit, x0, block)
            if params.early_exit:  # the rest of a finished row is irrelevant: fill it with its stop token
                done, fill = _finished(xa, P, e, mask_id, stop)
                xa[:, s:e] = torch.where((xa[:, s:e] == mask_id) & done[:, None], fill, xa[:, s:e])
            if not (xa[:, s:e] == mask_id).any():
                break
        x[active] = xa
        if params.early_exit:  # finished rows leave the batch; their tail is the stop token
            x[active[done], e:] = fill[done]
            active = active[~done]
    return x
