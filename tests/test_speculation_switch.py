"""Plain decoding is one of the trees a step may run (``total_tokens: 1``): a sequence goes from speculative to
plain steps and back, its head's inputs keep accumulating, and greedy output stays the target's own."""
import itertools

from test_engine import mixed_prompts, reference_greedy
from tiny import tiny_engine

from eagle_ray.config import PLAIN, SamplingParams, TreeConfig
from eagle_ray.engine.model_runner import FEED_EVERY

TREE = TreeConfig(total_tokens=12, depth=3, top_k=3)


def run_with_pattern(engine, prompts, pattern, new_tokens=48):
    """Generate at batch 4 with the step's tree taken from ``pattern`` in turn (True: TREE, False: plain)."""
    turns = itertools.cycle(pattern)
    engine.tree_for = lambda batch: TREE if next(turns) else PLAIN
    return engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))


def test_greedy_output_is_the_same_with_speculation_on_off_or_switching(tiny_dir, tiny_hf, tiny_head):
    prompts = mixed_prompts(6, seed=11)
    expected = [reference_greedy(tiny_hf, p, 48) for p in prompts]
    for pattern in ([False], [True, False], [False, False, True], [True] * 3 + [False] * 40):
        engine = tiny_engine(tiny_dir, tiny_head, TREE, max_batch_size=4)
        outs = run_with_pattern(engine, prompts, pattern)
        assert [o.token_ids for o in outs] == expected, pattern
        if pattern == [False]:
            assert all(o.stats.accept_hist == [o.stats.verify_steps] for o in outs)  # nothing drafted
        if pattern == [True, False]:
            assert any(len(o.stats.accept_hist) > 2 for o in outs)  # speculative steps still accept deep paths


def test_plain_steps_feed_the_head_in_bounded_passes(tiny_dir, tiny_head):
    engine = tiny_engine(tiny_dir, tiny_head, TREE, max_batch_size=4)
    engine.tree_for = lambda batch: PLAIN
    seqs = [engine.add_request(p, SamplingParams(max_new_tokens=100, ignore_eos=True)) for p in mixed_prompts(4)]
    most = 0
    while engine.has_unfinished():
        engine.step()
        most = max([most] + [len(s.draft_tokens) for s in seqs if not s.finished])
    assert most < FEED_EVERY
    assert all(s.finished for s in seqs)


def test_the_tuner_can_choose_plain():
    from eagle_ray.engine.tuning import choose_trees
    from eagle_ray.spec.trace import TreeTrace

    class NoAcceptance(TreeTrace):
        def simulated_tau(self, *shape):
            return 1.0   # a head that is never right: every tree costs more than it brings
    verify = {1: {n: 0.01 * (1 + n / 100) for n in (1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48)}}
    draft = {1: {f"{d},{k}": 0.002 for d in range(6) for k in (1, 2, 3, 4, 6, 8)}}
    choices, table = choose_trees(NoAcceptance(), verify, draft)
    assert TreeConfig(**choices[1].tree) == PLAIN and choices[1].expected_tok_s == 1 / verify[1][1]
    assert {"total_tokens": 1, "tau": 1.0}.items() <= table[0].items()


def test_a_simulated_batch_budget_spans_roots_only_to_uncapped(tiny_dir, tiny_head):
    from eagle_ray.engine.tuning import TRACE_TREE, collect_trace
    engine = tiny_engine(tiny_dir, tiny_head, TREE, max_batch_size=4)
    trace = collect_trace(engine, mixed_prompts(8, seed=3), 24, TRACE_TREE)
    shape = (12, 3, 3)
    assert trace.simulated_budget(*shape, batch=1, max_verify_tokens=12) == (trace.simulated_tau(*shape), 12.0)
    assert trace.simulated_budget(*shape, batch=4, max_verify_tokens=4) == (1.0, 1.0)
    taus = [trace.simulated_budget(*shape, batch=4, max_verify_tokens=4 * n)[0] for n in range(1, 13)]
    assert taus == sorted(taus) and taus[-1] > 1.0


def test_the_tuned_verify_budget_applies_per_batch_size(tiny_dir, tiny_head):
    engine = tiny_engine(tiny_dir, tiny_head, TREE, max_batch_size=4)
    engine.config = engine.config.replace(verify_budget_by_batch={2: 6, 4: 10}, max_verify_tokens=30)
    assert [engine.verify_budget_for(n) for n in (1, 2, 3, 4)] == [30, 6, 6, 10]
    assert engine.tree_summary() == TREE.model_dump(exclude_none=True)
    engine.set_trees(trees_by_batch={1: TREE, 4: PLAIN})
    assert engine.tree_summary()["trees_by_batch"]["4"] == "plain"
    assert engine.tree_summary()["verify_budget_by_batch"] == {"2": 6, "4": 10}


def test_prompt_chunks_get_the_room_a_plain_batch_leaves(tiny_dir, tiny_head):
    """The step budget counts the tree the step runs: four sequences decoding plain leave 256 - 4 prompt tokens,
    not 256 - 4 x 12 (the largest tree's reservation)."""
    engine = tiny_engine(tiny_dir, tiny_head, TREE, max_batch_size=5, max_model_len=512)
    engine.set_trees(trees_by_batch={1: TREE, 4: PLAIN})
    for i in range(4):
        engine.add_request([5 + i, 9, 10], SamplingParams(max_new_tokens=50, ignore_eos=True))
    while engine.scheduler.prefilling or engine.scheduler.waiting:
        engine.step()
    engine.add_request([3 + i % 60 for i in range(300)], SamplingParams(max_new_tokens=5))
    room = {True: engine.max_tree_budget(), False: 1}
    plan = engine.scheduler.schedule(room, engine.target.max_len, spec_tokens=engine.step_tree_tokens)
    assert len(plan.decode) == 4 and [c.end - c.start for c in plan.prefill] == [256 - 4]
    assert engine.step_tree_tokens(1) == 12 and engine.step_tree_tokens(4) == 1
