"""Device and dtype resolution: `auto` picks CUDA when present and bf16 where the hardware runs it fast."""

from __future__ import annotations

import functools
from typing import Literal

import torch

from .errors import DeviceError

DeviceName = Literal["auto", "cpu", "cuda"]
DtypeName = Literal["auto", "float32", "bfloat16"]


@functools.cache
def cpu_has_bf16() -> bool:
    """True where the CPU has native bf16 (AVX512-BF16 or AMX); elsewhere bf16 is emulated and slow."""
    try:
        if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            return False
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except (AttributeError, RuntimeError, OSError):
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError("--device cuda was requested, but CUDA is not available on this machine")
        return torch.device("cuda")
    if name == "cpu":
        return torch.device("cpu")
    raise DeviceError(f"unknown device {name!r} (choose auto, cpu or cuda)")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
        return torch.bfloat16 if cpu_has_bf16() else torch.float32
    raise DeviceError(f"unknown dtype {name!r} (choose auto, float32 or bfloat16)")
