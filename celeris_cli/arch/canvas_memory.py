"""DiffusionGemma's memory (`strategy` rule "canvas-vocab"), read off `decode.diffusion_gemma`,
`decode.canvas_step` and `arch.diffusion_gemma`. Pure arithmetic (but `shape_of_diffusion_gemma`, which counts
a built model).

A denoising step runs the decoder over every row's canvas (B x L positions: the cache, the widest layer's
activations), then the head, softmax, draws, entropies and the next step's self-conditioning input one row at a
time, `canvas_chunk` positions at a time (padded to a whole number of TILEs), so that at most tiles(chunk) x V
entries of them exist at once, whatever the batch and canvas. Between steps a row keeps only its
self-conditioning input (L x d, the weights' dtype), not its logits. A chunk's peak (`chunk_bytes`) is its
draw (`CanvasDraws.pick`: the scaled logits and probabilities over the tiles, 8 an entry, and the float64 cast and
cumulative sum of the chunk's own positions, 16: CHUNK_ENTRY in all) or its entropies (20 an entry of the tiles:
ENTROPY_ENTRY, above the draw only for a chunk padded by more than a fifth); the head's soft cap holds 12.
`noise: torch` draws with `multinomial`, a whole canvas at a time from a CPU copy, and a constrained row keeps
its whole canvas's logits: neither is counted. Held through the chunks: the rows' hidden states and their old and
new self-conditioning inputs (3 x L x d a row), the embedding read as the head in float32 (a V x d cast under
bfloat16) and a quantized embedding's dequantized copy.

The cache holds every layer's keys and values for the prompt and each committed canvas, all of them: a
sliding layer reads only its window, but the cache is not trimmed; a full layer's values (its keys'
projection) are stored apart from its keys. It is largest at the last canvas (the prompt and canvases - 1
committed ones); a commit pass builds the extended cache beside the old one and the pass's fresh keys.

Weights: every tensor of the text model as loaded (the vision tower is skipped at load, so not counted); the
128 routed experts of each layer are all resident, as stacked tensors: under int8 a byte a weight and a float32
scale per expert row; under int4 half a byte a weight and a scale and zero in the model's dtype per group of an
expert row (`quantize.QuantizedExperts`), dequantized one expert at a time as it runs (one expert's matrices in
the model's dtype: below the activations, not counted). The embedding is int8 under both.
"""

from __future__ import annotations

import math
from typing import Any

from .memory_sizes import DTYPE_BYTES, Estimate, Request, Shape, count_matrices, weights_bytes

CHUNK_ENTRIES = 1 << 24  # canvas positions x vocabulary entries a step computes at a time (`canvas_chunk`)
# The head's and the self-conditioning's matmuls run on a multiple of TILE positions (a ragged chunk padded with
# zeros): a matrix product's rounding depends on how many rows it has when they are few (torch's CPU kernels
# round rows of a 1- to 7-row product otherwise than those of 8 or more), never on which rows they are.
TILE = 16


def canvas_chunk(vocab: int, canvas: int, entries: int = CHUNK_ENTRIES) -> int:
    """The positions of one row a denoising step runs the head, softmax, entropies and draws on at a time: as
    many as `entries` holds at this vocabulary (a whole number of TILEs where that is at least one), at least
    one, at most the canvas. From the model and the request alone (never from free memory)."""
    n = entries // vocab
    return max(1, min(canvas, n - n % TILE if n >= TILE else n))


def tiles(n: int) -> int:
    """The positions a chunk of n is computed on: n rounded up to a whole number of TILEs."""
    return n + -n % TILE


CHUNK_ENTRY = 24  # bytes per chunk position x vocabulary entry at a step's draw (above)
ENTROPY_ENTRY = 20  # and while its entropies are computed, on the whole tiles


def chunk_bytes(chunk: int, vocab: int) -> int:
    """What a chunk of `chunk` positions holds at its peak: the draw's scaled logits and probabilities over the
    tiles, its float64 cast and sum over the chunk's own positions; or the entropies' over the tiles."""
    t = tiles(chunk)
    return vocab * max(8 * t + (CHUNK_ENTRY - 8) * chunk, ENTROPY_ENTRY * t)


