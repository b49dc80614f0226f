"""Tree traces and the tree tuner: exact numbers on hand-made trees, calibration and simulated tau, the tuner's
trade of acceptance against cost, lookup chains, and autotune on tiny models (lossless, cached)."""
import math

import pytest
import torch
from tiny import tiny_engine

from eagle_ray.config import ConfigError, EngineConfig, SamplingParams, TreeConfig
from eagle_ray.speculative.trace import TreeTrace
from eagle_ray.speculative.tree import Tree, ancestor_mask
from eagle_ray.engine.tuning import autotune, choose_trees


def known_tree() -> Tree:
    """root -> a (p .65) -> c (.55) -> d (.55), root -> b (.35); the target accepts a and c."""
    parents = torch.tensor([[0, 0, 0, 1, 3]])
    depth = torch.tensor([[0, 1, 1, 2, 3]])
    scores = torch.tensor([[0.0, math.log(.65), math.log(.35), math.log(.65 * .55), math.log(.65 * .55 * .55)]])
    return Tree(torch.tensor([[5, 6, 7, 8, 9]]), parents, depth, torch.ones(1, 5, dtype=torch.bool),
                ancestor_mask(parents, 3), scores)


def known_trace() -> TreeTrace:
    trace = TreeTrace()
    trace.record(known_tree(), torch.tensor([[0, 1, 3]]))
    return trace


def test_calibration_counts_nodes_the_target_judged():
    rows = {(r["bin_lo"], r["bin_hi"]): r for r in known_trace().calibration()}
    assert rows[(0.3, 0.4)]["nodes"] == 1 and rows[(0.3, 0.4)]["acceptance_rate"] == 0.0       # b
    assert rows[(0.5, 0.6)]["nodes"] == 2 and rows[(0.5, 0.6)]["acceptance_rate"] == 0.5       # c yes, d no
    assert rows[(0.6, 0.7)]["nodes"] == 1 and rows[(0.6, 0.7)]["acceptance_rate"] == 1.0       # a
    assert sum(r["nodes"] for r in rows.values()) == 4


@pytest.mark.parametrize("shape,tau", [((5, 2, 2), 3.0), ((2, 0, 1), 2.0), ((3, 2, 1), 3.0), ((3, 0, 2), 2.0),
                                       ((5, 1, 2), 3.0), ((2, 0, 2), 2.0)])
def test_simulated_tau_cuts_the_recorded_tree(shape, tau):
    assert known_trace().simulated_tau(*shape) == tau


def test_tuner_trades_acceptance_against_cost():
    trace = known_trace()
    draft = {b: {f"{d},{k}": 0.0 for d in range(6) for k in (1, 2, 3, 4, 6, 8)} for b in (1,)}
    flat = {1: {n: 1.0 for n in range(1, 49)}}
    linear = {1: {n: 1.0 + n for n in range(1, 49)}}
    assert choose_trees(trace, flat, draft)[0][1].expected_tau == 3.0
    best = choose_trees(trace, linear, draft)[0][1]
    assert (best.tree["total_tokens"], best.expected_tau) == (3, 3.0)   # 3/(1+3) beats 2/(1+2) and 3/(1+5)
    assert best.plain_tok_s == 0.5


def chained_trace(text: list[int], at: int) -> TreeTrace:
    """``known_tree`` recorded for request "r" with ``text[:at]`` behind it, chains matched against ``text``."""
    trace = TreeTrace()
    trace.record(known_tree(), torch.tensor([[0, 1, 3]]), [("r", at)])
    trace.match_chains({"r": text}, ngram=3, length=5)
    return trace


def test_a_traced_step_knows_how_deep_its_lookup_chain_would_have_been_accepted():
    # history 1 2 3 4 9 1 2 3: "1 2 3" occurred before, followed by 4 9 1 2 3; the sequence went on 4 7
    trace = chained_trace([1, 2, 3, 4, 9, 1, 2, 3, 4, 7], at=8)
    assert trace.chain_found.tolist() == [True] and trace.chain_match.tolist() == [1]
    # history 1 .. 8 1 2 3: the chain 4 5 6 7 8, the sequence went on 4 5 6 7 0
    trace = chained_trace([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 0], at=11)
    assert trace.chain_match.tolist() == [4]
    # the tree alone accepts a and c (tau 3); a chain accepted 4 deep is the deeper path, cut to its length
    assert [trace.simulated_tau(5, 2, 2, n) for n in (0, 3, 5)] == [3.0, 4.0, 5.0]
    assert trace.simulated_tau(2, 0, 1, 5) == 5.0
    assert chained_trace([1, 2, 3, 4, 5, 6], at=4).chain_found.tolist() == [False]   # "2 3 4" never seen before


def test_the_share_of_passes_a_chain_widens_grows_with_the_batch():
    trace = TreeTrace()
    trace.chain_found = torch.tensor([True, False, False, False, False, False, True, False])
    assert [trace.chain_rate(b) for b in (1, 2, 4, 8)] == [0.25, 0.5, 1.0, 1.0]


