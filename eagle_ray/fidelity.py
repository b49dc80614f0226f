"""Fidelity against the SafeAILab reference, step by step: run eagle-ray on the prompts, head and tree of a
reference trace (``bench/reference_fidelity.py reference``) and compare what each system did.

Compared per prompt: the first draft tree (tokens, parents and depths exactly, cumulative draft scores within a
tolerance), the accepted length of every verify step, and the output tokens. The golden test
(``tests/test_golden.py``) runs this on every commit against committed traces; ``bench/reference_fidelity.py
eagle-ray`` writes the same comparison as a result file.

How the reference's counting differs, and how it is read here: ``eagenerate`` stops only once its counter passes
``max_new_tokens`` (the first token, from the prefill, is not counted), so it can run cycles after the output is
complete; they are cut from its cleaned output (``output_ids_clean``), and its later steps are not compared.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from eagle_ray.config import SamplingParams, TreeConfig
from eagle_ray.engine.engine import EagleEngine
from eagle_ray.speculative.trace import TreeTrace

SCORE_TOL = 1e-4   # largest difference of a cumulative draft log-prob counted as equal (fp32, different op order)


@dataclass
class PromptRun:
    """What eagle-ray did for one prompt."""
    tokens: list[int]
    accept_lengths: list[int]                       # accepted drafts per verify step (bonus not counted)
    first_tree: dict = field(default_factory=dict)  # tokens, parents, depths, scores (root first)


def read_trace(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def trace_tree(trace: dict) -> TreeConfig:
    """The tree a reference trace ran (no prompt lookup: the reference has none)."""
    s = trace["settings"]
    return TreeConfig(total_tokens=s["total_token"], depth=s["depth"], top_k=s["top_k"], lookup=0)


def engine_like(trace: dict, target: str | None, head: str, batch: int = 1, **options) -> EagleEngine:
    """An fp32 engine that grows the trace's tree exactly as the reference does: the head's full draft vocabulary
    (an EAGLE-1/2 head in the reference drafts over every token), no context tokens, no verify cap, and a step
    budget that never trims a tree."""
    s = trace["settings"]
    return EagleEngine.from_pretrained(target, head, dtype="float32", max_batch_size=batch,
                                       max_model_len=s.get("max_length", 2048), tree=trace_tree(trace),
                                       draft_vocab_size=0, context_vocab=0, max_step_tokens=4096, **options)


def run_prompts(engine: EagleEngine, prompts: list[list[int]], max_new_tokens: int) -> list[PromptRun]:
    """Every prompt through ``engine`` at once (continuously batched up to its ``max_batch_size``), each
    sequence's verified trees recorded."""
    engine.runner.trace = trace = TreeTrace()
    try:
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens))
    finally:
        engine.runner.trace = None
    runs = {o.request_id: PromptRun(o.token_ids, []) for o in outs}
    for step, where in enumerate(trace.where):
        for row, (request_id, _) in enumerate(where):
            run = runs[request_id]
            if not run.accept_lengths:
                run.first_tree = {"tokens": trace.tokens[step][row].tolist(),
                                  "parents": trace.parents[step][row].tolist(),
                                  "depths": trace.depth[step][row].tolist(),
                                  "scores": trace.scores[step][row].tolist()}
            run.accept_lengths.append(int(trace.accepted[step][row].sum()) - 1)
    return [runs[o.request_id] for o in outs]


def compare(run: PromptRun, ref: dict, score_tol: float = SCORE_TOL) -> dict:
    """One prompt's agreement with its reference record: ``first_tree``, ``accept_lengths`` and ``output`` each
    True or False, the largest score gap, and where a part differs, both sides of it."""
    rt = ref["first_tree"]
    n = len(run.first_tree.get("tokens", ()))
    gap = max((abs(a - b) for a, b in zip(run.first_tree.get("scores", [])[1:], rt["scores"][1:])), default=0.0)
    tree_equal = (n == len(rt["tokens"]) and run.first_tree["tokens"] == rt["tokens"]
                  and run.first_tree["depths"] == rt["depths"] and run.first_tree["parents"][1:] == rt["parents"][1:]
                  and gap <= score_tol)
    clean, steps = ref["output_ids_clean"], ref["accept_lengths"]
    made = steps[:len(run.accept_lengths)]
    covered = 1 + sum(a + 1 for a in made)        # the prefill's token, then accepted + bonus per step
    steps_equal = made == run.accept_lengths and (len(steps) == len(run.accept_lengths) or covered >= len(clean))
    row = {"id": ref.get("question_id"), "first_tree": tree_equal, "accept_lengths": steps_equal,
           "output": run.tokens == clean, "max_score_gap": gap, "steps": len(run.accept_lengths),
           "steps_reference": len(steps)}
    if not tree_equal:
        row["first_tree_ours"], row["first_tree_reference"] = run.first_tree, {k: rt[k] for k in run.first_tree}
    if not steps_equal:
        i = next((j for j, (a, b) in enumerate(zip(run.accept_lengths, steps)) if a != b), len(made))
        row["first_step_difference"] = {"step": i, "ours": run.accept_lengths[i:i + 5], "reference": steps[i:i + 5]}
    if not row["output"]:
        i = next((j for j, (a, b) in enumerate(zip(run.tokens, clean)) if a != b), min(len(run.tokens), len(clean)))
        row["first_output_difference"] = {"index": i, "ours": run.tokens[i:i + 3], "reference": clean[i:i + 3]}
    return row