def shape_of_diffusion_gemma(model: Any) -> Shape:
    """The Shape of a built DiffusionGemma model (on the meta device is enough): its tensors counted as
    loaded in full precision (the encoder's per-layer scales too; a quantized model's as before quantization),
    its sizes from its config."""
    cfg = model.cfg
    matrices, other = count_matrices(model)
    other += sum(b.numel() for name, b in model.named_buffers() if name.endswith("layer_scalar"))
    other += sum(getattr(m, "full_params", 0) for m in model.modules())  # quantized experts, as full precision
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


def expert_params(shape: Shape) -> int:
    """The routed experts' weights: every layer's gate and up (2I x d) and down (d x I) of each expert."""
    return shape.layers * shape.experts * 3 * shape.expert_ffn * shape.hidden


def group_of(cols: int) -> int | None:
    """As `quantize.group_of` (not imported: that module needs torch): the int4 group of a row of `cols`."""
    return next((g for g in (128, 64, 32) if cols % g == 0), None)


def expert_bytes(shape: Shape, a: int, quantize: str) -> int:
    """The routed experts as loaded (`quantize.QuantizedExperts`): int8, a byte a weight and a float32 scale a
    row; int4, half a byte a weight and a scale and zero in the model's dtype a group (int8 where a row does not
    divide into groups)."""
    n, E, i, d = shape.layers, shape.experts, shape.expert_ffn, shape.hidden
    if quantize == "none":
        return expert_params(shape) * a
    total = 0
    for rows, cols in ((2 * i, d), (d, i)):  # gate and up fused, down: rows of `cols` inputs
        g = group_of(cols) if quantize == "int4" else None
        weights = n * E * rows * cols
        total += weights + 4 * n * E * rows if g is None else weights // 2 + 2 * a * (weights // g)
    return total


def canvas_weights(shape: Shape, req: Request) -> int:
    """Every text tensor as loaded, the routed experts quantized with the rest (`weights_bytes` counts the
    stacked experts among the parameters it leaves in the model's dtype)."""
    a, everything = DTYPE_BYTES[req.dtype], weights_bytes(shape, req.dtype, req.quantize)
    return everything - expert_params(shape) * a + expert_bytes(shape, a, req.quantize)


def canvas_phases(shape: Shape, req: Request, chunk: int | None = None) -> list[Estimate]:
    """The phases of decoding `req` (each a sum of what is alive at that moment): the prompt's pass, a commit
    pass, a step's forward, its chunks of head and draws. chunk: the positions at a time (`canvas_chunk`'s)."""
    a, B, V, d = DTYPE_BYTES[req.dtype], req.batch, shape.rows, shape.hidden
    L = req.block_length  # the canvas: every canvas is whole, the last one too
    n = math.ceil(req.gen_length / L)
    chunk = chunk or canvas_chunk(V, L)
    weights = canvas_weights(shape, req)
    cached = req.prompt + (n - 1) * L  # the most positions a step reads
    cache = cache_bytes(shape, B, cached, a)
    signal = B * L * d * a  # a row's self-conditioning input, kept between steps
    # the embedding as the head: an int8 (or int4's int8) embedding's dequantized copy; a float32 cast under bfloat16
    dequantized = V * d * a if req.quantize != "none" else 0
    cast = V * d * 4 if req.upcast and a < 4 else 0
    # a layer's keys and values over the cache and canvas, repeated to every head where rows are padded
    attend = 2 * B * (cached + L) * shape.heads * max(shape.head_dim, shape.full_head_dim) * a
    phases = [
        Estimate(weights, cache_bytes(shape, B, req.prompt, a), activations(shape, B * req.prompt, a), 0),
        Estimate(weights, cache, activations(shape, B * L, a) + attend, signal),
        Estimate(weights, cache, dequantized + cast + 2 * signal, signal + chunk_bytes(chunk, V)),
    ]
    if n > 1:  # the last commit: the cache of the canvases before, its extension and the pass's fresh keys
        before = req.prompt + (n - 2) * L
        kv = cache_bytes(shape, B, before, a) + cache_bytes(shape, B, L, a) + cache
        phases.append(Estimate(weights, kv, activations(shape, B * L, a), signal))
    return phases
