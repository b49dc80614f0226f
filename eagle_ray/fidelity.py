"""Fidelity against the SafeAILab reference, step by step: run eagle-ray on the prompts, head and tree of a
reference trace (``bench/fidelity.py reference``) and compare what each system did; and, for greedy outputs that
leave another decoder's (transformers ``generate()``, plain decoding), where they first part and whether that is a
near-tie (:func:`divergence`, :func:`near_tie`).

Compared per prompt: the first draft tree (tokens, parents and depths exactly, cumulative draft scores within a
tolerance), the accepted length of every verify step, and the output tokens. The golden test
(``tests/test_golden.py``) runs this on every commit against committed traces; ``bench/fidelity.py eagle-ray``
writes the same comparison as a result file, and ``bench/fidelity.py lossless`` the greedy check against
``generate()``.

How the reference's counting differs, and how it is read here: ``eagenerate`` stops only once its counter passes
``max_new_tokens`` (the first token, from the prefill, is not counted), so it can run cycles after the output is
complete; they are cut from its cleaned output (``output_ids_clean``), and its later steps are not compared.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

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



# ---- greedy outputs against another decoder's -------------------------------------------------------------------
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


def tie_rule(dtype: torch.dtype, tie_gap: float | None) -> str:
    """:func:`near_tie`'s rule in words, for result files."""
    if tie_gap is not None:
        return f"gap < {tie_gap}"
    return "gap < 1e-3" if dtype == torch.float32 else \
        f"gap <= one {str(dtype).replace('torch.', '')} unit at the top logit"


def hf_logits_fn(hf):
    """A transformers model's fp32 next-token logits after ``ids``, as :func:`divergence` reads them."""
    def fn(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return hf(torch.tensor([ids], device=hf.device)).logits[0, -1].float()
    return fn
