"""The benchmark report: EAGLE-2's Table 1 layout in Markdown plus PNG plots, from ``benchmark`` outputs.

Files in the output directory: ``results.parquet`` (one row per request), ``summary.json`` (cells, calibration,
tau against budget, engine and tuning), ``report.md`` and ``*.png``.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from eagle_ray.benchmark import summarize

METHOD_LABELS = {"hf": "transformers generate()", "plain": "plain (our runtime)", "chain": "chain (5 drafts)",
                 "eagle1": "EAGLE-1 static tree (25)", "eagle2": "EAGLE-2 (engine tree)",
                 "eagle2-26": "EAGLE-2 dynamic (26)"}


def write_results(out_dir: str | Path, rows: list[dict], extras: dict) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out / "results.parquet")
    summary = {"cells": summarize(rows)} | extras
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def table1(cells: list[dict], batch: int = 1) -> str:
    """Rows: temperature x method; columns: tasks (speedup over transformers generate() and tau) and their mean."""
    tasks = list(dict.fromkeys(c["task"] for c in cells))
    methods = [m for m in METHOD_LABELS if any(c["method"] == m for c in cells)]
    temps = sorted({c["temperature"] for c in cells})
    by = {(c["method"], c["task"], c["temperature"]): c for c in cells if c["batch_size"] == batch}
    head = "| T | method | " + " | ".join(f"{t} speedup | {t} tau" for t in tasks) + " | mean speedup | mean tau |"
    lines = [head, "|" + "---|" * (2 + 2 * len(tasks) + 2)]
    for temp in temps:
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
    for (m, task, temp), _ in by.items():
        if m != "chain":
            continue
        e2 = by.get(("eagle2-26", task, temp), by.get(("eagle2", task, temp)))
        e1, ch = by.get(("eagle1", task, temp)), by[(m, task, temp)]
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


def plots(summary: dict, rows: list[dict], out: Path) -> list[str]:
    plt = _pyplot()
    made = []
    cells = summary["cells"]
    # speedup and tau per task and method (T=0, batch 1)
    b1 = [c for c in cells if c["batch_size"] == 1 and c["temperature"] == 0]
    if b1:
        tasks = list(dict.fromkeys(c["task"] for c in b1))
        methods = [m for m in METHOD_LABELS if any(c["method"] == m for c in b1)]
        fig, axes = plt.subplots(1, 2, figsize=(12, 4))
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
        made.append(_finish(fig, None, out / "speedup_tau_by_task.png"))
    batches = sorted({c["batch_size"] for c in cells})
    if len(batches) > 1:
        fig, ax = plt.subplots(figsize=(6, 4))
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
        made.append(_finish(fig, ax, out / "speedup_vs_batch.png", "max batch size",
                            "throughput / plain batched decoding"))
    if summary.get("tau_vs_budget"):
        fig, ax = plt.subplots(figsize=(6, 4))
        pts = summary["tau_vs_budget"]
        ax.plot([p["total_tokens"] for p in pts], [p["tau"] for p in pts], marker="o", label="EAGLE-2, best depth/top_k")
        for m in ("eagle2", "eagle2-26", "eagle1", "chain"):
            rs = [r for r in rows if r["method"] == m and r["temperature"] == 0 and r["batch_size"] == 1]
            if rs:
                ax.scatter([statistics.mean(r["mean_tree_size"] for r in rs)], [statistics.mean(r["tau"] for r in rs)],
                           label=f"{METHOD_LABELS[m]} (measured)", zorder=3)
        made.append(_finish(fig, ax, out / "tau_vs_budget.png", "tree budget (verified tokens per sequence)", "tau"))
    if summary.get("calibration"):
        made.append(calibration_plot(summary["calibration"], out / "calibration.png"))
    depth_rows = [r for r in rows if r["method"] not in ("hf", "plain") and r["temperature"] == 0]
    if depth_rows:
        fig, ax = plt.subplots(figsize=(6, 4))
        for m in [m for m in METHOD_LABELS if any(r["method"] == m for r in depth_rows)]:
            rs = [r for r in depth_rows if r["method"] == m]
            steps = sum(r["verify_steps"] for r in rs)
            n = max((len(r["accepted_per_depth"]) for r in rs), default=0)
            per = [sum((r["accepted_per_depth"] + [0] * n)[d] for r in rs) / max(steps, 1) for d in range(n)]
            ax.plot(range(1, n + 1), per, marker="o", label=METHOD_LABELS[m])
        made.append(_finish(fig, ax, out / "acceptance_by_depth.png", "tree depth",
                            "accepted tokens per step at this depth"))
    return made


def calibration_plot(rows: list[dict], path: Path) -> str:
    pts = [r for r in rows if r["nodes"]]
    fig, ax = _pyplot().subplots(figsize=(5, 4))
    ax.plot([0, 1], [0, 1], color="gray", lw=0.8, ls="--", label="perfect calibration")
    ax.plot([r["mean_confidence"] for r in pts], [r["acceptance_rate"] for r in pts], marker="o", label="draft head")
    return _finish(fig, ax, path, "draft confidence (probability of the drafted token)", "acceptance rate",
                   legend_size=8)


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


def write_report(out_dir: str | Path, command: str = "") -> Path:
    out = Path(out_dir)
    summary = json.loads((out / "summary.json").read_text())
    rows = pq.read_table(out / "results.parquet").to_pylist()
    images = plots(summary, rows, out)
    cells = summary["cells"]
    eng, spec = summary["engine"], summary["spec"]
    parts = [f"# eagle-ray benchmark\n\n{spec['num_prompts']} prompts per task (first turns), {spec['max_new_tokens']}"
             f" new tokens, {eng['dtype']} on {eng['device']} with {eng['threads']} threads. Speedup = median per-prompt"
             " tokens/s over transformers `generate()` in the same run; tau = tokens per verify step (bonus counted)."]
    if command:
        parts.append(f"Command:\n\n```\n{command}\n```")
    for b in sorted({c["batch_size"] for c in cells}):
        if b == 1:
            parts.append("## Table 1 layout (batch 1)\n\n" + table1(cells, 1))
    mism = summary.get("greedy_mismatches", [])
    parts.append(f"Greedy (T=0) outputs identical across all methods and batch sizes: "
                 f"{'yes' if not mism else f'NO, {len(mism)} requests differ (see summary.json)'}.")
    if {"chain", "eagle1"} <= {c["method"] for c in cells}:  # the check needs all three methods
        bad = tau_order_check(cells)
        parts.append("tau ordering EAGLE-2 > EAGLE-1 > chain: " + ("holds on every task and temperature" if not bad
                     else "does NOT hold for: " + "; ".join(bad)))
    multi = [c for c in cells if c["batch_size"] > 1]
    if multi:
        lines = ["| batch | T | task | method | tok/s | tau | vs plain |", "|---|---|---|---|---|---|---|"]
        for c in sorted(multi, key=lambda c: (c["batch_size"], c["temperature"], c["task"], c["method"])):
            lines.append(f"| {c['batch_size']} | {c['temperature']:g} | {c['task']} | {c['method']} | "
                         f"{c['tok_s']:.1f} | {c['tau']:.2f} | {_fmt(c['speedup_vs_plain'])}x |")
        parts.append("## Batched throughput\n\n" + "\n".join(lines))
    if eng.get("trees_by_batch"):
        parts.append("## Speculation per batch size\n\n" + choice_table(eng["trees_by_batch"],
                                                                     eng.get("measured_choice") or {}))
    if summary.get("calibration"):
        parts.append("## Draft calibration (EAGLE-2 trees, T=0)\n\n" + calibration_table(summary["calibration"]))
    if summary.get("tau_vs_budget"):
        parts.append("## tau against tree budget (simulated from the traced trees)\n\n| total tokens | tau | depth | "
                     "top_k |\n|---|---|---|---|\n" + "\n".join(
                         f"| {p['total_tokens']} | {p['tau']:.2f} | {p['depth']} | {p['top_k']} |"
                         for p in summary["tau_vs_budget"]))
    parts.append("## Plots\n\n" + "\n".join(f"![{i}]({i})" for i in images))
    path = out / "report.md"
    path.write_text("\n\n".join(parts) + "\n")
    return path
