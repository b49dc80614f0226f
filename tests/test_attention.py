"""Attention kernels' contract: the same result whatever memory layout the device's SDPA kernel returns."""
import torch
import torch.nn.functional as F

from eagle_ray.model import attention
from eagle_ray.model.attention import BlockMeta, masked_sdpa


def test_folded_grouped_query_attention_accepts_a_kernel_output_in_any_layout(monkeypatch):
    """Grouped-query heads are folded into the query rows for the kernel, then unfolded. CUDA's memory-efficient
    kernel returns that output with strides a plain view cannot unfold (a view fails there on an H200); the
    result must equal unfolded grouped-query attention whatever layout the kernel returns."""
    torch.manual_seed(0)
    B, H, Hkv, T, L, D = 2, 6, 2, 3, 5, 4
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, Hkv, L, D), torch.randn(B, Hkv, L, D)
    mask = torch.rand(B, 1, T, L) > 0.3
    mask[..., 0] = True
    rep = H // Hkv
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                              attn_mask=mask, scale=0.5)
    kernel = F.scaled_dot_product_attention

    def rows_major(*args, **kwargs):  # the same values stored [B, rows, heads, D], as the CUDA kernel leaves them
        return kernel(*args, **kwargs).transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", rows_major)
    meta = BlockMeta(slice(0, B), None, None, mask, L, torch.zeros(B, dtype=torch.long))
    torch.testing.assert_close(masked_sdpa(q, k, v, meta, 0.5), expected)
