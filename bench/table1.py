"""EAGLE-2's Table 1 on the hardware at hand (``python bench/speed.py table1``): methods x tasks x temperatures x
batch sizes, side by side, then a report in that layout.

Every method runs over the same prompts in the same process, one after the other, so speedups are ratios taken
in one run (the machines are shared and noisy; absolute tokens/s are reported but not compared across runs):

- ``plain``: our runtime without a draft (the same KV cache and kernels as speculation);
- ``hf``: transformers ``generate()`` (greedy or sampled), what a user runs without us; batch 1 only;
- ``chain``: the head drafts a chain (vLLM-style), ``eagle1``: EAGLE-1's static tree, ``eagle2``: EAGLE-2's
  dynamic tree with the engine's own tree (tuned or configured), ``eagle2-26``: dynamic with EAGLE-1's budget.

One row per request goes to ``results.parquet``; :func:`summarize` folds them into cells (method, task,
temperature, batch size) with tau and the speedup over ``hf`` (the paper's baseline) and over ``plain``. EAGLE-2
runs at T=0 also record their verified trees, which give the draft calibration curve and tau against tree budget.
``summary.json`` holds the cells, calibration, tau against budget, engine, tuning, hardware and command;
``report.md`` and ``*.png`` show them. A module of ``bench/speed.py``, not a command.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from harness import hardware
from workloads import task_records

from eagle_ray.config import SamplingParams, TreeConfig
from eagle_ray.errors import ConfigError
from eagle_ray.prompts import first_turn_prompt
from eagle_ray.speculative.trace import TreeTrace

METHOD_TREES = {
    "chain": TreeConfig(mode="chain", depth=4),                        # 5 drafted tokens
    "eagle1": TreeConfig(mode="static"),                               # 25 draft nodes, depth 7
    "eagle2-26": TreeConfig(mode="dynamic", total_tokens=26, depth=5, top_k=6),
}
ALL_METHODS = ("plain", "hf", "chain", "eagle1", "eagle2", "eagle2-26")
BUDGET_CURVE = (2, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48)
METHOD_LABELS = {"hf": "transformers generate()", "plain": "plain (our runtime)", "chain": "chain (5 drafts)",
                 "eagle1": "EAGLE-1 static tree (25)", "eagle2": "EAGLE-2 (engine tree)",
                 "eagle2-26": "EAGLE-2 dynamic (26)"}


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
                             f"{self.batch_sizes}, num_prompts {self.num_prompts}, "
                             f"max_new_tokens {self.max_new_tokens})")
        for t in self.temperatures:   # each must make a valid SamplingParams, as the run will
            try:
                SamplingParams(temperature=t, max_new_tokens=self.max_new_tokens)
            except ConfigError as e:
                raise ValueError(f"temperature {t}: {e}") from None


# ---- the run ------------------------------------------------------------------------------------------------------
def _hf_generate(hf, prompt_ids: list[int], temperature: float, max_new_tokens: int, eos_ids, seed: int):
    ids = torch.tensor([prompt_ids], device=hf.device)
    kw = dict(do_sample=False) if temperature == 0 else dict(do_sample=True, temperature=temperature, top_p=1.0,
                                                             top_k=0)
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = hf.generate(ids, max_new_tokens=max_new_tokens, eos_token_id=list(eos_ids), **kw)
    return out[0, ids.shape[1]:].tolist()


def _hf_rows(engine, hf, records, prompts, temperature, spec, base) -> list[dict]:
    rows = []
    for r, p in zip(records, prompts):
        ids = engine.encode(p)
        t0 = time.perf_counter()
        out = _hf_generate(hf, ids, temperature, spec.max_new_tokens, engine.eos_ids, spec.seed)
        rows.append(base | dict(question_id=str(r.get("question_id", "")), token_ids=out, new_tokens=len(out),
                                wall_s=time.perf_counter() - t0, tau=1.0, verify_steps=len(out), accept_hist=[],
                                accepted_per_depth=[], mean_tree_size=1.0, tree=""))
    return rows


def run_cell(engine, method: str, task: str, records: list[dict], temperature: float, batch: int,
             spec: BenchmarkSpec, hf=None, trace: TreeTrace | None = None) -> list[dict]:
    """One method over one task's prompts at one temperature and batch size; one row per request."""
    prompts = [first_turn_prompt(r) for r in records]
    params = [SamplingParams(temperature=temperature, max_new_tokens=spec.max_new_tokens,
                             seed=spec.seed * 100_003 + i) for i in range(len(prompts))]
    base = dict(method=method, task=task, temperature=temperature, batch_size=batch)
    if method == "hf":
        return _hf_rows(engine, hf, records, prompts, temperature, spec, base)
    saved = (engine.config.speculation.tree, engine.config.speculation.trees_by_batch)
    if method in METHOD_TREES:
        engine.set_trees(METHOD_TREES[method])
    engine.runner.trace = trace if method == spec.traced_method() and temperature == 0 else None
    speculative = method != "plain"
    tree_desc = "" if not speculative else json.dumps(
        {str(b): engine.policy.tree_for(b).model_dump(exclude={"static_tree", "min_cum_prob"})
         for b in sorted({1, batch})})
    engine.scheduler.max_running = batch  # the engine may hold more slots than this cell's batch size
    rows = []
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
    datasets = [task_records(t) for t in spec.tasks]
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
                for method in spec.methods:
                    if method == "hf" and batch > 1:
                        continue
                    t0 = time.perf_counter()
                    cell = run_cell(engine, method, name, records[: spec.num_prompts], temperature, batch, spec, hf,
                                    trace)
                    rows += cell
                    n = sum(r["new_tokens"] for r in cell)
                    log(f"batch {batch} T={temperature} {name:10s} {method:9s} {n / (time.perf_counter() - t0):6.1f}"
                        f" tok/s  tau {statistics.mean(r['tau'] for r in cell):.2f}")
    return rows, extras_of(engine, spec, rows, trace)


