"""Masked attention on CPU: grouped-query heads folded into query rows against SDPA's ``enable_gqa``.

The fold is what lets CUDA's memory-efficient kernel take a tree mask; this checks what it costs on the CPU, at the
embedded target's head layout (9 query heads over 3 kv heads, head dim 64), fp32, for one-row decode and 8-token
tree blocks at batch 1, 8 and 32. Median of 200 calls each, alternating the two forms.

    .venv/bin/python bench/sdpa_fold.py --out bench/results/<hardware>/sdpa_fold.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    import torch
    import torch.nn.functional as F

    from eagle_ray.model.device import cpu_model
    torch.set_num_threads(a.threads)

    def fold(q, k, v, mask):
        B, H, T, D = q.shape
        Hkv, L = k.shape[1], k.shape[2]
        rep = H // Hkv
        m = mask.unsqueeze(2).expand(B, 1, rep, T, L).reshape(B, 1, rep * T, L)
        return F.scaled_dot_product_attention(q.reshape(B, Hkv, rep * T, D), k, v, attn_mask=m).view(B, H, T, D)

    def gqa(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    rows = []
    for B, T, L in [(1, 1, 512), (1, 8, 512), (8, 1, 1024), (8, 8, 1024), (32, 8, 1024)]:
        g = torch.Generator().manual_seed(B * 100 + T)
        q, k, v = torch.randn(B, 9, T, 64, generator=g), torch.randn(B, 3, L, 64, generator=g), \
            torch.randn(B, 3, L, 64, generator=g)
        mask = torch.rand(B, 1, T, L, generator=g) > 0.1
        times = {"enable_gqa": [], "folded": []}
        for _ in range(a.calls):
            for name, fn in (("enable_gqa", gqa), ("folded", fold)):
                t0 = time.perf_counter()
                fn(q, k, v, mask)
                times[name].append(time.perf_counter() - t0)
        med = {n: 1e6 * statistics.median(t) for n, t in times.items()}
        rows.append({"batch": B, "block": T, "keys": L, "enable_gqa_us": med["enable_gqa"], "folded_us": med["folded"],
                     "max_abs_diff": float((fold(q, k, v, mask) - gqa(q, k, v, mask)).abs().max())})
        print(rows[-1], flush=True)
    out = {"cpu": cpu_model(), "threads": a.threads, "torch": torch.__version__,
           "command": "bench/sdpa_fold.py " + " ".join(sys.argv[1:]), "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
