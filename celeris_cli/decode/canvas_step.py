"""One DiffusionGemma denoising step after its decoder pass, a chunk of a row's positions at a time: the head,
softmax, draws, entropies and the next step's self-conditioning input (`canvas_step`), and the random numbers
the draws take (`CanvasDraws`). What it holds at once is `arch.canvas_memory`'s count."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..arch.canvas_memory import tiles
from .sampling import RowNoise

SAMPLE = 1  # a row's stream's lane for each step's samples (`diffusion_gemma`'s INIT, SAMPLE, RENOISE)


class CanvasDraws:
    """One batch's random numbers: each row's own counter-based stream, or torch generators (`noise: torch`)."""

    def __init__(self, noise: RowNoise, torch_seeds: list[int] | None, vocab: int, device: torch.device) -> None:
        self.noise, self.vocab, self.device = noise, vocab, device
        self.gens = None if torch_seeds is None else [torch.Generator().manual_seed(s) for s in torch_seeds]

    def tokens(self, rows: list[int], canvas: int, step: int, lane: int, length: int) -> torch.Tensor:
        """Uniform token ids (len(rows), length)."""
        if self.gens is not None:
            out = [torch.randint(0, self.vocab, (1, length), generator=self.gens[r]) for r in rows]
            return torch.cat(out).to(self.device)
        u = self.noise.at(rows, canvas, step).uniform((length,), torch.float64, lane)
        return (u * self.vocab).long().clamp_max(self.vocab - 1)

    def sample(self, rows: list[int], canvas: int, step: int, probs: torch.Tensor) -> torch.Tensor:
        """One token per position from probs (len(rows), L, V): torch's `multinomial`, or the inverse of the
        cumulative distribution at one uniform per position."""
        if self.gens is not None:
            V = probs.shape[-1]
            out = [torch.multinomial(p.cpu().view(-1, V), 1, generator=self.gens[r]) for r, p in zip(rows, probs)]
            return torch.stack(out).view(probs.shape[:2]).to(self.device)
        return self.pick(probs, self.noise.at(rows, canvas, step).uniform((probs.shape[1],), torch.float64, SAMPLE))

    def uniforms(self, rows: list[int], canvas: int, step: int, length: int) -> torch.Tensor | None:
        """The step's uniforms (len(rows), length) that `pick` draws with; None under `noise: torch`."""
        if self.gens is not None:
            return None
        return self.noise.at(rows, canvas, step).uniform((length,), torch.float64, SAMPLE)

    def pick(self, probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The inverse of each position's cumulative distribution (.., V) at its uniform u (..)."""
        cdf = probs.double().cumsum(-1)
        picked = torch.searchsorted(cdf, (u * cdf[..., -1])[..., None]).squeeze(-1)
        return picked.clamp_max(probs.shape[-1] - 1)

    def pick_row(self, row: int, probs: torch.Tensor) -> torch.Tensor:
        """`noise: torch`: a row's whole canvas (L, V) at once, as its generate draws it (one `multinomial`)."""
        assert self.gens is not None
        return torch.multinomial(probs.cpu(), 1, generator=self.gens[row]).view(-1).to(self.device)


def entropy(scaled: torch.Tensor) -> torch.Tensor:
    """Each position's entropy (.., V) -> (..), computed as torch's `Categorical(logits=...).entropy()` computes
    it (the same operations, so the same bits), without building the distribution."""
    logits = scaled - scaled.logsumexp(-1, keepdim=True)
    probs = torch.softmax(logits, -1)
    return -(logits.clamp(min=torch.finfo(logits.dtype).min) * probs).sum(-1)


@dataclass
class Step:
    """One denoising step's results: the drawn tokens, argmax and entropies (B, L), the next step's
    self-conditioning input (B, L, d), and, for a constrained row only, its whole untempered and scaled logits
    and probabilities (L, V) (the rows not live keep their inputs)."""

    drawn: torch.Tensor
    argmax: torch.Tensor
    entropy: torch.Tensor
    signal: torch.Tensor
    whole: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def canvas_step(
    model: Any,
    h: torch.Tensor,
    x: torch.Tensor,
    signal: torch.Tensor | None,
    T: torch.Tensor,
    draws: CanvasDraws,
    live: list[int],
    j: int,
    i: int,
    chunk: int,
    whole: set[int],
) -> Step:
    """From the decoder's hidden states h (B, L, d) of the canvases x (B, L): the head, softmax, draws, argmax,
    entropies and next self-conditioning input of each live row, `chunk` of its positions at a time
    (`canvas_memory.canvas_chunk`), so that no more than tiles(chunk) x V entries of them exist at once (a
    constrained row in `whole` keeps its whole canvas's). A row's numbers are the same operations on the same
    rows whatever the chunk and its batch mates (on the CPU the same bits: tests/test_diffusion_gemma.py)."""
    B, L = x.shape
    w = model.embedding()  # (V, d) in the weights' dtype
    head = model.head_matrix(w)
    drawn, argmax = x.clone(), x.clone()
    ent = torch.zeros(B, L, device=x.device)
    nxt = torch.zeros(B, L, w.shape[1], dtype=w.dtype, device=x.device) if signal is None else signal.clone()
    u = draws.uniforms(live, j, i, L)
    kept: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for n_, b in enumerate(live):
        if b in whole:
            kept[b] = tuple(torch.empty(L, w.shape[0], device=x.device) for _ in range(3))  # type: ignore[assignment]
        for lo in range(0, L, chunk):
            hi = min(lo + chunk, L)
            n, hb = hi - lo, h[b, lo:hi]
            if tiles(n) > n:  # zero positions up to a whole tile: the matmuls round as on any other chunk
                hb = torch.cat([hb, hb.new_zeros(tiles(n) - n, hb.shape[1])])
            raw = model.logits(hb, head)  # (tiles(n), V) float32
            scaled = raw / T
            probs = torch.softmax(scaled, dim=-1, dtype=torch.float32)
            if b in whole:
                for keep, t in zip(kept[b], (raw, scaled, probs)):
                    keep[lo:hi] = t[:n]
            del raw
            drawn[b, lo:hi] = draws.pick(probs[:n], u[n_, lo:hi]) if u is not None else draws.pick_row(b, probs[:n])
            del probs
            argmax[b, lo:hi] = scaled[:n].argmax(-1)
            ent[b, lo:hi] = entropy(scaled)[:n]
            nxt[b, lo:hi] = model.signal(scaled.to(w.dtype), w)[:n]  # as its generate keeps it: the weights' dtype
    return Step(drawn, argmax, ent, nxt, kept)
