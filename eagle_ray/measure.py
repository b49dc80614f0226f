"""Measuring one engine configuration on a prompt set: tau, tokens/s against plain decoding and transformers
``generate()``, greedy mismatches with the reference's top-2 logit gap where outputs first differ, time split,
verify batch and width, memory. ``eagle-ray measure`` prints and saves what :func:`measure` returns.
"""
from __future__ import annotations

import math
import resource
import statistics
import time
from typing import Callable

import torch

from eagle_ray.config import SamplingParams
from eagle_ray.prompts import first_turn_prompt


def divergence(logits_fn, prompt_ids: list[int], ref: list[int], got: list[int]) -> dict | None:
    """First index where ``got`` leaves ``ref``, with the reference's top-2 logit gap there (a near-tie or a bug).

    ``logits_fn(ids)`` returns the reference's fp32 next-token logits after ``ids``.
    """
    n = min(len(ref), len(got))
    i = next((j for j in range(n) if ref[j] != got[j]), None)
    if i is None:
        return None if len(ref) == len(got) else {"index": n, "gap": None, "reason": "length differs"}
    top = logits_fn(prompt_ids + ref[:i]).float().topk(2)
    return {"index": i, "gap": float(top.values[0] - top.values[1]), "top_logit": float(top.values[0]),
            "ref_token": ref[i], "got_token": got[i]}


def ulp(x: float, dtype: torch.dtype) -> float:
    """The spacing of ``dtype``'s values at ``|x|``: two logits closer than this are one value in that dtype."""
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(abs(x) or 1.0))


def near_tie(d: dict, dtype: torch.dtype, tie_gap: float | None) -> bool:
    """Whether a divergence is a near-tie rather than a bug: its top-2 gap is under ``tie_gap`` when given; else,
    for an fp32 target, under 1e-3 (reductions in another order), and for a bf16/fp16 target, at most one unit of
    that dtype at the top logit's size: a gap the dtype itself cannot resolve (transformers' bf16 logits round
    the two candidates to one value or to neighbours), whichever order the sums ran in."""
    if d["gap"] is None:
        return False
    if tie_gap is not None:
        return d["gap"] < tie_gap
    if dtype == torch.float32:
        return d["gap"] < 1e-3
    return d["gap"] <= ulp(d["top_logit"], dtype)


