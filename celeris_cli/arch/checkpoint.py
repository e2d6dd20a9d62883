"""Load and save model folders: config.json + safetensors (one file or index-listed shards).

config.json chooses the architecture (`registry`). The model is built on the meta device and each tensor is
read from disk into its own memory (`safetensors_io`), cast to the target dtype and attached with
`assign=True` (gpt-fast): a checkpoint is never materialised twice, so peak memory stays near the weights'
size. Only safetensors are read; a pickle is never loaded.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ModelError, UsageError
from .folder import INDEX, SINGLE, ModelFolder
from .layers import ArchConfig
from .llada import LLaDAModel
from .quantize import converter
from .registry import Architecture
from .safetensors_io import read_header, read_tensors, shape_of

log = logging.getLogger(__name__)


# the initialisers torch's layers call from reset_parameters
_INITS = ("normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
          "xavier_normal_", "zeros_", "ones_", "constant_")  # fmt: skip


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """torch.nn.init's initialisers as no-ops (as transformers' `no_init_weights`): a tensor on the meta device
    holds no numbers to draw, and on it an initialiser's dispatch imports torch._dynamo, about 4 s of every
    first answer on a laptop CPU."""
    saved = {name: getattr(nn.init, name) for name in _INITS}
    try:
        for name in _INITS:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def build_on_meta(arch: Architecture, cfg: ArchConfig) -> nn.Module:
    """The family's network with no storage: every tensor's name and shape, nothing drawn."""
    with torch.device("meta"), _no_init():
        model: nn.Module = arch.build(cfg)
    return model


def read_folder(folder: Path) -> tuple[Architecture, ArchConfig]:
    """The architecture config.json names, and its config."""
    f = ModelFolder.open(folder)
    return f.arch, f.cfg


def load_model(
    folder: Path | ModelFolder,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    quantize: str = "none",
) -> nn.Module:
    """The folder's model on `device` in `dtype` (floating tensors), in eval mode. Each tensor is read
    from disk into its own memory and cast there, so the peak stays near the loaded weights. `quantize`
    ("int8", "int4"): each weight is quantized as it is read (`quantize`)."""
    if quantize == "int4" and torch.device(device).type == "cuda" and dtype != torch.bfloat16:
        raise UsageError("--quantize int4 on CUDA needs --dtype bfloat16: torch's CUDA int4 kernel takes bfloat16")
    mf = folder if isinstance(folder, ModelFolder) else ModelFolder.open(folder)
    folder, files = mf.path, mf.weight_files
    model: Any = build_on_meta(mf.arch, mf.cfg)  # the family's class, with its own methods
    with torch.device("meta"):
        expected = dict(model.state_dict())  # the checkpoint's names and shapes, before any quantization
        convert = converter(model, quantize, dtype)  # the identity unless quantizing
    optional = model.optional_tensors()
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
