"""Dream's own decoding (`diffusion_generate` in Dream's `generation_utils.py`), as a pure function on ids.

The whole generation part is one canvas (no blocks). Over `denoise_steps` steps, time falls linearly from
1 to `eps`; at step i (t -> s), a row with n masked positions commits int(n * (1 - s/t)) of them (all that
remain at the last step), the most confident first. The confidence rule is Dream's `alg`:

- `maskgit_plus`: the probability of the predicted token;
- `topk_margin`: the top probability minus the runner-up's;
- `entropy`: the negative entropy of the prediction;
- `origin`: no ranking: each masked position commits with probability 1 - s/t.

With `alg_temp` > 0 the positions are drawn, without replacement, with probabilities softmax(confidence /
alg_temp) instead of taken in order. Probabilities are those after temperature, top-p and top-k, in
Dream's order. Dream draws from the global random state; here every row draws from its own stream, so at
temperature 0 with `alg_temp` 0 the answer equals Dream's token for token, and otherwise it follows the
same distributions with per-request reproducibility.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from ..params import Sampling, Timeline, Unmasking
from .predict import Places, draw, in_chunks
from .reference import CanvasNet, select_top_k
from .sampling import ORDER, TRANSFER, Draws, RowNoise
from .wholerun import Tokens, whole_batch


@dataclass(frozen=True)
class DreamPlan:
    """The parts of the settings Dream's decoder honours (see `strategy.STRATEGIES`)."""

    timeline: Timeline
    sampling: Sampling
    unmasking: Unmasking

    @property
    def gen_length(self) -> int:
        return self.timeline.gen_length

    @property
    def forwards(self) -> int:
        """A forward a step, whatever it commits (Dream's loop)."""
        return self.timeline.denoise_steps

    def row(self, prompt: torch.Tensor, noise: RowNoise, tokens: Tokens) -> DreamRow:
        return DreamRow(prompt, self, noise, tokens.mask_id)


