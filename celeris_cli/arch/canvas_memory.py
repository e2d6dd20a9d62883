"""DiffusionGemma's memory (`strategy` rule "canvas-vocab"), read off `decode.diffusion_gemma` and
`arch.diffusion_gemma`. What limits this family is not its cache but the canvas times the vocabulary in
float32, alive at every step. Pure arithmetic (but `shape_of_diffusion_gemma`, which counts a built model).

The decoder does not chunk: every step runs the LM head, the softmax, the entropies and the draws on the
whole canvas of every row at once (B x L x V entries; `logit_chunk` does not apply). Per entry, at a step's
two peaks (a: the weights' dtype bytes):

- the head (`DiffusionGemmaModel.denoise`): the previous step's self-conditioning input (a), its float32
  scaled logits and probabilities, both still held by the loop (under float32 the input *is* the scaled
  logits), the softmax of the input that builds the self-conditioning signal (a, float32 under float32), and
  the head's float32 logits with the soft cap's two temporaries (12): HEAD_ENTRY, 24 bytes whatever the
  dtype; besides, the embedding read as the head in float32 (a V x d cast under bfloat16), and an int8
  embedding's dequantized copy (int4 keeps the embedding int8);
- the draw (`CanvasDraws.sample`): the input (a), the scaled logits and their probabilities (8), the live
  rows' probabilities (an indexed copy, 4), and their float64 cast and cumulative sum (16): a + DRAW_ENTRY.
  The entropies (`Categorical`: normalised logits, a clamped copy, probabilities, p log p: 16) stay below.
  (`noise: torch` draws with `multinomial` one row at a time from a CPU copy instead of the float64 sum:
  less on the device; the planner counts the default noise's draw.)

The cache holds every layer's keys and values for the prompt and each committed canvas, all of them: a
sliding layer reads only its window, but the cache is not trimmed; a full layer's values (its keys'
projection) are stored apart from its keys. It is largest at the last canvas (the prompt and canvases - 1
committed ones); a commit pass builds the extended cache beside the old one and the pass's fresh keys.

Weights: every tensor of the text model as loaded (the vision tower is skipped at load, so not counted);
the 128 routed experts of each layer are all resident, as stacked tensors that int8 and int4 leave in the
model's dtype (only linear layers and the embedding are quantized).
"""

from __future__ import annotations

import math
from typing import Any

from .memory import DTYPE_BYTES, Estimate, Request, Shape, count_matrices

HEAD_ENTRY = 24  # bytes per canvas x vocabulary entry while the head runs (above)
DRAW_ENTRY = 28  # and while a step draws, besides the self-conditioning input in the weights' dtype


def shape_of_diffusion_gemma(model: Any) -> Shape:
    """The Shape of a built DiffusionGemma model (on the meta device is enough): its tensors counted as
    loaded (the encoder's per-layer scales too), its sizes from its config."""
    cfg = model.cfg
    matrices, other = count_matrices(model)
    other += sum(b.numel() for b in model.buffers())
    return Shape(
        layers=cfg.num_hidden_layers,
        hidden=cfg.hidden_size,
        heads=cfg.num_attention_heads,
        kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        ffn=cfg.intermediate_size,
        rows=cfg.vocab_size,
        matrix_params=sum(r * c for r, c in matrices),
        matrix_rows=sum(r for r, _ in matrices),
        other_params=other,
        tied=True,
        full_layers=sum(not cfg.sliding(i) for i in range(cfg.num_hidden_layers)),
        full_kv_heads=cfg.global_kv_heads,
        full_head_dim=cfg.global_head_dim,
        experts=cfg.num_experts,
        experts_per_token=cfg.top_k_experts,
        expert_ffn=cfg.moe_intermediate_size,
    )


def cache_bytes(shape: Shape, batch: int, positions: int, a: int) -> int:
    """Keys and values of every layer (sliding and full, each with its own heads and head size)."""
    sliding = (shape.layers - shape.full_layers) * shape.kv_heads * shape.head_dim
    full = shape.full_layers * shape.full_kv_heads * shape.full_head_dim
    return 2 * batch * positions * (sliding + full) * a


def activations(shape: Shape, tokens: int, a: int) -> int:
    """One forward's widest layer over `tokens` (rows x positions): the residual stream and a norm's float32
    copies, then the attention (projections, float32 norms and rotary), the dense MLP, or the routed experts
    (each token's k rows gathered, up, gated, down, weighted, put back; the router's float32 scores)."""
    d, k, i = shape.hidden, shape.experts_per_token, shape.expert_ffn
    attention = max(
        (shape.heads + 2 * kv) * hd * a + 2 * (shape.heads + kv) * hd * 4 + shape.heads * hd * a
        for kv, hd in ((shape.kv_heads, shape.head_dim), (shape.full_kv_heads, shape.full_head_dim))
    )
    dense = 3 * shape.ffn * a
    routed = k * (4 * d + 3 * i) * a + 2 * shape.experts * 4 + d * a  # the dense MLP's output kept beside
    return tokens * (2 * d * a + 2 * d * 4 + max(attention, dense, routed))


def canvas_phases(shape: Shape, req: Request, weights: int) -> list[Estimate]:
    """The phases of decoding `req` (each a sum of what is alive at that moment): the prompt's pass, a commit
    pass, a step's forward, its head, its draw."""
    a, B, V, d = DTYPE_BYTES[req.dtype], req.batch, shape.rows, shape.hidden
    L = req.block_length  # the canvas: every canvas is whole, the last one too
    n = math.ceil(req.gen_length / L)
    entries = B * L * V
    cached = req.prompt + (n - 1) * L  # the most positions a step reads
    cache = cache_bytes(shape, B, cached, a)
    # an int8 (or int4's int8) embedding read as the head: a dequantized copy; under bfloat16 a float32 cast
    dequantized = V * d * a if req.quantize != "none" else 0
    cast = V * d * 4 if req.upcast and a < 4 else 0
    logits = entries * (HEAD_ENTRY + (a if not req.upcast and a < 4 else 0))  # logits in a, then float32
    held = entries * ((4 if a == 4 else a + 4) + 4 + a)  # the loop's input, scaled logits, probabilities
    # a layer's keys and values over the cache and canvas, repeated to every head where rows are padded
    attend = 2 * B * (cached + L) * shape.heads * max(shape.head_dim, shape.full_head_dim) * a
    phases = [
        Estimate(weights, cache_bytes(shape, B, req.prompt, a), activations(shape, B * req.prompt, a), 0),
        Estimate(weights, cache, activations(shape, B * L, a) + attend + dequantized, held),
        Estimate(weights, cache, dequantized + cast, logits),
        Estimate(weights, cache, 0, entries * (a + DRAW_ENTRY)),
    ]
    if n > 1:  # the last commit: the cache of the canvases before, its extension and the pass's fresh keys
        before = req.prompt + (n - 2) * L
        kv = cache_bytes(shape, B, before, a) + cache_bytes(shape, B, L, a) + cache
        phases.append(Estimate(weights, kv, activations(shape, B * L, a), 0))
    return phases
