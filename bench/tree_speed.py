"""Which draft tree is faster on this machine: tokens/s and tau of two or more trees, side by side in one run.

One engine per tree (same target, head and dtype; only the tree differs). At ``--batch-size 1`` they decode the
same first turns one request at a time, timed prompt by prompt in turn, the order reversed every prompt (A B, B A,
...), so a slow stretch of the machine falls on every tree. At a larger batch size each engine decodes the whole
set at once, in A B B A order over ``--rounds`` rounds. Greedy output is the target's whatever the tree; the
result counts outputs that differ from the first tree's (fp32: none expected; bf16 rounds verify passes of
other shapes otherwise, so some may).

    python bench/tree_speed.py --trees 8/2/3 8/3/3 --task mt_bench --num-prompts 40 --max-new-tokens 128 \
        --out bench/results/<hardware>/tree_speed_b1.json
    python bench/tree_speed.py --trees 8/2/3 8/3/3 --batch-size 8 --num-prompts 32 --out .../tree_speed_b8.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from eagle_ray.config import SamplingParams, TreeConfig
from eagle_ray.engine.engine import EagleEngine
from eagle_ray.measure import interleaved
from eagle_ray.model.device import cpu_model
from eagle_ray.prompts import EAGLE_TASKS, first_turn_prompt, load_dataset


def batch_runs(engines: dict, prompts: list[str], params: SamplingParams, rounds: int):
    """Each engine over the whole set at once, A B B A per round: outputs of the first round, wall seconds of all."""
    outs, walls = {}, {name: [] for name in engines}
    for r in range(rounds):
        for name in engines if r % 2 == 0 else list(engines)[::-1]:
            t0 = time.perf_counter()
            got = engines[name].generate(prompts, params)
            walls[name].append(time.perf_counter() - t0)
            outs.setdefault(name, got)
    return outs, walls


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trees", nargs="+", required=True, help="total/depth/top_k of each tree, the first the baseline")
    p.add_argument("--draft", default=None, help="head directory (default: the embedded head)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--task", default="mt_bench", choices=list(EAGLE_TASKS))
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--lookup", type=int, default=TreeConfig().lookup, help="prompt lookup tokens of every tree")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2, help="--batch-size > 1: whole-set runs per tree")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if len(set(a.trees)) < 2:
        p.error("--trees: give at least two different trees")
    try:
        trees = {name: TreeConfig.from_spec(name, lookup=a.lookup) for name in a.trees}
    except ValueError as e:
        p.error(f"--trees: {e}")
    engines = {name: EagleEngine.from_pretrained(draft=a.draft, dtype=a.dtype, max_batch_size=a.batch_size,
                                                 threads=a.threads, tree=t) for name, t in trees.items()}
    params = SamplingParams(max_new_tokens=a.max_new_tokens)
    prompts = [first_turn_prompt(r) for r in load_dataset(a.task)[1][:a.num_prompts]]
    for e in engines.values():                          # warm-up: first-call costs fall outside the timing
        e.generate(prompts[:1], SamplingParams(max_new_tokens=8))
    if a.batch_size == 1:
        outs, walls = interleaved({n: (lambda i, e=e: e.generate([prompts[i]], params)[0])
                                   for n, e in engines.items()}, len(prompts))
    else:
        outs, walls = batch_runs(engines, prompts, params, a.rounds)
    tokens = {n: sum(len(o.token_ids) for o in outs[n]) for n in engines}
    summary = {n: {"tokens_per_s": tokens[n] * len(walls[n]) / sum(walls[n]) if a.batch_size > 1
                   else tokens[n] / sum(walls[n]),
                   "tau": statistics.mean(o.stats.tau for o in outs[n]), "tokens": tokens[n],
                   "tree": trees[n].model_dump()} for n in engines}
    base = a.trees[0]
    result = {"command": " ".join(["python bench/tree_speed.py", *(sys.argv[1:] if argv is None else argv)]),
              "cpu": cpu_model(), "machine": platform.machine(), "torch": torch.__version__,
              "dtype": str(engines[base].target.dtype), "threads": a.threads, "batch_size": a.batch_size,
              "task": a.task, "prompts": len(prompts), "summary": summary,
              "speed_vs_first": {n: summary[n]["tokens_per_s"] / summary[base]["tokens_per_s"] for n in engines},
              "outputs_differing_from_first": {n: sum(x.token_ids != y.token_ids for x, y in zip(outs[base], outs[n]))
                                               for n in engines}}
    if a.batch_size == 1:
        per_prompt = {n: [(wb / len(ob.token_ids)) / (wn / len(on.token_ids))
                          for wb, ob, wn, on in zip(walls[base], outs[base], walls[n], outs[n])] for n in engines}
        result["median_prompt_speed_vs_first"] = {n: statistics.median(r) for n, r in per_prompt.items()}
        result["prompts_faster_than_first"] = {n: sum(x > 1 for x in r) for n, r in per_prompt.items()}
        result["per_prompt_s"] = {n: walls[n] for n in engines}
    else:
        result["run_s"] = walls
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    for n, s in summary.items():
        print(f"tree {n:>8}: {s['tokens_per_s']:.1f} tok/s, tau {s['tau']:.3f}, "
              f"{result['speed_vs_first'][n]:.3f}x the first tree")
    if a.batch_size == 1:
        print("median per-prompt speed against the first tree:",
              {n: round(r, 3) for n, r in result["median_prompt_speed_vs_first"].items()})
    print("outputs differing from the first tree's:", result["outputs_differing_from_first"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
