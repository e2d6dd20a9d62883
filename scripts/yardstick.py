"""The yardstick beside Celeris's own figures (`scripts/gpu-check`, issue 59): the same LLaDA-layout network, its
very weights, decoded by a minimal loop of plain PyTorch over a static KV cache, written apart from the project
(it imports nothing of it). On CUDA each step is also captured as one CUDA graph and replayed; on a CPU it runs
eager only.

A step takes q positions of every row at the cache's place `start`: q = 1 is an AR step (causal over the
cache), q = block length a dual-cache block step (the block attends to the cache before it and to itself).
Attention and the LM head run in the weights' dtype (bfloat16 on a GPU) through torch's fused scaled dot product
attention: the fast path, not Celeris's float32 `upcast`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

PREFIX = "model.transformer."


class Loop:
    """The network as plain tensors: read from a LLaDA-layout state dict (`model.transformer.*`)."""

    def __init__(self, state: dict[str, torch.Tensor], n_heads: int, theta: float, eps: float) -> None:
        s = {k.removeprefix(PREFIX): v for k, v in state.items()}
        self.emb, self.norm_f = s["wte.weight"], s["ln_f.weight"]
        self.head = s.get("ff_out.weight", self.emb)  # weight tying: the embedding is the head
        n = 1 + max(int(k.split(".")[1]) for k in s if k.startswith("blocks."))
        self.layers = []
        for i in range(n):
            b = {k.removeprefix(f"blocks.{i}."): v for k, v in s.items() if k.startswith(f"blocks.{i}.")}
            qkv = torch.cat((b["q_proj.weight"], b["k_proj.weight"], b["v_proj.weight"]))
            w13 = torch.cat((b["ff_proj.weight"], b["up_proj.weight"]))
            self.layers.append((b["attn_norm.weight"], qkv, b["attn_out.weight"], b["ff_norm.weight"], w13,
                                b["ff_out.weight"]))  # fmt: skip
        self.d = self.emb.shape[1]
        self.h, self.kv_heads = n_heads, b["k_proj.weight"].shape[0] // (self.d // n_heads)
        self.hd, self.eps, self.dtype, self.device = self.d // n_heads, eps, self.emb.dtype, self.emb.device
        self.inv = 1.0 / theta ** (torch.arange(0, self.hd, 2, device=self.device, dtype=torch.float32) / self.hd)

    def rms(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (g.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rotate-half rotary embeddings (LLaDA's): x (B, heads, q, hd) at positions pos (q,)."""
        f = pos.float()[:, None] * self.inv
        cos, sin = torch.cat((f, f), -1).cos(), torch.cat((f, f), -1).sin()
        xf = x.float()
        x1, x2 = xf.chunk(2, -1)
        return (xf * cos + torch.cat((-x2, x1), -1) * sin).to(x.dtype)

    def stepper(self, batch: int, q: int, length: int) -> tuple[Callable[[], None], dict[str, torch.Tensor]]:
        """A step over static buffers (`io`): tokens (batch, q) in, logits (batch, q, V) and their argmax out,
        at the cache's place io["start"] (advanced by one after an AR step, left as it is after a block step,
        which a decoder repeats in place). Nothing in it reads a value back to the host."""
        dev, dt = self.device, self.dtype
        caches = [
            (torch.zeros(batch, self.kv_heads, length, self.hd, device=dev, dtype=dt),
             torch.zeros(batch, self.kv_heads, length, self.hd, device=dev, dtype=dt))
            for _ in self.layers
        ]  # fmt: skip
        io = {
            "tokens": torch.zeros(batch, q, dtype=torch.long, device=dev),
            "start": torch.zeros((), dtype=torch.long, device=dev),
            "logits": torch.zeros(batch, q, self.head.shape[0], dtype=dt, device=dev),
            "argmax": torch.zeros(batch, q, dtype=torch.long, device=dev),
        }
        places, offsets = torch.arange(length, device=dev), torch.arange(q, device=dev)
        B, H, K, hd = batch, self.h, self.kv_heads, self.hd

        def step() -> None:
            pos = io["start"] + offsets  # (q,)
            # AR: each position sees the cache up to itself; a block sees the cache before it and all of itself
            seen = places[None, :] <= pos[:, None] if q == 1 else (places < io["start"] + q).expand(q, length)
            x = self.emb[io["tokens"]]
            for (n1, qkv, o, n2, w13, w2), (kc, vc) in zip(self.layers, caches):
                a = self.rms(x, n1) @ qkv.t()
                qq = a[..., : H * hd].view(B, q, H, hd).transpose(1, 2)
                k = a[..., H * hd : (H + K) * hd].view(B, q, K, hd).transpose(1, 2)
                v = a[..., (H + K) * hd :].view(B, q, K, hd).transpose(1, 2)
                qq, k = self.rope(qq, pos), self.rope(k, pos)
                kc.index_copy_(2, pos, k)
                vc.index_copy_(2, pos, v)
                y = F.scaled_dot_product_attention(qq, kc, vc, attn_mask=seen, enable_gqa=H != K)
                x = x + y.transpose(1, 2).reshape(B, q, H * hd) @ o.t()
                g, u = (self.rms(x, n2) @ w13.t()).chunk(2, -1)
                x = x + (F.silu(g) * u) @ w2.t()
            logits = self.rms(x, self.norm_f) @ self.head.t()
            io["logits"].copy_(logits)
            io["argmax"].copy_(logits.argmax(-1))
            if q == 1:
                io["start"].add_(1)

        return step, io


def _timed(fn: Callable[[], None], n: int, cuda: bool) -> float:
    for _ in range(2):
        fn()
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / n


def measure(loop: Loop, batch: int, q: int, length: int, steps: int) -> dict[str, Any]:
    """ms per step eager, and as one replayed CUDA graph where the device is CUDA; positions/s of each."""
    cuda = loop.device.type == "cuda"
    step, io = loop.stepper(batch, q, length)
    io["tokens"].random_(0, loop.head.shape[0])
    row: dict[str, Any] = {"batch": batch, "q": q, "cache_length": length}
    with torch.no_grad():
        eager = _timed(step, steps, cuda)
        io["start"].zero_()
        row["eager_ms"] = round(eager * 1e3, 3)
        row["eager_positions_per_s"] = round(batch * q / eager, 1)
        row["graph_ms"] = row["graph_positions_per_s"] = None
        if cuda:
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(3):
                        step()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
                io["start"].zero_()
                replay = _timed(graph.replay, steps, cuda)
                row["graph_ms"] = round(replay * 1e3, 3)
                row["graph_positions_per_s"] = round(batch * q / replay, 1)
            except Exception as e:  # the capture itself failing is a finding to report, not a crash
                row["graph_error"] = repr(e)[:300]
    return row
