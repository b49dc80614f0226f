"""Batching: greedy output at max batch 1/4/8/16 must equal batch-1 output token for token, and throughput per
max batch size for EAGLE-2 and plain batched decoding on the same runtime, all in one run -> JSON. With
``--tree-policy auto`` each row also carries the tuner's predicted tokens/s (its choice, plain included, and plain
decoding), and ``--plot`` draws measured and predicted curves. Sizes run largest first, so the tuner measures
every size once and the smaller engines read that result from its cache. ``--compare-cap`` also runs, wherever
the tuner chose a verify cap, the same trees without it (the cap's measured worth). ``--repeats 2`` times each
mode twice per size in the order A B B A after warming both, so the first run of an engine does not pay the
warm-up alone and a drift over the run cancels. ``--compare-lookup 0 5`` also runs the tuner's trees with every
prompt-lookup chain set to 0 and to 5 tokens (the tuner's own choice is per batch size).

    .venv/bin/python bench/batch_sweep.py --dtype float32 --num-prompts 64 --max-new-tokens 96 \
        --batch-sizes 1 4 8 16 --out bench/results/batch_lossless_fp32.json
    .venv/bin/python bench/batch_sweep.py --dtype auto --num-prompts 64 --max-new-tokens 128 --plain \
        --tree-policy auto --batch-sizes 1 2 4 8 16 32 64 --repeats 2 --out bench/results/<hardware>/plain_curve.json \
        --plot
"""
import argparse
import json
import resource
import statistics
import time
from pathlib import Path

from eagle_ray.cli import add_precision_args, precision_kwargs
from eagle_ray.config import EngineConfig, SamplingParams
from eagle_ray.engine.chooser import SpeculationChooser
from eagle_ray.engine.engine import EagleEngine
from eagle_ray.model.device import cpu_model
from eagle_ray.prompts import first_turn_prompt, read_jsonl


