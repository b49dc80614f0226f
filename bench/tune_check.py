"""Is the auto-tuned tree as good as the best of a grid?

Runs the tuner (no cache), then measures, in the same process and interleaved, greedy throughput at batch 1 and at
batch 8 for a grid of tree shapes, the tuner's choice and the reference's default (60 tokens, depth 5, top_k 10).

    .venv/bin/python bench/tune_check.py --out bench/results/tune_check.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from eagle_ray.config import SamplingParams, TreeConfig
from eagle_ray.engine.engine import EagleEngine
from eagle_ray.prompts import benchmark_path, first_turn_prompt, read_jsonl
from eagle_ray.engine.tuning import autotune

GRID = [(2, 0, 1), (3, 0, 2), (4, 0, 3), (4, 1, 2), (6, 1, 3), (8, 2, 3), (8, 1, 4), (12, 2, 4), (16, 3, 4),
        (24, 4, 6), (32, 5, 8)]
REFERENCE = (60, 5, 10)


def prompts(n: int, offset: int) -> list:
    mt, he = read_jsonl(benchmark_path("mt_bench")), read_jsonl(benchmark_path("humaneval"))
    return [first_turn_prompt((mt if i % 2 == 0 else he)[offset + i // 2]) for i in range(n)]


def throughput(engine, tree: TreeConfig, batch: int, ps: list, max_new: int) -> dict:
    engine.set_trees(tree)
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    t0 = time.perf_counter()
    if batch == 1:
        outs = [o for p in ps for o in engine.generate([p], params)]
    else:
        outs = engine.generate(ps, params)
    wall = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    return {"tok_s": n / wall, "tau": sum(o.stats.tau for o in outs) / len(outs), "tokens": n, "wall_s": wall}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--batch1-prompts", type=int, default=4)
    p.add_argument("--batch8-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    engine = EagleEngine.from_pretrained(dtype=a.dtype, max_batch_size=8, threads=a.threads)
    t0 = time.perf_counter()
    tuning = autotune(engine, batch_sizes=[1, 8], use_cache=False)
    tune_s = time.perf_counter() - t0
    chosen = {b: c.tree for b, c in tuning.batches.items()}
    print("tuned in", round(tune_s), "s:", {b: (t["total_tokens"], t["depth"], t["top_k"]) for b, t in chosen.items()})
    engine.generate(prompts(1, 30), SamplingParams(max_new_tokens=8))  # warm-up
    results = {}
    for batch, n in ((1, a.batch1_prompts), (8, a.batch8_prompts)):
        ps = prompts(n, 40)  # prompts the tuner did not trace
        shapes = {"auto": tuple(chosen[batch][k] for k in ("total_tokens", "depth", "top_k")),
                  "reference": REFERENCE, **{f"grid{s}": s for s in GRID}}
        rows = {}
        plain_t0 = time.perf_counter()
        outs = engine.generate(ps, SamplingParams(max_new_tokens=a.max_new_tokens, ignore_eos=True),
                               speculative=False) if batch > 1 else \
            [o for q in ps for o in engine.generate([q], SamplingParams(max_new_tokens=a.max_new_tokens,
                                                                        ignore_eos=True), speculative=False)]
        rows["plain"] = {"tok_s": sum(len(o.token_ids) for o in outs) / (time.perf_counter() - plain_t0)}
        for name, (t, d, k) in shapes.items():
            rows[name] = throughput(engine, TreeConfig(total_tokens=t, depth=d, top_k=k), batch, ps, a.max_new_tokens)
            rows[name]["shape"] = [t, d, k]
            print(batch, name, rows[name])
        grid_best = max((r for n_, r in rows.items() if n_.startswith("grid")), key=lambda r: r["tok_s"])
        results[batch] = {"rows": rows, "auto_vs_grid_best": rows["auto"]["tok_s"] / grid_best["tok_s"],
                          "grid_best_shape": grid_best["shape"],
                          "auto_vs_reference": rows["auto"]["tok_s"] / rows["reference"]["tok_s"],
                          "auto_vs_plain": rows["auto"]["tok_s"] / rows["plain"]["tok_s"]}
        print(batch, {k: v for k, v in results[batch].items() if k != "rows"})
    out = {"tuning": tuning.to_dict(), "tune_s": tune_s, "threads": torch.get_num_threads(),
           "dtype": str(engine.target.dtype), "results": results}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
