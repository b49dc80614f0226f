"""Draft trees: the EAGLE authors' example, EAGLE-2 expansion/rerank against brute force, static and chain shapes."""
import itertools

import pytest
import torch

from eagle_ray.config import TreeConfig
from eagle_ray.speculative.tree import Tree, ancestor_mask, grow_tree, root_to_leaf_paths, stack_trees, static_shape

WORDS = "It is has a the to good be".split()
PARENTS = [0, 0, 0, 1, 1, 2, 3, 5]  # is->It, has->It, a->is, the->is, to->has, good->a, be->to


def example_tree() -> Tree:
    parents = torch.tensor([PARENTS])
    anc = ancestor_mask(parents, 3)
    depth = anc.sum(-1) - 1
    T = len(WORDS)
    return Tree(torch.arange(T).view(1, -1), parents, depth, torch.ones(1, T, dtype=torch.bool), anc,
                torch.zeros(1, T))


def test_ancestor_mask_of_the_eagle_example():
    tree = example_tree()
    rows = {WORDS[i]: {WORDS[j] for j in range(8) if tree.ancestors[0, i, j]} for i in range(8)}
    assert rows == {
        "It": {"It"}, "is": {"It", "is"}, "has": {"It", "has"}, "a": {"It", "is", "a"}, "the": {"It", "is", "the"},
        "to": {"It", "has", "to"}, "good": {"It", "is", "a", "good"}, "be": {"It", "has", "to", "be"}}
    assert tree.depth[0].tolist() == [0, 1, 1, 2, 2, 2, 3, 3]
    paths = root_to_leaf_paths(tree)[0]
    assert sorted(" ".join(WORDS[i] for i in p) for p in paths) == ["It has to be", "It is a good", "It is the"]


