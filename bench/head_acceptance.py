"""Acceptance of several EAGLE heads on the same prompts and trees, in one run (greedy, fp32 by default).

Each head runs every tree (with each ``--lookup`` length: prompt-lookup tokens grafted onto the tree, 0 = the head's
tree alone) on every task's first turns; a row holds tau (mean over requests of accepted tokens per verify step, as
`eagle-ray measure` reports it) and the pooled ratio (all tokens / all verify steps). Greedy output is the target's
whatever the head and the lookup, so every run should produce the same tokens (fp32: up to near-ties); the result
counts the outputs that differ from the first run's.

    python bench/head_acceptance.py --heads embedded runs/head/head --tasks mt_bench humaneval --num-prompts 20 \
        --max-new-tokens 256 --out bench/results/<hardware>/head_acceptance.json
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from eagle_ray.config import SamplingParams, TreeConfig
from eagle_ray.engine.engine import EagleEngine
from eagle_ray.model.device import cpu_model
from eagle_ray.prompts import EAGLE_TASKS, first_turn_prompt, load_dataset

TREES = {"default": TreeConfig(), "60": TreeConfig(total_tokens=60, depth=5, top_k=10)}


def tree_of(name: str) -> TreeConfig:
    """A named tree, or ``total/depth/top_k`` (``12/3/4``) for any other dynamic tree."""
    if name in TREES:
        return TREES[name]
    try:
        return TreeConfig.from_spec(name)
    except ValueError:
        raise argparse.ArgumentTypeError(f"tree {name!r}: a name in {list(TREES)} or total/depth/top_k") from None


def tree_name(name: str) -> str:
    """argparse type: a name ``tree_of`` reads (rows keep the name)."""
    tree_of(name)
    return name


def run(head: str, tree: str, context_vocab: int, lookup: int, tasks: dict, a) -> list[dict]:
    engine = EagleEngine.from_pretrained(draft=None if head == "embedded" else head, dtype=a.dtype,
                                         max_batch_size=a.batch_size, threads=a.threads,
                                         tree=tree_of(tree).model_copy(update={"lookup": lookup}),
                                         context_vocab=context_vocab)
    rows = []
    for task, records in tasks.items():
        prompts = [first_turn_prompt(r) for r in records]
        t0 = time.perf_counter()
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=a.max_new_tokens))
        tokens = sum(len(o.token_ids) for o in outs)
        steps = sum(o.stats.verify_steps for o in outs)
        rows.append({"head": head, "tree": tree, "context_vocab": context_vocab, "lookup": lookup, "task": task,
                     "prompts": len(outs),
                     "tokens": tokens, "tau": sum(o.stats.tau for o in outs) / len(outs),
                     "tau_pooled": tokens / max(steps, 1),
                     "wall_s": time.perf_counter() - t0, "token_ids": [o.token_ids for o in outs]})
        print(f"{head} tree {tree} context {context_vocab} lookup {lookup} {task}: tau {rows[-1]['tau']:.3f} "
              f"(pooled {rows[-1]['tau_pooled']:.3f})", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", nargs="+", required=True, help="head directories ('embedded' = the shipped head)")
    p.add_argument("--trees", nargs="+", type=tree_name, default=list(TREES),
                   help="names in TREES or total/depth/top_k")
    p.add_argument("--tasks", nargs="+", default=["mt_bench", "humaneval"], choices=list(EAGLE_TASKS))
    p.add_argument("--context-vocab", nargs="+", type=int, default=[256],
                   help="context tokens a sequence adds to its draft vocabulary (0: the map alone); one run each")
    p.add_argument("--lookup", nargs="+", type=int, default=[TreeConfig().lookup],
                   help="prompt-lookup tokens grafted onto each tree (0: the head's tree alone); one run each")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    tasks = {t: load_dataset(t)[1][:a.num_prompts] for t in a.tasks}
    rows = [r for head in a.heads for tree in a.trees for c in a.context_vocab for lk in a.lookup
            for r in run(head, tree, c, lk, tasks, a)]
    same = {}
    for r in rows:
        same.setdefault((r["tree"], r["task"]), []).append(r.pop("token_ids"))
    differ = {f"{tree}/{task}": sum(o != outs[0] for o in outs[1:]) for (tree, task), outs in same.items()}
    result = {"command": " ".join(["python bench/head_acceptance.py", *(sys.argv[1:] if argv is None else argv)]),
              "cpu": cpu_model(), "machine": platform.machine(), "torch": torch.__version__, "dtype": a.dtype,
              "trees": {k: tree_of(k).model_dump(exclude_none=True) for k in a.trees},
              "outputs_differing_between_runs": differ, "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    for r in rows:
        print(f"{r['head']:>40} {r['tree']:>8} {r['context_vocab']:>5} {r['lookup']:>3} {r['task']:>10} "
              f"tau {r['tau']:.3f}")
    print("outputs differing from the first run (fp32: near-ties at most):", differ)
    return 0


if __name__ == "__main__":
    sys.exit(main())
