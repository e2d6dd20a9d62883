"""Whether a round of self-speculative decoding (`decode.selfspec`) drafts: a forward's cost, measured once per
engine (its device and dtype), against the tokens drafting has yielded.

A forward's wall time is modelled as `fixed + per_position * positions` (rows x columns). `calibrate` times
the network's plain forward at a few shapes (1 to 64 rows, 1 and 8 columns each: the shapes of an AR step and
of a drafting round), the fastest of three after a warm-up each, smallest first and no larger once a forward
takes a quarter of a second (a large model on a CPU), and fits the two numbers by least squares.
On this project's 2-core CPU the tiny embedded model costs a few milliseconds fixed and tens of microseconds a
position; on a GPU the fixed part dominates to much wider batches. The engine calibrates on its first
self-speculative decode and keeps the result (`Engine.forward_cost`).

A round of b rows with drafts of k_r tokens in hand computes b x (1 + max k + width) positions when it drafts
(the rows padded to the widest) and b when it steps left to right; it yields about `yield` tokens per row
when drafting (the mean over the drafting rounds that verified drafts, starting from 1.3 so that the first
rounds try) and exactly 1 otherwise. It drafts where yield / cost(drafting) > 1.05 / cost(AR step), each cost
the calibrated forward's times the measured overhead of its kind of round (`Pace.took`). The engine keeps the
yield and the overheads across its decodes, per sampler and shaping (`Learned`, `Engine.learned`), so
only its first decode explores. The choice never changes an answer (`decode.selfspec`), only how many
forwards it takes and the time.
"""

from __future__ import annotations

import json
import os
import platform
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..arch.exact import exactly
from ..params import draft_coin

PRIOR_YIELD = 1.3  # tokens per row per drafting round assumed before any draft has been verified
MARGIN = 1.05  # drafting must look this much faster than the AR step: a wrong "yes" costs more than a wrong "no"
PRIOR_WEIGHT = 1  # rounds the prior counts for
OVERHEAD_WEIGHT = 0.3  # a round's weight in the moving average of its kind's measured / calibrated time
SLOW = 0.25  # seconds: a calibration forward this slow ends the calibration (the fit uses what was timed)


@dataclass(frozen=True)
class ForwardCost:
    """Seconds of one forward: fixed + per_position x positions."""

    fixed: float
    per_position: float

    def seconds(self, positions: int) -> float:
        return self.fixed + self.per_position * positions


@dataclass
class Learned:
    """What drafting has shown so far, kept by the engine across its decodes for one sampler and shaping
    (`Engine.learned`), so that only its first decode explores: the tokens per row of the drafting rounds that
    verified drafts (the prior counted as PRIOR_WEIGHT rounds of PRIOR_YIELD), and each kind of round's
    measured wall time over the calibrated forward's (True: drafting rounds, False: AR steps)."""

    tokens: float = PRIOR_YIELD * PRIOR_WEIGHT
    rows: float = PRIOR_WEIGHT
    overhead: dict[bool, float] = field(default_factory=lambda: {True: 1.0, False: 1.0})


class Pace:
    """The per-round choice of one decode: `drafts(width, k)` before a round; `saw(...)` and `took(...)` after
    it. The calibrated cost is the network's forward alone; a round also costs the decoder's own work around
    it (a drafting round's most: its columns' bookkeeping, its guesses drawn), so each kind of round keeps the
    ratio of its measured wall time to the calibrated forward's (a moving average, from 1), and the choice
    weighs the two kinds by them: a decode learns within a few rounds what drafting costs here."""

    def __init__(
        self, policy: str, width: int, cost: ForwardCost | None, net: Any, learned: Learned | None = None
    ) -> None:
        self.policy, self.width = policy, width
        self.cost = cost if cost is not None or policy != "auto" else calibrate(net.model)
        self.learned = learned if learned is not None else Learned()  # this decode's own, unless kept
        seed = draft_coin(policy)
        self.coin = random.Random(seed) if seed is not None else None  # `random:SEED`: a schedule a test forces

    def drafts(self, b: int, k: torch.Tensor) -> bool:
        if self.coin is not None:  # tossed every round, even where nothing can draft: one toss a round
            heads = self.coin.random() < 0.5
            return heads and self.width >= 2
        if self.width < 2 or self.policy == "never":
            return False
        if self.policy == "always":
            return True
        assert self.cost is not None
        seen = self.learned
        drafting = self.cost.seconds(b * (1 + int(k.max()) + self.width)) * seen.overhead[True]
        return seen.tokens / seen.rows / drafting > MARGIN / (self.cost.seconds(b) * seen.overhead[False])

    def saw(self, b: int, tokens: int, verified: bool) -> None:
        """A round of b rows took `tokens`; `verified`: it drafted and had drafts to verify (the first drafting
        round after AR steps has none: its rows take one token each whatever drafting is worth)."""
        if verified:
            self.learned.tokens += tokens
            self.learned.rows += b

    def took(self, drafted: bool, positions: int, seconds: float) -> None:
        """A round of `positions` (rows x columns) took `seconds` of wall time."""
        if self.cost is not None:
            ratio = seconds / self.cost.seconds(positions)
            seen = self.learned.overhead
            seen[drafted] = (1 - OVERHEAD_WEIGHT) * seen[drafted] + OVERHEAD_WEIGHT * ratio