def hf_logits_fn(hf):
    def fn(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return hf(torch.tensor([ids], device=hf.device)).logits[0, -1].float()
    return fn


def interleaved(runs: dict[str, Callable[[int], object]], n: int) -> tuple[dict[str, list], dict[str, list[float]]]:
    """Times every run on items ``0..n-1`` item by item, the runs in turn and in reverse order every other item
    (A B C, C B A), so a slow stretch of a shared machine lands on every run alike and each item's ratio compares
    neighbouring timings. ``runs[name](i)`` does run ``name`` on item ``i``; returns outputs and wall seconds per
    run."""
    names = list(runs)
    outs: dict[str, list] = {m: [] for m in names}
    walls: dict[str, list[float]] = {m: [] for m in names}
    for i in range(n):
        for m in names if i % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            outs[m].append(runs[m](i))
            walls[m].append(time.perf_counter() - t0)
    return outs, walls


def measure(engine, records: list[dict], a) -> dict:
    """One configuration over prompt records: speculative vs plain (and transformers ``generate``), at batch 1
    prompt by prompt (or at ``a.batch_size`` over the whole set), greedy checks, time split. ``a`` holds the
    ``eagle-ray measure`` options (``max_new_tokens``, ``temperature``, ``batch_size``, ``compare_hf``,
    ``skip_plain``, ``tie_gap``); returns ``{"summary", "rows"}``. At batch 1 the modes take turns prompt by
    prompt, so their ratios hold on a machine whose speed drifts."""
    from eagle_ray.model.device import cpu_model
    hf = engine.reference_model() if a.compare_hf else None
    prompts = [first_turn_prompt(r) for r in records]
    params = SamplingParams(temperature=a.temperature, max_new_tokens=a.max_new_tokens)
    dtype = engine.target.dtype
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=8))          # warm-up
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=8), speculative=False)

    def hf_generate(prompt_ids: list[int]) -> list[int]:
        ids = torch.tensor([prompt_ids], device=hf.device)
        with torch.inference_mode():
            return hf.generate(ids, max_new_tokens=a.max_new_tokens, do_sample=False)[0, ids.shape[1]:].tolist()

    for k in engine.counters:
        engine.counters[k] = 0
    modes = ["spec"] + ([] if a.skip_plain else ["plain"]) + (["hf"] if a.compare_hf else [])
    outs: dict[str, list] = {m: [] for m in modes}
    walls: dict[str, list[float]] = {m: [] for m in modes}
    if a.batch_size > 1:
        for m in (x for x in modes if x != "hf"):
            t0 = time.perf_counter()
            outs[m] = engine.generate(prompts, params, speculative=m == "spec")
            walls[m] = [time.perf_counter() - t0]
            if m == "spec":
                c = dict(engine.counters)
    else:
        c = dict.fromkeys(engine.counters, 0.0)

        def spec_run(i: int):  # the time split and verify counters describe the speculative runs only
            before = dict(engine.counters)
            out = engine.generate([prompts[i]], params)[0]
            for k in c:
                c[k] += engine.counters[k] - before[k]
            return out
        runs = {"spec": spec_run, "plain": lambda i: engine.generate([prompts[i]], params, speculative=False)[0],
                "hf": lambda i: hf_generate(engine.encode(prompts[i]))}
        outs, walls = interleaved({m: runs[m] for m in modes}, len(prompts))
    spec, spec_wall = outs["spec"], walls["spec"]
    plain, plain_wall = (outs["plain"], walls["plain"]) if not a.skip_plain else (spec, spec_wall)
    rows = []
    for i, (s, p) in enumerate(zip(spec, plain)):
        row = {"id": records[i].get("question_id", records[i].get("id", i)), "tokens": len(s.token_ids),
               "tau": s.stats.tau, "verify_steps": s.stats.verify_steps, "accept_hist": s.stats.accept_hist,
               "accepted_per_depth": s.stats.accepted_per_depth, "mean_tree_size": s.stats.mean_tree_size,
               "draft_s": s.stats.draft_s, "verify_s": s.stats.verify_s, "other_s": s.stats.other_s,
               "prefill_s": s.stats.prefill_s}
        if a.batch_size == 1:
            row.update(spec_tok_s=len(s.token_ids) / spec_wall[i], plain_tok_s=len(p.token_ids) / plain_wall[i])
            row["speedup"] = row["spec_tok_s"] / row["plain_tok_s"]
        row["vs_plain"] = divergence(engine.target.next_token_logits, s.prompt_token_ids, p.token_ids, s.token_ids)
        rows.append(row)
    hf_walls = walls.get("hf", [])
    if a.compare_hf:
        if a.batch_size > 1:  # transformers at batch 1, after the engine's runs
            for s in spec:
                t0 = time.perf_counter()
                outs["hf"].append(hf_generate(s.prompt_token_ids))
                hf_walls.append(time.perf_counter() - t0)
        for row, s, gen, wall in zip(rows, spec, outs["hf"], hf_walls):
            row["hf_tok_s"] = len(gen) / wall
            if "spec_tok_s" in row:
                row["speedup_vs_hf"] = row["spec_tok_s"] / row["hf_tok_s"]
            row["vs_hf"] = divergence(hf_logits_fn(hf), s.prompt_token_ids, gen, s.token_ids)

    def mismatches(key):
        bad = [r[key] | {"id": r["id"], "near_tie": near_tie(r[key], dtype, a.tie_gap)} for r in rows if r.get(key)]
        return {"count": len(bad), "near_ties": sum(b["near_tie"] for b in bad),
                "real": [b for b in bad if not b["near_tie"]], "all": bad}
    tot = {k: sum(r[k] for r in rows) for k in ("draft_s", "verify_s", "other_s")}
    step_total = sum(tot.values())
    gen_tokens = sum(r["tokens"] for r in rows)
    summary = {
        "device": str(engine.device), "cpu": cpu_model(), "dtype": str(engine.target.dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(), "prompts": len(rows), "generated_tokens": gen_tokens,
        "timing": "prompt by prompt, modes in turn (" + " ".join(modes) + ", then reversed)" if a.batch_size == 1
        else "each mode over the whole set, one after the other",
        "tau_mean": statistics.mean(r["tau"] for r in rows),
        "spec_tok_s": gen_tokens / sum(spec_wall), "plain_tok_s": sum(len(p.token_ids) for p in plain) / sum(plain_wall),
        "time_split": {k: v / step_total for k, v in tot.items()} if step_total else {},
        "overhead_fraction": tot["other_s"] / step_total if step_total else 0.0,
        # decode-only steps of the speculative run: time outside target and head forwards (trees, acceptance,
        # bookkeeping, host reads) over step time
        "non_forward_fraction": 1 - c["decode_forward_s"] / c["decode_step_s"] if c["decode_step_s"] else 0.0,
        "mismatches_vs_plain": mismatches("vs_plain"),
        "tie_rule": f"gap < {a.tie_gap}" if a.tie_gap is not None else "gap < 1e-3" if dtype == torch.float32
        else f"gap <= one {str(dtype).replace('torch.', '')} unit at the top logit",
        "mean_verify_batch": c["decode_sequences"] / max(c["decode_passes"], 1),
        "mean_verify_width": c["verify_tokens"] / max(c["decode_sequences"], 1),
        "mean_tree_nodes_per_pass": c["tree_nodes"] / max(c["decode_passes"], 1),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "kv_cache_mib": engine.target.cache.nbytes() / 2**20,
    }
    if engine.device.type == "cuda":
        summary["peak_cuda_mib"] = torch.cuda.max_memory_allocated() / 2**20
    summary["speedup_total"] = summary["spec_tok_s"] / summary["plain_tok_s"]
    if a.batch_size == 1:
        summary["speedup_median"] = statistics.median(r["speedup"] for r in rows)
    if a.compare_hf:
        summary["hf_tok_s"] = sum(r["hf_tok_s"] * w for r, w in zip(rows, hf_walls)) / sum(hf_walls)
        summary["mismatches_vs_hf"] = mismatches("vs_hf")
        if a.batch_size == 1:
            summary["speedup_vs_hf_median"] = statistics.median(r["speedup_vs_hf"] for r in rows)
    return {"summary": summary, "rows": rows}
