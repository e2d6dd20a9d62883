"""Load and save model folders: config.json + safetensors (one file or index-listed shards).

The model is built on the meta device and the weights are attached with `assign=True` (gpt-fast), so a
checkpoint is never materialised twice. Only safetensors are read; a pickle is never loaded.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from ..errors import ModelError
from .llada import LLaDAModel, ModelConfig

log = logging.getLogger(__name__)

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def read_config(folder: Path) -> ModelConfig:
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
    return ModelConfig.from_dict(raw)


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


def load_model(folder: Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> LLaDAModel:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg = read_config(folder)
    files = weight_files(folder)
    with torch.device("meta"):
        model = LLaDAModel(cfg)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f), device=str(device)))
        except (SafetensorError, OSError) as e:
            raise ModelError(f"{f}: cannot read safetensors ({e})") from None
    expected = dict(model.state_dict())
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        detail = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise ModelError(f"{folder}: weights do not match config.json ({detail})")
    for name, t in state.items():
        if t.shape != expected[name].shape:
            raise ModelError(
                f"{folder}: {name} has shape {tuple(t.shape)}, config.json implies {tuple(expected[name].shape)}"
            )
        state[name] = t.to(dtype) if t.is_floating_point() else t
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
