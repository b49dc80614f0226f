"""Penalties and logit bias, as vLLM applies them, at every tree node with its own path counted.

Greedy speculative output under each penalty equals greedy plain decoding under it and an independent reference (a
full forward per token, the penalty written out from vLLM's formula, or transformers' own repetition-penalty
processor), token for token; a penalty changes the output (so the test sees it act); a node's counts are its
sequence's output plus its own path; sampled output has the penalised target's distribution.
"""
import collections

import pytest
import torch
from test_sampling_lossless import PROMPT, V, chi_square_p, draws_engine, small_vocab  # noqa: F401 - a fixture
from tiny import decode_step_costs, tiny_engine
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from eagle_ray.config import SamplingParams, TreeConfig
from eagle_ray.errors import InvalidRequestError
from eagle_ray.speculative.penalties import PenaltyBatch, apply_penalties, path_counts

TREE = TreeConfig(total_tokens=12, depth=3, top_k=3)
PENALTIES = {"frequency": dict(frequency_penalty=1.5), "presence": dict(presence_penalty=1.2),
             "repetition": dict(repetition_penalty=1.8),
             "rewarded repeats": dict(repetition_penalty=0.6, frequency_penalty=-0.7),
             "logit bias": dict(logit_bias={9: 4.0, 17: -100.0, 40: 2.5}),
             "all": dict(frequency_penalty=0.4, presence_penalty=0.3, repetition_penalty=1.3, logit_bias={12: 3.0})}


