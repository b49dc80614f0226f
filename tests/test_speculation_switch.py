"""Plain decoding is one of the trees a step may run (``total_tokens: 1``): a sequence goes from speculative to
plain steps and back, its head's inputs wait until a step drafts for it (or until their memory bound), and greedy
output stays the target's own."""
import itertools
from dataclasses import replace

from test_engine import mixed_prompts, reference_greedy
from tiny import tiny_engine

from eagle_ray.config import PLAIN, SamplingParams, TreeConfig

TREE = TreeConfig(total_tokens=12, depth=3, top_k=3)


def run_with_pattern(engine, prompts, pattern, new_tokens=48):
    """Generate at batch 4 with the step's tree taken from ``pattern`` in turn (True: TREE, False: plain)."""
    turns = itertools.cycle(pattern)
    engine.policy.step_tree = lambda batch: TREE if next(turns) else PLAIN
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


def count_head_passes(engine, monkeypatch) -> list[int]:
    """Tokens of every head forward (extend passes and draft levels), appended as they run (until the test ends:
    the head is shared, and a copy of it must not call this one)."""
    passes, forward = [], engine.draft.forward

    def spy(tokens, *args, **kw):
        passes.append(tokens.numel())
        return forward(tokens, *args, **kw)
    monkeypatch.setattr(engine.draft, "forward", spy)
    return passes


def test_plain_steps_never_run_the_head(tiny_dir, tiny_head, monkeypatch):
    """The head's pairs wait for a step that drafts: a request that runs plain to its end costs no head pass."""
    engine = tiny_engine(tiny_dir, tiny_head, TREE, max_batch_size=4)
    engine.policy.step_tree = lambda batch: PLAIN
    passes = count_head_passes(engine, monkeypatch)
    seqs = [engine.add_request(p, SamplingParams(max_new_tokens=60, ignore_eos=True)) for p in mixed_prompts(4)]
    most = 0
    while engine.has_unfinished():
        engine.step()
        most = max([most] + [len(s.pending) for s in seqs if not s.finished])
    assert passes == [] and all(s.finished for s in seqs)
    assert most == max(len(s.prompt_ids) for s in seqs) + 58     # a pair per prompt token and verified token


def test_pending_pairs_stay_under_their_memory_bound(tiny_dir, tiny_hf, tiny_head):
    """At ``max_pending`` pairs a sequence feeds the head in one bounded pass even in plain steps, so a long plain
    stretch holds bounded memory; speculating again afterwards gives the same output."""
    prompts = mixed_prompts(4, seed=2)
    engine = tiny_engine(tiny_dir, tiny_head, TREE, max_batch_size=4)
    engine.scheduler.feeding = replace(engine.scheduler.feeding, max_pending=10)
    turns = itertools.cycle([False] * 30 + [True] * 5)
    engine.policy.step_tree = lambda batch: TREE if next(turns) else PLAIN
    seqs = [engine.add_request(p, SamplingParams(max_new_tokens=80, ignore_eos=True)) for p in prompts]
    most = 0
    while engine.has_unfinished():
        engine.step()
        running = [len(s.pending) for s in seqs if not s.finished and not s.in_prefill]
        most = max([most] + running)
    assert most <= 10 and all(s.finished for s in seqs)
    assert [s.output_ids for s in seqs] == [reference_greedy(tiny_hf, p, 80) for p in prompts]


def test_a_return_to_speculation_catches_up_in_bounded_passes(tiny_dir, tiny_head, monkeypatch):
    """After a plain stretch the head takes at most ``MAX_EXTEND_PASSES`` passes of ``extend_budget`` tokens a
    step; sequences it has not caught up with verify their root only, the others draft at once."""
    from eagle_ray.engine.scheduler import MAX_EXTEND_PASSES
    engine = tiny_engine(tiny_dir, tiny_head, TREE, max_batch_size=4)
    engine.scheduler.feeding = replace(engine.scheduler.feeding, extend_budget=24)
    drafting = [False]
    engine.policy.step_tree = lambda batch: TREE if drafting[0] else PLAIN
    seqs = [engine.add_request(p, SamplingParams(max_new_tokens=90, ignore_eos=True)) for p in mixed_prompts(4)]
    for _ in range(40):
        engine.step()
    assert all(len(s.pending) > 24 for s in seqs)
    drafting[0] = True
    passes = count_head_passes(engine, monkeypatch)
    widths = []
    while any(len(s.pending) > 8 for s in seqs):
        before = len(passes)
        engine.step()
        extend = passes[before:before + MAX_EXTEND_PASSES + 1]
        widths.append((engine.counters["tree_nodes"], extend))
        assert len([n for n in passes[before:] if n > 3 * 4]) <= MAX_EXTEND_PASSES   # wider than a draft level
        assert all(n <= 24 for n in extend)
    assert len(widths) > 2       # four sequences of 40+ pairs in passes of 24: several steps of catching up


def test_the_tuner_can_choose_plain():
    from eagle_ray.engine.tuning import choose_trees
    from eagle_ray.speculative.trace import TreeTrace

    class NoAcceptance(TreeTrace):
        def simulated_tau(self, *shape):
            return 1.0   # a head that is never right: every tree costs more than it brings
    verify = {1: {n: 0.01 * (1 + n / 100) for n in (1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48)}}
    draft = {1: {f"{d},{k}": 0.002 for d in range(6) for k in (1, 2, 3, 4, 6, 8)}}
    choices, table = choose_trees(NoAcceptance(), verify, draft)
    assert TreeConfig(**choices[1].tree) == PLAIN and choices[1].expected_tok_s == 1 / verify[1][1]
    assert {"total_tokens": 1, "tau": 1.0}.items() <= table[0].items()


