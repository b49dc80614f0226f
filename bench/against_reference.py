"""The ``eagle-ray`` subcommand of ``bench/fidelity.py``, in eagle-ray's environment: eagle-ray run on the prompts,
head and tree of a ``reference`` result and compared with it step by step (``eagle_ray.fidelity``: what the golden
test runs on every commit), so a real pair is checked the way the tiny golden pair is."""
from __future__ import annotations

import json

from harness import command_line, write_result

from eagle_ray.fidelity import compare, engine_like, read_trace, run_prompts, trace_tree
from eagle_ray.model.device import cpu_model


def compared_rows(ref: dict, runs, score_tol: float) -> list[dict]:
    """Each prompt's comparison, with tau counted both ways (ours, and the reference's count on our tokens)."""
    eos = ref["settings"].get("eos_token_id")
    rows = []
    for run, p in zip(runs, ref["prompts"]):
        row = compare(run, p, score_tol)
        steps = max(len(run.accept_lengths), 1)
        row.update(tau_ours=(len(run.tokens) - 1) / steps, tau_reference=p["tau"],
                   tau_reference_count_on_ours=(len(run.tokens) + (1 if run.tokens and run.tokens[-1] == eos
                                                                   else 0)) / steps)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not isinstance(v, (dict, list))}), flush=True)
    return rows


def cmd_eagle_ray(args) -> None:
    """Run eagle-ray on the prompts, head and tree of a ``reference`` result and compare, step by step
    (``eagle_ray.fidelity``: what the golden test runs on every commit)."""
    ref = read_trace(args.reference)
    st = ref["settings"]
    engine = engine_like(ref, args.target, args.head, args.batch_size, threads=args.threads)
    runs = run_prompts(engine, [p["prompt_ids"] for p in ref["prompts"]], st["max_new_tokens"])
    rows = compared_rows(ref, runs, args.score_tol)
    n = len(rows)
    agree = {k: sum(r[k] for r in rows) for k in ("first_tree", "accept_lengths", "output")}
    result = {"kind": "eagle-ray vs reference", "reference_file": args.reference, "head": args.head,
              "head_kind": engine.draft.kind, "tree": trace_tree(ref).model_dump(), "batch_size": args.batch_size,
              "prompts": n, "cpu": cpu_model(), "agree": {k: f"{v}/{n}" for k, v in agree.items()},
              "max_score_gap": max(r["max_score_gap"] for r in rows),
              "tau_ours_mean": sum(r["tau_ours"] for r in rows) / n,
              "tau_reference_mean": sum(r["tau_reference"] for r in rows) / n, "rows": rows,
              "reference_settings": st, "reference_environment": ref.get("environment")}
    result = write_result(args.out, result, command_line("bench/fidelity.py", args.argv), engine.device)
    print(json.dumps({k: v for k, v in result.items() if k not in ("rows", "reference_settings",
                                                                   "reference_environment")}, indent=1))
    if min(agree.values()) < n:
        raise SystemExit(1)
