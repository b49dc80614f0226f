"""The attention of a head unrolled on its own outputs in training (the training-time test): both head kinds run
tree levels this way at inference, so both train this way."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


def unrolled_attention(attn, x: torch.Tensor, s: int, keys: list, values: list, cos, sin) -> torch.Tensor:
    """Attention of unrolled step ``s`` (``trainer.head_forward_unrolled``, ``eagle3.unrolled``) for ``x`` [B, T, in], appending this
    step's keys and values: step 0 is causal over true-feature keys; step ``s`` sees those keys up to ``i-s`` and
    the keys of its own chain at ``i-s+1 .. i``. Returns the attention output after ``o_proj``."""
    B, T = x.shape[:2]
    hd = attn.head_dim
    q = attn.q_proj(x).view(B, T, -1, hd).transpose(1, 2)
    k = attn.k_proj(x).view(B, T, -1, hd).transpose(1, 2)
    v = attn.v_proj(x).view(B, T, -1, hd).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    keys.append(k)
    values.append(v)
    gqa = True if k.shape[1] != q.shape[1] else False   # noqa: SIM210 - see attention.masked_sdpa
    if s == 0:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling, enable_gqa=gqa)
    else:
        idx = torch.arange(T, device=x.device)
        mask = torch.cat([idx.view(-1, 1) - s >= idx.view(1, -1)]
                         + [idx.view(-1, 1) - (s - r) == idx.view(1, -1) for r in range(1, s + 1)], dim=1)
        out = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask,
                                             scale=attn.scaling, enable_gqa=gqa)
    return attn.o_proj(out.transpose(1, 2).reshape(B, T, -1))
