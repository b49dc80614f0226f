"""A preallocated KV cache with one length per slot.

Layout ``[layers, slots, kv_heads, max_len + 1, head_dim]``: a slot is one sequence; ``lengths[slot]`` counts the
committed positions. A forward writes its new block at ``[length, length + T)`` of each slot; the caller moves the
length (prefill) or keeps the accepted tree path (:meth:`keep_accepted`), so speculative tree tokens past it are
simply overwritten next time. The extra position (``scratch``) takes the writes of padding rows in a ragged block,
which would otherwise land past the end of a slot whose row is deep in its context.
"""
from __future__ import annotations

import numpy as np
import torch

from eagle_ray.uploads import uploads_for


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, num_slots, num_kv_heads, max_len + 1, head_dim)
        # keys and values in one tensor, so that a block's K/V, side by side in a merged projection, are stored
        # by one scatter (write_kv); ``k`` and ``v`` are views of its halves
        self.kv = torch.zeros((2, *shape), dtype=dtype, device=device)
        self.k, self.v = self.kv[0], self.kv[1]
        # committed positions per slot, on the host: shapes are decided there, and reading them never waits for
        # the device (each forward uploads its rows' lengths)
        self.lengths = np.zeros(num_slots, dtype=np.int64)
        self.max_len = max_len
        self.kv_bucket = 1      # key lengths a forward reads are rounded up to this (masked; CUDA graph replay)
        self.slice_reads = True  # contiguous slots are read as a slice (no copy); compiled forwards gather instead
        self.scratch = max_len  # never committed, never read by a real row
        self.layers = [LayerCache(self, i) for i in range(num_layers)]

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def write(self, layer: int, slot_index: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Store ``k, v [B, H, T, D]`` at positions ``pos [B, T]`` of slots ``slot_index [B, 1]``."""
        self.k[layer][slot_index, :, pos] = k.transpose(1, 2)
        self.v[layer][slot_index, :, pos] = v.transpose(1, 2)

    def write_kv(self, layer: int, slot_index: torch.Tensor, pos: torch.Tensor, kv: torch.Tensor):
        """Store ``kv [B, T, 2 H, D]`` (keys' heads, then values') at positions ``pos [B, T]`` of slots
        ``slot_index [B, 1]``, in one scatter."""
        B, T, _, D = kv.shape
        self.kv[:, layer][:, slot_index, :, pos] = kv.view(B, T, 2, -1, D)

    def read(self, layer: int, slots: torch.Tensor | slice, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, H, kv_len, D]`` of ``slots`` (a slice avoids a copy when slots are contiguous)."""
        return self.k[layer, slots, :, :kv_len], self.v[layer, slots, :, :kv_len]

    def keep_accepted(self, slots: list[int], src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move positions ``src [B, A]`` to ``dst [B, A]`` in every layer (one gather + one scatter per tensor).

        Used after verification to place the accepted tree path right after the committed prefix. Entries with
        ``src == dst`` are no-ops, so callers pad ragged rows that way.
        """
        bi = uploads_for(self.k.device).ints(slots).view(-1, 1).expand_as(src)
        src, dst = src.to(self.k.device), dst.to(self.k.device)
        for cache in (self.k, self.v):
            cache[:, bi, :, dst] = cache[:, bi, :, src]

    def move(self, src: int, dst: int) -> None:
        """Copy slot ``src``'s committed positions (and length) to slot ``dst``; ``src`` becomes empty."""
        n = int(self.lengths[src])
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.lengths[dst], self.lengths[src] = n, 0

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Copy slot ``src``'s first ``n`` positions to slot ``dst``, which then holds exactly those (a prompt
        shared by several sequences, engine/samples.py); ``src`` keeps its own."""
        self.kv[:, :, dst, :, :n] = self.kv[:, :, src, :, :n]
        self.lengths[dst] = n

    def reset(self, slot: int) -> None:
        self.lengths[slot] = 0


class LayerCache(KVCache):
    """Layer ``layer`` of ``whole`` as a one-layer cache (index 0): views of its keys and values. A decoder layer
    run on it takes no layer index, so one compiled graph serves every layer (an index would be a constant of the
    graph: a graph per layer). Lengths and settings stay the whole cache's (a forward's block meta reads them)."""

    def __init__(self, whole: KVCache, layer: int):   # KVCache.__init__ is not called: it would allocate
        self.kv = whole.kv[:, layer:layer + 1]   # views only: no reference back, so the whole cache frees at once
        self.k, self.v = self.kv[0], self.kv[1]
