"""The memory planner: the peak a decode is expected to reach, from the network's sizes, the strategy, the
batch, the lengths, the dtype and the weights' quantization. Pure arithmetic, no torch.

A decode's peak is the largest of a few phases, each the sum of what is alive at that moment (read off the
decoders in `decode/`):

- every strategy holds the weights, and under bfloat16 with `upcast` a float32 copy of a small LM head
  (`layers.HEAD_CACHE_BYTES`), or a per-call float32 cast of a large one while the head runs;
- `fast` with a cache refreshes it with a full-canvas forward at each block: the old cache, the fresh
  keys/values of every layer (model dtype) and the new float32-or-model-dtype copy are alive together;
  its steps hold the cache, a window's activations and the logits of the active block's masked positions;
- `block-fast` runs as the running set (`decode.running`): an exact cache of the whole canvas in the model
  dtype, allocated once with a slot per row; a joining row's prompt is prefilled into its slot alone; each
  round's forward is one block-wide window per row (under bfloat16 with `upcast`, a layer's cache is read
  in float32, one layer at a time). Rows leaving move within the cache: nothing is copied;
- `block` recomputes the prefix up to the active block at every step, without a cache;
- `reference`, `dream` and `rnd1` run the whole canvas at every step, and the LM head on the positions a
  step predicts: the active block's masked ones (reference), the answer's (dream, rnd1);
- `diffusion-gemma` runs the head and draws of a step a chunk of a row's positions at a time, beside a cache of
  every layer's keys and values (`canvas_memory`).

The LM head and the sampling run on at most `logit_chunk` positions at a time (`decode.predict.in_chunks`),
so a step's logits stay within LOGIT_BUDGET per view however wide the batch and long the block. A position's
logits take LOGIT_COPIES float32 copies, or WHOLE_DRAW_BYTES an entry where tokens are drawn over the whole
vocabulary in float64 (sampling with no filter to narrow the candidates, or Dream's and RND1's samplers).

Activations are those of the largest forward's widest layer: the residual stream, then either the
attention's projections (with their float32 rotary and upcast copies) or the SwiGLU's three intermediates.
SDPA's fused kernels never materialise the (T x T) scores, so they are not counted.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Any

from ..backoff import largest_fitting
from ..errors import UsageError
from ..params import GenerationParams, honoured
from ..strategy import STRATEGIES
from .canvas_memory import canvas_phases, shape_of_diffusion_gemma
from .memory_sizes import (
    DTYPE_BYTES,
    HEAD_CACHE_BYTES,
    QUANTIZE_CHOICES,
    Estimate,
    Quantize,
    Request,
    Shape,
    _activations,
    _dim,
    _head,
    _kv,
    count_matrices,
    weights_bytes,
)


def plan(shape: Shape, req: Request) -> Estimate:
    """The expected peak of decoding `req` on a model of `shape`: the largest of the strategy's phases."""
    if req.quantize not in QUANTIZE_CHOICES:
        raise UsageError(f"unknown quantization {req.quantize!r} (choose {', '.join(QUANTIZE_CHOICES)})")
    if req.dtype not in DTYPE_BYTES:
        raise UsageError(f"unknown dtype {req.dtype!r} (choose {', '.join(DTYPE_BYTES)})")
    a, B, V = DTYPE_BYTES[req.dtype], req.batch, req.views
    f32 = req.upcast and a < 4
    int8 = req.quantize == "int8" or (req.quantize == "int4" and shape.tied)  # a head read as a matrix
    kernel = req.quantize == "int4" and not shape.tied  # an int4 head of its own: its kernel, never a matrix
    small = shape.rows * shape.hidden * 4 <= HEAD_CACHE_BYTES
    head_copy = shape.rows * shape.hidden * 4 if f32 and small and not kernel else 0
    weights = weights_bytes(shape, req.dtype, req.quantize) + head_copy
    L = req.prompt + req.gen_length  # the canvas
    W = min(req.block_length, req.gen_length)
    masked = B * W  # positions the head runs on in a step (at most), in each view
    phases: list[Estimate] = []
    rule = STRATEGIES[req.strategy].memory if req.strategy in STRATEGIES else None
    if rule == "fast":
        seen = L  # a bounded canvas (suffix_window) still reaches the whole canvas at its last block
        act = _activations(shape, B * seen, a, req.upcast)
        if req.cache == "none":
            phases.append(Estimate(weights, 0, act, _head(shape, masked, req, int8, kernel)))
        else:
            cache = V * _kv(shape, B, seen, 4 if f32 else a)
            fresh = _kv(shape, B, seen, a)
            phases.append(Estimate(weights, cache + fresh, act, 0))  # the refresh forward
            phases.append(Estimate(weights, 2 * cache + fresh, 0, 0))  # the new cache built beside the old
            window = W if req.cache == "dual" else seen - req.prompt
            step = _activations(shape, B * window, a, req.upcast)
            phases.append(Estimate(weights, cache, step, _head(shape, masked, req, int8, kernel)))
    elif rule in ("block-cached", "block"):
        C = math.ceil(L / W) * W + W  # block-aligned canvas (a row's first block may hold its prompt's tail)
        if rule == "block":
            act = V * _activations(shape, B * C, a, req.upcast)
            phases.append(Estimate(weights, 0, act, _head(shape, masked, req, int8, kernel)))
        else:
            cache = V * _kv(shape, B, C, a)
            prefill = (req.prompt // W) * W  # one row's, into its slot
            phases.append(Estimate(weights, cache, _activations(shape, prefill, a, req.upcast), 0))
            step = _activations(shape, B * W, a, req.upcast) + (_kv(shape, B, C, 4) // shape.layers if f32 else 0)
            phases.append(Estimate(weights, cache, step, _head(shape, masked, req, int8, kernel)))
    elif rule == "causal":  # a causal cache over the canvas and a round past it; the prompts' prefill, a round
        cache = _kv(shape, B, L + 2 * W, 4 if f32 else a)
        prefill = _activations(shape, B * req.prompt, a, req.upcast)
        phases.append(Estimate(weights, cache, prefill, _head(shape, B, req, int8, kernel)))
        step = _activations(shape, B * 2 * W, a, req.upcast)
        phases.append(Estimate(weights, cache, step, _head(shape, B * 2 * W, req, int8, kernel)))
    elif rule == "canvas-vocab":
        phases.extend(canvas_phases(shape, req))
    elif rule in ("canvas-block", "canvas-answer"):
        act = _activations(shape, B * L, a, req.upcast)
        predicted = B * (W if rule == "canvas-block" else req.gen_length)  # a block's, or the whole answer's
        phases.append(Estimate(weights, 0, act, _head(shape, predicted, req, int8, kernel)))
    else:
        raise UsageError(f"no memory plan for strategy {req.strategy!r}")
    return max(phases, key=lambda e: e.peak)


def largest_batch(shape: Shape, req: Request, budget: int, limit: int = 4096) -> int:
    """The largest batch whose expected peak fits `budget` bytes (0 when not even one row fits): the one
    "how many fit" search (`backoff.largest_fitting`) over the plan."""
    return largest_fitting(limit, lambda n: plan(shape, replace(req, batch=n)).peak <= budget)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(b|kb|mb|gb|tb|kib|mib|gib|tib)\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_size(text: str, name: str = "max-memory") -> int:
    """'8GiB', '512MB', '1.5gb' or '4096B' -> bytes. The unit is required: '2' could be two bytes or two GB."""
    m = _SIZE.match(str(text))
    if not m:
        unitless = re.fullmatch(r"\s*\d+(?:\.\d+)?\s*", str(text))
        why = " (a size needs its unit: B, KB, MB, GB, KiB, MiB or GiB)" if unitless else ""
        raise UsageError(f"{name} must be a size such as 8GiB or 512MB, got {text!r}{why}")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise UsageError(f"{name} must be positive, got {text!r}")
    return value


def shape_of_model(model: Any) -> Shape:
    """The Shape of a built model (on the meta device is enough): the quantizable parameters counted from
    its linear layers and embedding, the sizes read from its config."""
    cfg = model.cfg
    if getattr(cfg, "model_type", None) == "diffusion_gemma":
        return shape_of_diffusion_gemma(model)
    matrices, other = count_matrices(model)
    matrix_params = sum(r * c for r, c in matrices)
    heads = _dim(cfg, "n_heads", "num_attention_heads")
    hidden = _dim(cfg, "d_model", "hidden_size")
    experts = getattr(cfg, "num_experts", None) or 0
    per_token = (getattr(cfg, "num_experts_per_tok", 0) + (getattr(cfg, "num_shared_experts", 0) or 0)) * getattr(
        cfg, "moe_intermediate_size", 0
    )
    ffn = _dim(cfg, "mlp_hidden_size", "intermediate_size")
    dense_layers = getattr(cfg, "first_k_dense_replace", 0) if experts else 0
    return Shape(
        layers=_dim(cfg, "n_layers", "num_hidden_layers"),
        hidden=hidden,
        heads=heads,
        kv_heads=_dim(cfg, "kv_heads", "num_key_value_heads", "n_heads"),
        head_dim=_dim(cfg, "head_dim", "dim") if hasattr(cfg, "head_dim") or hasattr(cfg, "dim") else hidden // heads,
        ffn=max(per_token, ffn if dense_layers or not experts else 0),
        rows=cfg.rows,
        matrix_params=matrix_params,
        matrix_rows=sum(r for r, _ in matrices),
        other_params=other,
        tied=model.head_layer() is model.parts()[0],
    )


def request_of(p: GenerationParams, batch: int, prompt: int, dtype: str, quantize: Quantize = "none") -> Request:
    """The Request a decode with these settings runs: the parts of them memory depends on."""
    return Request(
        strategy=p.strategy,
        batch=batch,
        prompt=prompt,
        gen_length=p.gen_length,
        block_length=p.part("drafting").width if "drafting" in STRATEGIES[p.strategy].parts else p.block_length,
        dtype=dtype,
        quantize=quantize,
        cache=p.cache,
        suffix_window=p.suffix_window,
        views=2 if p.cfg_scale > 0 else 1,
        whole_draw=whole_draw(p),
    )


def whole_draw(p: GenerationParams) -> bool:
    """Whether a decode draws tokens over the whole vocabulary in float64: sampling (RND1's with `greedy`
    off) with no top-k, top-p or min-p to narrow the candidates, or Dream's and RND1's samplers, which
    always filter over it."""
    sampled = p.temperature > 0 and not ("greedy" in honoured(p.strategy) and p.greedy)
    narrowed = p.top_k > 0 or p.top_p < 1 or p.min_p > 0
    return sampled and (STRATEGIES[p.strategy].whole_draw or not narrowed)
