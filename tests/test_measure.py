"""What the measuring command counts as a near-tie when greedy outputs first differ."""
import torch

from eagle_ray.measure import divergence, near_tie, ulp


def test_a_dtype_unit_is_the_spacing_of_its_values_at_that_size():
    assert ulp(20.0, torch.bfloat16) == 0.125 and ulp(-20.0, torch.bfloat16) == 0.125
    assert ulp(5.0, torch.bfloat16) == 2 ** -5
    assert ulp(20.0, torch.float16) == 2 ** -6
    assert torch.tensor(20.0 + ulp(20.0, torch.bfloat16) / 2).bfloat16().item() == 20.0   # half a unit: one value


def test_bf16_near_ties_are_gaps_the_dtype_cannot_resolve_and_fp32_ones_are_tiny():
    d = {"gap": 0.125, "top_logit": 21.3}
    assert near_tie(d, torch.bfloat16, None)
    assert not near_tie(d | {"top_logit": 9.0}, torch.bfloat16, None)     # a unit is 0.0625 there
    assert not near_tie(d, torch.float32, None) and near_tie(d | {"gap": 5e-4}, torch.float32, None)
    assert near_tie(d, torch.bfloat16, 0.2) and not near_tie(d, torch.bfloat16, 0.1)   # an explicit gap wins
    assert not near_tie({"gap": None, "top_logit": None}, torch.bfloat16, None)         # lengths differ: a bug


def test_a_divergence_reports_the_reference_gap_where_outputs_first_differ():
    logits = torch.zeros(10)
    logits[3], logits[4] = 12.0, 11.5
    d = divergence(lambda ids: logits, [1, 2], [7, 3, 5], [7, 4, 5])
    assert d == {"index": 1, "gap": 0.5, "top_logit": 12.0, "ref_token": 3, "got_token": 4}
    assert divergence(lambda ids: logits, [1], [7, 3], [7, 3]) is None
