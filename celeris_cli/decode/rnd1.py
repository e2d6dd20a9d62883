"""RND1's own decoding (`diffusion_sample` in RadicalNumerics/RND1's `rnd/sampling.py`), as a pure function on ids.

The canvas after the prompt holds gen_length - 1 masks and, last, one pad token that is never predicted:
RND1 keeps that position for the end of text. Each forward gives, at every masked position, a token (the
likeliest, or with `greedy` off one drawn at the temperature) and the entropy of the distribution it came
from: the logits divided by max(temperature, 1e-8), then top-k, then top-p, as RND1 filters them. With S
steps and n masks to begin with, the step counting down from S-1 to 1 keeps masked the
floor(n * step / S) masked positions of highest entropy and unmasks the rest; what is still masked after
the last step takes its prediction. The first forward is shared by the first step; a forward runs after
a step only while something is masked.

With `eb_gamma` >= 0 (RND1's entropy-bounded sampler) a step instead unmasks, most confident first (the
log-probability of the chosen token), the longest run whose entropy sum minus its largest entropy stays
within eb_gamma.

Kept as RND1's code does it, so that answers equal its own: entropies are summed over every token,
-(p * log p), in the model's dtype, so at temperature 0 (logits times 1e8) every entropy is exactly 0, and
with top-k or top-p the tokens filtered to -inf make it NaN (0 x -inf); then which positions stay masked is
decided by `torch.topk`'s order among equal (or NaN) scores, and an entropy bound never holds (nothing
unmasks before the last fill). To fall the same way, each row's ranking runs on a tensor of the length
RND1's batch of one has (its prompt, then its canvas), the prompt positions at the same floor. RND1 has
no attention mask and runs one prompt at a time; here padding is masked and positions count from each
row's first token (`Net`), so a row's answer in a batch is its answer alone. RND1 draws tokens from the
global random state; here every row draws from its own stream, so sampled answers follow the same
distributions but not its numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..params import Canvas, EntropyRanking, Filters
from .predict import Places, draw, in_chunks
from .reference import CanvasNet
from .sampling import Draws, RowNoise
from .wholerun import Tokens, whole_batch


@dataclass(frozen=True)
class RND1Plan:
    """The parts of the settings RND1's decoder honours (see `strategy.STRATEGIES`)."""

    canvas: Canvas
    filters: Filters
    entropy: EntropyRanking

    @property
    def gen_length(self) -> int:
        return self.canvas.gen_length

    @property
    def forwards(self) -> int:
        """A forward a step at most (none once nothing is masked)."""
        return self.canvas.denoise_steps

    def row(self, prompt: torch.Tensor, noise: RowNoise, tokens: Tokens) -> RND1Row:
        return RND1Row(prompt, self, noise, tokens.mask_id, tokens.pad_id)


def rnd1_log_probs(logits: torch.Tensor, f: Filters) -> torch.Tensor:
    """log-probabilities (.., V) as RND1 forms them, in the logits' dtype: logits / max(temperature, 1e-8);
    top-k keeps exactly k tokens (`torch.topk`'s, ties included); top-p drops a token when the mass of the
    tokens before it exceeds top_p, but never the two likeliest; the dropped tokens at -inf."""
    scores = logits / max(f.temperature, 1e-8)
    if f.top_k > 0:
        kept = scores.topk(min(f.top_k, scores.shape[-1]), dim=-1)
        scores = torch.full_like(scores, float("-inf")).scatter(-1, kept.indices, kept.values)
    if f.top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        mass = sorted_scores.softmax(-1).cumsum(-1)
        drop = torch.zeros_like(mass, dtype=torch.bool)
        drop[..., 2:] = mass[..., 1:-1] > f.top_p  # RND1 clears the first flag, then shifts by one
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return scores.log_softmax(-1)