def extras_of(engine, spec: BenchmarkSpec, rows: list[dict], trace: TreeTrace) -> dict:
    policy = engine.policy.summary()
    return {"greedy_mismatches": greedy_mismatches(rows),
            "calibration": trace.calibration() if len(trace) else [],
            "tau_vs_budget": budget_curve(trace) if len(trace) else [],
            "engine": {"dtype": str(engine.target.dtype).replace("torch.", ""), "device": str(engine.device),
                       "threads": torch.get_num_threads(), "tree": engine.config.speculation.tree.model_dump(),
                       "trees_by_batch": policy.get("trees_by_batch", {}),
                       "measured_choice": policy.get("measured", {})},
            "hardware": hardware(engine.device),
            "tuning": engine.policy.tuning.to_dict() if engine.policy.tuning else None,
            "spec": asdict(spec)}


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


def _tok_s(rs: list[dict]) -> float:
    return sum(r["new_tokens"] for r in rs) / max(sum(r["wall_s"] for r in rs), 1e-9)


def _speedup(rs: list[dict], base: list[dict] | None, batch: int) -> float | None:
    """At batch 1 the median of per-prompt ratios (as the paper), at larger batches the ratio of throughputs."""
    if not base:
        return None
    if batch > 1:
        return _tok_s(rs) / _tok_s(base)
    per = {r["question_id"]: r["new_tokens"] / r["wall_s"] for r in base}
    ratios = [r["new_tokens"] / r["wall_s"] / per[r["question_id"]] for r in rs if r["question_id"] in per]
    return statistics.median(ratios) if ratios else None


def summarize(rows: list[dict]) -> list[dict]:
    """Cells (method, task, temperature, batch): tokens/s over the cell, mean tau, speedups over hf and plain."""
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        cells.setdefault((r["method"], r["task"], r["temperature"], r["batch_size"]), []).append(r)
    out = []
    for (method, task, temp, batch), rs in cells.items():
        row = {"method": method, "task": task, "temperature": temp, "batch_size": batch, "prompts": len(rs),
               "new_tokens": sum(r["new_tokens"] for r in rs), "tok_s": _tok_s(rs),
               "tau": statistics.mean(r["tau"] for r in rs)}
        for ref in ("hf", "plain"):
            row[f"speedup_vs_{ref}"] = _speedup(rs, cells.get((ref, task, temp, batch)), batch)
        out.append(row)
    return out


