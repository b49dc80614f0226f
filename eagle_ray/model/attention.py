"""The one attention path shared by target and draft: a decoder layer over a block of new tokens on top of a
per-slot KV cache, with an arbitrary mask inside the block (causal for prefill, ancestors for a tree).

The layer modules (norms, projections, MLP, Qwen3's q/k norms, biases) are transformers' or ``decoder.py``'s, which
hold the same names; this module runs them over our cache with our mask.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from eagle_ray.uploads import uploads_for
from eagle_ray.model.decoder import apply_rotary
from eagle_ray.model.kv_cache import KVCache


class FP32Rope:
    """Keeps a rotary embedding's frequency table in fp32 when its module is cast to bf16 or fp16: rounded to bf16
    (relative errors up to 2^-9) the angles drift further from the target's with every position, and drafts are
    accepted less on long contexts."""

    def __init__(self, rotary):
        self.rotary = rotary
        self.table = {name: buf.detach().float().clone() for name, buf in rotary.named_buffers()
                      if name.endswith("inv_freq")}   # on the meta device (memory plans): shapes only

    def restore(self) -> None:
        for name, table in self.table.items():
            buf = getattr(self.rotary, name)
            setattr(self.rotary, name, buf.float() if buf.device.type == "meta" else table.to(buf.device))


@dataclass
class BlockMeta:
    """Where a block of ``T`` new tokens goes for each of ``B`` slots, and what it may see."""
    slots: torch.Tensor | slice   # cache slot per row, or a slice when rows are contiguous slots
    slot_index: torch.Tensor      # [B, 1] slot ids (device) for scatter writes
    write_pos: torch.Tensor       # [B, T] cache positions written (device)
    key_mask: torch.Tensor        # [B, 1, T, kv_len] bool, True = may attend (device)
    kv_len: int
    lengths: torch.Tensor         # [B] committed positions of each row's slot (device): rotary positions
    invariant: bool = False       # batch-invariant kernels (fp32 activations on CPU; see pad_rows)
    attn_mask: torch.Tensor | None = None   # key_mask as the attention kernel reads it (with_attention_mask)
    fold: int = 1                 # query heads per kv head folded into the query rows (1: none; see masked_sdpa)


def with_attention_mask(meta: BlockMeta, heads: int, kv_heads: int) -> BlockMeta:
    """``meta`` with the mask the attention kernel reads, folded for grouped-query heads once per forward (not in
    every layer): see :func:`masked_sdpa` for when the heads are folded."""
    B, _, T, L = meta.key_mask.shape
    rep = heads // kv_heads
    fold = rep > 1 and not (meta.key_mask.device.type == "cpu" and (T == 1 or B == 1))
    if not fold:
        return replace(meta, attn_mask=meta.key_mask, fold=1)
    return replace(meta, attn_mask=meta.key_mask.unsqueeze(2).expand(B, 1, rep, T, L).reshape(B, 1, rep * T, L),
                   fold=rep)


def make_block_meta(cache: KVCache, slots: list[int], block_mask: torch.Tensor, offset: int = 0,
                    invariant: bool = False, n_valid: list[int] | None = None, kv_len: int | None = None) -> BlockMeta:
    """Meta for a block whose rows attend to their slot's committed prefix plus ``block_mask [B, T, N]``.

    The block's columns start at ``lengths[slot]``; the new ``T`` tokens are written at columns
    ``[lengths + offset, lengths + offset + T)``, i.e. the last ``T`` of the ``N`` block columns when
    ``offset = N - T`` (the draft's tree levels stack up that way). ``n_valid`` (B host ints; ragged blocks with
    ``T == N``) marks rows ``t >= n_valid[b]`` as padding: they write to the cache's scratch position and see only
    column 0, so they neither overrun a slot nor reach another row's keys. ``kv_len``: the key columns read, if
    fixed by the caller (a captured graph's; at least what the block needs), else the need rounded to the bucket.
    """
    device = cache.k.device
    B, T, N = block_mask.shape
    lengths = cache.lengths[slots]                         # host [B]: shapes come from the host, no device read
    if kv_len is None:
        kv_len = int((lengths + np.asarray(n_valid)).max()) if n_valid is not None else int(lengths.max()) + N
        kv_len = min(-(-kv_len // cache.kv_bucket) * cache.kv_bucket, cache.max_len + 1)  # extra columns masked
    upload = uploads_for(device)
    lengths_d = upload.ints(lengths)
    n_valid_d = upload.ints(n_valid) if n_valid is not None else None
    slot_index = upload.ints(slots).view(-1, 1)
    meta = block_meta(lengths_d, slot_index, block_mask.to(device), offset, kv_len, cache.scratch, n_valid_d, invariant)
    first = slots[0]
    if cache.slice_reads and slots == list(range(first, first + B)):
        meta.slots = slice(first, first + B)   # contiguous slots are read as a slice, without a gather
    return meta


def block_meta(lengths: torch.Tensor, slot_index: torch.Tensor, block_mask: torch.Tensor, offset: int, kv_len: int,
               scratch: int, n_valid: torch.Tensor | None = None, invariant: bool = False) -> BlockMeta:
    """The device part of :func:`make_block_meta`, from device tensors only (``lengths [B]``, ``slot_index [B, 1]``,
    ``n_valid [B]``): a captured graph builds its blocks' meta with it from its static buffers."""
    device = block_mask.device
    B, T, N = block_mask.shape
    cols = torch.arange(kv_len, device=device).view(1, -1) - lengths.view(-1, 1)  # [B, kv_len] block column
    in_block = (cols >= 0) & (cols < N)
    gathered = block_mask.gather(2, cols.clamp(0, N - 1).unsqueeze(1).expand(B, T, kv_len))
    key_mask = (cols < 0).unsqueeze(1) | (gathered & in_block.unsqueeze(1))
    t = torch.arange(T, device=device).view(1, -1)
    write_pos = lengths.view(-1, 1) + offset + t
    if n_valid is not None:
        pad = t >= n_valid.view(-1, 1)   # [B, T]
        write_pos = torch.where(pad, scratch, write_pos)
        first_col = torch.arange(kv_len, device=device) == 0
        key_mask = torch.where(pad.unsqueeze(-1), first_col, key_mask)
    return BlockMeta(slot_index.view(-1), slot_index, write_pos.contiguous(), key_mask.unsqueeze(1).contiguous(),
                     kv_len, lengths, invariant)


@dataclass
class Part:
    """One block of a forward: its rows' ``BlockMeta`` and rotary tables. A forward of several parts (a step's
    prompt chunks, drafted trees and plain roots) runs every projection once over all their tokens, one read of
    the weights, and attention part by part, each over its own rows' keys with its own mask. ``rope`` and
    ``attend`` are the fused layers' (``TargetModel.run_parts``)."""
    meta: BlockMeta
    cos: torch.Tensor             # [B, T, D]
    sin: torch.Tensor
    rope: object = None           # fused.RopeTables of cos and sin
    attend: object = None         # attend(q [B, H, T, D], layer) -> [B, H, T, D]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.meta.write_pos.shape)


def decoder_layer(layer, hidden: torch.Tensor, parts: list[Part], cache: KVCache, layer_idx: int) -> torch.Tensor:
    """One pre-norm decoder layer (Llama/Mistral/Qwen2/Qwen3 modules) with our cache and mask, on ``hidden [M, d]``
    (the parts' tokens one after another) or, for one part, ``[B, T, d]``.

    ``hidden`` may be fp32 while the weights are bf16/fp16 (fp32 activations): the residual stream, the norms and
    the attention then run in fp32 and only the projections' inputs are cast to the cache's dtype.
    """
    hidden = hidden + attention(layer.self_attn, layer.input_layernorm(hidden), parts, cache, layer_idx)
    return hidden + mlp(layer, hidden, parts[0].meta.invariant)


def rows_of(x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """``[..., D] -> [M, D]`` for a projection (rows padded to the batch-invariant GEMM shape when asked)."""
    return pad_rows(x) if invariant else x.reshape(-1, x.shape[-1])


def mlp(layer, hidden: torch.Tensor, invariant: bool) -> torch.Tensor:
    """The layer's MLP on its post-attention norm of ``hidden [..., d]``."""
    norm = layer.post_attention_layernorm
    x = rows_of(norm(hidden).to(norm.weight.dtype), invariant)   # the projections run in the model dtype
    M = hidden.numel() // hidden.shape[-1]
    return layer.mlp(x)[:M].view(*hidden.shape[:-1], -1)


def attention(attn, x: torch.Tensor, parts: list[Part], cache: KVCache, layer_idx: int) -> torch.Tensor:
    """Self-attention of the normed tokens ``x [..., in]`` (the parts' tokens in order) over each part's cached
    prefix plus its block (K/V written to the cache first); returns the o_proj output ``[..., d]`` in ``x``'s
    dtype. The projections run once over every part's tokens."""
    head_dim = attn.head_dim
    dt = cache.k.dtype
    invariant = parts[0].meta.invariant
    M = x.numel() // x.shape[-1]
    xr = rows_of(x.to(dt), invariant)
    q_all, k_all, v_all = attn.q_proj(xr)[:M], attn.k_proj(xr)[:M], attn.v_proj(xr)[:M]
    outs, start = [], 0
    for part in parts:
        B, T = part.shape
        meta, rows = part.meta, slice(start, start + B * T)
        start += B * T
        q = q_all[rows].view(B, T, -1, head_dim)
        k = k_all[rows].view(B, T, -1, head_dim)
        v = v_all[rows].view(B, T, -1, head_dim).transpose(1, 2)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rotary(q.transpose(1, 2), k.transpose(1, 2), part.cos, part.sin)
        cache.write(layer_idx, meta.slot_index, meta.write_pos, k, v)
        keys, values = cache.read(layer_idx, meta.slots, meta.kv_len)
        if meta.invariant:  # fp32 activations on CPU: attention whose rows do not depend on the block's shape
            out = invariant_attention(q, keys, values, meta.key_mask, attn.scaling)
        else:
            if x.dtype != dt:  # fp32 activations: bf16 SDPA rounds a 1-row and an 8-row block differently
                q, keys, values = q.float(), keys.float(), values.float()
            out = masked_sdpa(q, keys, values, meta, attn.scaling)
        outs.append(out.to(dt).transpose(1, 2).reshape(B * T, -1))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return attn.o_proj(rows_of(out, invariant))[:M].view(*x.shape[:-1], -1).to(x.dtype)


def masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: BlockMeta, scale: float) -> torch.Tensor:
    """SDPA with the forward's boolean mask, grouped-query heads folded into the query rows where it pays.

    ``q [B, H, T, D]`` over ``k, v [B, Hkv, L, D]``: the ``H / Hkv`` query heads that share a kv head become
    ``H / Hkv * T`` rows of one head, so the kernel sees plain multi-head attention with an explicit mask: the form
    CUDA's memory-efficient kernel accepts (its flash kernel takes no mask, and ``enable_gqa`` is served by flash
    or the slow math path only). On CPU the fold pays for tree blocks of several sequences and costs for one
    sequence or one row, so the CPU folds only the former (``with_attention_mask`` decides, once per forward).
    """
    if meta.attn_mask is None:
        meta = with_attention_mask(meta, q.shape[1], k.shape[1])
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    if meta.fold == 1:   # a branch, not the comparison itself: under torch.compile's dynamic shapes it is symbolic
        gqa = True if Hkv != H else False   # noqa: SIM210
        return F.scaled_dot_product_attention(q, k, v, attn_mask=meta.attn_mask, scale=scale, enable_gqa=gqa)
    out = F.scaled_dot_product_attention(q.reshape(B, Hkv, meta.fold * T, D), k, v, attn_mask=meta.attn_mask,
                                         scale=scale)
    return out.reshape(B, H, T, D)  # CUDA kernels may return it strided


GEMM_ROWS = 4


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """``[..., D] -> [M, D]`` with ``M`` rounded up to a multiple of :data:`GEMM_ROWS` (zero rows).

    oneDNN's low-precision GEMM computes a row in a 1-3 row product, or the odd row left over after blocks of
    rows, along another path than rows inside a block of 4, and rounds a few outputs differently (measured: 3 of
    1536 gate/up outputs). With a multiple of 4 rows, a row's result depends on nothing but the row (checked up to
    512 rows, 1 and 2 threads), so a projection computes a token the same way in plain decoding and in a verify.
    """
    x = x.reshape(-1, x.shape[-1])
    extra = -x.shape[0] % GEMM_ROWS
    return torch.cat([x, x.new_zeros(extra, x.shape[1])]) if extra else x


KV_CHUNK = 256


def invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """fp32 attention in which a query row's result depends only on its own keys, not on the block around it.

    SDPA's CPU kernel (and a plain ``softmax(q k^T) v``) sums over a key length and a row count that differ
    between a 1-token decode and a tree verify, so the same token gets last-bit different outputs, which the
    bf16 projections then round apart. Here query rows are padded to a multiple of 4 (one GEMM path), keys are
    padded with masked columns to a multiple of ``KV_CHUNK``, and ``p v`` is summed per fixed chunk: masked columns
    add exact zeros, so extra key columns and extra rows change nothing: a token decoded alone and the same token
    inside a
    causal block (prefill, a chain) get bit-identical outputs (tests/test_engine.py). In a tree, a node's
    ancestors sit at other block columns than the positions they take once accepted, so the sum over a chunk
    can still round differently in the last bit. ``q [B, H, T, D]``, ``k, v [B, Hkv, L, D]``, ``mask [B, 1, T, L]``.
    """
    B, H, T, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    rep, Tp = H // Hkv, -(-T // GEMM_ROWS) * GEMM_ROWS
    n = -(-L // KV_CHUNK)
    Lp = n * KV_CHUNK
    q = q.float()
    if Tp > T:
        q = F.pad(q, (0, 0, 0, Tp - T))
        mask = torch.cat([mask, mask[:, :, :1].expand(B, 1, Tp - T, L)], 2)
    kf = q.new_zeros(B, Hkv, Lp, D)                  # keys and values cast to fp32 and padded in one copy each
    vf = q.new_zeros(B, Hkv, Lp, D)                  # (at batch 64 the copies are much of the layer time)
    kf[:, :, :L], vf[:, :, :L] = k, v
    mask = F.pad(mask, (0, Lp - L)).unsqueeze(2)                              # [B, 1, 1, Tp, Lp]
    q = q.reshape(B, Hkv, rep * Tp, D)                                        # query heads grouped by kv head
    scores = (q @ kf.transpose(-1, -2)).mul_(scale).view(B, Hkv, rep, Tp, Lp).masked_fill_(~mask, float("-inf"))
    p = torch.softmax(scores.view(B, Hkv, rep * Tp, Lp), -1)
    out = (p.view(B, Hkv, rep * Tp, n, KV_CHUNK).transpose(2, 3) @ vf.view(B, Hkv, n, KV_CHUNK, D)).sum(2)
    return out.view(B, H, Tp, D)[:, :, :T]
