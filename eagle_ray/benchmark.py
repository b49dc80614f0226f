"""EAGLE-2's Table 1 on the hardware at hand: methods x tasks x temperatures x batch sizes, side by side.

Every method runs over the same prompts in the same process, one after the other, so speedups are ratios taken
in one run (the machines are shared and noisy; absolute tokens/s are reported but not compared across runs):

- ``plain``: our runtime without a draft (the same KV cache and kernels as speculation);
- ``hf``: transformers ``generate()`` (greedy or sampled), what a user runs without us; batch 1 only;
- ``chain``: the head drafts a chain (vLLM-style), ``eagle1``: EAGLE-1's static tree, ``eagle2``: EAGLE-2's
  dynamic tree with the engine's own tree (tuned or configured), ``eagle2-26``: dynamic with EAGLE-1's budget.

One row per request goes to Parquet; ``summarize`` folds them into cells (method, task, temperature, batch size)
with tau and the speedup over ``hf`` (the paper's baseline) and over ``plain``. EAGLE-2 runs at T=0 also record
their verified trees, which give the draft calibration curve and tau against tree budget.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from eagle_ray.config import SamplingParams, TreeConfig
from eagle_ray.errors import ConfigError
from eagle_ray.prompts import first_turn_prompt, load_dataset
from eagle_ray.speculative.trace import TreeTrace

METHOD_TREES = {
    "chain": TreeConfig(mode="chain", depth=4),                        # 5 drafted tokens
    "eagle1": TreeConfig(mode="static"),                               # 25 draft nodes, depth 7
    "eagle2-26": TreeConfig(mode="dynamic", total_tokens=26, depth=5, top_k=6),
}
ALL_METHODS = ("plain", "hf", "chain", "eagle1", "eagle2", "eagle2-26")
BUDGET_CURVE = (2, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48)


@dataclass
class BenchmarkSpec:
    tasks: list[str] = field(default_factory=lambda: ["mt_bench", "humaneval", "gsm8k", "alpaca", "sum", "qa"])
    methods: list[str] = field(default_factory=lambda: list(ALL_METHODS))
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    num_prompts: int = 10
    max_new_tokens: int = 128
    seed: int = 0

    def traced_method(self) -> str | None:
        """The EAGLE-2 method whose T=0 trees feed the calibration table and the tau-vs-budget curve (the larger)."""
        return next((m for m in ("eagle2-26", "eagle2") if m in self.methods), None)

    def __post_init__(self):
        unknown = set(self.methods) - set(ALL_METHODS)
        if unknown:
            raise ValueError(f"unknown methods {sorted(unknown)}; choose from {', '.join(ALL_METHODS)}")
        for name in ("tasks", "methods", "temperatures", "batch_sizes"):
            if not getattr(self, name):
                raise ValueError(f"{name} must name at least one")
        if min(self.batch_sizes) < 1 or self.num_prompts < 1 or self.max_new_tokens < 1:
            raise ValueError(f"batch sizes, num_prompts and max_new_tokens must be >= 1 (got batch_sizes "
                             f"{self.batch_sizes}, num_prompts {self.num_prompts}, max_new_tokens {self.max_new_tokens})")
        for t in self.temperatures:   # each must make a valid SamplingParams, as the run will
            try:
                SamplingParams(temperature=t, max_new_tokens=self.max_new_tokens)
            except ConfigError as e:
                raise ValueError(f"temperature {t}: {e}") from None


def _hf_generate(hf, prompt_ids: list[int], temperature: float, max_new_tokens: int, eos_ids, seed: int):
    ids = torch.tensor([prompt_ids], device=hf.device)
    kw = dict(do_sample=False) if temperature == 0 else dict(do_sample=True, temperature=temperature, top_p=1.0,
                                                             top_k=0)
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = hf.generate(ids, max_new_tokens=max_new_tokens, eos_token_id=list(eos_ids), **kw)
    return out[0, ids.shape[1]:].tolist()


def run_cell(engine, method: str, task: str, records: list[dict], temperature: float, batch: int,
             spec: BenchmarkSpec, hf=None, trace: TreeTrace | None = None) -> list[dict]:
    """One method over one task's prompts at one temperature and batch size; one row per request."""
    prompts = [first_turn_prompt(r) for r in records]
    params = [SamplingParams(temperature=temperature, max_new_tokens=spec.max_new_tokens,
                             seed=spec.seed * 100_003 + i) for i in range(len(prompts))]
    tree = METHOD_TREES.get(method)
    base = dict(method=method, task=task, temperature=temperature, batch_size=batch)
    rows = []
    if method == "hf":
        for r, p in zip(records, prompts):
            ids = engine.encode(p)
            t0 = time.perf_counter()
            out = _hf_generate(hf, ids, temperature, spec.max_new_tokens, engine.eos_ids, spec.seed)
            wall = time.perf_counter() - t0
            rows.append(base | dict(question_id=str(r.get("question_id", "")), token_ids=out, new_tokens=len(out),
                                    wall_s=wall,
                                    tau=1.0, verify_steps=len(out), accept_hist=[], accepted_per_depth=[],
                                    mean_tree_size=1.0, tree=""))
        return rows
    saved = (engine.config.speculation.tree, engine.config.speculation.trees_by_batch)
    if tree is not None:
        engine.set_trees(tree)
    engine.runner.trace = trace if method == spec.traced_method() and temperature == 0 else None
    speculative = method != "plain"
    tree_desc = "" if not speculative else json.dumps(
        {str(b): engine.policy.tree_for(b).model_dump(exclude={"static_tree", "min_cum_prob"})
         for b in sorted({1, batch})})
    engine.scheduler.max_running = batch  # the engine may hold more slots than this cell's batch size
    try:
        groups = [list(range(len(prompts)))] if batch > 1 else [[i] for i in range(len(prompts))]
        for g in groups:
            t0 = time.perf_counter()
            outs = engine.generate([prompts[i] for i in g], [params[i] for i in g], speculative=speculative)
            wall = time.perf_counter() - t0
            for i, o in zip(g, outs):
                s = o.stats
                rows.append(base | dict(question_id=str(records[i].get("question_id", i)), token_ids=o.token_ids,
                                        new_tokens=len(o.token_ids), wall_s=wall if batch == 1 else wall / len(g),
                                        tau=s.tau if speculative else 1.0, verify_steps=s.verify_steps,
                                        accept_hist=s.accept_hist, accepted_per_depth=s.accepted_per_depth,
                                        mean_tree_size=s.mean_tree_size, tree=tree_desc))
    finally:
        engine.scheduler.max_running = None
        engine.runner.trace = None
        engine.set_trees(*saved)
    return rows


