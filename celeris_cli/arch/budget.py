"""A loaded model's memory budget: the planner's estimate for a batch of encoded rows, and the budget the
engine sizes its batches to (`--max-memory`; on CUDA by default a share of the card's memory, on the CPU
none unless set)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import UsageError
from ..params import GenerationParams
from .memory import Estimate, Quantize, Shape, largest_batch, parse_size, plan, request_of, shape_of_model

log = logging.getLogger(__name__)

CUDA_SHARE = 0.9  # of the memory free after loading plus the weights, by default on CUDA


class MemoryBudget:
    def __init__(
        self,
        model: nn.Module | object,
        dtype: torch.dtype,
        quantize: Quantize | str = "none",
        max_memory: str | int | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.model = model
        self.dtype = str(dtype).replace("torch.", "")
        self.quantize = quantize
        self.device = device
        self._shape: Shape | None = None
        if isinstance(max_memory, int):  # bytes, from code (a user's text always carries its unit)
            self.budget: int | None = max_memory
        elif max_memory:
            self.budget = parse_size(max_memory)
        elif device is not None and device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            self.budget = int(CUDA_SHARE * (free + torch.cuda.memory_allocated(device)))
            log.info("memory budget %d bytes (%.0f%% of the card's free memory and the weights)", self.budget, 90)
        else:
            self.budget = None

    @property
    def shape(self) -> Shape:
        if self._shape is None:
            self._shape = shape_of_model(self.model)
        return self._shape

    def need(self, rows: Sequence[list[int]], params: GenerationParams) -> int:
        """The planner's peak, in bytes, for decoding these encoded rows as one batch (0 for a model the
        planner cannot read, which then has no budget to keep)."""
        est = self.estimate(rows, params)
        return 0 if est is None else est.peak

    def estimate(self, rows: Sequence[list[int]], params: GenerationParams) -> Estimate | None:
        """The planner's split for these rows as one batch; None for a model it cannot read."""
        prompt = max(len(ids) for ids in rows)
        try:
            req = request_of(params, len(rows), prompt, self.dtype, self.quantize)  # type: ignore[arg-type]
            return plan(self.shape, req)
        except (UsageError, AttributeError, TypeError) as e:  # a stand-in model (tests) has no sizes to read
            log.warning("no memory estimate: %s", e)
            return None

    def release(self) -> None:
        """After an out-of-memory error: hand the allocator's cached blocks back before the retry."""
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()


def reset_peak(device: torch.device) -> None:
    """Start a new peak: the CUDA allocator's, or on the CPU the process's resident high-water mark
    (`/proc/self/clear_refs`; where it cannot be reset, the peak is the process's since it started)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        pass


def read_peak(device: torch.device) -> int:
    """Bytes at the peak since `reset_peak`: allocated by torch on CUDA, resident (the whole process,
    weights included) on the CPU; 0 where neither can be read."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def folder_report(
    folder: Path,
    batch: int,
    prompt: int,
    dtype: str,
    quantize: str = "none",
    max_memory: str | None = None,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The planner's estimate for a model folder (built on the meta device: no weight is read), with the
    settings the folder's model runs by default under `overrides`, and the largest batch within
    `max_memory`."""
    from .checkpoint import build_on_meta, read_folder
    from .folder import ModelFolder

    arch, cfg = read_folder(folder)
    params = GenerationParams.from_mapping(overrides or {}, ModelFolder.open(folder).defaults())
    arch.check_strategy(params.strategy)
    shape = shape_of_model(build_on_meta(arch, cfg))
    req = request_of(params, batch, prompt, dtype, quantize)  # type: ignore[arg-type]
    est = plan(shape, req)
    report: dict[str, Any] = {
        "strategy": params.strategy,
        "batch": batch,
        "prompt_tokens": prompt,
        "gen_length": params.gen_length,
        "dtype": dtype,
        "quantize": quantize,
        "weights": est.weights,
        "kv_cache": est.kv_cache,
        "activations": est.activations,
        "logits": est.logits,
        "peak": est.peak,
    }
    if max_memory:
        budget = parse_size(max_memory)
        report["max_memory"] = budget
        report["largest_batch"] = largest_batch(shape, req, budget)
    return report
