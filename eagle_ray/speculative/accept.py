"""Tree acceptance for a batch, vectorised over nodes.

Greedy: a node is correct when its token is the target's argmax at its parent; the accepted path is the deepest
node whose whole root path is correct, and the bonus token is the target's argmax there.

Sampling uses the same walk with the target's *sampled* token at every node. This is exactly the reference's
recursive rejection with a deterministic (one-hot) draft: at a node, trying children x1, x2, ... in turn with
acceptance p(x_j) under the renormalised residual accepts x_j with total probability p(x_j), and when all are
rejected the bonus comes from p restricted to the non-children, i.e. a fresh draw y ~ p decides both: move to the
child whose token is y, or stop and emit y. Every emitted token is therefore a draw from the target's processed
distribution given the accepted prefix: lossless.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle_ray.speculative.tree import Tree


@dataclass
class Acceptance:
    nodes: torch.Tensor   # [B, A] accepted node indices, root first, padded by repeating the last one;
                          # A = the tree's max_depth + 1, whatever was accepted
    count: torch.Tensor   # [B] number of accepted nodes (root included) = accepted drafts + 1
    bonus: torch.Tensor   # [B] the token the target emits after the accepted path


def accept(tree: Tree, target_choice: torch.Tensor) -> Acceptance:
    """``target_choice [B, T]``: the target's token at each node (argmax or one sample per node)."""
    B, T = tree.tokens.shape
    choice_at_parent = target_choice.gather(1, tree.parents)
    correct = tree.valid & (tree.tokens == choice_at_parent)
    correct[:, 0] = True
    path_ok = ~(tree.ancestors & ~correct.unsqueeze(1)).any(-1)                    # [B, T]
    # distinct sibling tokens => the correct nodes form one chain; its deepest node ends the accepted path
    best = torch.where(path_ok, tree.depth, -1).argmax(1)
    count = tree.depth.gather(1, best.unsqueeze(1)).squeeze(1) + 1
    on_path = tree.ancestors.gather(1, best.view(B, 1, 1).expand(B, 1, T)).squeeze(1)
    idx = torch.arange(T, device=tree.tokens.device).expand(B, T)
    order = torch.where(on_path, idx, T).sort(1).values
    nodes = order[:, : tree.max_depth + 1]          # a static width: no read of the longest accepted path
    nodes = torch.where(nodes >= T, best.unsqueeze(1), nodes)
    return Acceptance(nodes, count, target_choice.gather(1, best.unsqueeze(1)).squeeze(1))