def test_the_tuner_grafts_lookup_chains_only_where_they_pay():
    trace = chained_trace([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 0], at=11)
    draft = {1: {f"{d},{k}": 0.0 for d in range(6) for k in (1, 2, 3, 4, 6, 8)}}
    flat = {1: {n: 1.0 for n in range(1, 49)}}
    linear = {1: {n: 1.0 + n for n in range(1, 49)}}
    wide = choose_trees(trace, flat, draft, lookup=5)[0][1]      # a chain costs nothing: 4 more tokens
    assert (wide.tree["lookup"], wide.expected_tau) == (5, 5.0)
    narrow = choose_trees(trace, linear, draft, lookup=5)[0][1]   # 3/(1+3) beats 5/(1+2+5)
    assert (narrow.tree["total_tokens"], narrow.tree["lookup"], narrow.expected_tau) == (3, 0, 3.0)
    assert choose_trees(trace, flat, draft)[0][1].tree["lookup"] == 0   # lookups off: never tried


def test_pass_costs_between_measured_widths_are_interpolated():
    from eagle_ray.engine.tuning import pass_seconds
    costs = {1: 1.0, 4: 4.0, 8: 6.0}
    assert [pass_seconds(costs, w) for w in (4, 2, 6, 10, 0.5)] == [4.0, 2.0, 5.0, 7.0, 1.0]
    assert pass_seconds({4: 2.0}, 9) == 2.0


def test_tree_for_uses_the_largest_batch_entry_at_or_below(tiny_dir, tiny_head):
    small, big = TreeConfig(total_tokens=4, depth=1, top_k=2), TreeConfig(total_tokens=12, depth=3, top_k=3)
    engine = tiny_engine(tiny_dir, tiny_head)
    engine.set_trees(trees_by_batch={2: small, 4: big})
    assert [engine.policy.tree_for(n) for n in (1, 2, 3, 4, 9)] == [small, small, small, big, big]
    assert engine.policy.max_verify_budget() == 12 + 5   # the largest tree and its lookup chain
    for bad in ({}, {0: small}):
        with pytest.raises(ConfigError):
            EngineConfig(trees_by_batch=bad)


def test_a_tuning_trace_matches_every_step_s_lookup_chain(tiny_dir, tiny_head):
    from eagle_ray.engine.tuning import TRACE_TREE, collect_trace
    engine = tiny_engine(tiny_dir, tiny_head, max_batch_size=2)
    trace = collect_trace(engine, [[5, 9, 13, 20], [7, 3, 40], [11, 12]], 24, TRACE_TREE)
    assert len(trace.chain_match) == len(trace) > 0 and trace.chain_found.any()   # tiny random models loop
    assert (trace.chain_match <= 5).all() and not trace.chain_match[~trace.chain_found].any()
    assert trace.simulated_tau(12, 3, 3, 5) >= trace.simulated_tau(12, 3, 3)


def test_autotune_picks_trees_that_stay_lossless_and_caches_them(tiny_dir, tiny_head, monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE_RAY_CACHE", str(tmp_path))
    engine = tiny_engine(tiny_dir, tiny_head, max_batch_size=2)
    prompts = [[5, 9, 13, 20], [7, 3, 40], [11, 12]]
    result = autotune(engine, batch_sizes=[1, 2], prompts=prompts, max_new_tokens=12)
    assert sorted(result.batches) == [1, 2] and result.trace_steps > 0
    assert all(c.expected_tau >= 1.0 and c.step_s > 0 for c in result.batches.values())
    assert len(list((tmp_path / "tuning").glob("*.json"))) == 1
    assert autotune(engine, batch_sizes=[1, 2], prompts=prompts).to_dict() == result.to_dict()  # from the cache
    only_one = autotune(engine, batch_sizes=[1], prompts=prompts)  # a smaller engine is served by the same file
    assert only_one.batches == {1: result.batches[1]} and list(only_one.costs["verify"]) == ["1"]
    assert {c.tree["lookup"] for c in result.batches.values() if c.tree["total_tokens"] > 1} <= {0, 5}
    engine.set_trees(trees_by_batch=result.trees_by_batch())
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    assert [o.token_ids for o in engine.generate(prompts, params)] == \
        [o.token_ids for o in engine.generate(prompts, params, speculative=False)]


def test_the_cost_table_predicts_at_the_context_a_run_decodes_at():
    """Passes are timed at a short and a long context and the choice made at their mean; a run's steady steps are
    compared with the table read at their own mean context (linear between the two, along the ends beyond)."""
    from eagle_ray.engine.tuning import BatchChoice, TuningResult
    at = {"128": {"1": 0.010, "4": 0.020}, "384": {"1": 0.030, "4": 0.040}}
    verify = {"1": 0.020 + 0.005, "4": 0.030 + 0.005}          # the mean pass plus 5 ms of host per step
    tree = TreeConfig(total_tokens=4, depth=2, top_k=2)
    result = TuningResult("cpu", "float32", 1, {8: BatchChoice(tree.model_dump(), 2.0, 0.001 + 0.035, 8 * 2 / 0.036,
                                                               8 / 0.025)},
                          10, 2.0, 1.0, {"verify": {"8": verify}, "verify_at": {"8": at}, "host": {"8": 0.005}})
    assert result.predicted_tok_s(8, 256) == pytest.approx({"choice": 8 * 2 / 0.036, "plain": 8 / 0.025})
    assert result.predicted_tok_s(8, 128) == pytest.approx({"choice": 8 * 2 / 0.026, "plain": 8 / 0.015})
    assert result.predicted_tok_s(8, 512) == pytest.approx({"choice": 8 * 2 / 0.056, "plain": 8 / 0.045})
