"""The one attention path shared by target and draft: a decoder layer over a block of new tokens on top of a
per-slot KV cache, with an arbitrary mask inside the block (causal for prefill, ancestors for a tree).

We run transformers' own layer modules (norms, projections, MLP, Qwen3's q/k norms, biases) and its rotary
embedding; only the cache and the mask are ours.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from eagle_ray.model.kv_cache import KVCache


@dataclass
class BlockMeta:
    """Where a block of ``T`` new tokens goes for each of ``B`` slots, and what it may see."""
    slots: torch.Tensor | slice   # cache slot per row, or a slice when rows are contiguous slots
    slot_index: torch.Tensor      # [B, 1] slot ids (device) for scatter writes
    write_pos: torch.Tensor       # [B, T] cache positions written (device)
    key_mask: torch.Tensor        # [B, 1, T, kv_len] bool, True = may attend (device)
    kv_len: int


def make_block_meta(cache: KVCache, slots: list[int], block_mask: torch.Tensor, offset: int = 0) -> BlockMeta:
    """Meta for a block whose rows attend to their slot's committed prefix plus ``block_mask [B, T, N]``.

    The block's columns start at ``lengths[slot]``; the new ``T`` tokens are written at columns
    ``[lengths + offset, lengths + offset + T)``, i.e. the last ``T`` of the ``N`` block columns when
    ``offset = N - T`` (the draft's tree levels stack up that way).
    """
    device = cache.k.device
    B, T, N = block_mask.shape
    lengths = cache.lengths[slots]                         # host [B]
    kv_len = int(lengths.max()) + N
    lengths_d = lengths.to(device)
    cols = torch.arange(kv_len, device=device).view(1, -1) - lengths_d.view(-1, 1)  # [B, kv_len] block column
    in_block = (cols >= 0) & (cols < N)
    gathered = block_mask.to(device).gather(2, cols.clamp(0, N - 1).unsqueeze(1).expand(B, T, kv_len))
    key_mask = (cols < 0).unsqueeze(1) | (gathered & in_block.unsqueeze(1))
    write_pos = lengths_d.view(-1, 1) + offset + torch.arange(T, device=device).view(1, -1)
    first = slots[0]
    contiguous = slots == list(range(first, first + B))
    slot_index = torch.tensor(slots, device=device).view(-1, 1)
    return BlockMeta(slice(first, first + B) if contiguous else slot_index.view(-1), slot_index, write_pos,
                     key_mask.unsqueeze(1), kv_len)


def decoder_layer(layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer_idx: int,
                  meta: BlockMeta) -> torch.Tensor:
    """One pre-norm decoder layer (Llama/Mistral/Qwen2/Qwen3 modules) with our cache and mask.

    ``hidden`` may be fp32 while the weights are bf16/fp16 (fp32 activations): the residual stream, the norms and
    the attention then run in fp32 and only the projections' inputs are cast to the cache's dtype.
    """
    attn = layer.self_attn
    B, T, _ = hidden.shape
    head_dim = attn.head_dim
    dt = cache.k.dtype
    x = layer.input_layernorm(hidden).to(dt)
    q = attn.q_proj(x).view(B, T, -1, head_dim)
    k = attn.k_proj(x).view(B, T, -1, head_dim)
    v = attn.v_proj(x).view(B, T, -1, head_dim).transpose(1, 2)
    if getattr(attn, "q_norm", None) is not None:  # Qwen3
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    cache.write(layer_idx, meta.slot_index, meta.write_pos, k, v)
    keys, values = cache.read(layer_idx, meta.slots, meta.kv_len)
    if hidden.dtype != dt:  # fp32 activations: bf16 SDPA rounds a 1-row and an 8-row block differently
        q, keys, values = q.float(), keys.float(), values.float()
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=meta.key_mask, scale=attn.scaling,
                                         enable_gqa=keys.shape[1] != q.shape[1])
    hidden = hidden + attn.o_proj(out.to(dt).transpose(1, 2).reshape(B, T, -1))
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden).to(dt))
