"""DiffusionGemma's own decoding (`DiffusionGemmaForBlockDiffusion.generate` in transformers 5.23.0), as a pure
function on ids. There is no mask token.

The prompt runs through the causal encoder into the cache. The answer is then made a canvas of block_length
tokens at a time, ceil(gen_length / block_length) canvases (the last one whole, as its generate makes it):

1. the canvas starts as uniformly random token ids (or the pinned `initial_canvases`);
2. each of at most block_steps steps (cur counting down from N to 1) runs the bidirectional decoder on the
   canvas against the cache, adding the self-conditioning signal of the previous step's scaled logits; the
   logits are divided by T = t_min + (t_max - t_min) * cur / N; every position samples a token from
   softmax(logits / T); the positions of lowest entropy are kept while their entropy sum minus its largest stays
   within entropy_bound, and every other position is redrawn uniformly at random (renoising);
3. with the adaptive stop on (confidence_threshold not None), a canvas ends once the argmax canvas has been the
   same for stability_threshold steps and the mean entropy is below confidence_threshold;
4. the canvas kept is the last *argmax* canvas; one causal pass over it appends it to the cache. An answer
   holding a stop id ends at that canvas: what follows its first stop id is the pad token.

Under a constraint (`structured_outputs`, `structured.commit`'s rule on a canvas): a row's canvas holds a
committed prefix that is never redrawn; each step its leftmost open position is sampled from the step's
distribution under the grammar's mask (with the row's own uniform for that position), then the positions after
it join the prefix, in order, while each is one the grammar alone decides or a kept (low-entropy) sample the
grammar accepts. The canvas ends when the prefix fills it or holds a stop token, taking steps past its
schedule if it must (at the last step's temperature); the prefix, not the argmax canvas, is what it keeps.

Rows are independent (rule 2): a row's noise comes from its own stream, keyed by canvas and step (`RowNoise`),
a finished canvas or answer is frozen while its batch mates go on, and left padding is masked with positions
counted from a row's first token. `noise: torch` draws instead from torch's CPU generator seeded with the row's
seed, in the order its generate draws for a batch of one (the canvas `randint`, then per step `multinomial` and
the renoise `randint`), so that answers equal its own; `initial_canvases` pins each loop's starting canvas (its
`randint` is still drawn, as its generate draws it before taking `decoder_input_ids`).

This is the static decoder (a batch decoded to its end); `decode.canvasrun` runs the same canvases as rows of a
running set, each joining as others leave and answering as it does here alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..arch.canvas_memory import canvas_chunk
from ..arch.gemma4 import Mask
from ..errors import UsageError
from ..params import NO_STRUCTURE, Blocks, CanvasNoise, Denoising, StopIds, Structure
from ..structured.commit import Rule, Rules, note, short_error
from .block import OnBlock
from .canvas_step import CanvasDraws, canvas_step
from .sampling import RowNoise

INIT, RENOISE = 0, 2  # with SAMPLE (1), the lanes of a row's stream: canvas start, each step's redraws


@dataclass(frozen=True)
class DiffusionGemmaPlan:
    """The parts of the settings DiffusionGemma's decoder honours (see `strategy.STRATEGIES`)."""

    blocks: Blocks
    denoising: Denoising
    noise: CanvasNoise
    stops: StopIds
    structure: Structure = NO_STRUCTURE  # rules come per row (`structured.commit`)

    @property
    def gen_length(self) -> int:
        return self.blocks.gen_length


def pass_masks(model: Any, real: torch.Tensor, T: int, causal: bool) -> dict[bool, Mask]:
    """The masks of T new positions after the S cached ones (`real` (B, S + T): the keys that may be attended
    to), for the full layers (True) and the sliding ones (False, over the keys they read: the last `window`
    cached and the new): causal (each query sees the real keys up to itself, a padding query itself; sliding
    layers the last sliding_window of them), or bidirectional (every real key). Where no row has padding,
    transformers' own choice: no mask for the decoder, SDPA's causal flag for a prefill that needs no window."""
    S, W = real.shape[1] - T, model.cfg.sliding_window
    w = model.window(S)
    if bool(real.all()) and (not causal or S == 0):
        if not causal:
            return {True: "all", False: "all"}
        if T < W:
            return {True: "causal", False: "causal"}
    dev = real.device
    q = torch.arange(S, S + T, device=dev)[:, None]
    out: dict[bool, Mask] = {}
    for full, first in ((True, 0), (False, S - w)):
        k = torch.arange(first, S + T, device=dev)[None, :]
        seen = real[:, None, first:]
        if causal:
            mask = (seen & (k <= q) & (full or (q - k < W))) | (k == q)
        else:
            mask = seen.expand(-1, T, -1)
        out[full] = mask[:, None]
    if causal and S == 0 and bool(real.all()):
        out[True] = "causal"
    return out