def mixed_prompts(n: int) -> list:
    """Half MT-bench, half HumanEval first turns, interleaved: prompt lengths from ~10 to ~400 tokens."""
    mt = read_jsonl("eagle_ray/assets/benchmarks/mt_bench.jsonl")
    he = read_jsonl("eagle_ray/assets/benchmarks/humaneval.jsonl")
    out = []
    for i in range(n):
        src = mt if i % 2 == 0 else he
        out.append(first_turn_prompt(src[(i // 2) % len(src)]))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--plain", action="store_true", help="also run plain batched decoding at each size")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--draft", default=None, help="EAGLE head dir (default: the embedded head)")
    p.add_argument("--tree-policy", default="fixed", choices=["fixed", "auto"],
                   help="auto: the tree the engine tunes for this device per batch size (what the job and Serve use)")
    add_precision_args(p)
    p.add_argument("--out", default=None)
    p.add_argument("--plot", action="store_true", help="also write <out>.png: tokens/s against max batch")
    p.add_argument("--compare-cap", action="store_true", help="where the tuner chose a verify cap, also run without")
    p.add_argument("--compare-lookup", type=int, nargs="*", default=[],
                   help="also run the tuner's trees with their prompt lookup set to each of these")
    p.add_argument("--plain-first", action="store_true", help="run plain before EAGLE at each size (a second run in "
                   "this order shows how much the first run's warm-up costs it)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs of each mode per size, the order reversed every "
                   "other repeat (A B B A ...), after one short warm-up run of each mode; rows carry their repeat "
                   "and `summary` the medians")
    a = p.parse_args()
    prompts = mixed_prompts(a.num_prompts)
    params = SamplingParams(max_new_tokens=a.max_new_tokens)
    runs = []
    for bs in sorted(a.batch_sizes, reverse=True):
        engine = EagleEngine.from_config(EngineConfig(draft=a.draft, dtype=a.dtype, max_batch_size=bs,
                                                      threads=a.threads, tree_policy=a.tree_policy,
                                                      **precision_kwargs(a)))
        modes = [("spec", True)] + ([("plain", False)] if a.plain else [])
        for _, speculative in modes:   # shapes of this batch size warmed in every mode before any timing
            engine.generate(prompts[:min(bs, 8)], SamplingParams(max_new_tokens=16 if a.repeats > 1 else 4),
                            speculative=speculative)
        if a.compare_cap and engine.verify_budget_for(bs):
            modes.insert(1, ("spec_uncapped", True))
        for n in a.compare_lookup:
            modes.insert(1, (f"spec_lookup{n}", True))
        trees = engine.config.speculation.trees_by_batch
        if a.plain_first:
            modes.reverse()
        caps = engine.config.speculation.verify_budget_by_batch
        order = [(rep, m) for rep in range(a.repeats) for m in (modes if rep % 2 == 0 else modes[::-1])]
        for rep, (mode, speculative) in order:
            engine.config = engine.config.replace(verify_budget_by_batch=None if mode == "spec_uncapped" else caps)
            if trees:
                n = int(mode.removeprefix("spec_lookup")) if mode.startswith("spec_lookup") else None
                engine.set_trees(trees_by_batch={b: t if n is None or t.total_tokens == 1 else
                                                 t.model_copy(update={"lookup": n}) for b, t in trees.items()})
                if engine.chooser is not None and engine.tuning is not None:   # each mode starts where the
                    engine.chooser = SpeculationChooser.for_trees(engine.tuning.trees_by_batch())  # engine does
            for k in engine.counters:
                engine.counters[k] = 0
            t0 = time.perf_counter()
            outs = engine.generate(prompts, params, speculative=speculative)
            wall = time.perf_counter() - t0
            ids = [o.token_ids for o in outs]
            c = engine.counters
            row = {"max_batch": bs, "speculative": speculative, "mode": mode, "repeat": rep, "wall_s": wall,
                   "tokens": sum(map(len, ids)), "tok_s": sum(map(len, ids)) / wall,
                   "trees": engine.tree_summary() if speculative else None,
                   "tau": sum(o.stats.step_tokens for o in outs) / max(sum(o.stats.verify_steps for o in outs), 1),
                   "mean_verify_batch": c["decode_sequences"] / max(c["decode_passes"], 1),
                   "mean_verify_width": c["verify_tokens"] / max(c["decode_sequences"], 1),
                   "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                   "kv_cache_mib": engine.target.cache.nbytes() / 2**20, "_ids": ids}
            if engine.tuning is not None:
                choice = engine.tuning.batches[max(b for b in engine.tuning.batches if b <= bs)]
                row["predicted_tok_s"] = {"spec": choice.expected_tok_s, "plain": choice.plain_tok_s}.get(mode)
                row["max_verify_tokens"] = engine.verify_budget_for(bs) if speculative else None
                if mode == "spec":
                    row["best_cap"], row["best_cap_predicted_tok_s"] = choice.best_cap, choice.best_cap_tok_s
            print(json.dumps({k: v for k, v in row.items() if k != "_ids"}), flush=True)
            runs.append(row)
        del engine
    runs.sort(key=lambda r: (r["max_batch"], r["mode"] != "spec", r["mode"]))
    reference = next(r["_ids"] for r in runs if r["mode"] == "spec")   # the smallest batch's speculative output
    for r in runs:
        ids = r.pop("_ids")
        r["differs_from_batch1_spec"] = [i for i, x in enumerate(ids) if x != reference[i]]
    summary = []
    for bs in sorted({r["max_batch"] for r in runs}):
        med = {m: statistics.median(r["tok_s"] for r in runs if r["max_batch"] == bs and r["mode"] == m)
               for m in dict.fromkeys(r["mode"] for r in runs if r["max_batch"] == bs)}
        row = {"max_batch": bs, "median_tok_s": med}
        if "plain" in med and "spec" in med:
            row["spec_over_plain"] = med["spec"] / med["plain"]
        summary.append(row)
    result = {"dtype": a.dtype, "cpu": cpu_model(), **precision_kwargs(a), "prompts": a.num_prompts,
              "max_new_tokens": a.max_new_tokens, "plain_first": a.plain_first, "repeats": a.repeats,
              "summary": summary, "runs": runs}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
        if a.plot:
            plot(runs, Path(a.out).with_suffix(".png"))


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, label in (("spec", "EAGLE (tuned)"), ("plain", "plain")):
        rs = [r for r in runs if r.get("mode", "spec" if r["speculative"] else "plain") == mode]
        if not rs:
            continue
        sizes = sorted({r["max_batch"] for r in rs})
        by_size = [[r for r in rs if r["max_batch"] == b] for b in sizes]
        line, = ax.plot(sizes, [statistics.median(r["tok_s"] for r in g) for g in by_size], "o-",
                        label=f"{label}, measured")
        if all("predicted_tok_s" in r for r in rs):
            ax.plot(sizes, [g[0]["predicted_tok_s"] for g in by_size], "x--", color=line.get_color(),
                    label=f"{label}, predicted")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max batch")
    ax.set_ylabel("tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
