"""Tree attention that reads each row's own keys only: ``torch.nn.attention.flex_attention`` over the KV cache as it
lies, one block mask per forward.

The dense path (``attention.masked_sdpa``) reads every row's keys up to the batch's longest length (plus the key
bucket) and, for slots that are not contiguous, gathers them first: at 32 sequences of 4k tokens that is as many
bytes a step as the weights. Here the cache's slots are flex attention's batch dimension, so nothing is gathered:
the queries are scattered into their slots (tokens, not keys), and the block mask, built once per forward from the
rows' lengths and trees, lets the kernel skip every key block a row cannot see (past its length, other slots).

Compiled (``torch.compile(flex_attention)``, on CUDA) it is one fused kernel; eager it is a reference implementation
that tests hold equal to the dense path on CPU. The compile sees static sizes everywhere but the query width: the
slots (flex's batch), heads, head dim and key length are the cache's, fixed for an engine, and only the block's width
``T`` varies, so Inductor picks its decoding kernel for short queries (it needs a static batch and head count) and
one graph serves every width above 1 (a width of 1 is its own, as torch specialises sizes of 1): two compiles per
dtype and cache shape. The block mask's tensors are per slot too (a row's length, and its tree in block columns),
so no size the batch brings reaches the compile.
"""
from __future__ import annotations

import inspect
from typing import NamedTuple

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from eagle_ray.model.attention import BlockMeta
from eagle_ray.model.guarded_compile import GuardedCompile
from eagle_ray.model.kv_cache import KVCache


FLEX_MAX_BLOCK = 64   # tokens per row at most: decode steps; a prompt chunk's mask over every slot would be too big
KV_BLOCK = 128        # keys per block of the block mask (flex attention's default)
# the transposed (query-side) blocks serve the backward pass only; torch builds them unless told not to
_NO_Q_BLOCKS = {"compute_q_blocks": False} if "compute_q_blocks" in inspect.signature(
    BlockMask.from_kv_blocks).parameters else {}
BLOCK_MASK_TENSORS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                      "q_indices", "full_q_num_blocks", "full_q_indices")


