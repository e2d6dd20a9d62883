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
from dataclasses import dataclass, replace
from typing import Any, Literal

from ..errors import UsageError
from ..params import GenerationParams, honoured
from ..strategy import STRATEGIES

Quantize = Literal["none", "int8", "int4"]
QUANTIZE_CHOICES: tuple[str, ...] = ("none", "int8", "int4")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LOGIT_COPIES = 3  # the head's float32 output, its softmax and the sampler's filtered scores, alive together
# per vocabulary entry of a position drawn over the whole vocabulary (`Request.whole_draw`): the float32
# logits and their filtered copy, the float64 scores and the inverse-CDF draw's two float64 temporaries
WHOLE_DRAW_BYTES = 2 * 4 + 3 * 8 + 4  # and the probabilities Dream and RND1 keep beside them
LOGIT_BUDGET = 512 * 2**20  # a step's logits and their copies alive at once: the head runs in chunks of this
HEAD_CACHE_BYTES = 64 * 2**20  # as `layers.HEAD_CACHE_BYTES` (not imported: that module needs torch)
GiB = 2**30


@dataclass(frozen=True)
class Shape:
    """The sizes memory depends on. `matrix_params`: parameters in the linear layers and the embedding
    (what int8 quantizes, one float32 scale per output row); `other_params`: norms, biases, routers.
    `ffn`: the widest intermediate a token passes through (a mixture of experts: its chosen experts')."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    rows: int  # embedding rows = LM head outputs
    matrix_params: int
    matrix_rows: int  # output rows summed over the quantizable matrices (the int8 scales)
    other_params: int
    tied: bool = False  # the LM head is the embedding (read as a matrix; int4 keeps it int8)
    # layers with key/value heads and a head size of their own (DiffusionGemma's full layers)
    full_layers: int = 0
    full_kv_heads: int = 0
    full_head_dim: int = 0
    experts: int = 0  # a mixture of experts beside the dense MLP (`canvas_memory`): routed experts,
    experts_per_token: int = 0  # each token's, and each expert's intermediate size
    expert_ffn: int = 0

    @property
    def params(self) -> int:
        return self.matrix_params + self.other_params


@dataclass(frozen=True)
class Request:
    """A decode to plan: `prompt` and `gen_length` in tokens; `window` the tokens a cached step recomputes
    (fast: block_length, or the block and suffix for `prefix`; block-fast: block_length)."""

    strategy: str
    batch: int
    prompt: int
    gen_length: int
    block_length: int
    dtype: str = "float32"
    quantize: Quantize = "none"
    cache: str = "dual"  # the fast decoder's cache mode: dual, prefix or none
    suffix_window: int = 0
    views: int = 1  # 2 under classifier-free guidance
    upcast: bool = True
    whole_draw: bool = False  # tokens drawn over the whole vocabulary in float64 (`request_of`)


@dataclass(frozen=True)
class Estimate:
    """The expected peak in bytes, split into what is alive at that moment."""

    weights: int
    kv_cache: int
    activations: int
    logits: int

    @property
    def peak(self) -> int:
        return self.weights + self.kv_cache + self.activations + self.logits


def shape_from_dims(
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    rows: int,
    head_dim: int | None = None,
    tied: bool = False,
    experts: int = 0,
    expert_ffn: int = 0,
    experts_per_token: int = 0,
    shared_experts: int = 0,
    dense_layers: int = 0,
) -> Shape:
    """A Shape from a model card's figures (for published models whose weights are not at hand)."""
    hd = head_dim or hidden // heads
    attn = hidden * (heads + 2 * kv_heads) * hd + heads * hd * hidden
    attn_rows = (heads + 2 * kv_heads) * hd + hidden
    dense = (3 * hidden * ffn, 2 * ffn + hidden)
    if experts:
        moe = 3 * hidden * expert_ffn * (experts + shared_experts)
        moe_rows = (2 * expert_ffn + hidden) * (experts + shared_experts)
        per_token = expert_ffn * (experts_per_token + shared_experts)
        mlp = dense[0] * dense_layers + moe * (layers - dense_layers)
        mlp_rows = dense[1] * dense_layers + moe_rows * (layers - dense_layers)
        other = (layers - dense_layers) * experts * hidden  # routers, kept in full precision
        width = max(ffn if dense_layers else 0, per_token)
    else:
        mlp, mlp_rows, other, width = dense[0] * layers, dense[1] * layers, 0, ffn
    heads_ = 1 if tied else 2
    return Shape(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=hd,
        ffn=width,
        rows=rows,
        matrix_params=layers * attn + mlp + heads_ * rows * hidden,
        matrix_rows=layers * attn_rows + mlp_rows + heads_ * rows,
        other_params=other + layers * 2 * hidden + hidden,
        tied=tied,
    )


INT4_GROUP = 128  # the group most rows divide into (`quantize.GROUPS`; smaller rows have more scales)


def weights_bytes(shape: Shape, dtype: str, quantize: Quantize = "none") -> int:
    """int8: a byte a weight and a float32 scale per row; int4: half a byte a weight of the linear layers
    and a scale and zero in `dtype` per group, the embedding as int8."""
    a = DTYPE_BYTES[dtype]
    if quantize == "int8":
        return shape.matrix_params + 4 * shape.matrix_rows + shape.other_params * a
    if quantize == "int4":
        embedding = shape.rows * shape.hidden
        linear = shape.matrix_params - embedding
        return linear // 2 + 2 * a * (linear // INT4_GROUP) + embedding + 4 * shape.rows + shape.other_params * a
    return shape.params * a