class FakeDraft:
    """A draft whose next-token log-probs are a fixed function of (input token, level): easy to brute-force."""

    def __init__(self, vocab=50, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.log_softmax(torch.randn(vocab, vocab, generator=g) * 3, -1)
        self.calls = []

    def draft_fn(self, tok, feat, level, block_mask, offset):
        self.calls.append((tok.clone(), level, block_mask.clone(), offset))
        # the "hidden state" carries the token so topk_fn can look it up
        return tok.unsqueeze(-1).float().expand(*tok.shape, feat.shape[-1])

    def topk_fn(self, hidden, k):
        tok = hidden[..., 0].long()
        return self.table[tok].topk(k, dim=-1)


def brute_force_pool(draft: FakeDraft, root: int, depth: int, k: int):
    """Every candidate EAGLE-2 scores: (cum logprob, path) per level, frontier = global top-k per level."""
    pool = []
    lp, tok = draft.table[root].topk(k)
    frontier = [(lp[i].item(), (tok[i].item(),)) for i in range(k)]
    pool += frontier
    for _ in range(depth):
        cands = []
        for score, path in frontier:
            lp, tok = draft.table[path[-1]].topk(k)
            cands += [(score + lp[i].item(), path + (tok[i].item(),)) for i in range(k)]
        pool += cands
        frontier = sorted(cands, key=lambda c: -c[0])[:k]
    return pool


def test_dynamic_tree_keeps_the_best_candidates_of_the_eagle2_pool():
    cfg = TreeConfig(total_tokens=20, depth=3, top_k=4)
    draft = FakeDraft()
    roots = torch.tensor([3, 17])
    feat = roots.view(-1, 1).float().expand(2, 8)
    tree = grow_tree(draft.draft_fn, draft.topk_fn, feat, roots, cfg)
    assert tree.tokens.shape == (2, 20)
    assert len(draft.calls) == cfg.depth  # the last level is scored, not forwarded
    for b, root in enumerate(roots.tolist()):
        pool = brute_force_pool(draft, root, cfg.depth, cfg.top_k)
        best = sorted(pool, key=lambda c: -c[0])[: cfg.total_tokens - 1]
        got = []
        for i in range(1, 20):
            path = [tree.tokens[b, j].item() for j in tree.ancestors[b, i].nonzero().flatten().tolist()][1:]
            got.append((tree.scores[b, i].item(), tuple(path)))
            p = tree.parents[b, i].item()
            assert p < i and tree.depth[b, i] == tree.depth[b, p] + 1
        assert sorted(x[1] for x in got) == sorted(x[1] for x in best)
        for score, path in got:
            assert abs(score - dict((pp, s) for s, pp in pool)[path]) < 1e-5
    assert tree.tokens[:, 0].tolist() == [3, 17]


def test_dynamic_tree_frontier_masks_follow_ancestry():
    cfg = TreeConfig(total_tokens=30, depth=3, top_k=3)
    draft = FakeDraft(seed=1)
    grow_tree(draft.draft_fn, draft.topk_fn, torch.ones(1, 4), torch.tensor([5]), cfg)
    for level, (_, lvl, mask, offset) in enumerate(draft.calls):
        assert lvl == level and offset == level * 3
        assert mask.shape == (1, 3, 3 * (level + 1))
        assert mask[0].sum(-1).tolist() == [level + 1] * 3  # each frontier node sees one node per level
        assert mask[0, :, offset:].equal(torch.eye(3, dtype=torch.bool))


def test_min_cum_prob_prunes_but_keeps_the_tree_connected():
    cfg = TreeConfig(total_tokens=40, depth=4, top_k=4, min_cum_prob=0.05)
    draft = FakeDraft(seed=2)
    tree = grow_tree(draft.draft_fn, draft.topk_fn, torch.ones(2, 4), torch.tensor([1, 2]), cfg)
    assert (tree.size < 40).all()
    for b in range(2):
        for i in range(40):
            if tree.valid[b, i]:
                assert tree.valid[b, tree.parents[b, i]]
                assert tree.scores[b, i] >= torch.log(torch.tensor(0.05))
            else:
                assert tree.ancestors[b, i].nonzero().flatten().tolist() == [i]


def test_static_tree_and_chain_shapes():
    draft = FakeDraft(seed=3)
    cfg = TreeConfig(mode="static", static_tree=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    tree = grow_tree(draft.draft_fn, draft.topk_fn, torch.full((1, 4), 7.0), torch.tensor([7]), cfg)
    assert tree.tokens.shape == (1, 7)
    assert tree.parents[0].tolist() == [0, 0, 0, 1, 1, 2, 3]
    lp, tok = draft.table[7].topk(2)
    assert tree.tokens[0, 1:3].tolist() == tok.tolist()
    assert tree.tokens[0, 3:5].tolist() == draft.table[tok[0]].topk(2).indices.tolist()

    chain = TreeConfig(mode="chain", depth=3)
    assert static_shape(chain) == [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]
    tree = grow_tree(draft.draft_fn, draft.topk_fn, torch.full((1, 4), 7.0), torch.tensor([7]), chain)
    assert tree.parents[0].tolist() == [0, 0, 1, 2, 3]
    expect, t = [], 7
    for _ in range(4):
        t = draft.table[t].argmax().item()
        expect.append(t)
    assert tree.tokens[0, 1:].tolist() == expect


def test_every_static_default_node_has_its_parent():
    shape = static_shape(TreeConfig(mode="static"))
    paths = {tuple(p) for p in shape}
    assert all(tuple(p[:-1]) in paths for p in shape if len(p) > 1)
    assert len(paths) == len(shape)
    assert all(a != b for a, b in itertools.combinations(shape, 2))


def _random_batch_tree(seed=0, B=4, cfg=None):
    from eagle_ray.speculative.tree import grow_dynamic
    g = torch.Generator().manual_seed(seed)
    d, V = 8, 50
    emb = torch.randn(V, d, generator=g)
    proj = torch.randn(d, V, generator=g)

    def topk_fn(h, k):
        lp = torch.log_softmax(h @ proj * 2, -1)
        return lp.topk(k, -1)

    def draft_fn(tok, feat, level, block_mask, offset):
        return torch.tanh(feat + emb[tok])

    cfg = cfg or TreeConfig(total_tokens=10, depth=3, top_k=3)
    return grow_dynamic(draft_fn, topk_fn, torch.randn(B, d, generator=g), torch.arange(B), cfg)


def test_batch_budget_keeps_the_most_probable_nodes_across_sequences_and_stays_connected():
    from eagle_ray.speculative.tree import fit_batch_budget
    tree = _random_batch_tree()
    cut = fit_batch_budget(tree, 20)
    assert int(cut.valid.sum()) == 20 and bool(cut.valid[:, 0].all())
    kept = cut.scores[cut.valid & (torch.arange(10) > 0)]
    dropped = tree.scores[tree.valid & ~cut.valid]
    assert kept.min() >= dropped.max()                      # a global top by cumulative draft probability
    assert bool(cut.valid.gather(1, cut.parents).logical_or(~cut.valid).all())   # parents kept
    assert bool(cut.ancestors.sum(-1)[cut.valid].eq(cut.depth[cut.valid] + 1).all())
    assert fit_batch_budget(tree, 40) is tree               # under budget: untouched


def test_drop_padding_moves_valid_nodes_first_and_trims_width_without_changing_the_trees():
    from eagle_ray.speculative.tree import drop_padding, fit_batch_budget
    tree = fit_batch_budget(_random_batch_tree(seed=3), 18)
    packed = drop_padding(tree)
    assert packed.tokens.shape[1] == int(tree.valid.sum(1).max())
    for b in range(tree.tokens.shape[0]):
        old = tree.valid[b].nonzero().flatten()
        n = len(old)
        assert bool(packed.valid[b, :n].all()) and not bool(packed.valid[b, n:].any())
        assert packed.tokens[b, :n].tolist() == tree.tokens[b, old].tolist()
        assert packed.depth[b, :n].tolist() == tree.depth[b, old].tolist()
        assert torch.equal(packed.ancestors[b, :n, :n], tree.ancestors[b][old][:, old])
        remap = {int(o): i for i, o in enumerate(old)}
        assert packed.parents[b, :n].tolist() == [remap[int(p)] for p in tree.parents[b, old]]


def test_nan_or_infinite_draft_scores_leave_every_tree_well_formed():
    """A head that outputs NaN (or overflows) used to yield trees whose children hung off the wrong parents and
    whose depths disagreed with their links: the verify pass then emitted tokens it never checked. Floored scores
    (``draft_log_probs``) keep each node's parent in the tree and one level above it, in every tree mode, and a
    context-token draft never picks the padding of an unused context slot."""
    from eagle_ray.speculative.context_vocab import context_topk
    from eagle_ray.speculative.tree import LOGP_FLOOR, draft_log_probs
    B, V, d = 2, 16, 8
    nan = float("nan")

    def topk_fn(hidden, k):
        logits = torch.full(hidden.shape[:-1] + (V,), nan)
        logits[..., 3] = float("inf")
        return draft_log_probs(logits).topk(k, dim=-1)

    def draft_fn(tok, feat, level, mask, offset):
        return torch.full(tok.shape + (d,), nan)

    for cfg in (TreeConfig(total_tokens=12, depth=3, top_k=3), TreeConfig(mode="static"),
                TreeConfig(mode="chain", depth=3)):
        tree = grow_tree(draft_fn, topk_fn, torch.full((B, d), nan), torch.zeros(B, dtype=torch.long), cfg)
        idx = torch.arange(tree.tokens.shape[1])
        parent_depth = tree.depth.gather(1, tree.parents)
        child = tree.valid & (idx > 0)
        assert (tree.parents[child] < idx.expand_as(tree.parents)[child]).all(), cfg
        assert (tree.depth[child] == parent_depth[child] + 1).all(), cfg
        assert torch.equal(tree.ancestors.sum(-1)[tree.valid], tree.depth[tree.valid] + 1), cfg
    context = torch.tensor([[40, 41, -1, -1], [-1, -1, -1, -1]])
    logp, ids = context_topk(torch.full((B, 1, V), nan), torch.full((B, 1, d), nan), torch.randn(64, d),
                             torch.arange(V), context, 3)
    assert ((logp >= LOGP_FLOOR) & (logp <= 0)).all() and (ids >= 0).all()


def test_a_tree_is_named_total_depth_top_k():
    assert TreeConfig.from_spec("8/3/3") == TreeConfig(total_tokens=8, depth=3, top_k=3)
    assert TreeConfig.from_spec("8/3/3", lookup=0) == TreeConfig(total_tokens=8, depth=3, top_k=3, lookup=0)
    with pytest.raises(ValueError, match=r"'8x3': write total/depth/top_k"):
        TreeConfig.from_spec("8x3")
    with pytest.raises(ValueError, match="top_k"):
        TreeConfig.from_spec("8/3/0")


def test_stacked_trees_pad_the_narrower_with_nodes_that_see_only_themselves():
    wide = Tree(torch.tensor([[5, 6, 7]]), torch.tensor([[0, 0, 1]]), torch.tensor([[0, 1, 2]]),
                torch.ones(1, 3, dtype=torch.bool), torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 1, 1]]]).bool(),
                torch.tensor([[0.0, -0.5, -1.0]]), max_depth=2)
    root = Tree(torch.tensor([[9]]), torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long),
                torch.ones(1, 1, dtype=torch.bool), torch.ones(1, 1, 1, dtype=torch.bool), torch.zeros(1, 1))
    both = stack_trees(wide, root)
    assert both.tokens.tolist() == [[5, 6, 7], [9, 0, 0]] and both.parents.tolist() == [[0, 0, 1], [0, 1, 2]]
    assert both.valid.tolist() == [[True] * 3, [True, False, False]] and both.size.tolist() == [3, 1]
    assert both.ancestors[1].int().tolist() == [[1, 0, 0], [0, 1, 0], [0, 0, 1]]
    assert both.scores[1].tolist() == [0.0, float("-inf"), float("-inf")] and (both.max_depth, both.padded) == (2, True)