# ---- the report ---------------------------------------------------------------------------------------------------
def write_results(out_dir: str | Path, rows: list[dict], extras: dict, command: str = "") -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out / "results.parquet")
    summary = {"command": command, "cells": summarize(rows)} | extras
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def table1(cells: list[dict], batch: int = 1) -> str:
    """Rows: temperature x method; columns: tasks (speedup over transformers generate() and tau) and their mean."""
    tasks = list(dict.fromkeys(c["task"] for c in cells))
    methods = [m for m in METHOD_LABELS if any(c["method"] == m for c in cells)]
    by = {(c["method"], c["task"], c["temperature"]): c for c in cells if c["batch_size"] == batch}
    head = "| T | method | " + " | ".join(f"{t} speedup | {t} tau" for t in tasks) + " | mean speedup | mean tau |"
    lines = [head, "|" + "---|" * (2 + 2 * len(tasks) + 2)]
    for temp in sorted({c["temperature"] for c in cells}):
        for m in methods:
            cs = [by.get((m, t, temp)) for t in tasks]
            if not any(cs):
                continue
            sp = [c["speedup_vs_hf"] for c in cs if c and c["speedup_vs_hf"] is not None]
            ta = [c["tau"] for c in cs if c]
            cols = " | ".join(f"{_fmt(c and c['speedup_vs_hf'])}x | {_fmt(c and c['tau'])}" for c in cs)
            lines.append(f"| {temp:g} | {METHOD_LABELS[m]} | {cols} | "
                         f"{_fmt(statistics.mean(sp) if sp else None)}x | {_fmt(statistics.mean(ta))} |")
    return "\n".join(lines)


def tau_order_check(cells: list[dict]) -> list[str]:
    """Tasks x temperatures where tau is not ordered EAGLE-2 > EAGLE-1 > chain (as in the paper)."""
    by = {(c["method"], c["task"], c["temperature"]): c["tau"] for c in cells if c["batch_size"] == 1}
    bad = []
    for (m, task, temp), ch in by.items():
        if m != "chain":
            continue
        e2 = by.get(("eagle2-26", task, temp), by.get(("eagle2", task, temp)))
        e1 = by.get(("eagle1", task, temp))
        if e2 is None or e1 is None or not (e2 > e1 > ch):
            bad.append(f"{task} T={temp:g}: eagle2 {e2}, eagle1 {e1}, chain {ch}")
    return bad


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _finish(fig, ax, path: Path, xlabel: str | None = None, ylabel: str | None = None, legend_size: int = 7) -> str:
    """Label, save and close one figure; returns the file name for the report."""
    if ax is not None:
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path.name


def _task_bars(cells: list[dict], out: Path) -> str | None:
    """Speedup and tau per task and method (T=0, batch 1)."""
    b1 = [c for c in cells if c["batch_size"] == 1 and c["temperature"] == 0]
    if not b1:
        return None
    tasks = list(dict.fromkeys(c["task"] for c in b1))
    methods = [m for m in METHOD_LABELS if any(c["method"] == m for c in b1)]
    fig, axes = _pyplot().subplots(1, 2, figsize=(12, 4))
    w = 0.8 / len(methods)
    for i, m in enumerate(methods):
        by = {c["task"]: c for c in b1 if c["method"] == m}
        xs = [j + i * w for j in range(len(tasks))]
        axes[0].bar(xs, [(by.get(t) or {}).get("speedup_vs_hf") or 0 for t in tasks], w, label=METHOD_LABELS[m])
        axes[1].bar(xs, [(by.get(t) or {}).get("tau") or 0 for t in tasks], w, label=METHOD_LABELS[m])
    for ax, title in zip(axes, ("speedup over transformers generate() (T=0)", "tau (T=0)")):
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(tasks))], tasks, rotation=20)
        ax.set_title(title)
    axes[0].axhline(1.0, color="gray", lw=0.8)
    axes[1].legend(fontsize=7)
    return _finish(fig, None, out / "speedup_tau_by_task.png")


