"""Draft trees for a batch: EAGLE-2 dynamic expansion + rerank, EAGLE-1 static shapes, chains.

Pure tensor code. The draft model is passed in as two callables, so trees can be tested with a fake draft:

- ``draft_fn(tokens [B,n], features [B,n,d], level: int, block_mask [B,n,N], offset: int) -> hidden [B,n,d]``
  runs the head on ``n`` tree tokens per sequence placed at draft position ``stable_len + level``; the block
  holds the ``N`` tree tokens forwarded so far this cycle (the new ones are the last ``n``).
- ``topk_fn(hidden [..., d], k) -> (logprob [..., k], token [..., k])`` scores the draft's next-token distribution.

Node 0 of every tree is the root (the last token the target emitted, not yet in its KV cache). Nodes are
ordered so that a parent always precedes its children; padding nodes (``valid == False``) see only themselves.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from eagle_ray.config import TreeConfig

DEFAULT_STATIC_TREE = [  # EAGLE-1 style: wide near the root, a deep greedy spine (25 draft nodes)
    [0], [1], [2], [3],
    [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [3, 0],
    [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0], [0, 2, 0],
    [0, 0, 0, 0], [0, 0, 1, 0], [0, 1, 0, 0], [1, 0, 0, 0],
    [0, 0, 0, 0, 0], [0, 0, 0, 0, 1], [0, 1, 0, 0, 0],
    [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0],
]


@dataclass
class Tree:
    tokens: torch.Tensor     # [B, T] long
    parents: torch.Tensor    # [B, T] long, index of the parent node (root: 0)
    depth: torch.Tensor      # [B, T] long, root 0
    valid: torch.Tensor      # [B, T] bool
    ancestors: torch.Tensor  # [B, T, T] bool, row i = i and its ancestors (the verify attention mask)
    scores: torch.Tensor     # [B, T] cumulative draft log-prob (root 0, padding -inf)
    # host facts known from the tree's shape, so no step reads the device to learn them
    max_depth: int = 0       # deepest a node can be (an accepted path has at most max_depth + 1 nodes)
    padded: bool = False     # some nodes may be invalid (min_cum_prob, a batch budget): see drop_padding

    @property
    def size(self) -> torch.Tensor:
        return self.valid.sum(1)


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[B, T, T] reflexive ancestor relation from parent indices (parents precede children): one gather per level."""
    B, T = parents.shape
    eye = torch.eye(T, dtype=torch.bool, device=parents.device).expand(B, T, T)
    anc = eye
    for _ in range(max_depth):
        anc = eye | anc.gather(1, parents.unsqueeze(-1).expand(B, T, T))
        anc[:, 0] = eye[:, 0]
    return anc


def root_to_leaf_paths(tree: Tree) -> list[list[list[int]]]:
    """Per sequence, every root-to-leaf path as node indices (for inspection and tests; not on the hot path)."""
    out = []
    for b in range(tree.tokens.shape[0]):
        valid = tree.valid[b]
        has_child = torch.zeros_like(valid)
        has_child[tree.parents[b][valid][1:]] = True
        leaves = (valid & ~has_child).nonzero().flatten().tolist()
        out.append([tree.ancestors[b, i].nonzero().flatten().tolist() for i in leaves])
    return out


# the lowest log-prob a draft node is scored with: what a head's NaN, -inf or overflow becomes (draft_log_probs)
LOGP_FLOOR = -1e4


def draft_log_probs(logits: torch.Tensor) -> torch.Tensor:
    """The draft's log-probs, each finite in ``[LOGP_FLOOR, 0]``. A head that overflows or holds NaN weights
    yields NaN or -inf scores; ranked as they are, they tie or compare false, a child can outrank its parent, and
    the tree loses its shape. Floored, a child's cumulative score never exceeds its parent's, so every tree stays
    connected and the target verifies exactly what it is given: a broken head only costs acceptance."""
    return torch.log_softmax(logits.float(), dim=-1).nan_to_num_(LOGP_FLOOR, 0.0, LOGP_FLOOR).clamp_(LOGP_FLOOR, 0.0)


