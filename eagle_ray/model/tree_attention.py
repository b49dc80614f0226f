"""Tree attention that reads each row's own keys only: ``torch.nn.attention.flex_attention`` over the KV cache as it
lies, one block mask per forward.

The dense path (``attention.masked_sdpa``) reads every row's keys up to the batch's longest length (plus the key
bucket) and, for slots that are not contiguous, gathers them first: at 32 sequences of 4k tokens that is as many
bytes a step as the weights. Here the cache's slots are flex attention's batch dimension, so nothing is gathered:
the queries are scattered into their slots (tokens, not keys), and the block mask, built once per forward from the
rows' lengths and trees, lets the kernel skip every key block a row cannot see (past its length, other slots).
Compiled (``torch.compile(flex_attention)``) it is one fused kernel on CUDA; eager it is a reference implementation
that tests hold equal to the dense path on CPU.
"""
from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from eagle_ray.model.attention import BlockMeta
from eagle_ray.model.kv_cache import KVCache


FLEX_MAX_BLOCK = 64   # tokens per row at most: decode steps; a prompt chunk's mask over every slot would be too big


def tree_block_mask(meta: BlockMeta, cache: KVCache) -> BlockMask:
    """What each query of the forward may see, over every slot of the cache: row ``r``'s queries live in slot
    ``meta.slot_index[r]`` and see that slot's committed prefix plus their tree ancestors (``meta.key_mask``);
    the other slots see nothing and cost nothing."""
    B, _, T, kv_len = meta.key_mask.shape
    device = meta.key_mask.device
    row_of = torch.full((cache.num_slots,), -1, dtype=torch.long, device=device)
    row_of[meta.slot_index.view(-1)] = torch.arange(B, device=device)
    seen = meta.key_mask[:, 0]   # [B, T, kv_len]

    def may_see(b, h, q, kv):
        r = row_of[b]
        return (r >= 0) & (kv < kv_len) & seen[r.clamp(min=0), q, kv.clamp(max=kv_len - 1)]

    return create_block_mask(may_see, cache.num_slots, None, T, cache.max_len + 1, device=device)


_compiled = None


def fused_flex_attention():
    """flex_attention compiled once per process: eager, it is a reference implementation that builds every score."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(flex_attention, dynamic=True)   # tree widths change step to step
    return _compiled


def flex_tree_attention(q: torch.Tensor, cache: KVCache, layer: int, meta: BlockMeta, block_mask: BlockMask,
                        scale: float, attend=None) -> torch.Tensor:
    """``q [B, H, T, D]`` over its rows' slots in ``cache`` (their block already written); returns ``[B, H, T, D]``.
    ``attend``: default flex_attention compiled on CUDA, eager elsewhere (the CPU tests' reference)."""
    attend = attend or (fused_flex_attention() if q.is_cuda else flex_attention)
    B, H, T, D = q.shape
    rows = meta.slot_index.view(-1)
    by_slot = q.new_zeros(cache.num_slots, H, T, D)
    by_slot[rows] = q
    out = attend(by_slot, cache.k[layer].to(q.dtype), cache.v[layer].to(q.dtype), block_mask=block_mask,
                 scale=scale, enable_gqa=cache.k.shape[2] != H)
    return out[rows]