def _batch_curve(cells: list[dict], out: Path) -> str | None:
    batches = sorted({c["batch_size"] for c in cells})
    if len(batches) < 2:
        return None
    fig, ax = _pyplot().subplots(figsize=(6, 4))
    for m in [m for m in METHOD_LABELS if m not in ("hf", "plain")]:
        pts = []
        for b in batches:
            cs = [c for c in cells if c["method"] == m and c["batch_size"] == b and c["temperature"] == 0
                  and c["speedup_vs_plain"] is not None]
            if cs:
                pts.append((b, statistics.mean(c["speedup_vs_plain"] for c in cs)))
        if pts:
            ax.plot(*zip(*pts), marker="o", label=METHOD_LABELS[m])
    ax.set_xscale("log", base=2)
    ax.axhline(1.0, color="gray", lw=0.8)
    return _finish(fig, ax, out / "speedup_vs_batch.png", "max batch size", "throughput / plain batched decoding")


def _budget_plot(summary: dict, rows: list[dict], out: Path) -> str | None:
    pts = summary.get("tau_vs_budget")
    if not pts:
        return None
    fig, ax = _pyplot().subplots(figsize=(6, 4))
    ax.plot([p["total_tokens"] for p in pts], [p["tau"] for p in pts], marker="o", label="EAGLE-2, best depth/top_k")
    for m in ("eagle2", "eagle2-26", "eagle1", "chain"):
        rs = [r for r in rows if r["method"] == m and r["temperature"] == 0 and r["batch_size"] == 1]
        if rs:
            ax.scatter([statistics.mean(r["mean_tree_size"] for r in rs)], [statistics.mean(r["tau"] for r in rs)],
                       label=f"{METHOD_LABELS[m]} (measured)", zorder=3)
    return _finish(fig, ax, out / "tau_vs_budget.png", "tree budget (verified tokens per sequence)", "tau")


def _depth_plot(rows: list[dict], out: Path) -> str | None:
    depth_rows = [r for r in rows if r["method"] not in ("hf", "plain") and r["temperature"] == 0]
    if not depth_rows:
        return None
    fig, ax = _pyplot().subplots(figsize=(6, 4))
    for m in [m for m in METHOD_LABELS if any(r["method"] == m for r in depth_rows)]:
        rs = [r for r in depth_rows if r["method"] == m]
        steps = sum(r["verify_steps"] for r in rs)
        n = max((len(r["accepted_per_depth"]) for r in rs), default=0)
        per = [sum((list(r["accepted_per_depth"]) + [0] * n)[d] for r in rs) / max(steps, 1) for d in range(n)]
        ax.plot(range(1, n + 1), per, marker="o", label=METHOD_LABELS[m])
    return _finish(fig, ax, out / "acceptance_by_depth.png", "tree depth", "accepted tokens per step at this depth")


def calibration_plot(rows: list[dict], path: Path) -> str:
    pts = [r for r in rows if r["nodes"]]
    fig, ax = _pyplot().subplots(figsize=(5, 4))
    ax.plot([0, 1], [0, 1], color="gray", lw=0.8, ls="--", label="perfect calibration")
    ax.plot([r["mean_confidence"] for r in pts], [r["acceptance_rate"] for r in pts], marker="o", label="draft head")
    return _finish(fig, ax, path, "draft confidence (probability of the drafted token)", "acceptance rate",
                   legend_size=8)


def plots(summary: dict, rows: list[dict], out: Path) -> list[str]:
    cells = summary["cells"]
    made = [_task_bars(cells, out), _batch_curve(cells, out), _budget_plot(summary, rows, out)]
    if summary.get("calibration"):
        made.append(calibration_plot(summary["calibration"], out / "calibration.png"))
    made.append(_depth_plot(rows, out))
    return [m for m in made if m]


def calibration_table(rows: list[dict]) -> str:
    lines = ["| draft confidence | nodes judged | mean confidence | acceptance rate |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['bin_lo']:.2f}-{r['bin_hi']:.2f} | {r['nodes']} | {_fmt(r['mean_confidence'])} | "
                     f"{_fmt(r['acceptance_rate'])} |")
    return "\n".join(lines)