def _pool_to_tree(root_tokens, pool_tokens, pool_scores, pool_parents, pool_depth, keep: int,
                  min_cum_prob: float, max_depth: int) -> Tree:
    """Keep the ``keep`` best-scoring pool nodes per sequence (ascending pool order) and connect them.

    A child's cumulative log-prob never exceeds its parent's (finite: see ``draft_log_probs``) and pool ids grow
    with depth, so ranking by (score, -pool id) keeps every chosen node's parent chosen: the tree stays connected
    without a check.
    """
    B, P = pool_scores.shape
    device = pool_scores.device
    keep = min(keep, P)
    max_depth = min(max_depth, keep)
    pool_ids = torch.arange(P, device=device)
    key = pool_scores.double() - pool_ids.double() * 1e-9
    chosen = key.topk(keep, dim=1).indices.sort(dim=1).values                       # [B, keep]
    parent_pool = pool_parents.gather(1, chosen)                                     # -1 = root
    parent_node = torch.searchsorted(chosen, parent_pool.clamp(min=0)) + 1
    parents = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=device),
                         torch.where(parent_pool < 0, 0, parent_node)], dim=1)
    scores = torch.cat([torch.zeros(B, 1, device=device), pool_scores.gather(1, chosen).float()], dim=1)
    tokens = torch.cat([root_tokens.view(B, 1), pool_tokens.gather(1, chosen)], dim=1)
    depth = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=device), pool_depth.gather(1, chosen)], dim=1)
    valid = torch.ones_like(tokens, dtype=torch.bool)
    if min_cum_prob > 0:
        valid = scores >= math.log(min_cum_prob)
        valid[:, 0] = True
    parents = torch.where(valid, parents, torch.arange(parents.shape[1], device=device).expand_as(parents))
    parents[:, 0] = 0
    anc = ancestor_mask(parents, max_depth)
    eye = torch.eye(anc.shape[1], dtype=torch.bool, device=device)
    anc = torch.where(valid.unsqueeze(-1), anc, eye)
    return Tree(tokens, parents, torch.where(valid, depth, 0), valid, anc,
                torch.where(valid, scores, float("-inf")), max_depth, min_cum_prob > 0)


def grow_dynamic(draft_fn, topk_fn, root_hidden: torch.Tensor, root_tokens: torch.Tensor, cfg: TreeConfig) -> Tree:
    """EAGLE-2: expand a global top-k frontier by cumulative log-prob for ``depth`` steps, keep the best
    ``total_tokens - 1`` candidates of the pool (``k + depth * k^2`` nodes)."""
    B, d = root_hidden.shape
    k = cfg.top_k
    device = root_hidden.device
    logp, tok = topk_fn(root_hidden, k)                                              # [B, k]
    pool_tokens, pool_scores = [tok], [logp.float()]
    pool_parents = [torch.full((B, k), -1, dtype=torch.long, device=device)]
    pool_depth = [torch.ones(B, k, dtype=torch.long, device=device)]
    front_ids = torch.arange(k, device=device).expand(B, k)
    front_scores, front_tok = logp.float(), tok
    front_feat = root_hidden.unsqueeze(1).expand(B, k, d)
    eye = torch.eye(k, dtype=torch.bool, device=device).expand(B, k, k)
    front_mask = eye
    base = k
    for level in range(cfg.depth):
        hidden = draft_fn(front_tok, front_feat, level, front_mask, level * k)        # [B, k, d]
        logp, tok = topk_fn(hidden, k)                                               # [B, k, k]
        cum = (front_scores.unsqueeze(-1) + logp.float()).view(B, k * k)
        pool_tokens.append(tok.reshape(B, k * k))
        pool_scores.append(cum)
        pool_parents.append(front_ids.unsqueeze(-1).expand(B, k, k).reshape(B, k * k))
        pool_depth.append(torch.full((B, k * k), level + 2, dtype=torch.long, device=device))
        if level == cfg.depth - 1:
            break
        front_scores, sel = cum.topk(k, dim=1)
        parent = sel // k
        front_ids = base + sel
        front_tok = tok.reshape(B, k * k).gather(1, sel)
        front_feat = hidden.gather(1, parent.unsqueeze(-1).expand(B, k, d))
        front_mask = torch.cat([front_mask.gather(1, parent.unsqueeze(-1).expand_as(front_mask)), eye], dim=2)
        base += k * k
    return _pool_to_tree(root_tokens, torch.cat(pool_tokens, 1), torch.cat(pool_scores, 1),
                         torch.cat(pool_parents, 1), torch.cat(pool_depth, 1), cfg.total_tokens - 1,
                         cfg.min_cum_prob, cfg.depth + 1)


