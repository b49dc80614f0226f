"""fp32-exact logits where they decide, at the price of a bf16 product.

A bf16 target's logits rounded to bf16 tie often (8 significant bits), and a last-bit difference in a hidden
state then flips a greedy choice. Exact fp32 logits avoid that, but an fp32 ``[rows, hidden] x [hidden, vocab]``
product is the slowest GEMM of a small model on CPUs whose fp32 kernels are poor for a few rows (on some CPUs
slower than all of the model's layers together; docs/benchmarks.md).

``RefinedLogits`` computes the bf16 product (fp32 accumulation), recomputes the ``candidates`` largest entries
of each row exactly in fp32, and proves per row that no other token can beat them: a token's exact logit differs
from its bf16 one by at most

    ||x - bf16(x)|| * max_j ||w_j||   (input rounding, Cauchy-Schwarz)
  + |logit| * 2^-8                    (output rounding, half a bf16 ulp is 2^-9 relative)
  + ||x|| * max_j ||w_j|| * 2^-12     (fp32 accumulation over the hidden size, with a wide margin)

so if the smallest candidate's bf16 logit plus that bound stays below the best exact candidate, the row's argmax
is exact. Rows where the proof fails (0-2% on the embedded pair with 32 candidates) are recomputed in full fp32.
The returned row holds exact values for the candidates and bf16 values elsewhere: greedy choice equals the fp32
argmax, sampling sees every probable token exactly. Every step is per row, so a token's logits do not depend on
what else shares the pass (see ``attention.pad_rows`` for the GEMM).
"""
from __future__ import annotations

import torch

from eagle_ray.model.attention import pad_rows


class RefinedLogits:
    def __init__(self, weight: torch.Tensor, candidates: int = 32, pad: bool = True):
        """``weight``: the lm_head, ``[vocab, hidden]`` in bf16/fp16. ``pad``: pad GEMM rows (batch-invariant)."""
        self.weight = weight.detach().contiguous()               # out-major: oneDNN's fast bf16 layout here
        self.weight_fp32 = self.weight.float()                    # for rows the bound cannot settle
        self.max_norm = float(self.weight_fp32.norm(dim=1).max()) * 1.001
        self.candidates = min(candidates, self.weight.shape[0])
        self.pad = pad
        self.fallback_rows = 0                                    # rows recomputed in full fp32 (diagnostics)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.shape[:-1]
        x = hidden.reshape(-1, hidden.shape[-1]).float()
        n = x.shape[0]
        xl = x.to(self.weight.dtype)
        approx = torch.nn.functional.linear(pad_rows(xl) if self.pad else xl, self.weight)[:n].float()
        top, idx = approx.topk(self.candidates, dim=-1)                                   # [n, C]
        exact = (self.weight[idx].float() * x.unsqueeze(1)).sum(-1)                      # [n, C] fp32
        x_norm = x.norm(dim=-1)
        bound = ((x - xl.float()).norm(dim=-1) * self.max_norm + top[:, -1].abs() * 2.0 ** -8
                 + x_norm * self.max_norm * 2.0 ** -12)
        settled = top[:, -1] + bound < exact.max(dim=-1).values
        out = approx.scatter_(-1, idx, exact)                                            # in place: a fresh tensor
        if not bool(settled.all()):
            bad = (~settled).nonzero().flatten()
            self.fallback_rows += int(bad.numel())
            out[bad] = self._fp32_rows(x[bad])
        return out.view(*rows, -1)

    def _fp32_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Full fp32 rows, 4 at a time (``W @ x^T`` with 4 columns: a row's result does not depend on the
        others, and this is the fast fp32 shape on CPU)."""
        n = x.shape[0]
        xg = pad_rows(x).view(-1, 4, x.shape[1])
        return torch.matmul(self.weight_fp32, xg.transpose(1, 2)).transpose(1, 2).reshape(-1, self.weight.shape[0])[:n]