def choice_table(trees: dict, measured: dict) -> str:
    """What a step with each batch size runs ("plain": no drafting), and the tokens/s the engine measured for both
    modes there when it chose by measurement."""
    lines = ["| batch size | runs | measured tree tok/s | measured plain tok/s |", "|---|---|---|---|"]
    for b, tree in sorted(trees.items(), key=lambda kv: int(kv[0])):
        shape = tree if tree == "plain" else f"tree {tree['total_tokens']}/{tree['depth']}/{tree['top_k']}"
        m = measured.get(b, {})
        lines.append(f"| {b} | {shape} | {_fmt(m.get('tree_tok_s'))} | {_fmt(m.get('plain_tok_s'))} |")
    return "\n".join(lines)


def batched_table(cells: list[dict]) -> str:
    lines = ["| batch | T | task | method | tok/s | tau | vs plain |", "|---|---|---|---|---|---|---|"]
    for c in sorted(cells, key=lambda c: (c["batch_size"], c["temperature"], c["task"], c["method"])):
        lines.append(f"| {c['batch_size']} | {c['temperature']:g} | {c['task']} | {c['method']} | "
                     f"{c['tok_s']:.1f} | {c['tau']:.2f} | {_fmt(c['speedup_vs_plain'])}x |")
    return "## Batched throughput\n\n" + "\n".join(lines)


def budget_table(points: list[dict]) -> str:
    return ("## tau against tree budget (simulated from the traced trees)\n\n| total tokens | tau | depth | top_k |\n"
            "|---|---|---|---|\n" + "\n".join(f"| {p['total_tokens']} | {p['tau']:.2f} | {p['depth']} | {p['top_k']} |"
                                              for p in points))


def report_parts(summary: dict) -> list[str]:
    cells, eng, spec, hw = summary["cells"], summary["engine"], summary["spec"], summary.get("hardware", {})
    parts = [f"# eagle-ray benchmark\n\n{spec['num_prompts']} prompts per task (first turns), {spec['max_new_tokens']}"
             f" new tokens, {eng['dtype']} on {hw.get('device', eng['device'])} with {eng['threads']} threads. "
             "Speedup = median per-prompt tokens/s over transformers `generate()` in the same run; tau = tokens per "
             "verify step (bonus counted)."]
    if summary.get("command"):
        parts.append(f"Command:\n\n```\n{summary['command']}\n```")
    if any(c["batch_size"] == 1 for c in cells):
        parts.append("## Table 1 layout (batch 1)\n\n" + table1(cells, 1))
    mism = summary.get("greedy_mismatches", [])
    parts.append(f"Greedy (T=0) outputs identical across all methods and batch sizes: "
                 f"{'yes' if not mism else f'NO, {len(mism)} requests differ (see summary.json)'}.")
    if {"chain", "eagle1"} <= {c["method"] for c in cells}:  # the check needs all three methods
        bad = tau_order_check(cells)
        parts.append("tau ordering EAGLE-2 > EAGLE-1 > chain: " + ("holds on every task and temperature" if not bad
                     else "does NOT hold for: " + "; ".join(bad)))
    if any(c["batch_size"] > 1 for c in cells):
        parts.append(batched_table([c for c in cells if c["batch_size"] > 1]))
    if eng.get("trees_by_batch"):
        parts.append("## Speculation per batch size\n\n" + choice_table(eng["trees_by_batch"],
                                                                     eng.get("measured_choice") or {}))
    if summary.get("calibration"):
        parts.append("## Draft calibration (EAGLE-2 trees, T=0)\n\n" + calibration_table(summary["calibration"]))
    if summary.get("tau_vs_budget"):
        parts.append(budget_table(summary["tau_vs_budget"]))
    return parts


def write_report(out_dir: str | Path) -> Path:
    import pyarrow.parquet as pq
    out = Path(out_dir)
    summary = json.loads((out / "summary.json").read_text())
    rows = pq.read_table(out / "results.parquet").to_pylist()
    images = plots(summary, rows, out)
    parts = report_parts(summary) + ["## Plots\n\n" + "\n".join(f"![{i}]({i})" for i in images)]
    path = out / "report.md"
    path.write_text("\n\n".join(parts) + "\n")
    return path