def static_shape(cfg: TreeConfig) -> list[list[int]]:
    if cfg.mode == "chain":
        return [[0] * (i + 1) for i in range(cfg.depth + 1)]
    shape = cfg.static_tree or DEFAULT_STATIC_TREE
    return sorted((list(p) for p in shape), key=lambda p: (len(p), p))


def children_per_node(cfg: TreeConfig) -> int:
    """The most children a node of ``cfg``'s trees takes from one top-k: the draft vocabulary needs that many."""
    return cfg.top_k if cfg.mode == "dynamic" else max(p[-1] for p in static_shape(cfg)) + 1


@dataclass(frozen=True)
class StaticLevel:
    """One forwarded level of a static tree: which pool nodes go through the head, what they attend to among the
    nodes forwarded before them, and where their children take their ranks from."""
    parents: torch.Tensor      # [n] pool ids forwarded at this level
    block: torch.Tensor        # [n, N0 + n] bool: the forwarded nodes each attends to (ancestors and itself)
    offset: int                # N0: nodes forwarded before this level
    children: torch.Tensor     # [c] pool ids of the next level
    child_rows: torch.Tensor   # [c] which forwarded row is each child's parent
    child_ranks: torch.Tensor  # [c] the child's rank among its parent's top-k
    child_parents: torch.Tensor  # [c] the parent's pool id (its score is added)


@dataclass(frozen=True)
class StaticPlan:
    """A static tree's shape turned into device index tensors once (per shape and device), so growing the tree
    sends nothing from the host: ``static_plan`` caches it."""
    first: torch.Tensor        # [l1] pool ids of level 1
    first_ranks: torch.Tensor  # [l1] their ranks in the root's top-k
    parents: torch.Tensor      # [P] parent pool id (-1: the root)
    depth: torch.Tensor        # [P] depth of each pool node
    levels: tuple[StaticLevel, ...]
    max_depth: int


_STATIC_PLANS: dict = {}


def prepare_trees(trees: list[TreeConfig], device) -> None:
    """Make the device plans of the static trees and chains among ``trees`` now (at load, or when the trees
    change), not in the first step that grows one."""
    for cfg in trees:
        if cfg.mode != "dynamic":
            static_plan(static_shape(cfg), device)


def static_plan(shape: list[list[int]], device) -> StaticPlan:
    key = (tuple(map(tuple, shape)), str(device))
    if key not in _STATIC_PLANS:
        _STATIC_PLANS[key] = _make_static_plan(shape, torch.device(device))
    return _STATIC_PLANS[key]


def _make_static_plan(shape: list[list[int]], device: torch.device) -> StaticPlan:
    index = {tuple(p): i for i, p in enumerate(shape)}
    depths = sorted({len(p) for p in shape})
    ints = lambda values: torch.tensor(values, dtype=torch.long, device=device)   # noqa: E731 (built once)
    first = [i for i, p in enumerate(shape) if len(p) == 1]
    levels, forwarded = [], []
    for level in depths[:-1]:
        parents = [i for i, p in enumerate(shape) if len(p) == level and any(
            len(q) == level + 1 and q[:-1] == p for q in shape)]
        if not parents:
            break
        n0, n = len(forwarded), len(parents)
        block = torch.zeros(n, n0 + n, dtype=torch.bool)
        for r, i in enumerate(parents):   # host-side shape bookkeeping, once per shape
            for anc in _ancestors(shape[i], index):
                if anc in forwarded:
                    block[r, forwarded.index(anc)] = True
            block[r, n0 + r] = True
        forwarded += parents
        children = [j for j, q in enumerate(shape) if len(q) == level + 1]
        child_parents = [index[tuple(shape[j][:-1])] for j in children]
        levels.append(StaticLevel(ints(parents), block.to(device), n0, ints(children),
                                  ints([parents.index(p) for p in child_parents]),
                                  ints([shape[j][-1] for j in children]), ints(child_parents)))
    return StaticPlan(ints(first), ints([shape[i][-1] for i in first]),
                      ints([index.get(tuple(p[:-1]), -1) for p in shape]), ints([len(p) for p in shape]),
                      tuple(levels), max(depths))