def dream_filter(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """Logits after Dream's temperature, top-p then top-k (excluded tokens at the dtype's minimum, as
    Dream does), then min-p (ours; Dream has none)."""
    if s.temperature > 0:
        logits = logits / s.temperature
    low = torch.finfo(logits.dtype).min
    if s.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        mass = sorted_logits.softmax(-1).cumsum(-1)
        drop = torch.zeros_like(mass, dtype=torch.bool)
        drop[..., 1:] = mass[..., :-1] > s.top_p  # keep tokens until the mass before them exceeds top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), low)
    if s.top_k > 0:
        kth = logits.topk(min(s.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, low)
    if s.min_p > 0:
        floor = logits.amax(-1, keepdim=True) + math.log(s.min_p)
        logits = logits.masked_fill(logits < floor, low)
    return logits


def predict(
    logits: torch.Tensor, s: Sampling, alg: str, places: Places, draws: Draws
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x0, confidence), each (N,), from the logits (N, V) of positions at `places` under Dream's rule `alg`."""
    filtered = dream_filter(logits, s)
    probs = filtered.softmax(-1)
    if s.temperature > 0:  # a float64 draw from the same categorical as Dream's torch.multinomial
        x0 = draw(filtered.double(), places, draws)
        confidence = probs.gather(-1, x0[:, None]).squeeze(-1)
    else:
        confidence, x0 = probs.max(-1)
    if alg == "topk_margin":
        top2 = probs.topk(2, dim=-1).values
        confidence = top2[:, 0] - top2[:, 1]
    elif alg == "entropy":
        confidence = (probs * torch.log(probs + 1e-10)).sum(-1)
    return x0, confidence


def _predict_part(
    head: Callable[[torch.Tensor], torch.Tensor],
    h: torch.Tensor,
    s: Sampling,
    alg: str,
    places: Places,
    draws: Draws,
    part: slice,
) -> tuple[torch.Tensor, ...]:
    """`predict` for the positions `part` of the hidden states h (N, d)."""
    return predict(head(h[part]), s, alg, places[part], draws)


def pick(confidence: torch.Tensor, k: torch.Tensor, alg_temp: float, draws: Draws) -> torch.Tensor:
    """Positions to commit per row: the k[b] most confident, or with alg_temp > 0 k[b] positions drawn
    without replacement from softmax(confidence / alg_temp) (Gumbel top-k). confidence: -inf where not
    allowed."""
    if alg_temp > 0:
        scores = (confidence.double() / alg_temp).log_softmax(-1)
        noise = draws.gumbel(tuple(scores.shape[1:]), torch.float64, ORDER)
        confidence = torch.where(torch.isfinite(scores), scores + noise, float("-inf"))
    return select_top_k(confidence, k)


class DreamRow:
    """One row of Dream's sampler (`decode.wholerun`): its canvas, its step on the timeline, its stream."""

    def __init__(self, prompt: torch.Tensor, plan: DreamPlan, noise: RowNoise, mask_id: int) -> None:
        tl = plan.timeline
        self.plan, self.noise, self.mask_id = plan, noise, mask_id
        self.prompt = len(prompt)
        self.canvas = torch.cat([prompt, prompt.new_full((tl.gen_length,), mask_id)])
        self.timesteps = torch.linspace(1, tl.eps, tl.denoise_steps + 1, device=prompt.device)  # float32, as Dream
        self.i = 0

    def views(self) -> list[torch.Tensor]:
        return [self.canvas]

    def wanted(self) -> torch.Tensor:
        return self.canvas[self.prompt :] == self.mask_id

    def step(self, hs: list[torch.Tensor], net: CanvasNet) -> bool:
        """Step i (t -> s) from the hidden states at the answer's masked positions: each predicted, drawing by
        its column in the answer, the most confident committed (Dream's `alg`)."""
        plan, alg, i = self.plan, self.plan.unmasking.alg, self.i
        self.i += 1
        last = self.i == plan.timeline.denoise_steps
        gen = self.canvas[None, self.prompt :]  # (1, N): the answer as a batch of one
        masked = gen == self.mask_id
        if not bool(masked.any()):  # nothing left to unmask: its answer is final, and its place another's
            return True
        places = Places.columns(masked.nonzero())
        draws = self.noise.at([0], 0, i)
        t, s = self.timesteps[i], self.timesteps[i + 1]
        rule = "maskgit_plus" if alg == "origin" else alg
        step = partial(_predict_part, net.step_head(), hs[0], plan.sampling, rule, places, draws)
        picked, picked_conf = in_chunks(len(places), net.chunk, step)
        x0 = gen.masked_scatter(masked, picked)
        if alg == "origin":
            p_transfer = 1.0 if last else float(1 - s / t)
            draw = draws.uniform(tuple(gen.shape[1:]), torch.float32, TRANSFER)
            self.canvas[self.prompt :] = torch.where(masked & (draw < p_transfer), x0, gen)[0]
            return last
        confidence = picked_conf.new_full(gen.shape, float("-inf")).masked_scatter(masked, picked_conf)
        n = masked.sum(1)
        k = n if last else (n.float() * (1 - s / t)).long()  # Dream's int(n * (1 - s/t)), in float32
        chosen = pick(confidence, k, plan.unmasking.alg_temp, draws)
        self.canvas[self.prompt :] = torch.where(chosen, x0, gen)[0]
        return last


@torch.no_grad()
def generate_dream(
    net: CanvasNet,
    prompt: torch.Tensor,
    prompt_mask: torch.Tensor,
    plan: DreamPlan,
    mask_id: int,
    noise: RowNoise,
) -> torch.Tensor:
    """prompt: (B, P) left-padded ids; prompt_mask: (B, P). Returns the canvas (B, P + gen_length): the
    running set (`decode.wholerun`) with every row admitted at once."""
    return whole_batch(net, prompt, prompt_mask, plan, mask_id, mask_id, noise)
