"""Pieces every architecture shares: rotary embeddings, attention over an optional cache, and the model
boundary (`Model`) that decoders call.

Each architecture's module builds its network from these and exposes the same four things: `cfg`
(special ids and sizes), `hidden(ids, positions, attn_mask, cache, start)`, `head(h)` and `logit_shift`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelError
from . import exact, invariant
from .config_fields import check_type
from .kv import KV, LayerKV
from .packed import PackedLayer
from .quantize import Int4Linear


class ArchConfig(Protocol):
    """What the engine, the tokenizer and the decoders read from any architecture's config."""

    @property
    def model_type(self) -> str: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def mask_token_id(self) -> int | None: ...
    @property
    def eos_token_id(self) -> int | None: ...  # None: the tokenizer's eos_token
    @property
    def pad_token_id(self) -> int | None: ...
    @property
    def eot_token_id(self) -> int | None: ...
    @property
    def bos_token_id(self) -> int | None: ...
    @property
    def max_sequence_length(self) -> int: ...
    @property
    def rows(self) -> int: ...


class Model(Protocol):
    """The model boundary: decoders see hidden states, the LM head and the cache, never a family's layers.

    `logit_shift` is 1 where the prediction for position j comes from position j-1 (Dream), else 0.
    `block_causal` is True where attention is causal between blocks (LLaDA2): such a model is decoded by
    the block strategies only."""

    @property
    def cfg(self) -> ArchConfig: ...
    @property
    def logit_shift(self) -> int: ...
    @property
    def block_causal(self) -> bool: ...

    def hidden(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        cache: Sequence[LayerKV | PackedLayer] | None = None,
        start: int | torch.Tensor = 0,
        keep_kv: bool = True,
    ) -> tuple[torch.Tensor, list[KV]]: ...

    def head(self, h: torch.Tensor) -> torch.Tensor: ...

    def step_head(self) -> Callable[[torch.Tensor], torch.Tensor]: ...

    def __call__(
        self, ids: torch.Tensor, key_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def set_upcast(self, on: bool) -> None: ...


def rope_tables(positions: torch.Tensor, rot_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for the rotate-half convention over the first `rot_dim` dims of a head, in float32.
    positions: (B, T) -> (B, 1, T, rot_dim)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, device=positions.device, dtype=torch.float32) / rot_dim))
    freqs = positions.float()[..., None] * inv_freq  # (B, T, rot_dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, T, rot_dim)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of each head (all of them unless rotary is partial), in float32."""
    dtype, rot = x.dtype, cos.shape[-1]
    x = x.float()
    xr, rest = x[..., :rot], x[..., rot:]
    x1, x2 = xr.chunk(2, dim=-1)
    out = xr * cos + torch.cat((-x2, x1), dim=-1) * sin
    return (torch.cat((out, rest), dim=-1) if rest.shape[-1] else out).to(dtype)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    cache: LayerKV | PackedLayer | None,
    start: int | torch.Tensor,
    upcast: bool,
) -> tuple[torch.Tensor, KV]:
    """Scaled dot-product attention of q (B, H, T, D) over k, v (B, Hkv, T, D), or over a cached canvas
    with positions [start, start+T) overwritten in place by the fresh k, v (`start` one per row where rows
    decode at different places; `LayerKV.update`). Returns (B, T, H*D) and the fresh (k, v). attn_mask:
    bool, broadcastable to (B, H, T, L); True = may attend. Grouped-query heads are SDPA's own
    (`enable_gqa`), so the keys/values are never repeated per query head. A float32 cache under upcast is
    used as it is (see `Net.cache_of`), not cast again at every step. In a packed forward (`arch.packed`)
    the layer's `PackedLayer` runs the attention, row by row."""
    fresh = (k, v)
    if isinstance(cache, PackedLayer):
        return cache.attend(q, k, v, upcast), fresh
    if cache is not None:
        k, v = cache.update(k, v, start)
    gqa = q.shape[1] != k.shape[1]
    dtype = q.dtype
    if dtype != torch.float32 and upcast:  # low-precision rounding would depend on the batch's shape
        q, k, v = q.float(), k.float(), v.float()
    if exact.active():  # each query's numbers its own (self-speculation: `arch.exact`)
        y = exact.attention(q, k, v, attn_mask)
    elif invariant.active() or (isinstance(cache, LayerKV) and cache.exact):
        y = invariant.attention(q, k, v, attn_mask, start, gqa)
    else:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=gqa)
    y = y.to(dtype)
    B, H, T, D = y.shape
    return y.transpose(1, 2).reshape(B, T, H * D), fresh


