"""LLaDA-MoE (LLaDA-MoE-7B-A1B Base/Instruct): a bidirectional masked-diffusion LM in OLMoE's layout,
`LLaDAMoEModelLM`, whose config.json says `model_type` "llada" like LLaDA-8B's (the registry tells them
apart by the class).

Layout as its `modeling_lladamoe.py` saves it: `model.embed_tokens`; per layer `self_attn.{q,k,v,o}_proj`,
an RMSNorm on each head's query and key (`q_norm`, `k_norm`, where `qk_layernorm`), rotary embedding on the
first `partial_rotary_factor` of each head; `mlp.gate` (the router) and `mlp.experts.{e}.*` on the layers
`moe_layer_freq` marks, a dense `mlp.*` of `dense_intermediate_size` on the others, and a
`shared_expert.*` beside the experts where `shared_expert_intermediate_size` is set; `model.norm`, `lm_head`.

The router, as that code runs it: softmax over every expert in float32, plus `mlp.expert_bias` where
`moe_router_enable_expert_bias` (added to the scores that then weigh the experts), top `num_experts_per_tok`,
never renormalised (the family's code fixes `norm_topk_prob` to false whatever the config says).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..errors import ModelError
from .layers import MLP, DiffusionLM, check_special_ids, read_fields, rms_norm
from .qwen3 import AttentionShape, Backbone, Layer, Routing, SoftmaxMoE

REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


@dataclass(frozen=True)
class LLaDAMoEConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    eos_token_id: int | None = None  # none named: generation_config.json's, else the tokenizer's eos_token
    num_key_value_heads: int | None = None
    dense_intermediate_size: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_layer_freq: tuple[int, ...] = field(default_factory=tuple)
    moe_router_enable_expert_bias: bool | None = None
    norm_topk_prob: bool | None = None  # read and ignored, as the family's code ignores it
    qk_layernorm: bool | None = None
    clip_qkv: float | None = None
    attention_bias: bool = False
    partial_rotary_factor: float = 1.0
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    mask_token_id: int | None = None  # the tokenizer's <|mdm_mask|> where config.json names none
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eot_token_id: int | None = None  # the tokenizer's end of turn is found instead
    model_type: str = "llada"

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ModelError(f"config.json: {name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.kv_heads:
            raise ModelError(
                f"config.json: hidden_size {self.hidden_size}, num_attention_heads {self.num_attention_heads} and "
                f"num_key_value_heads {self.kv_heads} do not divide evenly"
            )
        if self.rot_dim % 2 or not 0 < self.rot_dim <= self.dim:
            raise ModelError(
                f"config.json: partial_rotary_factor {self.partial_rotary_factor} gives no even rotary dimension"
            )
        if len(self.moe_layer_freq) != self.num_hidden_layers:
            n = len(self.moe_layer_freq)
            raise ModelError(f"config.json: moe_layer_freq has {n} entries for {self.num_hidden_layers} layers")
        if any(self.moe_layer_freq) and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelError(
                f"config.json: num_experts_per_tok {self.num_experts_per_tok} must be 1..num_experts {self.num_experts}"
            )
        check_special_ids(self)

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rot_dim(self) -> int:
        return int(self.dim * self.partial_rotary_factor)

    @property
    def rows(self) -> int:
        return self.vocab_size

    @property
    def max_sequence_length(self) -> int:
        return self.max_position_embeddings

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> LLaDAMoEConfig:
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelError(f"config.json: hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")
        if raw.get("moe_router_score_function") not in (None, "softmax"):
            raise ModelError(
                f"config.json: moe_router_score_function {raw['moe_router_score_function']!r} is not supported "
                "(only 'softmax', the one LLaDA-MoE's code runs)"
            )
        if raw.get("rope_scaling"):
            raise ModelError(f"config.json: rope_scaling={raw['rope_scaling']!r} is not supported")
        for key in ("routed_scaling_factor",):
            if raw.get(key, 1) != 1:
                raise ModelError(f"config.json: {key}={raw[key]!r} is not supported (LLaDA-MoE's code ignores it)")
        kwargs = read_fields(cls, raw, REQUIRED)
        freq = kwargs.get("moe_layer_freq", ())
        if not isinstance(freq, (list, tuple)) or not all(isinstance(i, int) for i in freq):
            raise ModelError(f"config.json: moe_layer_freq must be a list of 0/1 per layer, got {freq!r}")
        kwargs["moe_layer_freq"] = tuple(freq)
        return cls(**kwargs)


class LLaDAMoEModel(DiffusionLM):
    def __init__(self, cfg: LLaDAMoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        shape = AttentionShape(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.kv_heads,
            cfg.dim,
            cfg.rms_norm_eps,
            cfg.attention_bias,
            bool(cfg.qk_layernorm),
            cfg.clip_qkv,
        )
        routing = Routing(
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.expert_intermediate_size,
            norm_topk_prob=False,
            expert_bias=bool(cfg.moe_router_enable_expert_bias),
        )
        layers = []
        for moe in cfg.moe_layer_freq:
            if not moe:
                layers.append(Layer(shape, MLP(cfg.hidden_size, cfg.dense_intermediate_size)))
                continue
            shared = cfg.shared_expert_intermediate_size
            layers.append(
                Layer(shape, SoftmaxMoE(cfg.hidden_size, routing), MLP(cfg.hidden_size, shared) if shared else None)
            )
        self.model = Backbone(cfg.vocab_size, cfg.hidden_size, layers)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def parts(self) -> tuple[nn.Embedding, nn.ModuleList, Any]:
        eps = self.cfg.rms_norm_eps
        return self.model.embed_tokens, self.model.layers, lambda x: rms_norm(x, self.model.norm.weight, eps)

    def head_layer(self) -> nn.Module:
        return self.model.embed_tokens if self.cfg.tie_word_embeddings else self.lm_head

    def rope_dims(self) -> tuple[int, float]:
        return self.cfg.rot_dim, self.cfg.rope_theta


CONFIG = LLaDAMoEConfig
MODEL = LLaDAMoEModel