def run_benchmark(engine, spec: BenchmarkSpec, log=print) -> tuple[list[dict], dict]:
    """All cells of ``spec`` on ``engine``. Returns (rows, extras) where extras hold the calibration table, the
    tau-vs-budget curve (simulated from the traced EAGLE-2 trees) and the engine's tree choice."""
    from eagle_ray.model.device import cpu_model, device_name
    datasets = [load_dataset(t) for t in spec.tasks]
    hf = engine.reference_model() if "hf" in spec.methods else None
    trace = TreeTrace()
    engine.generate([first_turn_prompt(datasets[0][1][0])], SamplingParams(max_new_tokens=8))  # warm-up
    rows = []
    max_batch = engine.config.cache.max_batch_size
    for batch in spec.batch_sizes:
        if batch > max_batch:
            raise ValueError(f"batch size {batch} exceeds the engine's max_batch_size {max_batch}")
        for temperature in spec.temperatures:
            for name, records in datasets:
                records = records[: spec.num_prompts]
                for method in spec.methods:
                    if method == "hf" and batch > 1:
                        continue
                    t0 = time.perf_counter()
                    cell = run_cell(engine, method, name, records, temperature, batch, spec, hf, trace)
                    rows += cell
                    n = sum(r["new_tokens"] for r in cell)
                    log(f"batch {batch} T={temperature} {name:10s} {method:9s} {n / (time.perf_counter() - t0):6.1f}"
                        f" tok/s  tau {statistics.mean(r['tau'] for r in cell):.2f}")
    extras = {"greedy_mismatches": greedy_mismatches(rows),
              "calibration": trace.calibration() if len(trace) else [],
              "tau_vs_budget": budget_curve(trace) if len(trace) else [],
              "engine": {"dtype": str(engine.target.dtype).replace("torch.", ""), "device": str(engine.device),
                         "device_name": device_name(engine.device), "cpu": cpu_model(),
                         "threads": torch.get_num_threads(), "tree": engine.config.speculation.tree.model_dump(),
                         "trees_by_batch": engine.policy.summary().get("trees_by_batch", {}),
                         "measured_choice": engine.policy.summary().get("measured", {})},
              "tuning": engine.policy.tuning.to_dict() if engine.policy.tuning else None,
              "spec": asdict(spec)}
    return rows, extras