def key_mask_4d(key_mask: torch.Tensor | None) -> torch.Tensor | None:
    """(B, L) keys that may be attended to -> (B, 1, 1, L); a (B, 1, T, L) mask passes unchanged."""
    if key_mask is None or key_mask.dim() == 4:
        return key_mask
    return key_mask[:, None, None, :]


def read_fields(cls: Any, raw: dict[str, Any], required: tuple[str, ...]) -> dict[str, Any]:
    """The keys of `raw` that are fields of the config dataclass `cls`, type-checked by name; a missing
    required key is an error listing them."""
    from dataclasses import fields

    known = {f.name: str(f.type) for f in fields(cls)}
    kwargs = {k: v for k, v in raw.items() if k in known}
    missing = [k for k in required if k not in kwargs or kwargs[k] is None]
    if missing:
        raise ModelError(f"config.json: missing required keys: {', '.join(missing)}")
    for k, v in kwargs.items():
        check_type(k, v, known[k])
    return kwargs


def check_special_ids(cfg: Any) -> None:
    """A config's mask and end-of-text ids (where it names them) inside its embedding table (`cfg.rows`)."""
    for name in ("mask_token_id", "eos_token_id"):
        value = getattr(cfg, name)
        if value is not None and not 0 <= value < cfg.rows:
            raise ModelError(f"config.json: {name} {value} is outside the embedding table")