def test_a_tree_must_be_predicted_clearly_faster_than_plain():
    """Costs and trace are estimates: a tree predicted under ``MIN_GAIN`` x plain's tokens/s loses to plain."""
    from eagle_ray.engine.tuning import MIN_GAIN, choose_trees
    from eagle_ray.speculative.trace import TreeTrace

    class Accepts(TreeTrace):
        def __init__(self, tau):
            super().__init__()
            self.tau = tau

        def simulated_tau(self, *shape):
            return self.tau if shape[0] > 1 else 1.0
    verify = {1: {n: 0.01 for n in (1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48)}}
    draft = {1: {f"{d},{k}": 0.0 for d in range(6) for k in (1, 2, 3, 4, 6, 8)}}
    assert TreeConfig(**choose_trees(Accepts(MIN_GAIN - 0.01), verify, draft)[0][1].tree) == PLAIN
    chosen = choose_trees(Accepts(MIN_GAIN + 0.01), verify, draft)[0][1]
    assert chosen.tree["total_tokens"] > 1 and chosen.expected_tau == MIN_GAIN + 0.01


def test_a_simulated_batch_budget_spans_roots_only_to_uncapped(tiny_dir, tiny_head):
    from eagle_ray.engine.tuning import TRACE_TREE, collect_trace
    engine = tiny_engine(tiny_dir, tiny_head, TREE, max_batch_size=4)
    trace = collect_trace(engine, mixed_prompts(8, seed=3), 24, TRACE_TREE)
    shape = (12, 3, 3)
    assert trace.simulated_budget(*shape, batch=1, verify_cap=12) == (trace.simulated_tau(*shape), 12.0)
    assert trace.simulated_budget(*shape, batch=4, verify_cap=4) == (1.0, 1.0)
    taus = [trace.simulated_budget(*shape, batch=4, verify_cap=4 * n)[0] for n in range(1, 13)]
    assert taus == sorted(taus) and taus[-1] > 1.0


def test_the_tuned_verify_budget_applies_per_batch_size(tiny_dir, tiny_head):
    engine = tiny_engine(tiny_dir, tiny_head, TREE, max_batch_size=4)
    engine.config = engine.config.replace(verify_budget_by_batch={2: 6, 4: 10}, verify_cap=30)
    assert [engine.policy.verify_cap(n) for n in (1, 2, 3, 4)] == [30, 6, 6, 10]
    assert engine.policy.summary() == TREE.model_dump(exclude_none=True)
    engine.set_trees(trees_by_batch={1: TREE, 4: PLAIN})
    assert engine.policy.summary()["trees_by_batch"]["4"] == "plain"
    assert engine.policy.summary()["verify_cap_by_batch"] == {"2": 6, "4": 10}


def test_prompt_chunks_come_first_and_trees_take_the_room_left(tiny_dir, tiny_head):
    """Decoding sequences take one token each, prompt chunks the rest; trees get only what the prompts leave, as a
    verify cap on the step (a cap under two tokens a sequence runs the step plain, without drafting)."""
    engine = tiny_engine(tiny_dir, tiny_head, TREE, max_batch_size=5, max_model_len=512)
    for i in range(4):
        engine.add_request([5 + i, 9, 10], SamplingParams(max_new_tokens=50, ignore_eos=True))
    while engine.scheduler.prefilling or engine.scheduler.waiting:
        engine.step()
    engine.add_request([3 + i % 60 for i in range(262)], SamplingParams(max_new_tokens=5))
    plan = engine.scheduler.schedule(engine.target.max_len)
    assert len(plan.decode) == 4 and [c.end - c.start for c in plan.prefill] == [256 - 4]
    assert plan.verify_cap == 4 and plan.drafted == [] and plan.plain == plan.decode   # under 2 a sequence
    before = dict(engine.counters)
    engine.step()                                      # the prompt's first 252 tokens; the four decode plain
    assert engine.counters["verify_tokens"] - before["verify_tokens"] == 4
    assert engine.counters["tree_nodes"] - before["tree_nodes"] == 4          # roots only: no draft token
    plan = engine.scheduler.schedule(engine.target.max_len)
    assert [c.end - c.start for c in plan.prefill] == [10]
    assert plan.verify_cap is None and engine.policy.verify_cap(4, 256 - 10) is None   # four 12-node trees fit
    assert engine.policy.verify_cap(4, 30) == 30


def test_trees_trimmed_to_the_room_prompts_leave_keep_the_greedy_output(tiny_dir, tiny_hf, tiny_head):
    """Prompts arriving while others decode: steps run plain, trimmed trees (the room as a verify cap) and whole
    trees, and every output is still the target's greedy output."""
    engine = tiny_engine(tiny_dir, tiny_head, TREE, max_batch_size=3)
    engine.scheduler.step_budget = 16     # prompts of 1-23 tokens next to one or two decoding sequences
    caps = []
    step_cap = engine.policy.verify_cap

    def spy(batch, room=None):
        caps.append((batch, room, step_cap(batch, room)))
        return caps[-1][2]
    engine.policy.verify_cap = spy
    prompts = mixed_prompts(7, seed=5)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] == [reference_greedy(tiny_hf, p, 24) for p in prompts]
    trimmed = [c for b, room, c in caps if room is not None and c is not None and 2 * b <= c < 12 * b]
    plain = [c for b, room, c in caps if c is not None and c < 2 * b]
    whole = [c for b, room, c in caps if c is None]
    assert trimmed and plain and whole