def budget_curve(trace: TreeTrace) -> list[dict]:
    """tau against total_tokens for the best (depth, top_k) at each budget, read off the traced trees."""
    from eagle_ray.engine.tuning import shapes_for
    out = []
    for t in BUDGET_CURVE:
        best = max(((trace.simulated_tau(t, d, k), -d, -k) for d, k in shapes_for(t)), default=None)  # ties: smaller
        if best:
            out.append({"total_tokens": t, "tau": best[0], "depth": -best[1], "top_k": -best[2]})
    return out


def greedy_mismatches(rows: list[dict]) -> list[dict]:
    """T=0 requests whose tokens differ between methods (every method must produce the target's greedy output)."""
    ref: dict[tuple, tuple[str, list[int]]] = {}
    bad = []
    for r in rows:
        if r["temperature"] != 0:
            continue
        key = (r["task"], r["question_id"])
        if key not in ref:
            ref[key] = (r["method"], list(r["token_ids"]))
        elif list(r["token_ids"]) != ref[key][1]:
            a, b = ref[key][1], list(r["token_ids"])
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            bad.append({"task": r["task"], "question_id": r["question_id"], "method": r["method"],
                        "batch_size": r["batch_size"], "reference_method": ref[key][0], "first_difference": at})
    return bad


def summarize(rows: list[dict]) -> list[dict]:
    """Cells (method, task, temperature, batch): tokens/s over the cell, mean tau, speedups over hf and plain
    (at batch 1 the median of per-prompt ratios, as the paper; at larger batches the ratio of throughputs)."""
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        cells.setdefault((r["method"], r["task"], r["temperature"], r["batch_size"]), []).append(r)

    def tok_s(rs):
        return sum(r["new_tokens"] for r in rs) / max(sum(r["wall_s"] for r in rs), 1e-9)

    out = []
    for (method, task, temp, batch), rs in cells.items():
        row = {"method": method, "task": task, "temperature": temp, "batch_size": batch, "prompts": len(rs),
               "new_tokens": sum(r["new_tokens"] for r in rs), "tok_s": tok_s(rs),
               "tau": statistics.mean(r["tau"] for r in rs)}
        for ref in ("hf", "plain"):
            base = cells.get((ref, task, temp, batch))
            if not base:
                row[f"speedup_vs_{ref}"] = None
            elif batch == 1:
                per = {r["question_id"]: r["new_tokens"] / r["wall_s"] for r in base}
                ratios = [r["new_tokens"] / r["wall_s"] / per[r["question_id"]] for r in rs if r["question_id"] in per]
                row[f"speedup_vs_{ref}"] = statistics.median(ratios) if ratios else None
            else:
                row[f"speedup_vs_{ref}"] = tok_s(rs) / tok_s(base)
        out.append(row)
    return out
