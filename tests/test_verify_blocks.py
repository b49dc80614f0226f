"""Trees of different sizes verified in blocks of their own widths (the CPU's ``verify_block_tokens``).

Under a batch verify cap most trees keep only their root and a few keep many nodes; one verify block is as wide as
its widest tree, so every root would be verified with a row of padding beside it, and on a CPU a padding row costs
what a token costs. Blocks of one target pass (the largest trees first) verify the same trees: the output is the
same token for token, greedy and seeded sampled.
"""
import dataclasses

import pytest
import torch
from tiny import tiny_engine

from eagle_ray.config import SamplingParams, TreeConfig
from eagle_ray.model.numerics import DEVICE_DEFAULTS
from eagle_ray.speculative.tree import Tree, ancestor_mask, select_rows, size_order, split_by_size


def test_the_split_verifies_the_fewest_tokens_counting_each_further_block_as_its_cost():
    # tokens verified + each further block at its cost
    assert split_by_size([1] * 26 + [10] * 6, 8) == [(6, 10), (26, 1)]        # 60 + 26 + 8, not 320
    assert split_by_size([3, 1, 4, 1, 5, 2], 8) == [(3, 5), (3, 2)]            # 15 + 6 + 8, not 30 or 18 + 16
    assert split_by_size([3, 1, 4, 1, 5, 2], 2) == [(2, 5), (2, 3), (2, 1)]    # 10 + 6 + 2 + 4, not 15 + 6 + 2
    assert split_by_size([9, 9, 5, 5, 5, 5, 1, 1, 1, 1], 8) == [(2, 9), (4, 5), (4, 1)]   # 18 + 20 + 4 + 16
    assert split_by_size([4, 4, 4, 4], 8) == [(4, 4)]                          # nothing to save
    assert split_by_size([4, 3, 4, 3], 8) == [(4, 4)]                          # 8 + 6 + 8, not 16
    assert split_by_size([4, 3, 4, 3], 1) == [(2, 4), (2, 3)]                  # 8 + 6 + 1, not 16
    assert split_by_size([4, 3, 4, 3], 2) == [(4, 4)]                          # a tie: one block
    assert split_by_size([7], 8) == [(1, 7)]


def test_a_block_of_selected_rows_holds_the_same_trees():
    parents = torch.tensor([[0, 0, 1, 0], [0, 0, 0, 0], [0, 0, 1, 2]])
    valid = torch.tensor([[True, True, True, True], [True, False, False, False], [True, True, True, False]])
    tree = Tree(torch.arange(12).view(3, 4), parents, torch.zeros(3, 4, dtype=torch.long), valid,
                ancestor_mask(parents, 3), torch.zeros(3, 4), 3, True)
    order = size_order(tree)
    assert order.tolist() == [0, 2, 1]
    block = select_rows(tree, order[1:], 3)
    assert block.tokens.tolist() == [[8, 9, 10], [4, 5, 6]]
    assert block.valid.tolist() == [[True, True, True], [True, False, False]]
    assert torch.equal(block.ancestors, tree.ancestors[[2, 1], :3, :3])


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_split_blocks_give_plain_decodings_tokens(tiny_dir, tiny_head, temperature, monkeypatch):
    """A further block counted as one token: most steps split, some in three blocks or more."""
    monkeypatch.setitem(DEVICE_DEFAULTS, "cpu", dataclasses.replace(DEVICE_DEFAULTS["cpu"], verify_block_tokens=1))
    engine = tiny_engine(tiny_dir, tiny_head, TreeConfig(total_tokens=12, depth=4, top_k=3), max_batch_size=8,
                         verify_cap=16)   # 8 roots and 8 draft nodes: the most confident sequences take them
    blocks = []
    verify_blocks = engine.runner.verify_blocks
    engine.runner.verify_blocks = lambda *a: blocks.append(verify_blocks(*a)) or blocks[-1]
    prompts = [[5 + i, 9, 10, 11 + i % 3] for i in range(8)]
    params = [SamplingParams(max_new_tokens=40, ignore_eos=True, temperature=temperature, seed=i) for i in range(8)]
    spec = engine.generate(prompts, params)
    plain = engine.generate(prompts, params, speculative=False)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    split = [b for b in blocks if len(b) > 1]
    assert len(split) > len(blocks) // 2 and any(len(b) > 2 for b in split)   # most steps split, some in 3+
    for step in split:                                        # the largest trees first, each sequence once
        widths = [b.tree.tokens.shape[1] for b in step]
        assert widths == sorted(widths, reverse=True) and len(set(widths)) == len(widths)
        ids = [s.request_id for b in step for s in b.seqs]
        assert len(ids) == len(set(ids))
    assert sum(o.stats.verify_steps for o in spec) < sum(len(o.token_ids) for o in spec)   # drafts accepted