class Context:
    """The rows' prompts and committed canvases (left-padded), their positions and the cache."""

    def __init__(self, net: Any, prompt: torch.Tensor, prompt_mask: torch.Tensor) -> None:
        self.net, self.model = net, net.model
        self.real = prompt_mask.bool()  # (B, S): keys that may be attended to
        self.next_pos = self.real.long().sum(1)  # (B,): each row's next position
        self.cache: Any = None
        self.encode(prompt, (self.real.long().cumsum(1) - 1).clamp_min(0))

    def _masks(self, T: int, causal: bool) -> dict[bool, Mask]:
        return pass_masks(self.model, self.real, T, causal)

    def encode(self, ids: torch.Tensor, positions: torch.Tensor) -> None:
        """The causal pass over ids (B, T): its keys and values join the cache."""
        if self.cache is not None:
            self.real = torch.cat([self.real, torch.ones_like(ids, dtype=torch.bool)], 1)
        self.net.nfe += 1
        self.net.positions_computed += ids.numel()
        self.cache = self.model.encode(ids, positions, self._masks(ids.shape[1], True), self.cache)

    def denoise(self, canvas: torch.Tensor, self_conditioning: torch.Tensor | None) -> torch.Tensor:
        """The canvas's logits (B, L, V) all at once, from the previous step's scaled logits (or None)."""
        return self._decoder_pass(canvas, lambda *a: self.model.denoise(*a, self_conditioning))

    def hidden(self, canvas: torch.Tensor, signal: torch.Tensor | None) -> torch.Tensor:
        """The canvas's final hidden states (B, L, d), from the self-conditioning input `signal` (or None)."""
        return self._decoder_pass(canvas, lambda *a: self.model.hidden(*a, signal))

    def _decoder_pass(self, canvas: torch.Tensor, run: Any) -> torch.Tensor:
        L = canvas.shape[1]
        self.net.nfe += 1
        self.net.positions_computed += canvas.numel()
        real = self.real
        self.real = torch.cat([real, torch.ones_like(canvas, dtype=torch.bool)], 1)
        masks = self._masks(L, False)
        self.real = real
        out: torch.Tensor = run(canvas, self.positions(L), masks, self.cache)
        return out

    def positions(self, L: int) -> torch.Tensor:
        return self.next_pos[:, None] + torch.arange(L, device=self.real.device)[None, :]

    def commit(self, canvas: torch.Tensor) -> None:
        positions = self.positions(canvas.shape[1])
        self.encode(canvas, positions)
        self.next_pos = self.next_pos + canvas.shape[1]


def temperature(d: Denoising, cur: int, steps: int) -> torch.Tensor:
    """The step's temperature, t_min + (t_max - t_min) * cur / steps, in float32 arithmetic as its generate
    computes it (cur is an int32 tensor there), so that the scaled logits are the same numbers."""
    frac = torch.tensor(cur, dtype=torch.int32) / steps
    return d.temperature_final + (d.temperature - d.temperature_final) * frac


