"""`celeris inspect`'s facts about a model folder, from config.json, the safetensors headers and the
tokenizer: no weight is read, so it answers at once even for a large checkpoint."""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path
from typing import Any

from .folder import ModelFolder
from .safetensors_io import read_header, shape_of

EXPERT = re.compile(r"^(.*\.experts)\.\d+\.")  # a routed expert's tensor, by its layer's experts module
STACKED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")  # experts stacked in one tensor (Gemma 4)


def _sizes(folder: ModelFolder) -> tuple[int, Counter[str], Counter[str]]:
    """Parameters in all, per dtype, and per layer's routed experts (all of them)."""
    total, dtypes, experts = 0, Counter[str](), Counter[str]()
    for f in folder.weight_files:
        for name, entry in read_header(f)[0].items():
            n = math.prod(shape_of(entry))
            total += n
            dtypes[str(entry.get("dtype"))] += n
            m = EXPERT.match(name) or STACKED.match(name)
            if m:
                experts[m.group(1)] += n
    return total, dtypes, experts


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:.2f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:.1f} MiB"


def describe(path: Path) -> dict[str, Any]:
    folder = ModelFolder.open(path)
    arch, cfg = folder.arch, folder.cfg
    tok = folder.tokenizer()
    params, dtypes, experts = _sizes(folder)
    defaults = folder.defaults()
    mask = None if getattr(cfg, "mask_free", False) else tok.mask_id
    special = {"mask": mask, "eos": tok.eos_id, "end_of_turn": tok.eot_id, "pad": tok.pad_id, "bos": tok.bos_id}
    info: dict[str, Any] = {
        "folder": str(folder.path),
        "architecture": f"{arch.name} ({_declared(folder.config)})",
        "layout": arch.layout,
        "attention": arch.attention,
        "parameters": f"{params:,}",
    }
    if experts:
        num = getattr(cfg, "num_experts", 0) or 1
        named: Any = getattr(cfg, "num_experts_per_tok", None) or getattr(cfg, "top_k_experts", 1)
        top_k = int(named)
        active = params - sum(experts.values()) + sum(n * top_k // num for n in experts.values())
        info["active_parameters"] = f"{active:,} per token ({top_k} of {num} experts)"
    info |= {
        "weights": {k: f"{v:,}" for k, v in dtypes.most_common()},
        "bf16_weights": _gib(params * 2),
        "special_ids": {k: (f"{v} {tok.backend.piece(v)!r}" if v is not None else "none") for k, v in special.items()},
        "stop_ids": sorted(tok.stop_ids | folder.extra_stops),
        "eos_from": folder.eos_named(),
        "vocabulary": f"{tok.backend.size():,} tokens, {cfg.rows:,} embedding rows",
        "context": cfg.max_sequence_length,
        "chat_template": "yes" if tok.chat_template else "no",
        "strategies": ", ".join(arch.strategies) + f" (default {defaults.strategy})",
        "logit_shift": "yes (position j-1 predicts j)" if arch.model_class.logit_shift else "no",
        "block": f"{defaults.block_length} (default block_length)" if arch.attention == "block-causal" else "none",
    }
    if getattr(cfg, "mask_free", False):  # DiffusionGemma: no mask; canvases of uniform noise
        info["canvas"] = f"{getattr(cfg, 'canvas_length', 0)} tokens (config.json canvas_length; block_length)"
        info["noise"] = "uniform random tokens, entropy-bounded acceptance (no mask token)"
    info["ignored"] = ", ".join(folder.ignored_keys) or "none"  # config.json keys no part of the family reads

    return info


def _declared(config: dict[str, Any]) -> str:
    """What config.json declares: its class names (when it lists any) and its model_type."""
    return ", ".join([*(config.get("architectures") or []), f"model_type {config.get('model_type')!r}"])
