"""The measured choice between speculative and plain steps (engine/chooser.py): each batch-size bucket starts from
the tuner's choice, samples the decode rows of steps that ran one mode, explores the other mode now and then and
keeps the faster, speculation only where it beats plain by ``MIN_GAIN``. Output never depends on it."""
from test_engine import mixed_prompts, reference_greedy
from tiny import tiny_engine

from eagle_ray.config import PLAIN, SamplingParams, TreeConfig
from eagle_ray.engine.chooser import SpeculationChooser
from eagle_ray.engine.chooser import MIN_GAIN

TREE = TreeConfig(total_tokens=12, depth=3, top_k=3)


def run(chooser, batch, tok_s: dict, steps: int, sampled: bool = True) -> list[bool]:
    """``steps`` one-second steps at ``batch``, each running what the chooser says at ``tok_s[mode]``; the modes."""
    modes = []
    for _ in range(steps):
        spec = chooser.speculate(batch)
        chooser.record(batch, spec, 1.0, tok_s[spec], sampled)
        modes.append(spec)
    return modes


def test_each_bucket_starts_from_its_prior_and_keeps_a_mode_the_other_cannot_beat():
    c = SpeculationChooser({1: True, 8: False}, window=4, explore_every=8)
    assert [c.speculate(n) for n in (1, 2, 7, 8, 64)] == [True, True, True, False, False]
    modes = run(c, 1, {True: 150, False: 100}, 4 + 4 + 16 + 4)
    assert modes == [True] * 4 + [False] * 4 + [True] * 16 + [False] * 4   # explored after one window, kept, next
    #                                                                          after twice explore_every
    b = c.buckets[1]
    assert b.speculate and b.explorations == 2 and b.switches == 0 and b.explore_every == 32
    assert c.summary()["1"] == {"choice": "tree", "tree_tok_s": 150.0, "plain_tok_s": 100.0, "explorations": 2,
                                "switches": 0}
    assert c.summary()["8"]["choice"] == "plain" and c.buckets[8].explorations == 0   # untouched by batch 1


def test_speculation_must_beat_plain_by_the_margin_and_a_switch_restarts_the_schedule():
    c = SpeculationChooser({16: True}, window=4, explore_every=8)
    modes = run(c, 16, {True: MIN_GAIN * 100 - 1, False: 100}, 8)
    assert modes == [True] * 4 + [False] * 4                         # the prior lasts one window
    assert not c.speculate(16) and c.buckets[16].switches == 1 and c.buckets[16].explore_every == 8
    modes = run(c, 16, {True: MIN_GAIN * 100 + 1, False: 100}, 12)   # speculation got clearly faster: back to it
    assert modes == [False] * 8 + [True] * 4 and c.speculate(16) and c.buckets[16].switches == 2


def test_speculation_pays_for_the_heads_catch_up():
    """Steady speculative steps at 150 tok/s, but every other step the head catches up for a second: 100 tok/s in
    all, no better than plain, so plain wins; the same steps without catch-up keep speculation."""
    for catch_up_s, keeps in ((1.0, False), (0.0, True)):
        c = SpeculationChooser({16: True}, window=8, explore_every=16)
        for _ in range(8):
            c.record(16, True, 3.0, 150, sampled=False, catch_up_s=catch_up_s)
            c.record(16, True, 1.0, 150, sampled=True)
        assert c.summary()["16"]["tree_tok_s"] == (100.0 if catch_up_s else 150.0)
        run(c, 16, {True: 150, False: 100}, 8)     # the plain window
        assert c.speculate(16) == keeps