def penalised_reference(hf, prompt: list[int], n: int, frequency_penalty=0.0, presence_penalty=0.0,
                        repetition_penalty=1.0, logit_bias=None) -> list[int]:
    """A full forward per token and vLLM's formulas written out: bias, then repetition over prompt and output
    (transformers' processor, the same rule), then frequency and presence over the output."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1].clone()
            for tok, b in (logit_bias or {}).items():
                logits[tok] += b
            if repetition_penalty != 1.0:
                logits = RepetitionPenaltyLogitsProcessor(repetition_penalty)(torch.tensor([ids]), logits[None])[0]
            out = collections.Counter(ids[len(prompt):])
            for tok, c in out.items():
                logits[tok] -= frequency_penalty * c + presence_penalty
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def prompts(n: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 64, (int(k),), generator=g).tolist() for k in torch.randint(2, 16, (n,), generator=g)]


@pytest.mark.parametrize("penalty", list(PENALTIES))
def test_greedy_speculation_under_a_penalty_equals_plain_decoding_under_it(tiny_dir, tiny_hf, tiny_head, penalty):
    engine = tiny_engine(tiny_dir, tiny_head, TREE, max_batch_size=3)
    ps = prompts(3)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, **PENALTIES[penalty])
    spec = engine.generate(ps, params)
    plain = engine.generate(ps, params, speculative=False)
    free = engine.generate(ps, SamplingParams(max_new_tokens=24, ignore_eos=True))
    for s, p, f, prompt in zip(spec, plain, free, ps):
        assert s.token_ids == p.token_ids == penalised_reference(tiny_hf, prompt, 24, **PENALTIES[penalty])
    assert any(s.token_ids != f.token_ids for s, f in zip(spec, free))   # the penalty acts
    assert sum(sum(o.stats.accepted_per_depth) for o in spec) > 0      # and trees are accepted under it


def test_penalised_and_free_sequences_share_a_batch(tiny_dir, tiny_hf, tiny_head):
    engine = tiny_engine(tiny_dir, tiny_head, TREE, max_batch_size=4)
    ps = prompts(4, seed=8)
    kinds = [PENALTIES["all"], {}, PENALTIES["frequency"], PENALTIES["logit bias"]]
    outs = engine.generate(ps, [SamplingParams(max_new_tokens=25, ignore_eos=True, **k) for k in kinds])
    for out, prompt, k in zip(outs, ps, kinds):
        assert out.token_ids == penalised_reference(tiny_hf, prompt, 25, **k)


def test_a_node_counts_its_sequence_output_and_its_own_path():
    """Root 0 (already in the output), its children 1 and 2, 3 under 1: node 3 counts tokens of 1 and 3."""
    tokens = torch.tensor([[5, 6, 7, 6]])
    anc = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]], dtype=torch.bool)
    counts = path_counts(tokens, anc, 8)[0]
    assert counts[:, 5].tolist() == [0, 0, 0, 0]           # the root is counted in the output, not again
    assert counts[:, 6].tolist() == [0, 1, 0, 2]
    assert counts[:, 7].tolist() == [0, 0, 1, 0]

    class Seq:
        def __init__(self, output_ids, **kw):
            self.params, self.output_ids, self.prompt_ids = SamplingParams(**kw), output_ids, [1, 2]
    logits = torch.zeros(1, 4, 8)
    batch = PenaltyBatch.of([Seq([6, 5], frequency_penalty=1.0, presence_penalty=0.5)], 8, "cpu")
    out = apply_penalties(logits, batch, tokens, anc)[0]
    assert out[:, 6].tolist() == [-1.5, -2.5, -1.5, -3.5]   # output count 1, + path's
    assert out[:, 5].tolist() == [-1.5] * 4
    assert out[:, 7].tolist() == [0.0, 0.0, -1.5, 0.0]
    assert logits.abs().sum() == 0                          # the raw logits are left as they were


def test_a_penalised_step_still_reads_once_and_copies_once(tiny_dir, tiny_head):
    engine = tiny_engine(tiny_dir, tiny_head, TREE, max_batch_size=4)
    for i, k in enumerate(["all", "frequency", "logit bias", "repetition"]):
        engine.add_request([5 + i, 9, 10, 11], SamplingParams(max_new_tokens=40, ignore_eos=True, **PENALTIES[k]))
    assert decode_step_costs(engine) == (1, 1, 0)


def test_a_logit_bias_outside_the_vocabulary_is_refused(tiny_dir, tiny_head):
    engine = tiny_engine(tiny_dir, tiny_head, TREE)
    with pytest.raises(InvalidRequestError, match="logit_bias: token id 64 is not in the vocabulary"):
        engine.generate([[5, 6]], SamplingParams(logit_bias={64: 1.0}))


def exact_penalised_joint(hf, **kw) -> dict[tuple, float]:
    """The exact distribution of the first three tokens (T=1) under ``kw``'s penalties, by enumeration."""
    def probs(prefix):
        ids = PROMPT + list(prefix)
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].double().clone()
        if kw.get("repetition_penalty", 1.0) != 1.0:
            logits = RepetitionPenaltyLogitsProcessor(kw["repetition_penalty"])(torch.tensor([ids]), logits[None])[0]
        for tok, c in collections.Counter(prefix).items():
            logits[tok] -= kw.get("frequency_penalty", 0.0) * c + kw.get("presence_penalty", 0.0)
        return logits.softmax(-1)
    p1 = probs([])
    joint = {}
    for a in range(V):
        p2 = probs([a])
        for b in range(V):
            p3 = probs([a, b])
            for c in range(V):
                joint[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    return joint


def test_sampled_speculation_has_the_penalised_distribution(small_vocab):  # noqa: F811 - the fixture
    """On an 8-token target: 3,000 seeded sequences of 3 tokens under frequency + presence and under repetition
    penalties, drafted with trees (lookup chains grafted, so paths repeat tokens), against the exact joint."""
    path, hf = small_vocab
    settings = {"frequency+presence": dict(frequency_penalty=1.0, presence_penalty=0.8),
                "repetition": dict(repetition_penalty=2.0)}
    engine = draws_engine(path)
    names = list(settings) * 3000
    outs = engine.generate([PROMPT] * len(names), [SamplingParams(temperature=1.0, max_new_tokens=3, ignore_eos=True,
                                                                  seed=i, **settings[n])
                                                   for i, n in enumerate(names)])
    assert max(o.stats.tau for o in outs) > 1
    by = collections.defaultdict(list)
    for name, out in zip(names, outs):
        by[name].append(tuple(out.token_ids))
    for name, kw in settings.items():
        exact = exact_penalised_joint(hf, **kw)
        assert chi_square_p(by[name], exact) > 0.01, name
        unpenalised = exact_penalised_joint(hf)
        assert chi_square_p(by[name], unpenalised) < 1e-6, name   # the test can tell the penalty apart
