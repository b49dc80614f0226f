"""Log-probabilities and samples of penalised and constrained requests.

Penalties, logit bias and grammar masks change what the target chooses, never what it reports: a token's
log-probability is the target's raw log-softmax (vLLM's default "raw" logprobs), read before any of them, with
speculation on or off. Each of a constrained request's ``n`` samples has its own matcher.
"""
import re

import pytest
import torch
from test_grammar import constrained_reference
from test_logprobs import log_softmax_rows
from test_penalties import penalised_reference
from tiny import tiny_engine

from eagle_ray.config import SamplingParams, TreeConfig

TREE = TreeConfig(total_tokens=12, depth=3, top_k=3)
PROMPTS = [[5, 9, 10, 11], [7, 8, 7, 8, 30], [20, 21, 22, 23, 24, 25]]
PENALISED = dict(frequency_penalty=1.5, repetition_penalty=1.3, logit_bias={9: 4.0, 17: -100.0})
REGEX = "(w[0-9]|w[1-3][0-9]){3,24}"


@pytest.fixture(scope="module")
def engine(tiny_dir, tiny_head):
    return tiny_engine(tiny_dir, tiny_head, TREE, max_batch_size=4)


def assert_raw_logprobs(hf, out, k: int) -> None:
    """``out``'s values and top-``k`` are the unprocessed target's, over its own tokens."""
    rows = log_softmax_rows(hf, out.prompt_token_ids + out.token_ids)[len(out.prompt_token_ids) - 1:-1]
    assert len(out.logprobs) == len(out.token_ids)
    want = rows.gather(-1, torch.tensor(out.token_ids).view(-1, 1))[:, 0]
    torch.testing.assert_close(torch.tensor(out.logprobs.values), want, atol=1e-5, rtol=0)
    values, ids = rows.topk(k)
    assert [[t for t, _ in top] for top in out.logprobs.top] == ids.tolist()
    torch.testing.assert_close(torch.tensor([[v for _, v in top] for top in out.logprobs.top]), values,
                               atol=1e-5, rtol=0)


def chosen_below_raw_top(out) -> int:
    """Tokens the processors made the target choose over its raw favourite."""
    return sum(v < top[0][1] for v, top in zip(out.logprobs.values, out.logprobs.top))


@pytest.mark.parametrize("speculative", [True, False], ids=["eagle", "plain"])
def test_a_penalised_requests_logprobs_are_the_raw_targets(engine, tiny_hf, speculative):
    params = SamplingParams(max_new_tokens=20, ignore_eos=True, logprobs=3, **PENALISED)
    outs = engine.generate(PROMPTS, params, speculative=speculative)
    for out, prompt in zip(outs, PROMPTS):
        assert out.token_ids == penalised_reference(tiny_hf, prompt, 20, **PENALISED)
        assert_raw_logprobs(tiny_hf, out, 3)
    assert sum(chosen_below_raw_top(o) for o in outs) > 0   # the penalties chose, the logprobs did not follow
    if speculative:
        assert sum(sum(o.stats.accepted_per_depth) for o in outs) > 0


@pytest.mark.parametrize("speculative", [True, False], ids=["eagle", "plain"])
def test_a_constrained_requests_logprobs_are_the_raw_targets(engine, tiny_hf, speculative):
    params = SamplingParams(max_new_tokens=20, logprobs=2, guided_regex=REGEX)
    outs = engine.generate(PROMPTS, params, speculative=speculative)
    for out, prompt in zip(outs, PROMPTS):
        assert out.token_ids == constrained_reference(tiny_hf, engine, prompt, 20, guided_regex=REGEX)
        assert_raw_logprobs(tiny_hf, out, 2)
    assert sum(chosen_below_raw_top(o) for o in outs) > 0   # the mask chose, the logprobs did not follow


def test_each_sample_of_a_constrained_request_follows_the_grammar_on_its_own(engine):
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=5, n=4, logprobs=0, guided_regex=REGEX,
                            presence_penalty=0.5)
    outs = engine.generate(PROMPTS[0], params)
    assert [o.sample_index for o in outs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in outs}) == 4
    for o in outs:
        assert re.fullmatch(REGEX, o.text.replace(" ", "")) or (o.finish_reason == "length" and
                                                                  re.fullmatch("(w[0-9]+)*", o.text.replace(" ", "")))
        assert len(o.logprobs) == len(o.token_ids)
