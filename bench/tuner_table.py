"""Why the tuner chose what it chose at a batch size: its estimate for plain decoding, for every tree and for every
verify cap on the best tree, from the cached costs of this machine (tuning again if none) and the same traced
trees the tuner reads (greedy, so the trace is the tuner's own) -> JSON.

    .venv/bin/python bench/tuner_table.py --batch 8 --out bench/results/<hardware>/tuner_table_b8.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from eagle_ray.config import EngineConfig
from eagle_ray.engine.engine import EagleEngine
from eagle_ray.engine.tuning import autotune, choose_trees, collect_trace, trace_prompts
from eagle_ray.model.device import cpu_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-batch-size", type=int, default=64, help="the engine whose tuning is read")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--draft", default=None, help="EAGLE head dir (default: the embedded head)")
    p.add_argument("--top", type=int, default=8, help="trees listed besides plain and the caps")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    engine = EagleEngine.from_config(EngineConfig(dtype=a.dtype, draft=a.draft, max_batch_size=a.max_batch_size,
                                                       threads=2))
    tuning = autotune(engine)                              # the cached result (its costs)
    trace = collect_trace(engine, trace_prompts(4), 48)    # autotune's defaults
    verify = {int(b): {int(n): s for n, s in c.items()} for b, c in tuning.costs["verify"].items()}
    draft = {int(b): c for b, c in tuning.costs["draft"].items()}
    tree = engine.config.speculation.tree
    choices, table = choose_trees(trace, {a.batch: verify[a.batch]}, {a.batch: draft[a.batch]}, tree.lookup,
                                  tree.lookup_ngram)
    rows = sorted(table, key=lambda r: -r["tok_s"])
    trees = [r for r in rows if "max_verify_tokens" not in r and r["total_tokens"] > 1][: a.top]
    result = {"cpu": cpu_model(), "batch": a.batch, "choice": choices[a.batch].__dict__,
              "plain": next(r for r in rows if r["total_tokens"] == 1), "best_trees": trees,
              "caps_on_best_tree": [r for r in table if "max_verify_tokens" in r]}
    print(json.dumps(result, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
