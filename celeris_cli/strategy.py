"""The decoding strategies, each declared once (no torch): the one table of strategy names.

A strategy is a decoder (`decode.strategies.DECODERS`, by the decoder's name) fed exactly the parts of the
settings it declares (`params.PARTS`), with the rules every other layer reads from its entry here rather
than from a list of names of its own: how its steps are reported, what the memory planner counts for it
(`arch.memory.plan`), which running set its rows join, whether it streams blocks, and the quirks of its
family's own sampler. Which strategies run on a model is the architecture's (`arch.registry`).

Adding a strategy: its decoder module (and a `DECODERS` entry if the decoder is new), and one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# how the steps a request runs are reported (`GenerationParams.steps_for`):
# "schedule": the canvas's blocks, steps split over them; "block_steps": block diffusion's blocks from the row's
# own position 0, steps per block; "seeded": Nemotron's blocks after a seed token each; "per_token": one
# token a forward (at most); "denoise": one block, the whole canvas; "canvases": whole fixed-length canvases
# (DiffusionGemma's), each with its cap of steps
StepsRule = Literal["schedule", "block_steps", "seeded", "per_token", "denoise", "canvases"]
# what the memory planner counts for one step (`arch.memory.plan`): "fast": the fast decoder's cache and
# windows; "block-cached": block diffusion's exact cache; "block": block diffusion recomputing its canvas;
# "canvas-block": a full-canvas forward, the head on a block; "canvas-answer": the same, the head on the answer;
# "canvas-vocab": DiffusionGemma's canvas x vocabulary of float32 logits and sampling buffers over a causal cache;
# "causal": a causal cache over the canvas and a round of verified and drafted columns (block_length: the draft's;
# Nemotron's diffusion mode runs one block of block_length over such a cache, so the round of two bounds it)
MemoryRule = Literal["fast", "block-cached", "block", "canvas-block", "canvas-answer", "canvas-vocab", "causal"]
RowKind = Literal["block", "waves", "spec", "canvas", "seeded", "whole"]


@dataclass(frozen=True)
class Strategy:
    """One decoding strategy."""

    parts: tuple[str, ...]  # the settings' parts its decoder receives, and so the knobs it honours
    decoder: str  # its decoder, in `decode.strategies.DECODERS`
    steps: StepsRule
    memory: MemoryRule | None  # None: no memory plan (its batches are sized by the out-of-memory back-off)
    running: RowKind | None = None  # the running set its rows join (without guidance); None: static batches
    static_because: str = ""  # with no running set: why its rows cannot decode row by row (docs/scheduling.md)
    streams_blocks: bool = False  # takes an `on_block` hook: a row's text as each of its blocks is committed
    uncapped: bool = False  # its family's own code allows more steps than tokens (a step may commit nothing)
    whole_draw: bool = False  # its family's sampler draws over the whole vocabulary in float64, filtered or not
    end_slot: bool = False  # its family's sampler keeps the canvas's last position for the end of text
    left_to_right: bool = False  # decides an answer in order: no masked slots for a template to hold open


_BLOCK_PARTS = ("blocks", "sampling", "ordering", "guidance", "commit", "shaping", "editing", "structure")

STRATEGIES: dict[str, Strategy] = {
    "fast": Strategy(
        ("schedule", "sampling", "ordering", "guidance", "parallel", "shaping", "structure"),
        "fast",
        "schedule",
        "fast",
        "waves",
    ),
    "reference": Strategy(
        ("schedule", "sampling", "ordering", "guidance"),
        "reference",
        "schedule",
        "canvas-block",
        "whole",
    ),
    "dream": Strategy(
        ("timeline", "sampling", "unmasking"),
        "dream",
        "denoise",
        "canvas-answer",
        "whole",
        uncapped=True,
        whole_draw=True,
    ),
    "rnd1": Strategy(
        ("canvas", "filters", "entropy"),
        "rnd1",
        "denoise",
        "canvas-answer",
        "whole",
        uncapped=True,
        whole_draw=True,
        end_slot=True,
    ),
    "block": Strategy(_BLOCK_PARTS, "block", "block_steps", "block", "block", streams_blocks=True),
    "block-fast": Strategy(_BLOCK_PARTS, "block-cached", "block_steps", "block-cached", "block", streams_blocks=True),
    "nemotron": Strategy(
        ("blocks", "sampling", "ordering", "commit", "shaping"),
        "seeded",
        "seeded",
        "causal",
        "seeded",
        streams_blocks=True,
    ),
    "ar": Strategy(
        ("length", "sampling", "shaping"),
        "ar",
        "per_token",
        None,
        static_because="the AR yardstick `bench` measures against stays the plain static loop (the AR step `spec` "
        "runs in its running set, as `spec` with `drafting: never`)",
    ),
    "nemotron-spec": Strategy(
        ("draft", "sampling"),
        "speculative",
        "per_token",
        None,
        static_because="Nemotron's speculative verify pass has its own cache rule (a draft is appended only when "
        "verified); `spec` is the running form of speculation on the same checkpoint",
    ),
    "spec": Strategy(
        ("drafting", "sampling", "shaping", "structure"),
        "self-spec",
        "per_token",
        "causal",
        "spec",
        streams_blocks=True,
        left_to_right=True,
    ),
    "diffusion-gemma": Strategy(
        ("blocks", "denoising", "noise", "stops", "structure"),
        "diffusion-gemma",
        "canvases",
        "canvas-vocab",
        "canvas",  # every setting it takes, constraints and `noise: torch` included (`decode.canvasrun`)
        streams_blocks=True,
        uncapped=True,
    ),
}
