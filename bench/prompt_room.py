"""Prompt chunks first or trees first: throughput of a batch job whose prompts arrive while others decode.

The engine gives a step's budget to one token of every decoding sequence, then to prompt chunks, and lets trees
take only what is left (``Scheduler``). The other order (``trees_first``, the engine's earlier policy, rebuilt here
by re-planning each step's chunks) reserved every speculative sequence's tree first. Both against plain batched
decoding, modes interleaved and repeated on one engine per max batch size, the tuner's trees (``tree_policy:
auto``); outputs must be identical across modes.

    .venv/bin/python bench/prompt_room.py --batch-sizes 4 8 --repeats 2 \
        --out bench/results/<hardware>/prompt_room.json
"""
import argparse
import json
import statistics
import time
from pathlib import Path

from batch_sweep import mixed_prompts

from eagle_ray.config import EngineConfig, SamplingParams
from eagle_ray.engine.engine import EagleEngine, tree_budget
from eagle_ray.engine.scheduler import MIN_PREFILL, StepPlan, plan_chunks
from eagle_ray.model.device import cpu_model


def trees_first(engine: EagleEngine):
    """The scheduler's ``schedule`` with the speculative sequences' trees reserved before prompt chunks."""
    sched, schedule = engine.scheduler, engine.scheduler.schedule

    def plan(room, max_len):
        p = schedule(room, max_len)
        n_spec = sum(s.speculative for s in p.decode)
        if not p.prefill or not n_spec:
            return p
        per = tree_budget(engine.tree_for(n_spec))
        cap = engine.verify_budget_for(n_spec)
        per = min(per, -(-cap // n_spec)) if cap else per
        budget = max(MIN_PREFILL, sched.step_budget - n_spec * per - (len(p.decode) - n_spec))
        return StepPlan(plan_chunks(sched.prefilling, budget), p.decode, None)
    return plan


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[8])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    prompts = mixed_prompts(a.num_prompts)
    params = SamplingParams(max_new_tokens=a.max_new_tokens)
    rows = []
    for bs in a.batch_sizes:
        engine = EagleEngine.from_config(EngineConfig(dtype=a.dtype, max_batch_size=bs, threads=a.threads,
                                                      tree_policy="auto"))
        engine.generate(prompts[:1], SamplingParams(max_new_tokens=4))
        own = engine.scheduler.schedule
        runs: dict[str, list] = {"plain": [], "prompts_first": [], "trees_first": []}
        outputs = {}
        for _ in range(a.repeats):
            for mode in runs:
                engine.scheduler.schedule = trees_first(engine) if mode == "trees_first" else own
                for k in engine.counters:
                    engine.counters[k] = 0
                t0 = time.perf_counter()
                outs = engine.generate(prompts, params, speculative=mode != "plain")
                wall = time.perf_counter() - t0
                tokens = sum(len(o.token_ids) for o in outs)
                tau = sum(o.stats.step_tokens for o in outs) / max(sum(o.stats.verify_steps for o in outs), 1)
                runs[mode].append({"wall_s": wall, "tok_s": tokens / wall, "tau": tau,
                                   "prefill_passes": engine.counters["prefill_passes"],
                                   "decode_passes": engine.counters["decode_passes"]})
                outputs.setdefault(mode, [o.token_ids for o in outs])
                print(bs, mode, json.dumps(runs[mode][-1]), flush=True)
        engine.scheduler.schedule = own
        med = {m: statistics.median(r["tok_s"] for r in rs) for m, rs in runs.items()}
        rows.append({"max_batch": bs, "trees": engine.tree_summary(), "runs": runs,
                     "median_tok_s": med,
                     "prompts_first_over_plain": med["prompts_first"] / med["plain"],
                     "trees_first_over_plain": med["trees_first"] / med["plain"],
                     "outputs_identical": outputs["plain"] == outputs["prompts_first"] == outputs["trees_first"]})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "runs"}), flush=True)
        del engine
    result = {"cpu": cpu_model(), "dtype": a.dtype, "threads": a.threads, "prompts": a.num_prompts,
              "max_new_tokens": a.max_new_tokens, "repeats": a.repeats, "rows": rows}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
