"""What one target forward costs for B sequences x T new tokens each, per dtype and kernel mode.

Speculative decoding pays off when verifying T tokens costs little more than decoding one. This table is the
device's side of that bargain: with ``cost(B, T) / cost(B, 1)`` and a head's acceptance length ``tau`` at T
verify tokens, the best possible speedup of a step is ``tau / (cost(B, T) / cost(B, 1))`` (before draft time).

    python bench/row_cost.py --out bench/results/row_cost.json

``logits`` compares, in the same run and interleaved, three ways to get fp32-decisive logits for N rows of a
bf16 target: the fp32 product (an fp32 copy of the lm_head, the method before exact logits), the bf16
product alone (rounded logits), and ``RefinedLogits`` (bf16 product + exact candidates; the engine's method now).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from eagle_ray.engine.engine import EagleEngine
from eagle_ray.model.device import cpu_model

MODES = {  # name -> (dtype, fp32_activations, batch_invariant)
    "fp32": ("float32", False, False),
    "bf16": ("bfloat16", False, False),
    "bf16-exact": ("bfloat16", True, True),
}


def step_ms(target, B: int, T: int, context: int, reps: int) -> float:
    """Median ms of one forward + fp32 logits over ``T`` causal tokens on top of ``context`` cached ones."""
    slots = list(range(B))
    ids = torch.arange(100, 100 + context).view(1, -1)
    idx = torch.arange(context)
    causal = (idx.view(-1, 1) >= idx.view(1, -1)).unsqueeze(0)
    for s in slots:
        target.cache.reset(s)
        target.forward(ids, [s], idx.view(1, -1), causal)
        target.cache.lengths[s] = context
    tokens = torch.randint(0, 1000, (B, T))
    depth = torch.arange(T).view(1, -1).expand(B, T)
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool)).unsqueeze(0).expand(B, T, T)
    times = []
    for i in range(reps + 2):
        t0 = time.perf_counter()
        target.logits(target.forward(tokens, slots, depth, mask))
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def logits_ms(target, rows: list[int], reps: int) -> list[dict]:
    """Median ms per logits method for ``rows`` post-norm hidden states of the target (interleaved)."""
    from eagle_ray.model.attention import pad_rows
    from eagle_ray.model.logits import RefinedLogits

    w = target.lm_head_weight.detach()
    refined = RefinedLogits(w)
    fp32_t = w.float().t().contiguous()
    methods = {"fp32_gemm": lambda x: (pad_rows(x) @ fp32_t)[: x.shape[0]],
               "bf16_gemm": lambda x: torch.nn.functional.linear(pad_rows(x.to(w.dtype)), w)[: x.shape[0]].float(),
               "refined": refined}
    ctx = max(rows)
    target.cache.reset(0)
    idx = torch.arange(ctx)
    hidden = target.forward(torch.randint(100, 20000, (1, ctx), generator=torch.Generator().manual_seed(0)), [0],
                            idx.view(1, -1), (idx.view(-1, 1) >= idx.view(1, -1)).unsqueeze(0))[0].float()
    out = []
    for n in rows:
        x = hidden[:n]
        times = {k: [] for k in methods}
        for i in range(reps + 1):
            for k, f in methods.items():
                t0 = time.perf_counter()
                f(x)
                if i:
                    times[k].append((time.perf_counter() - t0) * 1e3)
        out.append({"rows": n, "refined_fallback_rows": refined.fallback_rows, **{k + "_ms": round(sorted(v)[len(v) // 2], 2) for k, v in times.items()}})
        print(json.dumps(out[-1]), flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    p.add_argument("--context", type=int, default=300, help="cached tokens per sequence")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--logits-rows", nargs="+", type=int, default=[1, 4, 8, 16, 64],
                   help="rows for the logits comparison (bf16 modes only; empty to skip)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    rows, logits = [], []
    for mode in a.modes:
        dtype, fp32_act, invariant = MODES[mode]
        engine = EagleEngine.from_pretrained(draft="none", dtype=dtype, max_batch_size=max(a.batch_sizes),
                                             threads=a.threads, fp32_activations=fp32_act,
                                             batch_invariant=invariant)
        for B in a.batch_sizes:
            base = None
            for T in a.tokens:
                ms = step_ms(engine.target, B, T, a.context, a.reps)
                base = ms if T == 1 else base
                rows.append({"mode": mode, "batch": B, "tokens": T, "ms": round(ms, 2),
                             "vs_one_token": round(ms / base, 3) if base else None})
                print(json.dumps(rows[-1]), flush=True)
        if mode == "bf16-exact" and a.logits_rows:
            logits = logits_ms(engine.target, a.logits_rows, a.reps)
        del engine
    out = {"threads": torch.get_num_threads(), "cpu": cpu_model(),
           "context": a.context, "rows": rows, "logits": logits}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
