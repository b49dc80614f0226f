"""Logits processors agree with transformers' own warpers; token choice is greedy or seeded sampling."""
import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from eagle_ray.speculative.sampling import SamplingBatch, choose_tokens, processed_probs


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.0, 5, 1.0), (1.3, 7, 0.8)])
def test_processed_probs_match_transformers_warpers(temperature, top_k, top_p):
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)) * 2
    ref = logits.clone()
    ref = TemperatureLogitsWarper(temperature)(None, ref)
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    n = logits.shape[0]
    got = processed_probs(logits, torch.full((n,), temperature), torch.full((n,), top_k), torch.full((n,), top_p))
    torch.testing.assert_close(got, ref.softmax(-1), atol=1e-6, rtol=1e-5)


def test_rows_with_different_parameters_in_one_call():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(1))
    got = processed_probs(logits, torch.tensor([1.0, 0.5, 1.0]), torch.tensor([0, 3, 0]), torch.tensor([1.0, 1.0, 0.5]))
    assert (got[0] > 0).all()
    assert (got[1] > 0).sum() == 3
    n = int((got[2] > 0).sum())
    mass = logits[2].softmax(-1).sort(descending=True).values.cumsum(0)
    assert mass[n - 2] < 0.5 <= mass[n - 1]  # the smallest prefix reaching top_p


def test_greedy_rows_take_the_argmax_and_sampled_rows_follow_their_seed():
    logits = torch.randn(2, 4, 20, generator=torch.Generator().manual_seed(2))
    positions = torch.arange(4).expand(2, 4) + 10

    def run(seed, pos=positions):
        return choose_tokens(logits, SamplingBatch(torch.tensor([0.0, 1.0]), torch.tensor([0, 0]),
                                                   torch.tensor([1.0, 1.0]), torch.tensor([0, seed])), pos)
    a, b = run(7), run(7)
    assert a[0].equal(logits[0].argmax(-1))
    assert a.equal(b)
    assert not all(run(s)[1].equal(a[1]) for s in range(8, 12))
    assert not all(run(7, positions + 1)[1].equal(a[1]) for _ in range(1))


def test_the_noise_depends_only_on_seed_position_and_token():
    """Exp(1) noise keyed by (seed, position): equal keys give equal noise wherever the row sits, distinct keys
    independent noise with the right moments."""
    from eagle_ray.speculative.sampling import position_noise
    n = position_noise(torch.tensor([5, 5, 6, 5]), torch.tensor([100, 101, 100, 100]), 200_000)
    assert n[0].equal(n[3]) and not n[0].equal(n[1]) and not n[0].equal(n[2])
    assert (n > 0).all()
    for row in n[:3]:
        assert abs(float(row.mean()) - 1) < 0.01 and abs(float(row.std()) - 1) < 0.01
    assert abs(float(torch.corrcoef(n[:3])[0, 1:].abs().max())) < 0.01


def test_the_noise_is_never_zero_so_a_token_of_probability_zero_is_never_drawn():
    """At seed 7, position 49, token 43577 draws the largest 24-bit uniform, which float32 rounds to 1: its noise
    must still be positive, or ``p / noise`` is 0/0 and a masked token wins the race."""
    from eagle_ray.speculative.sampling import SamplingBatch, choose_tokens, position_noise
    assert float(position_noise(torch.tensor([7]), torch.tensor([49]), 49152)[0, 43577]) > 0
    logits = torch.full((1, 1, 49152), float("-inf"))
    logits[0, 0, 107], logits[0, 0, 90] = 31.4, 29.6      # a grammar allows two tokens
    sampling = SamplingBatch(torch.tensor([0.8]), torch.tensor([0]), torch.tensor([1.0]), torch.tensor([7]))
    assert int(choose_tokens(logits, sampling, torch.tensor([[49]]))) in (107, 90)
