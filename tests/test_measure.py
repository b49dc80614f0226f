"""What the measuring command counts as a near-tie when greedy outputs first differ; how runs take turns; what the
tree bench compares."""
import json

import pytest
import repo_scripts
import torch

from eagle_ray.config import TreeConfig
from eagle_ray.measure import divergence, interleaved, near_tie, ulp


def test_a_dtype_unit_is_the_spacing_of_its_values_at_that_size():
    assert ulp(20.0, torch.bfloat16) == 0.125 and ulp(-20.0, torch.bfloat16) == 0.125
    assert ulp(5.0, torch.bfloat16) == 2 ** -5
    assert ulp(20.0, torch.float16) == 2 ** -6
    assert torch.tensor(20.0 + ulp(20.0, torch.bfloat16) / 2).bfloat16().item() == 20.0   # half a unit: one value


def test_bf16_near_ties_are_gaps_the_dtype_cannot_resolve_and_fp32_ones_are_tiny():
    d = {"gap": 0.125, "top_logit": 21.3}
    assert near_tie(d, torch.bfloat16, None)
    assert not near_tie(d | {"top_logit": 9.0}, torch.bfloat16, None)     # a unit is 0.0625 there
    assert not near_tie(d, torch.float32, None) and near_tie(d | {"gap": 5e-4}, torch.float32, None)
    assert near_tie(d, torch.bfloat16, 0.2) and not near_tie(d, torch.bfloat16, 0.1)   # an explicit gap wins
    assert not near_tie({"gap": None, "top_logit": None}, torch.bfloat16, None)         # lengths differ: a bug


def test_a_divergence_reports_the_reference_gap_where_outputs_first_differ():
    logits = torch.zeros(10)
    logits[3], logits[4] = 12.0, 11.5
    d = divergence(lambda ids: logits, [1, 2], [7, 3, 5], [7, 4, 5])
    assert d == {"index": 1, "gap": 0.5, "top_logit": 12.0, "ref_token": 3, "got_token": 4}
    assert divergence(lambda ids: logits, [1], [7, 3], [7, 3]) is None


def test_interleaved_runs_take_turns_item_by_item_and_flip_the_order_every_other_item():
    calls = []
    outs, walls = interleaved({m: (lambda i, m=m: calls.append((m, i)) or f"{m}{i}") for m in "AB"}, 3)
    assert calls == [("A", 0), ("B", 0), ("B", 1), ("A", 1), ("A", 2), ("B", 2)]
    assert outs == {"A": ["A0", "A1", "A2"], "B": ["B0", "B1", "B2"]}
    assert [len(w) for w in walls.values()] == [3, 3] and all(t >= 0 for w in walls.values() for t in w)


def test_at_batch_1_the_modes_take_turns_prompt_by_prompt_and_agree(tiny_dir, tiny_hf, tiny_head, monkeypatch):
    """Speculative, plain and transformers runs alternate per prompt, the order reversed every other prompt, so
    a machine whose speed drifts slows every mode alike; greedy outputs are equal."""
    from argparse import Namespace

    from test_engine import mixed_prompts
    from tiny import tiny_engine

    from eagle_ray.config import TreeConfig
    from eagle_ray.measure import measure

    engine = tiny_engine(tiny_dir, tiny_head, TreeConfig(total_tokens=8, depth=3, top_k=2))
    order, generate, hf_generate = [], engine.generate, tiny_hf.generate

    def engine_generate(prompts, params=None, speculative=True):
        if params.max_new_tokens == 12:            # not the warm-up
            order.append("spec" if speculative else "plain")
        return generate(prompts, params, speculative=speculative)

    def transformers_generate(*args, **kwargs):
        order.append("hf")
        return hf_generate(*args, **kwargs)

    monkeypatch.setattr(engine, "generate", engine_generate)
    monkeypatch.setattr(engine, "reference_model", lambda: tiny_hf)
    monkeypatch.setattr(tiny_hf, "generate", transformers_generate)
    records = [{"prompt": p} for p in mixed_prompts(3, seed=11)]
    a = Namespace(max_new_tokens=12, temperature=0.0, batch_size=1, compare_hf=True, skip_plain=False, tie_gap=None)
    got = measure(engine, records, a)
    assert order == ["spec", "plain", "hf", "hf", "plain", "spec", "spec", "plain", "hf"]
    s = got["summary"]
    assert s["mismatches_vs_plain"]["count"] == 0 and s["mismatches_vs_hf"]["count"] == 0
    assert s["timing"] == "prompt by prompt, modes in turn (spec plain hf, then reversed)"
    assert all(r["speedup_vs_hf"] > 0 for r in got["rows"])


@pytest.mark.slow
def test_the_tree_bench_times_two_trees_of_the_embedded_pair_in_turn_and_their_fp32_outputs_agree(tmp_path):
    """``bench/tree_speed.py``: one engine per tree over the same prompts; in fp32 each output is the target's own
    whatever the tree, so none differs from the first tree's, and the result names the machine it ran on."""
    tree_speed = repo_scripts.load("bench/tree_speed.py")
    out = tmp_path / "trees.json"
    assert tree_speed.main(["--trees", "8/2/3", "6/1/4", "--num-prompts", "2", "--max-new-tokens", "12",
                            "--dtype", "float32", "--threads", "1", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["outputs_differing_from_first"] == {"8/2/3": 0, "6/1/4": 0}
    assert got["summary"]["8/2/3"]["tokens"] == got["summary"]["6/1/4"]["tokens"] == 24
    assert got["summary"]["6/1/4"]["tree"] == TreeConfig(total_tokens=6, depth=1, top_k=4).model_dump()
    assert got["speed_vs_first"]["8/2/3"] == 1.0 and got["cpu"] and got["batch_size"] == 1
    assert len(got["per_prompt_s"]["6/1/4"]) == 2
