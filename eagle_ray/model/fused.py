"""A decoder layer in few kernels, for devices where a kernel launch costs more than the work in it (CUDA).

transformers' layer modules launch about 44 kernels a layer in a verify pass (separate q, k, v and gate, up GEMMs,
norms of eight ops each, RoPE of ten, a mask copy, residual adds); at ~15 us a launch an 8B verify pass then takes
several times the time its weights take to read. Here the same layer runs as:

    rms_norm -> qkv GEMM -> RoPE (keys in place) -> one K/V scatter -> attention -> o GEMM + residual
    -> rms_norm -> gate_up GEMM -> silu * up -> down GEMM + residual

q/k/v and gate/up are one GEMM each (their weights merged at load, the modules' weights becoming views of the merged
ones, so memory does not grow), the norms are one fused kernel each, RoPE and SwiGLU one operation each
(``model/kernels.py``), the keys and values stored by one scatter (rotated in place, they lie side by side in the
merged projection), the residual adds ride in the output GEMMs (``addmm``), and RoPE's cos/sin tables
(``RopeTables``) are made once per forward. ``tests/test_fused.py`` counts the operations of a layer (at most 12)
and checks fp32 tokens against the modules' path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eagle_ray.model import kernels


@dataclass
class FusedLayer:
    """One decoder layer's weights in the merged form (views shared with the transformers modules)."""
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    qkv: torch.Tensor                 # [(H + 2 Hkv) D, d]
    qkv_bias: torch.Tensor | None     # Qwen2
    o: torch.Tensor                   # [d, H D]
    gate_up: torch.Tensor             # [2 I, d]
    down: torch.Tensor                # [d, I]
    q_norm: torch.Tensor | None       # Qwen3: per-head norms of q and k before RoPE
    k_norm: torch.Tensor | None
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    row_sum: object = None            # a shard's hook summing o and down products over ranks (tensor_parallel.RowSum)


def merge(modules: list[nn.Linear], bias: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for ``modules`` stacked by output rows; each module's weight becomes a view of it."""
    weight = torch.cat([m.weight.detach() for m in modules])
    b = torch.cat([m.bias.detach() for m in modules]) if bias else None
    start = 0
    for m in modules:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(weight[start:start + n], requires_grad=False)
        if bias:
            m.bias = nn.Parameter(b[start:start + n], requires_grad=False)
        start += n
    return weight, b


def fuse_layer(layer, row_sum=None) -> FusedLayer:
    """The merged form of a transformers decoder layer (Llama, Mistral, Qwen2, Qwen3 modules); with ``row_sum``, of
    one shard of it, whose o and down products that hook sums."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv, qkv_bias = merge([attn.q_proj, attn.k_proj, attn.v_proj], bias=attn.q_proj.bias is not None)
    gate_up, _ = merge([mlp.gate_proj, mlp.up_proj])
    head_dim = attn.head_dim
    norm = layer.input_layernorm
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    return FusedLayer(norm.weight, layer.post_attention_layernorm.weight, norm.variance_epsilon, qkv, qkv_bias,
                      attn.o_proj.weight, gate_up, mlp.down_proj.weight,
                      None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight,
                      attn.q_proj.weight.shape[0] // head_dim, attn.k_proj.weight.shape[0] // head_dim, head_dim,
                      attn.scaling, row_sum)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """One fused kernel where torch has one (``_fused_rms_norm``), else the functional form."""
    fused = getattr(torch.ops.aten, "_fused_rms_norm", None)
    if fused is not None:
        return fused(x, [x.shape[-1]], weight, eps)[0]
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


@dataclass
class RopeTables:
    """cos and sign-folded sin of every row's position, made once per forward: RoPE is then
    ``x * cos + swap_halves(x) * sin_signed`` (``rotate_half``'s negation folded into the table)."""
    cos: torch.Tensor          # [B, T, 1, D]
    sin_signed: torch.Tensor   # [B, T, 1, D]

    @classmethod
    def of(cls, cos: torch.Tensor, sin: torch.Tensor) -> "RopeTables":
        D = cos.shape[-1]
        sign = torch.ones(D, dtype=sin.dtype, device=sin.device)
        sign[: D // 2] = -1
        return cls(cos.unsqueeze(2), (sin * sign).unsqueeze(2))


def fused_decoder_layer(L: FusedLayer, hidden: torch.Tensor, parts, cache, layer_idx: int) -> torch.Tensor:
    """The layer on ``hidden [M, d]``, the tokens of ``parts`` (``attention.Part``) one after another: each GEMM
    runs once over all of them; RoPE, the K/V store and attention run part by part (``part.attend(q [B, H, T, D],
    layer_idx)``: SDPA with the forward's mask, or flex; ``TargetModel.attention_of``)."""
    M, d = hidden.shape
    H, Hkv, D = L.heads, L.kv_heads, L.head_dim
    qkv_all = F.linear(rms_norm(hidden, L.input_norm, L.eps), L.qkv, L.qkv_bias).view(M, H + 2 * Hkv, D)
    if L.q_norm is not None:   # Qwen3: each head's q and k normed before RoPE
        qkv_all = torch.cat([rms_norm(qkv_all[:, :H], L.q_norm, L.eps), rms_norm(qkv_all[:, H:H + Hkv], L.k_norm,
                             L.eps), qkv_all[:, H + Hkv:]], 1)
    outs, start = [], 0
    for part in parts:
        B, T = part.shape
        qkv = qkv_all[start:start + B * T].view(B, T, H + 2 * Hkv, D)
        start += B * T
        q = kernels.rotary(qkv, part.rope.cos, part.rope.sin_signed, H, Hkv)    # keys rotated in place
        cache.write_kv(layer_idx, part.meta.slot_index, part.meta.write_pos, qkv[:, :, H:])
        outs.append(part.attend(q, layer_idx).transpose(1, 2).reshape(B * T, H * D))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    flat = output(L, hidden, out, L.o)
    return output(L, flat, kernels.silu_mul(F.linear(rms_norm(flat, L.post_norm, L.eps), L.gate_up)), L.down)


def output(L: FusedLayer, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``residual + x @ weight.T`` in one GEMM; in a shard, the ``row_sum`` hook's (summed over the ranks)."""
    if L.row_sum is None:
        return torch.addmm(residual, x, weight.t())
    return L.row_sum.residual_gemm(residual, x, weight)
