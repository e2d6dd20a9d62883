"""The KV cache every architecture and decoder uses: per layer, keys and values of shape (rows, kv_heads,
length, head_dim).

`LayerKV.update(k, v, start)` writes a forward's fresh keys/values at `start` (one position for every row,
or one per row: rows decoding at different places, as the scheduler's do) and returns the whole cache for
attention to read (gpt-fast's `KVCache.update`); a model's layers are given `LayerKV`s only. `KVCache` holds
every layer's and the operations on rows and positions a decoder needs: made from a forward's fresh
keys/values, a view of the first rows and positions, keeping some rows, moving a row into another's slot,
growing. Every decoder holds its cache as a `KVCache`; only a forward's fresh keys/values, which it returns,
are plain `KV` tuples.
"""

from __future__ import annotations

import torch

KV = tuple[torch.Tensor, torch.Tensor]  # (B, kv_heads, L, head_dim) each


class LayerKV:
    """One layer's cache: keys and values, (B, kv_heads, L, head_dim) each (views of a larger store).

    `exact`: attention over it runs per group of rows over exactly the keys they see (`invariant.attention`),
    not over all L. The block running set asks for it: L there is the furthest row's reach, set by the rows
    beside it, and SDPA's result for a row changes with L even where the extra keys are masked (measured:
    L 40 against 48), which flipped a near tie of the default model's (rule 2)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, exact: bool = False) -> None:
        self.k, self.v, self.exact = k, v, exact

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
    """Every layer's keys and values for up to `rows` rows and `length` positions. Rows are slots;
    `view(rows, length)` gives slots' first `length` positions to a forward, without copying.

    `empty` allocates it zeroed, for the running sets: a row's attention masks the positions past its own,
    but their values still enter the kernel, where uninitialised memory holding NaN would poison the row
    (0 x NaN). `of` does not zero it, for a decoder that reads only positions it has written (block
    diffusion's committed blocks)."""

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

    @classmethod
    def of(cls, kv: list[KV], length: int) -> KVCache:
        """A forward's fresh keys/values at the start of a cache of `length` positions, allocated once (not
        zeroed: the positions past them hold garbage until written)."""

        def one(t: torch.Tensor) -> torch.Tensor:
            out = t.new_empty(*t.shape[:2], length, t.shape[3])
            out[:, :, : t.shape[2]] = t
            return out

        return cls([(one(k), one(v)) for k, v in kv])

    @property
    def rows(self) -> int:
        return self.layers[0][0].shape[0]

    @property
    def length(self) -> int:
        return self.layers[0][0].shape[2]

    def view(self, rows: slice | int = slice(None), length: int | None = None, exact: bool = False) -> list[LayerKV]:
        """Per-layer caches over slots `rows` (a slice, or one slot; all by default) and positions
        [0, length) (all by default): views, so a forward's updates land in this cache. The whole cache is
        not sliced at all (the fast decoder asks for it at every step). `exact`: see `LayerKV`."""
        if rows == slice(None) and length is None:
            return [LayerKV(k, v, exact) for k, v in self.layers]
        sl = rows if isinstance(rows, slice) else slice(rows, rows + 1)
        return [LayerKV(k[sl, :, :length], v[sl, :, :length], exact) for k, v in self.layers]

    def keep(self, rows: torch.Tensor, written: int | None = None) -> None:
        """Only slots `rows` (a bool mask or indices) stay, in their order; only their first `written`
        positions (all by default) are copied, the rest of each new slot is left unwritten."""

        def one(t: torch.Tensor) -> torch.Tensor:
            part = t[rows, :, :written]
            if part.shape[2] == t.shape[2]:
                return part
            out = t.new_empty(part.shape[0], *t.shape[1:])
            out[:, :, : part.shape[2]] = part
            return out

        self.layers = [(one(k), one(v)) for k, v in self.layers]

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot `src`'s first `length` positions into slot `dst` (a leaving row's slot is reused)."""
        for k, v in self.layers:
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]

    def grow(self, length: int, keep_rows: int, rows: int | None = None) -> None:
        """At least `length` positions per slot (and `rows` slots), the first `keep_rows` slots' contents kept."""
        rows = max(rows or 0, self.rows)
        if length <= self.length and rows == self.rows:
            return
        length = max(length, self.length)
        grown = []
        for k, v in self.layers:
            nk = k.new_zeros(rows, k.shape[1], length, k.shape[3])
            nv = v.new_zeros(rows, v.shape[1], length, v.shape[3])
            nk[:keep_rows, :, : k.shape[2]] = k[:keep_rows]
            nv[:keep_rows, :, : v.shape[2]] = v[:keep_rows]
            grown.append((nk, nv))
        self.layers = grown


class DeferredKVCache(KVCache):
    """A `KVCache` of `rows` slots and `length` positions whose layout (layers, heads, head size, dtype) is
    learnt from the first keys and values written into it (`materialize`, by a packed forward), so that no
    forward runs only to find it out. Until then it grows in name only."""

    def __init__(self, rows: int, length: int) -> None:
        super().__init__([])
        self._rows, self._length = rows, length

    @property
    def rows(self) -> int:
        return super().rows if self.layers else self._rows

    @property
    def length(self) -> int:
        return super().length if self.layers else self._length

    def grow(self, length: int, keep_rows: int, rows: int | None = None) -> None:
        if self.layers:
            super().grow(length, keep_rows, rows)
        else:
            self._length, self._rows = max(self._length, length), max(self._rows, rows or 0)

    def move(self, src: int, dst: int, length: int) -> None:
        if self.layers:
            super().move(src, dst, length)

    def materialize(
        self, n_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        def one() -> torch.Tensor:
            return torch.zeros(self._rows, kv_heads, self._length, head_dim, dtype=dtype, device=device)

        self.layers = [(one(), one()) for _ in range(n_layers)]
