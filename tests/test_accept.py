"""Greedy acceptance over padded trees: the longest correct root path, then the bonus token."""
import torch

from eagle_ray.speculative.accept import accept
from eagle_ray.speculative.tree import Tree, ancestor_mask

#            It is has a  the to good be   (token ids = node ids 10..17)
PARENTS = [0, 0, 0, 1, 1, 2, 3, 5]


def tree_batch(valid_rows=None) -> Tree:
    parents = torch.tensor([PARENTS, PARENTS])
    anc = ancestor_mask(parents, 3)
    valid = torch.ones(2, 8, dtype=torch.bool) if valid_rows is None else valid_rows
    eye = torch.eye(8, dtype=torch.bool)
    anc = torch.where(valid.unsqueeze(-1), anc, eye)
    return Tree(torch.arange(10, 18).expand(2, 8).clone(), parents, ancestor_mask(parents, 3).sum(-1) - 1, valid, anc,
                torch.zeros(2, 8), max_depth=3)


def choice_for(path_tokens: dict[int, int]) -> torch.Tensor:
    """Target choice per node: node -> token the target emits after it (default: a token no draft has)."""
    c = torch.full((8,), 99)
    for node, tok in path_tokens.items():
        c[node] = tok
    return c


def test_accepts_the_deepest_correct_path_and_takes_the_bonus_there():
    tree = tree_batch()
    # sequence 0: target says It->is, is->a, a->good, good->42 : accept It is a good, bonus 42
    # sequence 1: target says It->has, has->to, to->77 (not "be") : accept It has to, bonus 77
    choice = torch.stack([choice_for({0: 11, 1: 13, 3: 16, 6: 42}), choice_for({0: 12, 2: 15, 5: 77})])
    acc = accept(tree, choice)
    assert acc.count.tolist() == [4, 3]
    assert acc.nodes[0].tolist() == [0, 1, 3, 6]
    assert acc.nodes[1, :3].tolist() == [0, 2, 5]
    assert acc.bonus.tolist() == [42, 77]


def test_nothing_accepted_gives_the_targets_token_after_the_root():
    acc = accept(tree_batch(), torch.stack([choice_for({0: 5}), choice_for({0: 6})]))
    assert acc.count.tolist() == [1, 1] and acc.bonus.tolist() == [5, 6]
    assert acc.nodes[:, 0].tolist() == [0, 0]


def test_padding_nodes_are_never_accepted():
    valid = torch.ones(2, 8, dtype=torch.bool)
    valid[0, 6] = False  # "good" is padding for sequence 0
    choice = torch.stack([choice_for({0: 11, 1: 13, 3: 16, 6: 42}), choice_for({0: 11, 1: 13, 3: 16, 6: 42})])
    acc = accept(tree_batch(valid), choice)
    assert acc.count.tolist() == [3, 4]
    assert acc.bonus.tolist() == [16, 42]
