"""Automatic prefix sharing (engine/prefix_sharing.py): a prompt that begins like one in a running sequence's slot
copies those positions and prefills the rest, and its tokens are the ones it gets without the copy."""
import torch
from test_engine import reference_greedy
from tiny import tiny_engine

from eagle_ray.config import SamplingParams
from eagle_ray.engine.prefix_sharing import MIN_SHARED, common_start
from eagle_ray.engine.sequence import PendingPairs
from eagle_ray.speculative.logprobs import TokenLogprobs


def under_one_preamble(n: int, preamble: int = 40, seed: int = 3) -> list[list[int]]:
    """``n`` prompts: one ``preamble`` of random tokens, then each its own few (the first differs between all)."""
    g = torch.Generator().manual_seed(seed)
    pre = torch.randint(3, 64, (preamble,), generator=g).tolist()
    return [pre + [3 + i] + torch.randint(3, 64, (int(k),), generator=g).tolist()
            for i, k in enumerate(torch.randint(1, 8, (n,), generator=g))]


def one_long_then_short(n: int) -> list[SamplingParams]:
    """The first request outlives the others, so each later prompt starts while it runs (the others run 6
    tokens each, two at a time)."""
    return [SamplingParams(max_new_tokens=120 if i == 0 else 6, ignore_eos=True) for i in range(n)]


def run(engine, prompts, params, sharing: bool):
    engine.scheduler.prefix_sharing = sharing
    return engine.generate(prompts, params)


def test_common_start_counts_the_tokens_two_prompts_begin_with():
    assert common_start([1, 2, 3, 4], [1, 2, 3, 4]) == 4
    assert common_start([1, 2, 3, 4], [1, 2]) == 2
    assert common_start([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert common_start([5] * 100 + [1], [5] * 100 + [2]) == 100
    assert common_start([1], [2]) == 0 and common_start([], [1]) == 0


def test_greedy_prompts_under_one_preamble_copy_it_and_give_the_targets_tokens(tiny_dir, tiny_hf, tiny_head):
    """The first two prompts start together (no sequence holds the preamble yet) and prefill in full; every later
    one copies the 40-token preamble but its last token (the head's input there holds the token after it, where the
    prompts part) from the first, still running."""
    engine = tiny_engine(tiny_dir, tiny_head, max_batch_size=2)
    prompts, params = under_one_preamble(7), one_long_then_short(7)
    shared = run(engine, prompts, params, sharing=True)
    assert [o.stats.cached_prompt_tokens for o in shared] == [0, 0] + [39] * 5
    for out, prompt, p in zip(shared, prompts, params):
        assert out.token_ids == reference_greedy(tiny_hf, prompt, p.max_new_tokens)
    alone = run(engine, prompts, params, sharing=False)
    assert [o.stats.cached_prompt_tokens for o in alone] == [0] * 7
    assert [o.token_ids for o in alone] == [o.token_ids for o in shared]
    assert all(o.stats.verify_steps > 0 for o in shared)


def test_seeded_samples_are_the_same_with_and_without_sharing(tiny_dir, tiny_head):
    engine = tiny_engine(tiny_dir, tiny_head, max_batch_size=2)
    prompts = under_one_preamble(7, seed=4)
    params = [SamplingParams(max_new_tokens=120 if i == 0 else 6, ignore_eos=True, temperature=0.9, seed=i)
              for i in range(7)]
    shared = run(engine, prompts, params, sharing=True)
    assert sum(o.stats.cached_prompt_tokens for o in shared) == 5 * 39
    assert [o.token_ids for o in run(engine, prompts, params, sharing=False)] == [o.token_ids for o in shared]


def test_plain_decoding_shares_too(tiny_dir, tiny_hf, tiny_head):
    engine = tiny_engine(tiny_dir, tiny_head, max_batch_size=2)
    prompts, params = under_one_preamble(5), one_long_then_short(5)
    outs = engine.generate(prompts, params, speculative=False)
    assert [o.stats.cached_prompt_tokens for o in outs] == [0, 0, 39, 39, 39]
    for out, prompt, p in zip(outs, prompts, params):
        assert out.token_ids == reference_greedy(tiny_hf, prompt, p.max_new_tokens)


def test_a_start_shorter_than_the_minimum_is_prefilled(tiny_dir, tiny_head):
    engine = tiny_engine(tiny_dir, tiny_head, max_batch_size=2)
    outs = engine.generate(under_one_preamble(4, preamble=MIN_SHARED - 1), one_long_then_short(4))
    assert [o.stats.cached_prompt_tokens for o in outs] == [0] * 4


def test_a_prompt_asking_for_its_logprobs_runs_all_of_it(tiny_dir, tiny_head):
    """Prompt logprobs come from the prompt's own pass (echo, scoring): such a prompt prefills in full, beside a
    running sequence that holds its preamble, and scores every position."""
    engine = tiny_engine(tiny_dir, tiny_head, max_batch_size=2)
    prompts = under_one_preamble(3)
    seqs = [engine.make_sequence(p, q) for p, q in zip(prompts, one_long_then_short(3))]
    seqs[2].prompt_logprobs = TokenLogprobs()
    for s in seqs:
        engine.add_request(s)
    while engine.has_unfinished():
        engine.step()
    assert [s.stats.cached_prompt_tokens for s in seqs] == [0, 0, 0]
    assert len(seqs[2].prompt_logprobs) == len(prompts[2]) - 1


def test_online_adaptation_gets_a_sharing_sequences_pairs_from_its_first_position(tiny_dir, tiny_head, monkeypatch):
    """The head trains on every (feature, next token) pair of a finished sequence, position 0 first: one that
    copied its preamble has those pairs from its source."""
    from test_adaptation import adapting, own
    from eagle_ray.train.online import Adapter
    engine = tiny_engine(tiny_dir, own(tiny_head), max_batch_size=2)
    adapting(engine, time_share=0.01)
    kept = {}
    real_add = Adapter.add

    def add(self, seq):
        kept[seq.request_id] = [t for toks, _ in seq.pending.kept for t in toks]
        real_add(self, seq)
    monkeypatch.setattr(Adapter, "add", add)
    prompts, params = under_one_preamble(4), one_long_then_short(4)
    outs = engine.generate(prompts, params)
    assert [o.stats.cached_prompt_tokens for o in outs] == [0, 0, 39, 39]
    for out, prompt in zip(outs, prompts):
        pairs = kept[out.request_id]   # pair i's token is token i + 1 of prompt + output (and of the tokens a
        made = prompt[1:] + out.token_ids   # last step accepted past max_new_tokens)
        assert len(pairs) >= len(prompt) and pairs[:len(made)] == made[:len(pairs)]


def test_kept_first_takes_the_first_pairs_across_chunks():
    pairs = PendingPairs()
    pairs.kept = []
    pairs.add([1, 2, 3], torch.arange(3.0).unsqueeze(1))
    pairs.add([4, 5], torch.arange(3.0, 5.0).unsqueeze(1))
    first = pairs.kept_first(4)
    assert [t for toks, _ in first for t in toks] == [1, 2, 3, 4]
    assert torch.cat([f for _, f in first]).flatten().tolist() == [0.0, 1.0, 2.0, 3.0]
    assert pairs.kept_first(0) == [] and len(pairs.kept_first(9)) == 2