def grow_static(draft_fn, topk_fn, root_hidden: torch.Tensor, root_tokens: torch.Tensor, cfg: TreeConfig) -> Tree:
    """EAGLE-1 style fixed tree (and chains): node ``[r0, r1, ...]`` is the r-th ranked child along the path.

    Only nodes that have children are forwarded through the draft, one batched call per level; the shape's index
    tensors come from :func:`static_plan` (made once per shape), so no level sends anything from the host.
    """
    shape = static_shape(cfg)
    plan = static_plan(shape, root_hidden.device)
    B, d = root_hidden.shape
    P = len(shape)
    K = children_per_node(cfg)
    logp, tok = topk_fn(root_hidden, K)
    pool_tokens = root_tokens.new_zeros(B, P)
    pool_scores = root_hidden.new_zeros(B, P, dtype=torch.float32)
    pool_tokens[:, plan.first] = tok[:, plan.first_ranks]
    pool_scores[:, plan.first] = logp[:, plan.first_ranks].float()
    outputs = root_hidden.new_zeros(B, P, d)   # the head's output at each forwarded node: its children's feature
    for step, lvl in enumerate(plan.levels):
        feats = root_hidden.unsqueeze(1).expand(B, len(lvl.parents), d) if step == 0 else \
            outputs[:, plan.parents[lvl.parents]]
        hidden = draft_fn(pool_tokens[:, lvl.parents], feats, step, lvl.block.expand(B, *lvl.block.shape),
                          lvl.offset)
        outputs[:, lvl.parents] = hidden.to(outputs.dtype)
        lp, tk = topk_fn(hidden, K)                                                # [B, n, K]
        pool_tokens[:, lvl.children] = tk[:, lvl.child_rows, lvl.child_ranks]
        pool_scores[:, lvl.children] = pool_scores[:, lvl.child_parents] + lp[:, lvl.child_rows, lvl.child_ranks].float()
    return _pool_to_tree(root_tokens, pool_tokens, pool_scores, plan.parents.expand(B, P), plan.depth.expand(B, P),
                         P, cfg.min_cum_prob, plan.max_depth)


def _ancestors(path: list[int], index: dict) -> list[int]:
    return [index[tuple(path[:j])] for j in range(1, len(path) + 1)]


def grow_tree(draft_fn, topk_fn, root_hidden, root_tokens, cfg: TreeConfig) -> Tree:
    if cfg.mode == "dynamic":
        return grow_dynamic(draft_fn, topk_fn, root_hidden, root_tokens, cfg)
    return grow_static(draft_fn, topk_fn, root_hidden, root_tokens, cfg)


def fit_batch_budget(tree: Tree, max_tokens: int) -> Tree:
    """Keep at most ``max_tokens`` nodes over the whole batch: every root, then the draft nodes with the highest
    cumulative draft probability across all sequences. Cumulative probability estimates a node's chance of being
    accepted, so this spends the verify pass where acceptance is likeliest: a confident sequence keeps a big tree,
    an unsure one shrinks to its root. Parents outrank their children, so every tree stays connected."""
    B, T = tree.tokens.shape
    budget = max_tokens - B
    if B * T <= max_tokens:  # decided from the shape: counting valid nodes would read the device
        return tree
    idx = torch.arange(T, device=tree.tokens.device)
    key = torch.where(tree.valid, tree.scores.double(), float("-inf")) - idx.double() * 1e-9
    key[:, 0] = float("-inf")                                       # roots are always kept, outside the budget
    keep = torch.zeros(B * T, dtype=torch.bool, device=key.device)
    if budget > 0:
        keep[key.flatten().topk(budget).indices] = True
    valid = (keep.view(B, T) & tree.valid)
    valid[:, 0] = True
    return _with_valid(tree, valid)


def _with_valid(tree: Tree, valid: torch.Tensor) -> Tree:
    T = tree.tokens.shape[1]
    eye = torch.eye(T, dtype=torch.bool, device=valid.device)
    idx = torch.arange(T, device=valid.device).expand_as(tree.parents)
    return Tree(tree.tokens, torch.where(valid, tree.parents, idx), torch.where(valid, tree.depth, 0), valid,
                torch.where(valid.unsqueeze(-1), tree.ancestors, eye), torch.where(valid, tree.scores, float("-inf")),
                tree.max_depth, True)


