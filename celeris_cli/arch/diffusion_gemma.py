"""DiffusionGemma (`DiffusionGemmaForBlockDiffusion`): a Gemma 4 text model run two ways over one set of weights.

- The **encoder** is causal: it runs over the prompt (and later over each finished canvas: the commit pass) and
  writes the key/value cache. Sliding layers see the last `sliding_window` positions, full layers all of them.
- The **decoder** is bidirectional: it denoises a canvas of `canvas_length` tokens against that cache without
  writing it. Its sliding layers see the last sliding_window - 1 cached positions (what transformers'
  sliding cache keeps) and the whole canvas; its full layers everything. Its input adds a self-conditioning
  signal: an MLP of softmax(previous step's temperature-scaled logits) @ E.

Layout as transformers saves it: the text weights once, under `model.decoder.` (`embed_tokens`, `layers.{i}.`
`self_attn.{q,k,v,o}_proj` + `q_norm`/`k_norm`, `mlp.{gate,up,down}_proj`, `router.{proj.weight,scale,
per_expert_scale}`, `experts.{gate_up_proj,down_proj}`, seven norms, `layer_scalar`; `norm`;
`self_conditioning.*`), the encoder's own per-layer `layer_scalar` under `model.encoder.language_model.layers.{i}`
(the one thing the passes do not share), the head tied to the embedding. The vision tower's tensors are skipped.
Logits are soft-capped, cap * tanh(logits / cap), in float32. The layer itself is `gemma4.py`'s.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelError
from . import invariant
from .diffusion_gemma_config import DiffusionGemmaConfig
from .gemma4 import Layer, Mask, Norm, norm, rope_table

# a pass's masks: one for the full layers (True) and one for the sliding ones (False), or such a pair a row
PassMasks = dict[bool, Mask] | list[dict[bool, Mask]]
VISION = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")


class SelfConditioning(nn.Module):
    def __init__(self, cfg: DiffusionGemmaConfig) -> None:
        super().__init__()
        d, self.eps = cfg.hidden_size, cfg.rms_norm_eps
        self.pre_norm = Norm(d)
        self.gate_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, d, bias=False)

    def forward(self, x: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
        h = norm(soft, self.pre_norm.weight, self.eps)
        return norm(x + self.down_proj(F.gelu(self.gate_proj(h), approximate="tanh") * self.up_proj(h)), None, self.eps)


class Decoder(nn.Module):
    def __init__(self, cfg: DiffusionGemmaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg, not cfg.sliding(i)) for i in range(cfg.num_hidden_layers))
        self.norm = Norm(cfg.hidden_size)
        self.self_conditioning = SelfConditioning(cfg)


class ScalarOnly(nn.Module):
    layer_scalar: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("layer_scalar", torch.ones(1))


class _LanguageModel(nn.Module):
    """The encoder's own tensors: its per-layer skip scales (everything else is the decoder's)."""

    def __init__(self, cfg: DiffusionGemmaConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ScalarOnly() for _ in range(cfg.num_hidden_layers))


class _Encoder(nn.Module):
    def __init__(self, cfg: DiffusionGemmaConfig) -> None:
        super().__init__()
        self.language_model = _LanguageModel(cfg)


class _Both(nn.Module):
    def __init__(self, cfg: DiffusionGemmaConfig) -> None:
        super().__init__()
        self.decoder = Decoder(cfg)
        self.encoder = _Encoder(cfg)


class NoEstimate(ModelError, AttributeError):
    """A user-facing error to `inspect --memory`, and to a run's budget the missing part it skips (a warning)."""


class _Vision(frozenset[str]):
    """The tensors a folder may carry that text-only use skips: the vision tower's, by prefix."""

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.startswith(VISION)