_CALIBRATION = ((1, 1), (1, 8), (4, 1), (4, 8), (16, 1), (16, 8), (64, 1), (64, 8))


@torch.no_grad()
def calibrate(model: Any, shapes: tuple[tuple[int, int], ...] = _CALIBRATION) -> ForwardCost:
    """Fit `ForwardCost` to the model's forward times at `shapes` (rows, columns) on its device and dtype."""
    with exactly():  # the arithmetic a round runs (`arch.exact`)
        return _calibrate(model, shapes)


def _calibrate(model: Any, shapes: tuple[tuple[int, int], ...]) -> ForwardCost:
    device = next(model.parameters()).device
    xs: list[int] = []
    ys: list[float] = []
    for rows, cols in sorted(shapes, key=lambda s: s[0] * s[1]):
        if len(set(xs)) >= 2 and ys[-1] > SLOW:  # a large model: the shapes so far fit it, the next would cost
            break
        ids = torch.full((rows, cols), int(model.cfg.mask_token_id), device=device)
        pos = torch.arange(cols, device=device).expand(rows, cols)
        mask = torch.ones(rows, 1, cols, cols, dtype=torch.bool, device=device).tril()
        model.hidden(ids, pos, mask, keep_kv=False)  # warm-up
        best = float("inf")
        for _ in range(3):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            h, _ = model.hidden(ids, pos, mask, keep_kv=False)
            model.head(h)  # every position: a drafting round reads the logits of all its columns
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
        xs.append(rows * cols)
        ys.append(best)
    x, y = torch.tensor(xs, dtype=torch.float64), torch.tensor(ys, dtype=torch.float64)
    a = torch.stack([torch.ones_like(x), x], 1)
    fixed, per = torch.linalg.lstsq(a, y[:, None]).solution.flatten().tolist()
    return ForwardCost(max(fixed, 1e-6), max(per, 1e-9))


CACHE_FILE = "forward-cost.json"  # under ~/.cache/celeris: calibrations by machine, device, dtype and model


def machine_key(model: Any) -> str:
    """What a calibration holds for: this machine (its name, processor and threads, or its GPU), the model's
    device, dtype, class and size, and torch's version."""
    p = next(model.parameters())
    where = torch.cuda.get_device_name(p.device) if p.device.type == "cuda" else platform.processor()
    size = sum(t.numel() for t in model.parameters())
    parts = (platform.node(), platform.machine(), where, os.cpu_count(), torch.get_num_threads(), p.device.type,
             str(p.dtype), type(model).__name__, size, torch.__version__)  # fmt: skip
    return "|".join(str(x) for x in parts)


def cached_calibration(model: Any, folder: Path | None = None) -> ForwardCost:
    """`calibrate`, kept in `folder`/forward-cost.json (default ~/.cache/celeris) by `machine_key`, so that a
    process's first answer does not pay for it again. An unreadable file is calibrated over; one that cannot be
    written is left as it is (the cost is then measured again next time). It decides only how fast an answer
    comes (docs/determinism.md)."""
    path = (folder if folder is not None else Path.home() / ".cache" / "celeris") / CACHE_FILE
    key = machine_key(model)
    try:
        known = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(known, dict):
            known = {}
        if key in known:
            return ForwardCost(float(known[key]["fixed"]), float(known[key]["per_position"]))
    except (OSError, ValueError, TypeError, KeyError):
        known = {}
    cost = calibrate(model)
    known[key] = asdict(cost)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass
    return cost
