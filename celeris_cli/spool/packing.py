"""Packing prepared requests into batches: shared by the queue and `celeris batch` (no torch)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

from .backend import Prepared

T = TypeVar("T")


def pack(items: Sequence[T], prepared: Callable[[T], Prepared], batch_size: int, token_budget: int) -> list[list[T]]:
    """Group items whose prepared requests may share a batch (equal `group`), sort each group by cost so
    the rows of a batch are of similar length, and cap each batch by rows and by padded canvas tokens."""
    groups: dict[Hashable, list[T]] = {}
    for item in items:
        groups.setdefault(prepared(item).group, []).append(item)
    out: list[list[T]] = []
    for members in groups.values():
        members.sort(key=lambda item: prepared(item).cost)
        batch: list[T] = []
        for item in members:
            cost = prepared(item).cost  # sorted by cost: this row is the longest, the padded batch is cost * rows
            if batch and (len(batch) >= batch_size or cost * (len(batch) + 1) > token_budget):
                out.append(batch)
                batch = []
            batch.append(item)
        if batch:
            out.append(batch)
    return out