def predict(
    logits: torch.Tensor, f: Filters, greedy: bool, places: Places, draws: Draws
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, confidence, entropy), each (N,), from the logits (N, V) of positions at `places`: the
    likeliest token or one drawn (`predict.draw`, in float64, from each row's stream), its
    log-probability, and the distribution's entropy."""
    logp = rnd1_log_probs(logits, f)
    tokens = logp.argmax(-1) if greedy else draw(logp.double(), places, draws)
    confidence = logp.gather(-1, tokens[:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return tokens, confidence, entropy


def _as_alone(scores: torch.Tensor, prompt_tokens: int, floor: float) -> torch.Tensor:
    """One row's canvas scores (T,) laid out as RND1's batch of one holds them: (1, prompt + T), the
    prompt's positions at `floor`."""
    return torch.cat([scores.new_full((prompt_tokens,), floor), scores])[None]


def keep_masked(entropy: torch.Tensor, maskable: torch.Tensor, lengths: list[int], k: int) -> torch.Tensor:
    """(B, T) bool: in each row the k maskable positions of highest entropy, by `torch.topk` over the row
    as RND1 lays it out (`_as_alone`), so that ties fall as in its code."""
    floor = -torch.finfo(entropy.dtype).max
    scores = entropy.masked_fill(~maskable, floor)
    keep = torch.zeros_like(maskable)
    for b, n in enumerate(lengths):
        picked = _as_alone(scores[b], n, floor).topk(k, dim=-1).indices[0] - n
        keep[b, picked[picked >= 0]] = True
    return keep & maskable


def bounded(
    confidence: torch.Tensor, entropy: torch.Tensor, maskable: torch.Tensor, lengths: list[int], gamma: float
) -> torch.Tensor:
    """(B, T) bool, RND1's entropy bound: per row, the maskable positions sorted by confidence (highest
    first, `torch.sort` over the row as RND1 lays it out), as many as hold cumulative entropy minus its
    running maximum <= gamma. (The prompt's positions sort last and count as zero entropy: only maskable
    positions are unmasked, so they cannot change the choice.)"""
    top = torch.finfo(confidence.dtype).max
    err = (-confidence).masked_fill(~maskable, top)
    chosen = torch.zeros_like(maskable)
    for b, n in enumerate(lengths):
        order = torch.sort(_as_alone(err[b], n, top), dim=-1).indices
        ent = _as_alone(entropy[b], n, 0.0).gather(1, order)
        valid = ent.cumsum(-1) - ent.cummax(-1).values <= gamma
        picked = order[0, : int(valid.sum())] - n
        chosen[b, picked[picked >= 0]] = True
    return chosen & maskable


class RND1Row:
    """One row of RND1's sampler (`decode.wholerun`): its canvas, the positions still masked, the step it
    is at, its stream and its last forward's predictions."""

    def __init__(self, prompt: torch.Tensor, plan: RND1Plan, noise: RowNoise, mask_id: int, pad_id: int) -> None:
        N = plan.canvas.gen_length
        self.plan, self.noise = plan, noise
        self.prompt = len(prompt)
        tail = prompt.new_full((N,), mask_id)
        tail[-1] = pad_id  # kept for the end of text: attended, never predicted
        self.canvas = torch.cat([prompt, tail])
        self.maskable = torch.ones(1, N, dtype=torch.bool, device=prompt.device)
        self.maskable[:, -1] = False
        self.total = self.maskable.sum(1)  # (1,) long: n, as RND1 counts it
        self.forwards = 0  # the forwards its scores came from: step S - 1 - forwards reads the latest

    def views(self) -> list[torch.Tensor]:
        return [self.canvas]

    def wanted(self) -> torch.Tensor:
        return self.maskable[0]

    def step(self, hs: list[torch.Tensor], net: CanvasNet) -> bool:
        """From the hidden states at the maskable positions, each position's (token, confidence, entropy),
        drawing by its column; then the step counting down from S - 1 unmasks, or after the last step what is
        still masked takes its prediction. Done when nothing is masked."""
        S, f, rank = self.plan.canvas.denoise_steps, self.plan.filters, self.plan.entropy
        maskable = self.maskable
        places = Places.columns(maskable.nonzero())
        draws = self.noise.at([0], 0, self.forwards)
        self.forwards += 1
        head = net.step_head()

        def part(p: slice) -> tuple[torch.Tensor, ...]:
            return predict(head(hs[0][p]), f, rank.greedy, places[p], draws)

        flat = in_chunks(len(places), net.chunk, part)
        tokens, confidence, entropy = (t.new_zeros(maskable.shape).masked_scatter(maskable, t) for t in flat)
        answer = self.canvas[None, self.prompt :]
        step = S - self.forwards  # the first forward is shared by step S - 1
        if step < 1:
            self.canvas[self.prompt :] = torch.where(maskable, tokens, answer)[0]
            return True
        lengths = [self.prompt]
        if rank.bounded:
            unmask = bounded(confidence, entropy, maskable, lengths, rank.eb_gamma)
        else:
            k = int((self.total * (step / S)).long())  # in float32, as RND1's (total * rate).long()
            unmask = maskable & ~keep_masked(entropy, maskable, lengths, k) if k > 0 else maskable.clone()
        self.canvas[self.prompt :] = torch.where(unmask, tokens, answer)[0]
        self.maskable = maskable & ~unmask
        return not bool(self.maskable.any())  # RND1's later steps find nothing to unmask and run no forward


@torch.no_grad()
def generate_rnd1(
    net: CanvasNet,
    prompt: torch.Tensor,
    prompt_mask: torch.Tensor,
    plan: RND1Plan,
    mask_id: int,
    pad_id: int,
    noise: RowNoise,
) -> torch.Tensor:
    """prompt: (B, P) left-padded ids; prompt_mask: (B, P). Returns the canvas (B, P + gen_length), whose
    last position is pad_id: the running set (`decode.wholerun`) with every row admitted at once. The net's
    hidden state at position j predicts position j (`Net` shifts them)."""
    return whole_batch(net, prompt, prompt_mask, plan, mask_id, pad_id, noise)
