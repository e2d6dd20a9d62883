"""The KV cache every decoder shares: per layer, keys and values of shape (rows, kv_heads, length, head_dim).

`LayerKV.update(k, v, start)` writes a forward's fresh keys/values at `start` (one position for every row,
or one per row: rows decoding at different places, as the scheduler's do) and returns the whole cache for
attention to read (gpt-fast's `KVCache.update`). `KVCache` holds every layer's and the operations on rows a
decoder needs: a view of the first rows and positions, moving a row into another's slot, growing.
"""

from __future__ import annotations

import torch

KV = tuple[torch.Tensor, torch.Tensor]  # (B, kv_heads, L, head_dim) each


class LayerKV:
    """One layer's cache: keys and values, (B, kv_heads, L, head_dim) each (views of a larger store)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v

    def update(self, k: torch.Tensor, v: torch.Tensor, start: int | torch.Tensor) -> KV:
        """Write k, v (B, kv_heads, T, head_dim) at positions [start, start + T) of each row (`start`: an int,
        or a (B,) tensor, one start per row), and return the cache to attend over."""
        T = k.shape[2]
        if isinstance(start, int):
            self.k[:, :, start : start + T] = k
            self.v[:, :, start : start + T] = v
        else:
            rows = torch.arange(k.shape[0], device=k.device)[:, None]  # (B, 1)
            at = start[:, None] + torch.arange(T, device=k.device)[None, :]  # (B, T)
            # advanced indices on dims 0 and 2 put them first: the target is (B, T, kv_heads, head_dim)
            self.k[rows, :, at] = k.transpose(1, 2).to(self.k.dtype)
            self.v[rows, :, at] = v.transpose(1, 2).to(self.v.dtype)
        return self.k, self.v


class KVCache:
    """Every layer's keys and values for up to `rows` rows and `length` positions, allocated once and zeroed:
    a row's attention masks the positions past its own, but their values still enter the kernel, where
    uninitialised memory holding NaN would poison the row (0 x NaN). Rows are slots; `view(n, length)` gives the
    first n slots' first `length` positions to a forward, without copying."""

    def __init__(self, layers: list[KV]) -> None:
        self.layers = layers

    @classmethod
    def empty(
        cls,
        n_layers: int,
        rows: int,
        kv_heads: int,
        length: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        def one() -> torch.Tensor:
            return torch.zeros(rows, kv_heads, length, head_dim, dtype=dtype, device=device)

        return cls([(one(), one()) for _ in range(n_layers)])

    @property
    def rows(self) -> int:
        return self.layers[0][0].shape[0]

    @property
    def length(self) -> int:
        return self.layers[0][0].shape[2]

    def view(self, rows: slice | int, length: int) -> list[LayerKV]:
        """Per-layer caches over slots `rows` (a slice, or one slot) and positions [0, length): views, so a
        forward's updates land in this cache."""
        sl = rows if isinstance(rows, slice) else slice(rows, rows + 1)
        return [LayerKV(k[sl, :, :length], v[sl, :, :length]) for k, v in self.layers]

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot `src`'s first `length` positions into slot `dst` (a leaving row's slot is reused)."""
        for k, v in self.layers:
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]

    def grow(self, length: int, keep_rows: int) -> None:
        """At least `length` positions per slot, the first `keep_rows` slots' contents kept."""
        if length <= self.length:
            return
        grown = []
        for k, v in self.layers:
            nk = k.new_zeros(k.shape[0], k.shape[1], length, k.shape[3])
            nv = v.new_zeros(v.shape[0], v.shape[1], length, v.shape[3])
            nk[:keep_rows, :, : k.shape[2]] = k[:keep_rows]
            nv[:keep_rows, :, : v.shape[2]] = v[:keep_rows]
            grown.append((nk, nv))
        self.layers = grown


Cache = list[KV] | list[LayerKV]  # what a forward is given: per-layer tuples (one start) or `LayerKV`s