def tree_block_mask(meta: BlockMeta, cache: KVCache) -> BlockMask:
    """What each query of the forward may see, over every slot of the cache: row ``r``'s queries live in slot
    ``meta.slot_index[r]`` and see that slot's committed prefix plus their tree ancestors (``meta.key_mask``; a
    padding query its first column only); the other slots see nothing and cost nothing. The target's blocks start
    at each row's length (``make_block_meta`` with no offset), so a query's tree is ``key_mask`` read there.

    The key blocks a slot's queries visit are its first ``ceil((length + T) / 128)`` (none for a slot without a
    row), made directly: evaluating the mask over every slot, query and key (``create_block_mask``) would cost the
    host more than the attention costs the device."""
    B, _, T, kv_len = meta.key_mask.shape
    device = meta.key_mask.device
    S, keys = cache.num_slots, cache.max_len + 1
    rows = meta.slot_index.view(-1)
    cols = meta.lengths.view(B, 1) + torch.arange(T, device=device)                # [B, T] the block's key columns
    tree = meta.key_mask[:, 0].gather(2, cols.clamp(max=kv_len - 1).unsqueeze(1).expand(B, T, T))
    tree &= (cols < kv_len).unsqueeze(1)
    padding = meta.write_pos == cache.scratch                                     # [B, T]
    length = torch.zeros(S, dtype=torch.long, device=device)                     # per slot: its committed length,
    prefix = torch.zeros(S, T, dtype=torch.long, device=device)                  # the prefix columns each query sees,
    seen = torch.zeros(S, T, T, dtype=torch.bool, device=device)                 # the block columns each query sees
    length[rows] = meta.lengths
    prefix[rows] = torch.where(padding, 1, meta.lengths.view(B, 1))
    seen[rows] = tree & ~padding.unsqueeze(-1)
    blocks = -(-keys // KV_BLOCK)
    visited = torch.zeros(S, dtype=torch.int32, device=device)
    visited[rows] = ((meta.lengths + T + KV_BLOCK - 1) // KV_BLOCK).clamp(max=blocks).to(torch.int32)
    order = torch.arange(blocks, dtype=torch.int32, device=device).expand(S, 1, 1, blocks).contiguous()
    for t in (length, prefix, seen):
        torch._dynamo.mark_static(t, 0)

    def may_see(b, h, q, kv):
        j = kv - length[b]
        in_block = (j >= 0) & (j < seen.shape[-1])
        return (kv < prefix[b, q]) | (in_block & seen[b, q, j.clamp(0, seen.shape[-1] - 1)])

    return BlockMask.from_kv_blocks(visited.view(S, 1, 1), order, BLOCK_SIZE=KV_BLOCK, mask_mod=may_see,
                                    seq_lengths=(T, keys), **_NO_Q_BLOCKS)


class FlexShape(NamedTuple):
    """A compile's key: everything but the query width, static."""
    dtype: torch.dtype
    slots: int
    heads: int
    kv_heads: int
    head_dim: int
    keys: int


def _flex(query, key, value, block_mask, scale, enable_gqa):
    return flex_attention(query, key, value, block_mask=block_mask, enable_gqa=enable_gqa,
                          scale=query.size(-1) ** -0.5 if scale is None else scale)


def _flex_static_but_width(query, key, value, block_mask, scale, enable_gqa):
    """What torch.compile traces: every size is made static here (where marking a size specializes it) but the
    query width, whatever other engines of the process compiled before."""
    for dim in (0, 1, 3):
        torch._dynamo.mark_static(query, dim)
    torch._dynamo.mark_static(key)
    torch._dynamo.mark_static(value)
    for name in BLOCK_MASK_TENSORS:
        t = getattr(block_mask, name)
        if t is not None:
            torch._dynamo.mark_static(t)
    return _flex(query, key, value, block_mask, scale, enable_gqa)


def compiled_flex(backend="inductor", report: bool = False) -> GuardedCompile:
    """flex_attention through a guarded ``torch.compile`` keyed by :class:`FlexShape` (a key whose compile fails
    runs the eager reference, reported); ``backend``: Inductor on CUDA, a counting one in tests."""
    return GuardedCompile("flex_attention", _flex_static_but_width, backend, eager=_flex, report=report,
                          fullgraph=True)


_CUDA = compiled_flex(report=True)   # compiled on first use


def eager_flex(_shape: FlexShape, *args):
    """The reference implementation (builds every score): the CPU's."""
    return _flex(*args)


def flex_tree_attention(q: torch.Tensor, cache: KVCache, layer: int, meta: BlockMeta, block_mask: BlockMask,
                        scale: float, attend=None) -> torch.Tensor:
    """``q [B, H, T, D]`` over its rows' slots in ``cache`` (their block already written); returns ``[B, H, T, D]``.
    ``attend(shape, query, key, value, block_mask, scale, enable_gqa)``: default flex_attention compiled on CUDA,
    eager elsewhere (the CPU tests' reference)."""
    attend = attend or (_CUDA if q.is_cuda else eager_flex)
    B, H, T, D = q.shape
    rows = meta.slot_index.view(-1)
    by_slot = q.new_zeros(cache.num_slots, H, T, D)
    by_slot[rows] = q
    k, v = cache.k[layer].to(q.dtype), cache.v[layer].to(q.dtype)
    shape = FlexShape(q.dtype, cache.num_slots, H, k.shape[1], D, k.shape[2])
    # the usual scale (1 / sqrt(D)) is left to the compiled function, where D is static: a float argument that
    # changed between engines would become a symbolic input
    out = attend(shape, by_slot, k, v, block_mask, None if scale == D ** -0.5 else scale, k.shape[1] != H)
    return out[rows]
