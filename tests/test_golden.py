"""Golden traces: eagle-ray does, step by step, what the SafeAILab reference did on the golden pair.

The golden pair (tests/golden: a tiny fixed Llama target, an EAGLE-2 and an EAGLE-3 head trained on its greedy
outputs) accepts almost a whole tree path every step, so deep draft levels (the head fed its own output), the
tree's later ranks and the KV moves of long accepted paths all decide the result. The reference ran each head with
trees 8/2/3 (the default) and 60/5/10 on 10 prompts (fp32, greedy; tests/golden/README.md says how); its first
draft tree, every step's accepted length and the output are committed. Here eagle-ray runs the same prompts: every
tree token, parent and depth equal, every draft score within ``SCORE_TOL``, every step's accepted length and every
output token equal; at batch 1, at batch 4 (continuous batching of prompts of 16 to 89 tokens) and with key lengths
bucketed as the CUDA-graph path reads them, and with the fused layers a GPU runs.
"""
from pathlib import Path

import pytest

from eagle_ray.config import SamplingParams
from eagle_ray.fidelity import SCORE_TOL, compare, engine_like, read_trace, run_prompts

GOLDEN = Path(__file__).parent / "golden"
REPO = GOLDEN.parents[1]
TRACES = sorted((GOLDEN / "traces").glob("*.json"))
REFERENCE_COMMIT = "cb7e0841fe0c206c6ed74a197ad5e2a1f13f5a2b"   # SafeAILab/EAGLE


def golden_engine(trace: dict, batch: int, **options):
    """The engine the reference's trace describes, on the committed golden pair."""
    s = trace["settings"]
    return engine_like(trace, str(REPO / s["target"]), str(REPO / s["head"]), batch, **options)


def disagreements(trace_file: Path, batch: int, kv_bucket: int = 1, **options) -> list[dict]:
    trace = read_trace(trace_file)
    engine = golden_engine(trace, batch, **options)
    engine.target.cache.kv_bucket = engine.draft.cache.kv_bucket = kv_bucket
    runs = run_prompts(engine, [p["prompt_ids"] for p in trace["prompts"]], trace["settings"]["max_new_tokens"])
    rows = [compare(run, ref) for run, ref in zip(runs, trace["prompts"])]
    return [r for r in rows if not (r["first_tree"] and r["accept_lengths"] and r["output"])]


def test_the_traces_cover_both_heads_and_both_trees_from_the_pinned_reference():
    seen = set()
    for f in TRACES:
        trace = read_trace(f)
        s = trace["settings"]
        seen.add((s["head_type"], (s["total_token"], s["depth"], s["top_k"])))
        assert trace["environment"]["reference_commit"] == REFERENCE_COMMIT
        assert s["dtype"] == "float32" and s["temperature"] == 0.0 and len(trace["prompts"]) == 10
        assert all(p["greedy_match"] for p in trace["prompts"])     # the reference's own check: tree == plain greedy
    assert seen == {(h, t) for h in ("eagle2", "eagle3") for t in ((8, 2, 3), (60, 5, 10))}


@pytest.mark.parametrize("trace_file", TRACES, ids=lambda f: f.stem)
def test_the_golden_pair_accepts_at_least_three_tokens_a_step_in_the_reference(trace_file):
    trace = read_trace(trace_file)
    assert trace["summary"]["pooled_tau"] >= 3.0


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("trace_file", TRACES, ids=lambda f: f.stem)
def test_every_step_equals_the_reference(trace_file, batch):
    assert disagreements(trace_file, batch) == []


@pytest.mark.parametrize("trace_file", TRACES, ids=lambda f: f.stem)
def test_every_step_equals_the_reference_with_bucketed_key_lengths(trace_file):
    assert disagreements(trace_file, 4, kv_bucket=256) == []


@pytest.mark.parametrize("trace_file", TRACES, ids=lambda f: f.stem)
def test_every_step_equals_the_reference_with_fused_layers(trace_file):
    """The few-kernel layers a GPU runs (model/fused.py), here in fp32 on the CPU."""
    assert disagreements(trace_file, 4, fused_layers=True, cpu_linears="native") == []


@pytest.mark.slow
@pytest.mark.parametrize("trace_file", TRACES, ids=lambda f: f.stem)
def test_every_step_equals_the_reference_with_compiled_forwards(trace_file):
    """The four traces share this process's compiled layer graphs (one target; a trace adds only the shapes and
    heads the ones before it lacked). ``fullgraph=True`` turns a compile past the recompile limit into an error, so
    shared graphs never fall back to eager unnoticed."""
    assert disagreements(trace_file, 4, compile="inductor") == []


@pytest.mark.slow
def test_inductor_kernels_give_the_eager_tokens_speculative_and_plain():
    """Inductor's kernels against eager layers on the golden pair (the EAGLE-2 head, the first trace's engine),
    speculative and plain. After the traces above, in this process: their graphs serve the speculative steps, so
    only plain decoding's shapes compile here (on a target of its own, every graph would)."""
    trace = read_trace(TRACES[0])
    prompts = [p["prompt_ids"] for p in trace["prompts"]]
    eager = golden_engine(trace, 4, cpu_linears="input_major")   # the linears model.compile picks on CPU
    compiled = golden_engine(trace, 4, compile="inductor")
    for speculative in (True, False):
        want, got = (e.generate(prompts, SamplingParams(max_new_tokens=24), speculative=speculative)
                     for e in (eager, compiled))
        assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_a_score_off_by_more_than_the_tolerance_is_a_difference():
    trace = read_trace(TRACES[0])
    ref = trace["prompts"][0]
    from eagle_ray.fidelity import PromptRun
    tree = dict(ref["first_tree"])
    run = PromptRun(ref["output_ids_clean"], ref["accept_lengths"], dict(tree))
    assert compare(run, ref)["first_tree"]
    run.first_tree["scores"] = [0.0] + [s + 2 * SCORE_TOL for s in tree["scores"][1:]]
    assert not compare(run, ref)["first_tree"]
    run = PromptRun(ref["output_ids_clean"], [0] + ref["accept_lengths"][1:], tree)
    assert compare(run, ref)["first_step_difference"]["step"] == 0