class LlamaShape:
    """Sizes as transformers' Llama-family configs name them (Qwen3, Nemotron), with what every family derives
    from them and the checks they share. A config dataclass mixes it in and calls `check_shape` after init."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int | None
    head_dim: int | None
    vocab_size: int
    max_position_embeddings: int

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def dim(self) -> int:
        """Per-head dimension (a config may name it; it need not be hidden_size / heads)."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rows(self) -> int:
        return self.vocab_size

    @property
    def max_sequence_length(self) -> int:
        return self.max_position_embeddings

    def check_shape(self, positive: tuple[str, ...]) -> None:
        """The `positive` sizes above 0, whole query heads per key/value head, an even head for rotary
        embeddings, and the special ids inside the embedding table."""
        for name in positive:
            if getattr(self, name) <= 0:
                raise ModelError(f"config.json: {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.kv_heads:
            raise ModelError(
                f"config.json: num_attention_heads {self.num_attention_heads} is not divisible by "
                f"num_key_value_heads {self.kv_heads}"
            )
        if self.dim % 2:
            raise ModelError(f"config.json: head_dim {self.dim} is odd; rotary embeddings need an even one")
        check_special_ids(self)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm the Llama/Qwen2 way: normalised in float32, cast back, then scaled by the weight."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class Weight(nn.Module):
    """A norm's scale, saved as `<name>.weight`."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class MLP(nn.Module):
    """The SwiGLU MLP as Llama/Qwen save it: `gate_proj`, `up_proj`, `down_proj`, no biases."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _fill(logits: torch.Tensor, holes: torch.Tensor | None) -> torch.Tensor:
    """The logits with the ids in `holes` (ids the tokenizer has no token for) at -inf: never drawn."""
    if holes is None:
        return logits
    return logits.index_fill(-1, holes.to(logits.device), float("-inf"))


HEAD_CACHE_BYTES = 64 * 2**20  # the largest float32 copy of an LM head's weight kept between forwards


class DiffusionLM(nn.Module):
    """The model boundary every architecture shares: embed, run the layers (with an optional cache), norm,
    LM head. A family supplies its parts through `parts()` and `head_layer()`; each layer is called as
    `layer(x, rope, mask, cache_i, start, upcast) -> (x, (k, v))`.

    `upcast`: with low-precision weights (bfloat16), attention and the LM head are computed in float32.
    Their bfloat16 rounding depends on the padded length and the batch's shape, so without it a prompt
    decoded in a batch often drifts from the same prompt decoded alone (README, "Reproducible answers")."""

    upcast = True
    _routed = False  # whether the linear layers compute through `invariant.linear` yet (`hidden`)
    _rows: int | None = None  # the head's rows a decoder sees (`limit_head`); None: all of vocab_size
    _holes: torch.Tensor | None = None  # ids below _rows the tokenizer has no token for (`limit_head`)
    logit_shift = 0  # 1 where position j-1's logits predict position j (Dream)
    block_causal = False  # True where attention is causal between blocks (LLaDA2)
    cfg: Any

    def parts(self) -> tuple[nn.Embedding, nn.ModuleList, Any]:
        """The embedding, the layers, and the final norm (a callable on hidden states)."""
        raise NotImplementedError

    def head_layer(self) -> nn.Module:
        """The LM head: a linear layer, or the embedding it is tied to (its `weight` is the matrix)."""
        raise NotImplementedError

    def head_weight(self) -> torch.Tensor:
        weight = self.head_layer().weight
        assert isinstance(weight, torch.Tensor)
        return weight

    def rope_dims(self) -> tuple[int, float]:
        """Rotary dimensions per head, and theta."""
        raise NotImplementedError

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What each layer's attention rotates by, for (B, T) positions: cos and sin (`rope_tables`)."""
        return rope_tables(positions, *self.rope_dims())

    def set_upcast(self, on: bool) -> None:
        self.upcast = on

    def limit_head(self, decodable: frozenset[int] | None) -> None:
        """Logits over the ids a tokenizer can decode only (`Tokenizer.decodable_ids`; the engine sets it): the
        head's rows past the last of them are cut, and any id below it without a token is at -inf, so that no
        strategy, sampler, constraint or log-probability ever sees an id with no text (a released head is padded
        past its tokenizer: LLaDA-8B has 126,464 rows). None: every row of vocab_size again (a family's own
        code, which normalises over the padded rows too, as a parity test compares with it)."""
        if decodable is None:
            self._rows = self._holes = None
            return
        rows = min(self.cfg.vocab_size, max(decodable) + 1)
        holes = sorted(set(range(rows)) - decodable)
        self._rows = rows
        self._holes = torch.tensor(holes, dtype=torch.long) if holes else None

    @property
    def logit_rows(self) -> int:
        """The width of the logits `head` gives: vocab_size, or fewer under `limit_head`."""
        return self.cfg.vocab_size if self._rows is None else self._rows

    def optional_tensors(self) -> frozenset[str]:
        """Tensors a saved folder may carry or not: the LM head where it is tied to the embedding."""
        return frozenset({"lm_head.weight"}) if getattr(self.cfg, "tie_word_embeddings", False) else frozenset()

    def hidden(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        cache: Sequence[LayerKV | PackedLayer] | None = None,
        start: int | torch.Tensor = 0,
        keep_kv: bool = True,
    ) -> tuple[torch.Tensor, list[KV]]:
        """Final hidden states (after the final norm) for `ids`, and each layer's fresh keys/values (none
        with keep_kv False, so that each layer's are freed as the next runs: a forward whose caller drops
        them does not hold every layer's at once).

        ids: (B, T). positions: (B, T) RoPE positions (default start..start+T-1; under left padding pass
        cumsum(key_mask)-1 so a row's positions match its unpadded self). key_mask: (B, L) bool, True for
        keys that may be attended to (L is T without a cache, the cached canvas length with one), or a
        (B, 1, T, L) mask (block-causal). cache: a `LayerKV` per layer over the whole canvas (`KVCache.view`);
        `ids` then stands for positions [start, start+T) (`start` one per row, or one for all), and the cache
        is updated in place there.
        """
        B, T = ids.shape
        if positions is None:
            assert isinstance(start, int), "rows decoding at their own places pass their positions"
            positions = torch.arange(start, start + T, device=ids.device).expand(B, T)
        mask = key_mask_4d(key_mask)
        if not self._routed:
            invariant.route_linears(self)
            self._routed = True
        layer0 = None if cache is None else cache[0]
        if not isinstance(layer0, PackedLayer) and (invariant.active() or (layer0 is not None and layer0.exact)):
            # the per-row attention's groups read the mask on the host: worked out here, before the step
            invariant.plan(mask, start, B, T, T if layer0 is None else layer0.k.shape[2])
        if not isinstance(layer0, PackedLayer) and exact.active():  # its windows too read the mask on the host
            exact.plan(mask, B, T, T if layer0 is None else layer0.k.shape[2], ids.device)
        return self.step(ids, positions, mask, cache, start, keep_kv)

    def step(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        cache: Sequence[LayerKV | PackedLayer] | None,
        start: int | torch.Tensor,
        keep_kv: bool,
    ) -> tuple[torch.Tensor, list[KV]]:
        """`hidden`'s work on tensors, with nothing read on the host: what a decoder runs every round, and
        what `torch.compile` can capture whole (`measure.graphs`). mask: (B, 1, 1 or T, L) bool, or None."""
        rope = self.rope(positions)
        embed, layers, norm = self.parts()
        x = embed(ids)
        fresh: list[KV] = []
        for i, layer in enumerate(layers):
            x, kv = layer(x, rope, mask, None if cache is None else cache[i], start, self.upcast)
            if keep_kv:
                fresh.append(kv)
        return norm(x), fresh

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """LM head (B, T, vocab_size); call it on the positions whose logits are needed only."""
        return self.step_head()(h)

    def step_head(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The LM head with its matrix made ready once for the calls it serves (a step's chunks of positions,
        `decode.predict.in_chunks`): an int8 head's dequantized copy, and under `upcast` a large head's
        float32 cast, are made at most once, not once per chunk."""
        layer, V, holes = self.head_layer(), self.logit_rows, self._holes
        if isinstance(layer, Int4Linear):  # its own kernel: int4 is never dequantized as a whole
            return lambda h: _fill(layer(h.float() if h.dtype != torch.float32 and self.upcast else h)[..., :V], holes)
        w = self.head_weight()
        cast: list[torch.Tensor] = []
        if self.upcast and w.dtype != torch.float32 and w.numel() * 4 <= HEAD_CACHE_BYTES:
            cast.append(self._float_head(w))  # kept between forwards: free, and out of a traced step's way

        def apply(h: torch.Tensor) -> torch.Tensor:
            if h.dtype != torch.float32 and self.upcast:
                if not cast:
                    cast.append(self._float_head(w))
                return _fill(invariant.linear(h.float(), cast[0])[..., :V], holes)
            return _fill(invariant.linear(h, w)[..., :V], holes)

        return apply

    def _float_head(self, w: torch.Tensor) -> torch.Tensor:
        """The head's weight in float32 for the upcast head: cast once and kept while the weight is
        unchanged, where the copy is small (the embedded models: 9.5 MB, cast at every forward before);
        a large head (LLaDA-8B's is 2 GB in float32) is cast per call instead of held twice."""
        if w.numel() * 4 > HEAD_CACHE_BYTES or w.is_inference() or (torch.is_grad_enabled() and w.requires_grad):
            return w.float()  # an inference tensor has no version counter to tell a changed weight by
        key = (w.data_ptr(), w._version, w.device)
        if getattr(self, "_head_key", None) != key:
            self._head_f32, self._head_key = w.detach().float(), key
        return self._head_f32

    def forward(
        self, ids: torch.Tensor, key_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Full-canvas logits (B, T, vocab_size), unshifted (as each family's own forward returns them)."""
        h, _ = self.hidden(ids, positions, key_mask, keep_kv=False)
        return self.head(h)