def keep_nodes(tree: Tree, valid: torch.Tensor, width: int) -> Tree:
    """``tree`` with only the nodes ``valid [B, T]`` marks (every kept node's parent kept), moved to the front,
    ``width`` (the most kept in a row, known to the caller) wide: what a grammar leaves of a drafted tree."""
    return drop_padding(_with_valid(tree, valid), width)


def rows_of(tree: Tree, n: int) -> Tree:
    """The first ``n`` sequences' trees."""
    return tree if n == tree.tokens.shape[0] else select_rows(tree, slice(0, n), tree.tokens.shape[1])


def split_by_size(sizes: list[int], block_tokens: int) -> list[tuple[int, int]]:
    """(rows, width) of each verify block, its rows next in ``size_order``: the split of the trees, largest first,
    into blocks as wide as their largest tree that verifies the fewest tokens, each block after the first counted as
    ``block_tokens`` more (what a further block costs: its attention calls, its acceptance). Under a batch verify cap
    most trees shrink to their root while a few keep many nodes: in one block every root would be verified as wide
    as the widest tree. Blocks start only where the width changes, so the search is over the distinct sizes."""
    widths = sorted(sizes, reverse=True)
    starts = [i for i, w in enumerate(widths) if i == 0 or w != widths[i - 1]] + [len(widths)]
    # best[j]: (cost, blocks) of the rows from starts[j] on; a block from starts[j] ends at some later start
    best: list[tuple[float, list[tuple[int, int]]]] = [(0.0, [])] * len(starts)
    for j in range(len(starts) - 2, -1, -1):
        first, w = starts[j], widths[starts[j]]
        splits = (((starts[m] - first) * w + block_tokens + best[m][0], [(starts[m] - first, w)] + best[m][1])
                  for m in range(j + 1, len(starts)))
        best[j] = min(splits, key=lambda c: (c[0], len(c[1])))   # ties: fewer blocks
    return best[0][1]


def size_order(tree: Tree) -> torch.Tensor:
    """The rows by tree size, largest first, ties in row order (what ``split_by_size`` counts in), on the device."""
    return torch.sort(tree.size, descending=True, stable=True).indices


def select_rows(tree: Tree, index: torch.Tensor | slice, width: int) -> Tree:
    """The trees of rows ``index``, cut to their first ``width`` nodes: for trees whose valid nodes lie at the front
    (``drop_padding``) and hold at most ``width``, the same trees in a narrower block."""
    return replace(tree, tokens=tree.tokens[index, :width], parents=tree.parents[index, :width],
                   depth=tree.depth[index, :width], valid=tree.valid[index, :width],
                   ancestors=tree.ancestors[index, :width, :width], scores=tree.scores[index, :width])


def stack_trees(first: Tree, second: Tree) -> Tree:
    """Both batches' trees as one batch, the narrower padded to the wider with padding nodes (invalid, their own
    parent, seeing only themselves): one verify pass, so one read of the weights, for drafted and plain rows."""
    W = max(first.tokens.shape[1], second.tokens.shape[1])

    def widened(t: Tree) -> Tree:
        B, T = t.tokens.shape
        if T == W:
            return t
        dev, pad = t.tokens.device, W - T
        anc = torch.zeros(B, W, W, dtype=torch.bool, device=dev)
        anc[:, :T, :T] = t.ancestors
        anc[:, T:, T:] = torch.eye(pad, dtype=torch.bool, device=dev)
        own = torch.arange(T, W, device=dev).expand(B, pad)
        return Tree(F.pad(t.tokens, (0, pad)), torch.cat([t.parents, own], 1), F.pad(t.depth, (0, pad)),
                    F.pad(t.valid, (0, pad)), anc, F.pad(t.scores, (0, pad), value=float("-inf")), t.max_depth, True)

    a, b = widened(first), widened(second)
    return Tree(*(torch.cat([x, y]) for x, y in ((a.tokens, b.tokens), (a.parents, b.parents), (a.depth, b.depth),
                                                  (a.valid, b.valid), (a.ancestors, b.ancestors),
                                                  (a.scores, b.scores))),
                max(a.max_depth, b.max_depth), a.padded or b.padded)


