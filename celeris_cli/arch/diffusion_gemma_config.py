"""DiffusionGemma's config.json (`DiffusionGemmaForBlockDiffusion`, `model_type` "diffusion_gemma"), read as
transformers saves it: the text model's sizes under `text_config`, the canvas at the top level, a vision tower
(`vision_config`) that text-only use skips.

Every `text_config` key is type-checked by name; a key this code does not follow is refused by name, and so
is a value that would change the network in a way not implemented (bidirectional encoder attention, another
activation, attention biases, other rotary types).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ModelError
from .config_fields import check_type

# DiffusionGemmaTextConfig's fields (transformers 5.23.0), and the bookkeeping any saved config may carry
_TEXT_KEYS = {
    "vocab_size": "int", "hidden_size": "int", "intermediate_size": "int", "num_hidden_layers": "int",
    "num_attention_heads": "int", "num_key_value_heads": "int", "head_dim": "int", "max_position_embeddings": "int",
    "rms_norm_eps": "float", "pad_token_id": "int | None", "bos_token_id": "int | None",
    "sliding_window": "int", "num_experts": "int", "top_k_experts": "int", "moe_intermediate_size": "int",
    "final_logit_softcapping": "float", "initializer_range": "float", "tie_word_embeddings": "bool",
    "attention_dropout": "float", "attention_bias": "bool", "hidden_activation": "str", "layer_types": "list",
    "rope_parameters": "dict", "per_layer_config": "dict", "use_bidirectional_attention": "str | None",
    "eos_token_id": "any",
    "global_head_dim": "int", "num_global_key_value_heads": "int | None",  # per_layer_config's source
}  # fmt: skip
_BOOKKEEPING = {"model_type", "dtype", "torch_dtype", "transformers_version", "architectures", "_name_or_path",
                "output_hidden_states", "output_attentions", "return_dict", "use_cache"}  # fmt: skip
# the top level: the text model, the canvas, the end-of-text ids (transformers writes `[1, 106]` here; the
# folder's reader hands the first on and keeps the rest as stops), and the multimodal wrapper's keys, which
# text-only decoding accepts and ignores
_TOP_KEYS = {"text_config", "canvas_length", "eos_token_id", "initializer_range", "tie_word_embeddings",
             "vision_config", "audio_config", "boi_token_id", "eoi_token_id", "image_token_id", "video_token_id",
             "audio_token_id", "boa_token_id", "eoa_token_id", "vision_soft_tokens_per_image",
             "audio_soft_tokens_per_image"} | _BOOKKEEPING  # fmt: skip
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "num_experts", "top_k_experts", "moe_intermediate_size")  # fmt: skip
LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class Rope:
    """One layer type's rotary embedding: `theta`, and the share of each head's frequency pairs that rotate
    (proportional RoPE: the others have frequency 0, so they pass unrotated)."""

    theta: float
    partial: float = 1.0
    factor: float = 1.0


@dataclass(frozen=True)
class DiffusionGemmaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    global_head_dim: int  # the full layers' head size and key/value heads (`per_layer_config`)
    global_kv_heads: int
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    layer_types: tuple[str, ...]
    sliding_rope: Rope
    full_rope: Rope
    canvas_length: int
    sliding_window: int = 512
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float = 30.0
    pad_token_id: int | None = 0
    bos_token_id: int | None = 2
    eos_token_id: int | None = 1
    model_type: str = "diffusion_gemma"
    mask_token_id: int | None = None  # none: the canvas starts as random tokens, never as masks
    eot_token_id: int | None = None  # the folder's generation_config.json lists the end of turn among its stops
    mask_free = True  # tells the tokenizer not to look for a mask token

    @property
    def rows(self) -> int:
        return self.vocab_size

    @property
    def max_sequence_length(self) -> int:
        return self.max_position_embeddings

    def sliding(self, i: int) -> bool:
        return self.layer_types[i] == "sliding_attention"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DiffusionGemmaConfig:
        unknown = sorted(set(raw) - _TOP_KEYS)
        if unknown:
            raise ModelError(f"config.json: keys {unknown} are not supported")
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ModelError("config.json: text_config is missing")
        unknown = sorted(set(text) - set(_TEXT_KEYS) - _BOOKKEEPING)
        if unknown:
            raise ModelError(f"config.json: text_config keys {unknown} are not supported")
        for key, kind in _TEXT_KEYS.items():
            if key in text and kind in ("list", "dict", "str | None", "str") and text[key] is not None:
                want = {"list": list, "dict": dict}.get(kind.split(" ")[0], str)
                if not isinstance(text[key], want):
                    raise ModelError(f"config.json: text_config.{key} must be a {want.__name__}, got {text[key]!r}")
            elif key in text and kind != "any":
                check_type(f"text_config.{key}", text[key], kind)
        missing = [k for k in REQUIRED if text.get(k) is None]
        if missing:
            raise ModelError(f"config.json: text_config is missing {', '.join(missing)}")
        for key, plain in (("hidden_activation", "gelu_pytorch_tanh"), ("attention_bias", False)):
            if text.get(key, plain) != plain:
                raise ModelError(f"config.json: text_config.{key}={text[key]!r} is not supported (only {plain!r})")
        for where, tied in (
            ("", raw.get("tie_word_embeddings", True)),
            ("text_config.", text.get("tie_word_embeddings", True)),
        ):
            if tied is not True:
                raise ModelError(
                    f"config.json: {where}tie_word_embeddings={tied!r} is not supported (the head is the embedding)"
                )
        if text.get("use_bidirectional_attention") == "all":
            raise ModelError(
                "config.json: text_config.use_bidirectional_attention 'all' is not supported (a causal encoder)"
            )
        n = text["num_hidden_layers"]
        types = tuple(text.get("layer_types") or ())
        if len(types) != n or any(t not in LAYER_TYPES for t in types):
            raise ModelError(f"config.json: text_config.layer_types must name {n} of {', '.join(LAYER_TYPES)}")
        full = _per_layer(text, types)
        canvas = raw.get("canvas_length", 256)
        check_type("canvas_length", canvas, "int")
        eos = raw["eos_token_id"] if raw.get("eos_token_id") is not None else text.get("eos_token_id", 1)
        return cls(
            **{k: text[k] for k in REQUIRED},
            global_head_dim=full.get("head_dim") or text["head_dim"],
            global_kv_heads=full.get("num_key_value_heads") or text["num_key_value_heads"],
            layer_types=types,
            sliding_rope=_rope(text, "sliding_attention", "default"),
            full_rope=_rope(text, "full_attention", "proportional"),
            canvas_length=canvas,
            **{k: text[k] for k in ("sliding_window", "max_position_embeddings", "rms_norm_eps",
                                    "final_logit_softcapping", "pad_token_id", "bos_token_id") if k in text},
            eos_token_id=eos[0] if isinstance(eos, list) and eos else eos if isinstance(eos, int) else None,
        )  # fmt: skip


def _per_layer(text: dict[str, Any], types: tuple[str, ...]) -> dict[str, int]:
    """The full layers' overrides (`per_layer_config`: layer index -> head_dim, num_key_value_heads), the same
    for every full layer; a sliding layer has none."""
    if "per_layer_config" not in text and "global_head_dim" in text:  # the form DiffusionGemmaTextConfig takes
        over = {"head_dim": text["global_head_dim"]}
        if text.get("num_global_key_value_heads") is not None:
            over["num_key_value_heads"] = text["num_global_key_value_heads"]
        return over
    per = text.get("per_layer_config") or {}
    seen: list[dict[str, int]] = []
    for key, over in per.items():
        if not str(key).isdigit() or int(key) >= len(types) or not isinstance(over, dict):
            raise ModelError(f"config.json: text_config.per_layer_config has an entry {key!r} for no layer")
        bad = sorted(set(over) - {"head_dim", "num_key_value_heads"})
        if bad:
            raise ModelError(f"config.json: text_config.per_layer_config keys {bad} are not supported")
        for k, v in over.items():
            check_type(f"text_config.per_layer_config.{key}.{k}", v, "int")
        if types[int(key)] != "full_attention":
            raise ModelError(f"config.json: text_config.per_layer_config overrides sliding layer {key}")
        seen.append(dict(over))
    if any(s != seen[0] for s in seen):
        raise ModelError("config.json: text_config.per_layer_config differs between full layers")
    return seen[0] if seen else {}


def _rope(text: dict[str, Any], layer_type: str, kind: str) -> Rope:
    default = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                  "rope_theta": 1000000.0}}[layer_type]  # fmt: skip
    params = (text.get("rope_parameters") or {}).get(layer_type, default)
    if not isinstance(params, dict):
        raise ModelError(f"config.json: text_config.rope_parameters.{layer_type} must be an object")
    bad = sorted(set(params) - {"rope_type", "rope_theta", "partial_rotary_factor", "factor"})
    if bad:
        raise ModelError(f"config.json: text_config.rope_parameters.{layer_type} keys {bad} are not supported")
    if params.get("rope_type", "default") not in (kind, "default"):
        raise ModelError(
            f"config.json: text_config.rope_parameters.{layer_type} rope_type {params['rope_type']!r} is not "
            f"supported (only {kind!r})"
        )
    for k in ("rope_theta", "partial_rotary_factor", "factor"):
        if k in params:
            check_type(f"text_config.rope_parameters.{layer_type}.{k}", params[k], "float")
    proportional = params.get("rope_type") == "proportional"
    if not proportional and (params.get("partial_rotary_factor", 1.0) != 1.0 or "factor" in params):
        raise ModelError(
            f"config.json: text_config.rope_parameters.{layer_type}: a partial or scaled default rotary embedding "
            "is not supported"
        )
    return Rope(
        float(params.get("rope_theta", 10000.0)),
        float(params.get("partial_rotary_factor", 1.0)) if proportional else 1.0,
        float(params.get("factor", 1.0)) if proportional else 1.0,
    )
