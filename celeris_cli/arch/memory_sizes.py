"""The memory planner's arithmetic of sizes: a network's `Shape`, a decode's `Request`, the `Estimate` of a
phase, and the bytes of weights, caches, activations and logits (`memory` plans phases from these, and
`canvas_memory` DiffusionGemma's). Pure arithmetic, no torch (`count_matrices` imports it to read a model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ..errors import UsageError

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


def human(n: int) -> str:
    """Bytes for people: 1.2 GiB, 340 MiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.0f} {unit}"
    return f"{n} B"