class DiffusionGemmaModel(nn.Module):
    """`encode` writes a causal pass into the cache; `denoise` gives a canvas's logits against it."""

    logit_shift = 0
    block_causal = False
    upcast = True

    def __init__(self, cfg: DiffusionGemmaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = _Both(cfg)
        self._routed = False

    def optional_tensors(self) -> frozenset[str]:
        return _Vision()

    def head_layer(self) -> nn.Module:
        """Asked by the memory planner, which does not know this family yet: what limits it is the canvas times
        the vocabulary in float32 (logits, probabilities, entropies), not what the planner counts."""
        raise NoEstimate("no memory estimate for DiffusionGemma's head: the planner counts its canvas step instead")

    def set_upcast(self, on: bool) -> None:
        self.upcast = on

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        rows: torch.Tensor = self.model.decoder.embed_tokens(ids)  # a quantized embedding dequantizes these rows only
        return rows * torch.tensor(self.cfg.hidden_size**0.5, dtype=rows.dtype)

    def _ropes(self, positions: torch.Tensor) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        cfg = self.cfg
        return {
            False: rope_table(positions, cfg.head_dim, cfg.sliding_rope),
            True: rope_table(positions, cfg.global_head_dim, cfg.full_rope),
        }

    def window(self, cached: int) -> int:
        """Of `cached` positions, how many a sliding layer reads: the last sliding_window - 1 (what
        transformers' sliding cache keeps between passes)."""
        return min(cached, self.cfg.sliding_window - 1)

    def _run(
        self, x: torch.Tensor, positions: torch.Tensor, masks: PassMasks, cache: Any, encoder: bool
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """masks: the pass's (`encode`), or one a row with `cache` a list of each row's past a layer: each row
        then attends over its own past alone (`gemma4.Attention.forward`)."""
        if not self._routed:  # every linear layer through `invariant.linear` (plain while the mode is off)
            invariant.route_linears(self)
            self._routed = True
        ropes = self._ropes(positions)
        fresh = []
        for i, layer in enumerate(self.model.decoder.layers):
            full = not self.cfg.sliding(i)
            owner = self.model.encoder.language_model.layers[i] if encoder else layer
            scalar = owner.layer_scalar
            assert isinstance(scalar, torch.Tensor)
            past = None if cache is None else cache[i]
            if isinstance(past, list):
                past = [p if p is None or full else self._window(p) for p in past]
            elif past is not None and not full:
                past = self._window(past)
            mask = masks[full] if isinstance(masks, dict) else [m[full] for m in masks]
            x, kv = layer(x, ropes[full], mask, past, scalar)
            fresh.append(kv)
        return x, fresh

    def _window(self, past: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """A sliding layer's cached keys and values: the last `window` of them."""
        n = past[0].shape[2]
        w = self.window(n)
        return past[0][:, :, n - w :], past[1][:, :, n - w :]

    def fresh(self, ids: torch.Tensor, positions: torch.Tensor, masks: PassMasks, cache: Any) -> Any:
        """The causal pass over ids (B, T) after the cached positions; returns its own keys and values, a
        (B, kv_heads, T, dim) pair a layer. masks and cache: as `_run` takes them."""
        return self._run(self._embed(ids), positions, masks, cache, encoder=True)[1]

    def encode(self, ids: torch.Tensor, positions: torch.Tensor, masks: dict[bool, Mask], cache: Any) -> Any:
        """The causal pass over ids (B, T) after the cached positions; returns the cache extended by them.
        masks[full]: the full layers' and the sliding layers' (over the keys they read: `window`)."""
        fresh = self.fresh(ids, positions, masks, cache)
        if cache is None:
            return fresh
        return [(torch.cat([k0, k], 2), torch.cat([v0, v], 2)) for (k0, v0), (k, v) in zip(cache, fresh)]

    def denoise(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        masks: dict[bool, Mask],
        cache: Any,
        self_conditioning: torch.Tensor | None,
    ) -> torch.Tensor:
        """The canvas ids (B, L) against the cache -> soft-capped logits (B, L, V) in float32, all at once (the
        decoder runs `hidden`, `signal` and `logits` a chunk of positions at a time instead).
        self_conditioning: the previous step's temperature-scaled logits (B, L, V), or None at the first step."""
        w = self.embedding()
        signal = None if self_conditioning is None else self.signal(self_conditioning, w)
        return self.logits(self.hidden(ids, positions, masks, cache, signal), self.head_matrix(w))

    def embedding(self) -> torch.Tensor:
        """The embedding as a matrix (V, d) in the weights' dtype: the parameter itself, or a quantized
        embedding's dequantized copy (`quantize`), which a step holds while it runs."""
        w: torch.Tensor = self.model.decoder.embed_tokens.weight
        return w

    def head_matrix(self, w: torch.Tensor) -> torch.Tensor:
        """The matrix the head multiplies by: the embedding `w`, cast to float32 under `upcast` (held for a step)."""
        return w.float() if self.upcast and w.dtype != torch.float32 else w

    def signal(self, scaled: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Temperature-scaled logits (.., V) in the weights' dtype -> the self-conditioning input (.., d):
        softmax(scaled) @ E, scaled as the embedding is."""
        probs = scaled.softmax(-1, dtype=torch.float32).to(w.dtype)
        return invariant.linear(probs, w.t()) * torch.tensor(self.cfg.hidden_size**0.5, dtype=w.dtype)

    def hidden(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        masks: PassMasks,
        cache: Any,
        signal: torch.Tensor | None,
    ) -> torch.Tensor:
        """The canvas ids (B, L) against the cache -> the final-normed hidden states (B, L, d). signal: the
        self-conditioning input (B, L, d) of the previous step (`signal`), or None at the first step. masks
        and cache: as `_run` takes them."""
        dec = self.model.decoder
        x = self._embed(ids)
        x = dec.self_conditioning(x, torch.zeros_like(x) if signal is None else signal)
        h, _ = self._run(x, positions, masks, cache, encoder=False)
        return norm(h, dec.norm.weight, self.cfg.rms_norm_eps)

    def logits(self, h: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """Hidden states (.., d) -> soft-capped logits (.., V) in float32; head: `head_matrix`'s."""
        logits = invariant.linear(h.float(), head) if head.dtype == torch.float32 else invariant.linear(h, head).float()
        cap = self.cfg.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap and math.isfinite(cap) else logits


CONFIG = DiffusionGemmaConfig
MODEL = DiffusionGemmaModel
