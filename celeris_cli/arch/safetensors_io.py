"""Reading safetensors one tensor at a time, with plain file reads into the tensor's own memory.

The format (https://huggingface.co/docs/safetensors): 8 bytes of little-endian header length, a JSON header
naming each tensor's dtype, shape and byte range, then the data. Reading each tensor's bytes straight into
a fresh tensor (rather than through a memory map) keeps the source pages out of the process's resident
memory, so loading a checkpoint, with a dtype cast or without, peaks at about the loaded weights plus one
tensor. The `safetensors` library writes our files and checks them in tests; this only reads.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..errors import ModelError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
MAX_HEADER = 100 * 2**20  # the library's own limit


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The tensors' entries (name -> dtype, shape, data_offsets) and where the data starts."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ModelError(f"{path}: not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER:
                raise ModelError(f"{path}: not a safetensors file (header of {n} bytes)")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{path}: cannot read safetensors ({e})") from None
    if not isinstance(header, dict):
        raise ModelError(f"{path}: not a safetensors file (header is not an object)")
    header.pop("__metadata__", None)
    for name, entry in header.items():
        ok = (
            isinstance(entry, dict)
            and isinstance(entry.get("dtype"), str)
            and isinstance(entry.get("shape"), list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry["shape"])
            and isinstance(entry.get("data_offsets"), list)
            and len(entry["data_offsets"]) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in entry["data_offsets"])
        )
        if not ok:
            raise ModelError(f"{path}: damaged safetensors header (entry {name!r})")
    return header, 8 + n


def shape_of(entry: dict[str, Any]) -> tuple[int, ...]:
    return tuple(int(d) for d in entry["shape"])


CHUNK_BYTES = 64 * 2**20  # a cast reads the source in pieces of this size


def read_tensors(
    path: Path, names: list[str], device: torch.device | str, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each named tensor of the file, floating ones in `dtype`, on `device`. A tensor stored in `dtype` is
    read straight into its memory; one to be cast is read in pieces and cast into its place, so nothing
    bigger than one piece exists beside the weights."""
    header, start = read_header(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        for name in names:
            entry = header[name]
            stored = DTYPES.get(entry.get("dtype"))
            if stored is None:
                raise ModelError(f"{path}: {name} has dtype {entry.get('dtype')!r}, which is not supported")
            shape = shape_of(entry)
            lo, hi = (int(x) for x in entry["data_offsets"])
            width = torch.empty((), dtype=stored).element_size()
            if hi - lo != math.prod(shape) * width or start + hi > size or lo < 0:
                raise ModelError(f"{path}: {name}'s bytes do not match its shape (a truncated or damaged file?)")
            target = dtype if stored.is_floating_point else stored
            out = torch.empty(shape, dtype=target)
            f.seek(start + lo)
            if target == stored:
                _read_into(f, out.view(-1).view(torch.uint8), path, name)
            else:
                flat, step = out.view(-1), max(1, CHUNK_BYTES // width)
                for i in range(0, flat.numel(), step):
                    piece = torch.empty(min(step, flat.numel() - i) * width, dtype=torch.uint8)
                    _read_into(f, piece, path, name)
                    flat[i : i + piece.numel() // width] = piece.view(stored)
            yield name, out.to(device)


def _read_into(f: Any, buf: torch.Tensor, path: Path, name: str) -> None:
    if f.readinto(buf.numpy().data) != buf.numel():
        raise ModelError(f"{path}: {name} is cut short (a truncated file?)")
