"""Sampled speculative output has the target's distribution.

On a target small enough to enumerate (8 tokens), the empirical joint distribution of the first three sampled
tokens must match the exact one computed with transformers' own warpers (chi-square, p > 0.01) for T=1,
T=0.7 + top_p=0.9 and top_k=5, all three settings mixed in the same batches, with prompt-lookup chains grafted onto
the trees (one-token matches, so nearly every step has one); and the same test must catch a deliberately broken
acceptance rule. The same holds for each of n = 8 samples of one request, which share its prefill.
"""
import collections

import pytest
import torch
from scipy.stats import chisquare
from tiny import save_target, tiny_engine
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import eagle_ray.engine.model_runner as runner_module
from eagle_ray.config import SamplingParams, TreeConfig
from eagle_ray.engine.budgets import verify_budget
from eagle_ray.speculative.accept import accept

SETTINGS = {"T=1": dict(temperature=1.0), "T=0.7,top_p=0.9": dict(temperature=0.7, top_p=0.9),
            "top_k=5": dict(temperature=1.0, top_k=5)}
N = 20_000
PROMPT = [3, 5, 2, 7]
V = 8
TREE = TreeConfig(total_tokens=8, depth=2, top_k=3, lookup=3, lookup_ngram=1)
# sequences a step, each with room for its whole tree and lookup chain: on a model this small a step costs little
# more at 128 sequences than at 48, so the draws take fewer, more speculative steps (tau 2.81, not 2.68)
BATCH = 128


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    path = save_target(tmp_path_factory.mktemp("v8"), vocab_size=V, seed=4, logit_scale=60.0)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def exact_joint(hf, temperature=1.0, top_p=1.0, top_k=0) -> dict[tuple, float]:
    def probs(prefixes):
        with torch.no_grad():
            logits = hf(torch.tensor(prefixes)).logits[:, -1]
        logits = TemperatureLogitsWarper(temperature)(None, logits)
        if top_k:
            logits = TopKLogitsWarper(top_k)(None, logits)
        if top_p < 1:
            logits = TopPLogitsWarper(top_p)(None, logits)
        return logits.double().softmax(-1)
    p1 = probs([PROMPT])[0]
    p2 = probs([PROMPT + [a] for a in range(V)])
    p3 = probs([PROMPT + [a, b] for a in range(V) for b in range(V)]).view(V, V, V)
    return {(a, b, c): float(p1[a] * p2[a, b] * p3[a, b, c]) for a in range(V) for b in range(V) for c in range(V)}


def chi_square_p(samples: list[tuple], exact: dict[tuple, float]) -> float:
    counts = collections.Counter(samples)
    assert all(exact[s] > 0 for s in counts), "sampled a sequence the target gives probability 0"
    n = len(samples)
    big = [k for k, p in exact.items() if p * n >= 5]
    obs = [counts[k] for k in big] + [n - sum(counts[k] for k in big)]
    exp = [exact[k] * n for k in big] + [n - sum(exact[k] * n for k in big)]
    if exp[-1] < 1e-6:
        obs, exp = obs[:-1], exp[:-1]
    total = sum(exp)
    return chisquare(obs, [e * sum(obs) / total for e in exp]).pvalue


def draws_engine(path):
    """The engine every distribution test draws from: an untrained head's trees with lookup chains grafted on."""
    return tiny_engine(path, None, TREE, max_batch_size=BATCH, max_model_len=32,
                       max_step_tokens=BATCH * verify_budget(TREE))


def sample_mixed(path, seed=0, n=N) -> dict[str, list[tuple]]:
    torch.manual_seed(seed)
    engine = draws_engine(path)
    names = list(SETTINGS) * n
    params = [SamplingParams(max_new_tokens=3, ignore_eos=True, **SETTINGS[n]) for n in names]
    outs = engine.generate([PROMPT] * len(names), params)
    assert max(o.stats.tau for o in outs) > 1  # drafts do get accepted
    by = collections.defaultdict(list)
    for name, out in zip(names, outs):
        by[name].append(tuple(out.token_ids))
    return by


@pytest.mark.parametrize("n", [pytest.param(N, marks=pytest.mark.slow), 3000])
def test_sampled_joint_distribution_matches_the_target(small_vocab, n):
    """The fast tier draws 3,000 sequences per setting; the slow tier 20,000 (power to see a 1% bias)."""
    path, hf = small_vocab
    samples = sample_mixed(path, n=n)
    for name, kw in SETTINGS.items():
        p = chi_square_p(samples[name], exact_joint(hf, **kw))
        assert p > 0.01, (name, p)


def test_a_broken_acceptance_rule_is_caught(small_vocab, monkeypatch):
    """Always accepting the draft's favourite first child (a biased rule) must fail the same test."""
    path, hf = small_vocab

    def broken(tree, choice):
        choice = choice.clone()
        choice[:, 0] = tree.tokens[:, 1]
        return accept(tree, choice)
    monkeypatch.setattr(runner_module, "accept", broken)
    samples = sample_mixed(path, seed=1, n=3000)
    assert chi_square_p(samples["T=1"], exact_joint(hf, temperature=1.0)) < 1e-6


def test_each_of_n_samples_has_the_targets_distribution(small_vocab):
    """250 requests of n = 8 samples at T=1: pooled, the samples' joint distribution is the target's; sample by
    sample, each index's first token is too. The samples copied their request's prompt instead of prefilling it."""
    path, hf = small_vocab
    torch.manual_seed(2)
    engine = draws_engine(path)
    prefilled, block = [], engine.runner.prefill_block
    engine.runner.prefill_block = lambda chunks: prefilled.append(sum(c.end - c.start for c in chunks)) or block(chunks)
    requests = 250
    outs = engine.generate([PROMPT] * requests, SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=1.0,
                                                               n=8))
    assert len(outs) == 8 * requests and sum(prefilled) < requests * 8 * len(PROMPT) / 2
    exact = exact_joint(hf)
    assert chi_square_p([tuple(o.token_ids) for o in outs], exact) > 0.01
    first = collections.defaultdict(float)
    for (a, _, _), p in exact.items():
        first[(a,)] += p
    for i in range(8):
        p = chi_square_p([tuple(o.token_ids[:1]) for o in outs[i::8]], first)
        assert p > 0.001, (i, p)