def test_steps_of_mixed_modes_are_not_samples_and_a_window_that_never_fills_ends():
    c = SpeculationChooser({4: True}, window=4, explore_every=8)
    run(c, 4, {True: 10, False: 1000}, 50, sampled=False)           # rows catching up verify roots only
    assert c.speculate(4) and c.buckets[4].explorations == 0
    run(c, 4, {True: 10, False: 1000}, 4)
    assert not c.speculate(4)                                        # exploring plain after one window
    run(c, 4, {True: 10, False: 1000}, 16, sampled=False)            # never sampled: gives up after 4 windows
    assert c.speculate(4) and c.buckets[4].explorations == 1 and c.buckets[4].switches == 0


def test_output_is_the_targets_whatever_the_measured_choice_does(tiny_dir, tiny_hf, tiny_head):
    """A chooser that explores every few steps switches modes many times in one run; greedy output is unchanged."""
    prompts = mixed_prompts(6, seed=4)
    engine = tiny_engine(tiny_dir, tiny_head, TREE, max_batch_size=4)
    engine.policy.chooser = SpeculationChooser({1: True, 4: False}, window=2, explore_every=3, min_gain=1.0)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=40, ignore_eos=True))
    assert [o.token_ids for o in outs] == [reference_greedy(tiny_hf, p, 40) for p in prompts]
    measured = engine.policy.summary()["measured"]
    assert sum(m["explorations"] for m in measured.values()) >= 2
    assert engine.policy.speculative_tree_for(4) == TREE and PLAIN != TREE


def test_steady_steps_are_tallied_by_mode_and_batch(tiny_dir, tiny_head):
    """What the tuner predicts, as the engine ran it: whole decode-only steps, keyed by (drafted, sequences)."""
    prompts = [[5, 9, 13, 20], [7, 3, 40]]
    engine = tiny_engine(tiny_dir, tiny_head, TREE, max_batch_size=2)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    engine.generate(prompts, params, speculative=False)
    (key, (seconds, tokens, steps, contexts)), = engine.steady_steps.items()
    assert key == (False, 2) and seconds > 0 and tokens == 2 * steps and 0 < steps <= 12
    assert 3 + 1 <= contexts / steps <= 4 + 12   # prompt plus output, per sequence, after each step
    engine.steady_steps.clear()
    outs = engine.generate(prompts, params)
    assert {drafted for drafted, _ in engine.steady_steps} == {True}
    assert sum(t[1] for t in engine.steady_steps.values()) <= sum(len(o.token_ids) for o in outs)


def test_steps_with_prompt_chunks_sample_their_decode_rows(tiny_dir, tiny_head):
    """A job of short answers: most steps carry a prompt chunk, and their decode rows are samples all the same
    (timed without the chunks), so the measured choice gets its samples early."""
    engine = tiny_engine(tiny_dir, tiny_head, TREE, max_batch_size=4)
    engine.policy.chooser = chooser = SpeculationChooser({1: True, 4: True}, window=64, explore_every=128)
    engine.generate(mixed_prompts(16, seed=5), SamplingParams(max_new_tokens=6, ignore_eos=True))
    sampled = sum(len(b.samples[True]) for b in chooser.buckets.values())
    whole_steps = sum(t[2] for (drafted, _), t in engine.steady_steps.items() if drafted)
    assert sampled > 2 * whole_steps


def test_a_fixed_tree_is_measured_per_batch_size(tiny_dir, tiny_head):
    """With a fixed tree and ``measured_choice`` on, full batches and a job's tail of a few sequences are timed and
    chosen apart: a bucket at every power of two up to the slots (a tuned or configured table gives its own)."""
    engine = tiny_engine(tiny_dir, tiny_head, TREE, max_batch_size=5, measured_choice=True)
    assert sorted(engine.policy.chooser.buckets) == [1, 2, 4]
    assert [engine.policy.chooser.bucket(b) is engine.policy.chooser.buckets[k] for b, k in ((3, 2), (5, 4))] == \
        [True, True]
    engine.policy.set_trees(trees_by_batch={1: TREE, 3: PLAIN})
    assert {k: b.speculate for k, b in engine.policy.chooser.buckets.items()} == {1: True, 3: False}
