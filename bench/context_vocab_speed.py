"""What context tokens in the draft vocabulary cost and earn at batch 1: tokens/s with ``context_vocab`` 0 and N.

Two engines (same target, head, tree and dtype; only ``context_vocab`` differs) decode the same first turns one
request at a time, timed prompt by prompt in turn, the order flipped every prompt (A B, B A, ...), so a slow
stretch of the machine falls on both. Greedy output is the target's either way; the result counts outputs that
differ (fp32: none expected).

    python bench/context_vocab_speed.py --task mt_bench --num-prompts 20 --max-new-tokens 128 \
        --out bench/results/<hardware>/context_vocab_speed.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

from eagle_ray.config import SamplingParams
from eagle_ray.engine.engine import EagleEngine
from eagle_ray.measure import interleaved
from eagle_ray.model.device import cpu_model
from eagle_ray.prompts import EAGLE_TASKS, first_turn_prompt, load_dataset


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", default=None, help="head directory (default: the embedded head)")
    p.add_argument("--task", default="mt_bench", choices=list(EAGLE_TASKS))
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--context-vocab", type=int, default=256, help="N, compared with 0")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    sizes = (0, a.context_vocab)
    engines = {c: EagleEngine.from_pretrained(draft=a.draft, dtype=a.dtype, max_batch_size=1, threads=a.threads,
                                              context_vocab=c) for c in sizes}
    params = SamplingParams(max_new_tokens=a.max_new_tokens)
    prompts = [first_turn_prompt(r) for r in load_dataset(a.task)[1][:a.num_prompts]]
    for c in sizes:                                     # warm-up: first-call costs fall outside the timing
        engines[c].generate(prompts[:1], SamplingParams(max_new_tokens=8))
    outs, walls = interleaved({c: (lambda i, e=engines[c]: e.generate([prompts[i]], params)[0]) for c in sizes},
                              len(prompts))
    runs = {c: [{"s": s, "tokens": len(o.token_ids), "tau": o.stats.tau, "token_ids": o.token_ids}
                for o, s in zip(outs[c], walls[c])] for c in sizes}
    base, ctx = runs[0], runs[a.context_vocab]
    ratios = [(b["s"] / b["tokens"]) / (x["s"] / x["tokens"]) for b, x in zip(base, ctx)]
    summary = {str(c): {"tokens_per_s": sum(r["tokens"] for r in rs) / sum(r["s"] for r in rs),
                        "tau": statistics.mean(r["tau"] for r in rs)} for c, rs in runs.items()}
    result = {"command": " ".join(["python bench/context_vocab_speed.py", *(sys.argv[1:] if argv is None else argv)]),
              "cpu": cpu_model(), "machine": platform.machine(), "torch": torch.__version__,
              "dtype": str(engines[0].target.dtype), "threads": a.threads, "summary": summary,
              "median_speed_ratio": statistics.median(ratios),
              "prompts_faster_with_context": sum(r > 1 for r in ratios),
              "outputs_differing": sum(b["token_ids"] != x["token_ids"] for b, x in zip(base, ctx)),
              "per_prompt": [{"s_0": b["s"], "s_n": x["s"], "tokens": b["tokens"], "tau_0": b["tau"],
                              "tau_n": x["tau"]} for b, x in zip(base, ctx)]}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    for c, s in summary.items():
        print(f"context_vocab {c:>4}: {s['tokens_per_s']:.1f} tok/s, tau {s['tau']:.3f}")
    print(f"median per-prompt speed ratio (N / 0): {result['median_speed_ratio']:.3f}, "
          f"{result['prompts_faster_with_context']} of {len(ratios)} prompts faster; "
          f"outputs differing: {result['outputs_differing']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