def denoise_canvas(
    ctx: Context,
    x: torch.Tensor,
    steps: int,
    d: Denoising,
    draws: CanvasDraws,
    j: int,
    done: torch.Tensor,
    rules: Rules | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """One canvas's denoising loop over the canvases x (B, L) -> the argmax canvases (under a constraint, the
    committed canvas). Rows already `done` (an answer finished earlier) draw nothing and change nothing.
    chunk: the positions of a row a step computes at a time (`canvas_chunk`'s; `noise: torch` draws a row's
    canvas at once, as its generate does)."""
    B, L = x.shape
    V = ctx.model.cfg.vocab_size
    chunk = L if draws.gens is not None else chunk or canvas_chunk(V, L)
    argmax, signal = x, None
    adaptive = d.confidence_threshold is not None
    history = torch.full((d.stability_threshold, B, L), -1, dtype=x.dtype, device=x.device)
    done, gone = done.clone(), done.clone()
    held = {
        b: Held(r, j * L) for b, r in enumerate(rules or []) if r is not None and r.constrained and not bool(done[b])
    }
    extra = L if held else 0  # a constrained row takes steps past the schedule until its canvas is full
    for i in range(steps + extra):
        cur = max(steps - i, 1)
        if i >= steps:  # past the schedule: only the constrained rows still open go on
            open_ = [b for b, h in held.items() if not h.closed(L)]
            if not open_:
                break
            done = done | ~torch.isin(torch.arange(B, device=x.device), torch.tensor(open_, device=x.device))
        live = (~done).nonzero().flatten().tolist()
        at = (~done).nonzero().flatten()
        T = temperature(d, cur, steps).to(x.device)
        hidden = ctx.hidden(x, signal)  # (B, L, d)
        step = canvas_step(ctx.model, hidden, x, signal, T, draws, live, j, i + 1, chunk, set(held) & set(live))
        low, order = torch.sort(step.entropy, dim=-1)
        keep = torch.zeros_like(done[:, None].expand(B, L)).scatter(1, order, low.cumsum(-1) - low <= d.entropy_bound)
        fresh = x.clone()
        fresh[at] = draws.tokens(live, j, i + 1, RENOISE, L)
        new_x, new_argmax = torch.where(keep, step.drawn, fresh), step.argmax
        for b, h in held.items():
            if not bool(done[b]) and not h.closed(L):
                raw, scaled, probs = step.whole[b]
                h.step(b, scaled, probs, step.drawn[b], keep[b], draws, j, i + 1, raw)
            new_x[b, : len(h.ids)] = torch.tensor(h.ids, dtype=x.dtype, device=x.device)
        if adaptive or bool(gone.any()) or i >= steps:  # past the schedule, the rows done are frozen too
            frozen = done[:, None]
            new_argmax = torch.where(frozen, argmax, new_argmax)
            new_x = torch.where(frozen, x, new_x)
        if d.confidence_threshold is not None:
            if d.stability_threshold == 0:
                stable = torch.ones_like(done)
            else:
                stable = (history == new_argmax[None]).all(-1).all(0)
                history = torch.roll(history, -1, 0)
                history[-1] = new_argmax
            done |= stable & (step.entropy.mean(-1) < d.confidence_threshold)  # a frozen row is done already
        for b, h in held.items():  # a constrained row is done when its canvas is committed, not when stable
            done[b] = h.closed(L)
        x, argmax, signal = new_x, new_argmax, step.signal
        if bool(done.all()):
            break
    for b, h in held.items():
        argmax[b] = torch.tensor(h.filled(L), dtype=x.dtype, device=x.device)
    return argmax


class Held:
    """A constrained row's committed prefix of the canvas in hand (the module's docstring)."""

    def __init__(self, rule: Rule, offset: int) -> None:
        assert rule.grammar is not None, "a template needs a mask token: diffusion-gemma refuses it"
        self.rule, self.grammar = rule, rule.grammar
        self.ids: list[int] = []
        self.offset = offset  # the answer position of the canvas's column 0

    def closed(self, L: int) -> bool:
        return len(self.ids) >= L or self.rule.ended

    def filled(self, L: int) -> list[int]:
        """The canvas kept: the prefix, and past an end of text the end of text again."""
        eos = self.grammar.vocab.eos_id
        return (self.ids + [eos] * L)[:L]

    def step(
        self,
        b: int,
        scaled: torch.Tensor,
        probs: torch.Tensor,
        drawn: torch.Tensor,
        keep: torch.Tensor,
        draws: CanvasDraws,
        j: int,
        i: int,
        raw: torch.Tensor,
    ) -> None:
        """One step's commits for row b, from its own (L, V) scaled logits, probabilities and untempered logits
        and its (L,) draws and keeps: the leftmost open position under the mask, then the grammar's own tokens
        and the kept samples it accepts, in order."""
        c0, L, vocab = len(self.ids), scaled.shape[0], self.grammar.vocab
        allowed = self.grammar.allowed(scaled.device)[: scaled.shape[-1]]
        if not bool(allowed.any()):
            why = short_error(self.grammar.error())
            self.rule.dead = "the grammar allows no token here (a dead end" + (f": {why})" if why else ")")
            self.rule.ended = True
            self.ids.append(vocab.eos_id)
            return
        masked = probs.clone()
        masked[c0] = torch.where(allowed, masked[c0], 0.0)
        if not bool(masked[c0].sum() > 0):  # every allowed token underflowed: the likeliest allowed one
            best = scaled[c0].masked_fill(~allowed, -torch.inf).argmax()
            masked[c0] = torch.zeros_like(masked[c0]).index_fill(0, best, 1.0)
        token = int(draws.sample([b], j, i, masked[None])[0, c0])
        self._take(token, raw[c0 : c0 + 1], allowed, c0)
        forced: list[int] = []
        while not self.closed(L):
            c = len(self.ids)
            forced = forced or self.grammar.forced()
            token = forced.pop(0) if forced else int(drawn[c]) if bool(keep[c]) else -1
            here = self.grammar.allowed(scaled.device)[: scaled.shape[-1]]
            if token < 0 or not bool(here[token]):
                return
            self._take(token, raw[c : c + 1], here, c)

    def _take(self, token: int, logits: torch.Tensor, allowed: torch.Tensor, c: int) -> None:
        self.grammar.take(token)
        self.ids.append(token)
        if self.rule.record is not None:
            note(self.rule.record, logits.float().masked_fill(~allowed, -torch.inf), token, self.offset + c)
        if token in self.grammar.vocab.stop_ids:
            self.rule.ended = True


@torch.no_grad()
def generate_diffusion_gemma(
    net: Any,
    prompt: torch.Tensor,
    prompt_mask: torch.Tensor,
    plan: DiffusionGemmaPlan,
    stop_ids: frozenset[int],
    pad_id: int,
    noise: RowNoise,
    rules: Rules | None = None,
    chunk: int | None = None,
    on_block: OnBlock | None = None,
) -> torch.Tensor:
    """prompt (B, P) left-padded -> (B, P + canvases * block_length): every row's answer in whole canvases, the
    positions after its first stop id holding the pad token. rules: each row's constraint (`structured.commit`;
    the module's docstring), or None. chunk: the positions a step computes at a time (`canvas_chunk`'s by
    default; the answer does not depend on it). on_block(row, its answer so far): as each of its canvases is
    kept (streaming)."""
    B, P = prompt.shape
    L, V = plan.blocks.block_length, net.model.cfg.vocab_size
    pinned = plan.noise.initial_canvases
    bad = sorted({t for c in pinned for t in c if t >= V})
    if bad:
        raise UsageError(f"initial_canvases: token id {bad[0]} is outside the vocabulary of {V}")
    stops = plan.stops.stop_token_ids or tuple(sorted(stop_ids))
    stop = torch.tensor(stops, device=prompt.device, dtype=prompt.dtype)
    seeds = noise.given if plan.noise.noise == "torch" else None
    if seeds is not None and len(seeds) != B:
        raise UsageError("noise: torch needs each request's own seed, which this caller does not pass")
    draws = CanvasDraws(noise, seeds, V, prompt.device)
    ctx = Context(net, prompt, prompt_mask)
    out = prompt.new_full((B, len(plan.blocks.canvas_steps()) * L), pad_id)
    finished = torch.zeros(B, dtype=torch.bool, device=prompt.device)
    schedule = plan.blocks.canvas_steps()
    for j, steps in enumerate(schedule):
        rows = (~finished).nonzero().flatten().tolist()
        x = prompt.new_zeros((B, L))
        x[rows] = draws.tokens(rows, j, 0, INIT, L)
        if j < len(pinned):
            x[:] = torch.tensor(pinned[j], device=prompt.device, dtype=prompt.dtype)
        canvas = denoise_canvas(ctx, x, steps, plan.denoising, draws, j, finished, rules, chunk)
        canvas[finished] = pad_id
        out[:, j * L : (j + 1) * L] = canvas
        hit = torch.isin(canvas, stop) & ~finished[:, None]
        after = (hit.cumsum(-1) > 0) & ~((hit.cumsum(-1) == 1) & hit)
        out[:, j * L : (j + 1) * L][after] = pad_id
        if on_block is not None:
            for b in rows:
                on_block(b, out[b, : (j + 1) * L].tolist())
        finished |= hit.any(-1)
        if bool(finished.all()) or j + 1 == len(schedule):
            break
        ctx.commit(canvas)
    return torch.cat([prompt, out], 1)
