"""Load and save model folders: config.json + safetensors (one file or index-listed shards).

config.json chooses the architecture (`registry`). The model is built on the meta device and each tensor is
read from disk into its own memory (`safetensors_io`), cast to the target dtype and attached with
`assign=True` (gpt-fast): a checkpoint is never materialised twice, so peak memory stays near the weights'
size. Only safetensors are read; a pickle is never loaded.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ModelError
from .layers import ArchConfig
from .llada import LLaDAModel
from .quantize import converter
from .registry import Architecture, read_arch_config
from .safetensors_io import read_header, read_tensors, shape_of

log = logging.getLogger(__name__)

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def read_config(folder: Path) -> ArchConfig:
    return read_folder(folder)[1]


def read_folder(folder: Path) -> tuple[Architecture, ArchConfig]:
    """The architecture config.json names, and its config."""
    folder = Path(folder)
    path = folder / "config.json"
    if not folder.is_dir():
        raise ModelError(f"model folder not found: {folder}")
    if not path.is_file():
        raise ModelError(f"{folder} is not a model folder: config.json is missing")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ModelError(f"{path}: expected a JSON object")
    return read_arch_config(raw, path)


def weight_files(folder: Path) -> list[Path]:
    if (folder / SINGLE).is_file():
        return [folder / SINGLE]
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelError(f"{index}: not a safetensors index ({e})") from None
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelError(f"{folder} is incomplete: missing shard(s) {', '.join(absent)}")
        return files
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise ModelError(f"{folder}: only safetensors weights are loaded (pickle files are never read)")
    raise ModelError(f"{folder} is incomplete: no {SINGLE} or {INDEX}")


def load_model(
    folder: Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, quantize: str = "none"
) -> nn.Module:
    """The folder's model on `device` in `dtype` (floating tensors), in eval mode. Each tensor is read
    from disk into its own memory and cast there, so the peak stays near the loaded weights. `quantize`
    ("int8"): each weight is quantized as it is read (`quantize`)."""
    folder = Path(folder)
    arch, cfg = read_folder(folder)
    files = weight_files(folder)
    with torch.device("meta"):
        model = arch.build(cfg)
        convert = converter(model, quantize, dtype)  # the identity unless quantizing
    expected = dict(model.state_dict())
    optional = arch.optional(cfg)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        header, _ = read_header(f)
        wanted = []
        for name, entry in header.items():
            if name not in expected:
                if name in optional or name.endswith("rotary_emb.inv_freq"):
                    continue
                raise ModelError(f"{folder}: weights do not match config.json (unexpected {name!r})")
            if shape_of(entry) != tuple(expected[name].shape):
                raise ModelError(
                    f"{folder}: {name} has shape {shape_of(entry)}, config.json implies {tuple(expected[name].shape)}"
                )
            wanted.append(name)
        for name, t in read_tensors(f, wanted, device, dtype):
            state.update(convert(name, t))
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ModelError(f"{folder}: weights do not match config.json (missing {missing[:3]})")
    model.load_state_dict(state, assign=True)
    return model.eval()


def save_model(model: LLaDAModel, folder: Path, max_shard_bytes: int | None = None) -> None:
    """Write config.json and the weights; sharded with an index when `max_shard_bytes` is given."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    (folder / "config.json").write_text(json.dumps(model.cfg.to_dict(), indent=2) + "\n", encoding="utf-8")
    if max_shard_bytes is None:
        save_file(state, str(folder / SINGLE), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (folder / INDEX).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2), encoding="utf-8"
    )


def describe(folder: Path) -> dict[str, Any]:
    """A model folder's facts, from config.json, the safetensors headers and the tokenizer; no weight is
    read, so it answers at once even for a large checkpoint."""
    from ..engine import read_generation_config
    from .tokenizer import load_tokenizer

    folder = Path(folder)
    arch, cfg = read_folder(folder)
    tok = load_tokenizer(folder, cfg)
    params, dtypes = 0, Counter[str]()
    for f in weight_files(folder):
        for entry in read_header(f)[0].values():
            n = math.prod(shape_of(entry))
            params += n
            dtypes[str(entry.get("dtype"))] += n
    defaults, extra_stops = read_generation_config(folder, arch)
    special = {"mask": tok.mask_id, "eos": tok.eos_id, "end_of_turn": tok.eot_id, "pad": tok.pad_id, "bos": tok.bos_id}
    return {
        "folder": str(folder),
        "architecture": f"{arch.name} (model_type {cfg.model_type!r})",
        "parameters": f"{params:,}",
        "weights": {k: f"{v:,}" for k, v in dtypes.most_common()},
        "special_ids": {k: (f"{v} {tok.backend.piece(v)!r}" if v is not None else "none") for k, v in special.items()},
        "stop_ids": sorted(tok.stop_ids | extra_stops),
        "vocabulary": f"{tok.backend.size():,} tokens, {cfg.rows:,} embedding rows",
        "context": cfg.max_sequence_length,
        "chat_template": "yes" if tok.chat_template else "no",
        "strategies": ", ".join(arch.strategies) + f" (default {defaults.strategy})",
        "logit_shift": "yes (position j-1 predicts j)" if getattr(arch.build, "logit_shift", 0) else "no",
    }