def logit_chunk(vocab: int, budget: int = LOGIT_BUDGET) -> int:
    """The positions a step runs the LM head and the sampling on at a time (`decode.predict.in_chunks`): as
    many as fit `budget` when each is drawn over the whole vocabulary (WHOLE_DRAW_BYTES an entry, the most a
    sampler keeps), a whole number of the head's row tiles (16) where that is at least one; never fewer than
    one."""
    n = budget // (vocab * WHOLE_DRAW_BYTES)
    return max(1, n - n % 16 if n >= 16 else n)


def _kv(shape: Shape, batch: int, length: int, nbytes: int) -> int:
    """Keys and values of every layer for `batch` rows of `length` positions."""
    return 2 * shape.layers * batch * shape.kv_heads * length * shape.head_dim * nbytes


def _activations(shape: Shape, tokens: int, a: int, upcast: bool) -> int:
    """The widest layer of one forward over `tokens` (rows x positions) in dtype bytes `a`."""
    qkv = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    rope = (shape.heads + shape.kv_heads) * shape.head_dim * 4  # rotary runs in float32
    up = qkv * 4 if (upcast and a < 4) else 0  # attention in float32 under low precision
    attention = qkv * a + rope + up + shape.heads * shape.head_dim * a
    mlp = 3 * shape.ffn * a
    return tokens * (2 * shape.hidden * a + max(attention, mlp))


def _head(shape: Shape, positions: int, req: Request, int8: bool, kernel: bool = False) -> int:
    """The LM head's output for a step's `positions` in each view (a chunk of them at a time) with its
    sampling copies (float64 ones for a draw over the whole vocabulary), a large head's float32 cast, and an
    int8 head's dequantized copy (`quantize`: the head is read as a matrix; an int4 head of its own runs the
    kernel (`kernel`): no copy, no cast; a tied one is the int8 embedding)."""
    a = DTYPE_BYTES[req.dtype]
    f32 = req.upcast and a < 4 and not kernel
    cast = shape.rows * shape.hidden * 4 if f32 and shape.rows * shape.hidden * 4 > HEAD_CACHE_BYTES else 0
    positions = min(positions, logit_chunk(shape.rows)) * req.views  # the head runs in chunks
    entry = WHOLE_DRAW_BYTES if req.whole_draw else 4 * LOGIT_COPIES
    return positions * shape.rows * entry + cast + (shape.rows * shape.hidden * a if int8 else 0)


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
        from .canvas_memory import canvas_phases

        phases.extend(canvas_phases(shape, req))
    elif rule in ("canvas-block", "canvas-answer"):
        act = _activations(shape, B * L, a, req.upcast)
        predicted = B * (W if rule == "canvas-block" else req.gen_length)  # a block's, or the whole answer's
        phases.append(Estimate(weights, 0, act, _head(shape, predicted, req, int8, kernel)))
    else:
        raise UsageError(f"no memory plan for strategy {req.strategy!r}")
    return max(phases, key=lambda e: e.peak)


def largest_batch(shape: Shape, req: Request, budget: int, limit: int = 4096) -> int:
    """The largest batch whose expected peak fits `budget` bytes (0 when not even one row fits)."""
    if plan(shape, replace(req, batch=1)).peak > budget:
        return 0
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if plan(shape, replace(req, batch=mid)).peak <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


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


def human(n: int) -> str:
    """Bytes for people: 1.2 GiB, 340 MiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.0f} {unit}"
    return f"{n} B"


def _dim(cfg: object, *names: str) -> int:
    for name in names:
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise UsageError(f"{type(cfg).__name__} names none of {', '.join(names)}: no memory plan for it")


def count_matrices(model: Any) -> tuple[list[tuple[int, int]], int]:
    """(rows, columns) of each linear layer and embedding of a built model (what quantization reads as a
    matrix), and the count of its other parameters (norms, biases, routers, stacked experts)."""
    import torch
    from torch import nn

    matrices: list[tuple[int, int]] = []
    other = 0
    for m in model.modules():
        weight = m.qweight if hasattr(m, "qweight") else getattr(m, "weight", None)  # int8 (`quantize`) or float
        if isinstance(weight, torch.Tensor) and (isinstance(m, (nn.Linear, nn.Embedding)) or hasattr(m, "qweight")):
            matrices.append((m.rows, m.cols) if hasattr(m, "group") else (weight.shape[0], weight.shape[1]))  # int4
            bias = getattr(m, "bias", None)
            other += bias.numel() if isinstance(bias, torch.Tensor) else 0
        else:
            other += sum(p.numel() for p in m.parameters(recurse=False))
    return matrices, other


def shape_of_model(model: Any) -> Shape:
    """The Shape of a built model (on the meta device is enough): the quantizable parameters counted from
    its linear layers and embedding, the sizes read from its config."""
    cfg = model.cfg
    if getattr(cfg, "model_type", None) == "diffusion_gemma":
        from .canvas_memory import shape_of_diffusion_gemma

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
