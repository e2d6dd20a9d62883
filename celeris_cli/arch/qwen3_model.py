"""A diffusion LM in Qwen3's (or Qwen3-MoE's) layout, as `transformers` saves it: `model.embed_tokens`,
`model.layers.{i}` (see `qwen3`), `model.norm`, `lm_head`. The families built on it (SDAR, CoDA, RND1) differ
only in their attention pattern, their logit shift and their special ids, which each family's module sets.

Config keys are Qwen3's (and Qwen3-MoE's for the experts); a key that would change the computation in a way
this code does not follow (`rope_scaling`, sliding windows, another activation) is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..errors import ModelError
from .layers import MLP, DiffusionLM, LlamaShape, read_fields, rms_norm
from .qwen3 import AttentionShape, Backbone, Layer, Routing, SoftmaxMoE

REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


@dataclass(frozen=True)
class Qwen3Config(LlamaShape):
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    eos_token_id: int | None = None  # required but for CoDA's, whose tokenizer names it
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 32768
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    # Qwen3-MoE
    num_experts: int | None = None
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)
    mask_token_id: int | None = None  # the tokenizer's mask token where config.json names none
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eot_token_id: int | None = None  # the tokenizer's <|im_end|> is found instead
    model_type: str = "qwen3"

    def __post_init__(self) -> None:
        self.check_shape(REQUIRED)
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelError(
                f"config.json: num_experts_per_tok {self.num_experts_per_tok} must be 1..num_experts {self.num_experts}"
            )
        if self.num_experts and self.moe_intermediate_size <= 0:
            raise ModelError("config.json: moe_intermediate_size must be positive for a mixture of experts")

    def is_moe(self, layer: int) -> bool:
        """Qwen3-MoE's rule: experts where the layer is not listed dense and falls on the sparse step."""
        return (
            bool(self.num_experts) and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def read(cls, raw: dict[str, Any], model_type: str, required: tuple[str, ...] = ("eos_token_id",)) -> Any:
        """A family's config: Qwen3's keys (those in `required` too) and its own `model_type`."""
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelError(f"config.json: hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")
        for key in ("rope_scaling", "use_sliding_window"):
            if raw.get(key):
                raise ModelError(f"config.json: {key}={raw[key]!r} is not supported")
        layer_types = raw.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            kinds = sorted(set(layer_types))
            raise ModelError(f"config.json: layer_types {kinds} are not supported (only full_attention)")
        kwargs = read_fields(cls, raw, REQUIRED + required)
        only = kwargs.get("mlp_only_layers", ())
        if not isinstance(only, (list, tuple)) or not all(isinstance(i, int) for i in only):
            raise ModelError(f"config.json: mlp_only_layers must be a list of layer numbers, got {only!r}")
        kwargs["mlp_only_layers"] = tuple(only)
        return cls(**{**kwargs, "model_type": model_type})


class Qwen3DiffusionLM(DiffusionLM):
    """The model boundary over Qwen3's layout; a family's subclass sets `logit_shift` and `block_causal`."""

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.cfg = cfg
        shape = AttentionShape(
            cfg.hidden_size, cfg.num_attention_heads, cfg.kv_heads, cfg.dim, cfg.rms_norm_eps, cfg.attention_bias
        )
        layers = [Layer(shape, self._mlp(cfg, i)) for i in range(cfg.num_hidden_layers)]
        self.model = Backbone(cfg.vocab_size, cfg.hidden_size, layers)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @staticmethod
    def _mlp(cfg: Qwen3Config, i: int) -> nn.Module:
        if not cfg.is_moe(i):
            return MLP(cfg.hidden_size, cfg.intermediate_size)
        assert cfg.num_experts
        r = Routing(cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob)
        return SoftmaxMoE(cfg.hidden_size, r)

    def parts(self) -> tuple[nn.Embedding, nn.ModuleList, Any]:
        eps = self.cfg.rms_norm_eps
        return self.model.embed_tokens, self.model.layers, lambda x: rms_norm(x, self.model.norm.weight, eps)

    def head_layer(self) -> nn.Module:
        return self.model.embed_tokens if self.cfg.tie_word_embeddings else self.lm_head

    def rope_dims(self) -> tuple[int, float]:
        return self.cfg.dim, self.cfg.rope_theta
