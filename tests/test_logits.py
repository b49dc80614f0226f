"""RefinedLogits: a bf16 product plus an fp32 recomputation of the candidates gives the fp32 argmax, row by row."""
import torch

from eagle_ray.model.logits import RefinedLogits


def _weights_and_rows(vocab=3000, hidden=96, rows=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(vocab, hidden, generator=g) * 0.3).bfloat16()
    x = torch.randn(rows, hidden, generator=g) * 4
    # near-ties: make token 7 and token 11 score almost alike on the first rows
    w[11] = (w[7].float() + 1e-3 * torch.randn(hidden, generator=g)).bfloat16()
    x[:8] = w[7].float() * 20 + 0.01 * torch.randn(8, hidden, generator=g)
    return w, x


def test_greedy_choice_is_the_fp32_argmax():
    w, x = _weights_and_rows()
    refined = RefinedLogits(w, candidates=16)
    exact = x @ w.float().t()
    bf16_argmax = torch.nn.functional.linear(x.bfloat16(), w).float().argmax(-1)
    assert torch.equal(refined(x).argmax(-1), exact.argmax(-1))
    assert not torch.equal(bf16_argmax, exact.argmax(-1))  # the plain bf16 product gets some rows wrong


def test_candidates_hold_exact_fp32_values_and_the_rest_bf16_ones():
    w, x = _weights_and_rows()
    out = RefinedLogits(w, candidates=16)(x)
    exact = x @ w.float().t()
    approx = torch.nn.functional.linear(x.bfloat16(), w).float()
    top = approx.topk(16, dim=-1).indices          # the candidates: the 16 best bf16 logits of each row
    assert torch.allclose(out.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-5)
    rest = torch.ones_like(out, dtype=torch.bool).scatter(1, top, False)
    assert torch.equal(out[rest], approx[rest])


def test_a_row_is_computed_the_same_whatever_shares_the_pass():
    w, x = _weights_and_rows()
    refined = RefinedLogits(w, candidates=16)
    together = refined(x.view(4, 16, -1)).view(64, -1)
    alone = torch.cat([refined(x[i:i + 1]) for i in range(64)])
    assert torch.equal(together, alone)


def test_rows_the_bound_cannot_settle_are_recomputed_in_full_fp32():
    w, x = _weights_and_rows()
    refined = RefinedLogits(w, candidates=1)   # one candidate: near-ties cannot be proven
    out = refined(x[:8])
    assert refined.fallback_rows > 0
    exact = x[:8] @ w.float().t()
    assert torch.equal(out.argmax(-1), exact.argmax(-1))
    assert torch.allclose(out, exact, rtol=1e-5, atol=1e-5)