def drop_padding(tree: Tree, width: int | None = None) -> Tree:
    """Move each tree's valid nodes to the front (keeping their order, so parents still precede children) and
    drop the all-padding columns: the verify pass is as wide as the largest tree, not the widest budget.
    Only a tree that may hold padding pays the one read of its width (none where the caller knows ``width``)."""
    B, T = tree.tokens.shape
    if not tree.padded:
        return tree
    idx = torch.arange(T, device=tree.tokens.device).expand(B, T)
    order = torch.where(tree.valid, idx, idx + T).argsort(dim=1)        # valid first, stable
    W = int(tree.valid.sum(1).max()) if width is None else width
    order = order[:, :W]
    new_of_old = torch.empty_like(idx)
    new_of_old.scatter_(1, order, torch.arange(W, device=idx.device).expand(B, W))
    valid = tree.valid.gather(1, order)
    parents = new_of_old.gather(1, tree.parents.gather(1, order))
    parents = torch.where(valid, parents, torch.arange(W, device=idx.device).expand(B, W))
    anc = tree.ancestors.gather(1, order.unsqueeze(-1).expand(B, W, T)).gather(2, order.unsqueeze(1).expand(B, W, W))
    return replace(tree, tokens=tree.tokens.gather(1, order), parents=parents, depth=tree.depth.gather(1, order),
                   valid=valid, ancestors=anc, scores=tree.scores.gather(1, order))


# log-prob a lookup token is scored with: where the last 3 tokens occurred before, the token that followed them
# came next again 81-90% of the time in the embedded target's answers to MT-bench and HumanEval prompts
LOOKUP_LOGP = math.log(0.8)


def graft_chain(tree: Tree, chain: torch.Tensor, n: torch.Tensor) -> Tree:
    """Add a chain of guessed tokens (``chain [B, L]``, the first ``n [B]`` of each row; ``speculative/lookup.py``) to
    every tree: it follows the tree's own nodes as long as they spell it, then continues as ``L`` new nodes (padding
    where the chain ends), so siblings stay distinct and acceptance stays one walk. A new node scores its attach
    point's cumulative log-prob plus ``LOOKUP_LOGP`` per level, for a batch budget to weigh it against drafts.
    The few padding nodes (a chain's prefix the tree already held) are verified, not dropped: dropping them would
    read the width back."""
    B, T = tree.tokens.shape
    L = chain.shape[1]
    device = chain.device
    d = tree.depth
    expected = chain.gather(1, (d - 1).clamp(0, L - 1))
    match = tree.valid & (tree.tokens == expected) & (d <= n.view(B, 1))
    match[:, 0] = True
    on_chain = ~(tree.ancestors & ~match.unsqueeze(1)).any(-1)          # the whole root path spells the chain
    attach = torch.where(on_chain, d, -1).argmax(1)                      # the deepest such node: one per depth
    start = d.gather(1, attach.view(B, 1))                               # chain tokens the tree already holds
    j = torch.arange(L, device=device).view(1, L)
    pos = start + j
    valid = pos < n.view(B, 1)
    own = T + j.expand(B, L)
    parents = torch.where(j == 0, attach.view(B, 1), own - 1)
    parents = torch.where(valid, parents, own)
    tokens = torch.where(valid, chain.gather(1, pos.clamp(max=L - 1)), 0)
    depth = torch.where(valid, start + j + 1, 0)
    scores = torch.where(valid, tree.scores.gather(1, attach.view(B, 1)) + LOOKUP_LOGP * (j + 1), float("-inf"))
    # a new node's ancestors: its attach point's, and the chain nodes up to itself (a padding node: itself only)
    above = tree.ancestors.gather(1, attach.view(B, 1, 1).expand(B, 1, T)) & valid.unsqueeze(-1)    # [B, L, T]
    upto = torch.ones(L, L, dtype=torch.bool, device=device).tril() & valid.unsqueeze(-1)
    upto = upto | torch.eye(L, dtype=torch.bool, device=device)
    ancestors = torch.cat([torch.cat([tree.ancestors, tree.ancestors.new_zeros(B, T, L)], 2),
                           torch.cat([above, upto], 2)], 1)
    return Tree(torch.cat([tree.tokens, tokens], 1), torch.cat([tree.parents, parents], 1), torch.cat([d, depth], 1),
                torch.cat([tree.valid, valid], 1), ancestors, torch.cat([tree.scores, scores.to(tree.scores.dtype)], 1),
                max(tree.max_depth, L), tree.padded)
