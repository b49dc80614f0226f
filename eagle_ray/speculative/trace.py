"""What the verifier did with each draft tree: the data behind the calibration curve and the tree tuner.

Recording is off unless a :class:`TreeTrace` is attached to the engine. Each verify step adds, per sequence, the
verified tree's nodes (cumulative draft log-prob, parent, depth) and which of them the target accepted, as a
few small CPU tensors; nothing is looped over in Python. It also notes where each sequence stood, so that once the
outputs are known (:meth:`TreeTrace.match_chains`) the trace can say how deep a prompt-lookup chain
(``speculative/lookup.py``) would have been accepted at each step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from eagle_ray.speculative.lookup import TokenHistory
from eagle_ray.speculative.tree import Tree

CALIBRATION_BINS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


@dataclass
class TreeTrace:
    """Verified trees of every step, padded to a common width when read back."""
    max_steps: int = 100_000
    scores: list[torch.Tensor] = field(default_factory=list)    # [B, T] cumulative draft log-prob (root 0)
    parents: list[torch.Tensor] = field(default_factory=list)   # [B, T]
    depth: list[torch.Tensor] = field(default_factory=list)     # [B, T]
    valid: list[torch.Tensor] = field(default_factory=list)     # [B, T]
    accepted: list[torch.Tensor] = field(default_factory=list)  # [B, T] on the accepted path (root included)
    tokens: list[torch.Tensor] = field(default_factory=list)    # [B, T] node tokens (root first)
    where: list[list | None] = field(default_factory=list)      # per step: (request id, tokens so far) per sequence
    chain_found: torch.Tensor | None = None   # [N] a lookup found its n-gram (match_chains)
    chain_match: torch.Tensor | None = None   # [N] leading chain tokens equal to what the target emitted next
    _stacked: dict | None = field(default=None, repr=False)

    def record(self, tree: Tree, accepted_nodes: torch.Tensor, where: list[tuple[str, int]] | None = None) -> None:
        """``where``: each sequence's request id and its prompt + output length at this step (root included)."""
        if len(self.scores) >= self.max_steps:
            return
        self._stacked = None
        self.where.append(where)
        on_path = torch.zeros_like(tree.valid).scatter_(1, accepted_nodes, True)
        self.scores.append(tree.scores.float().cpu())
        self.parents.append(tree.parents.cpu())
        self.depth.append(tree.depth.cpu())
        self.valid.append(tree.valid.cpu())
        self.accepted.append(on_path.cpu())
        self.tokens.append(tree.tokens.cpu())

    def __len__(self) -> int:
        return sum(s.shape[0] for s in self.scores)

    def match_chains(self, texts: dict[str, list[int]], ngram: int, length: int) -> None:
        """For every recorded sequence-step, the prompt-lookup chain of ``length`` tokens its history then gave
        (``TokenHistory.propose``), and how many of its leading tokens equal what the sequence emitted after that
        step's root (``texts``: request id -> prompt + output ids). Greedy acceptance of a tree with that chain
        grafted on is the deeper of the two: the tree's accepted path and the chain's match."""
        found, match = [], []
        for where, scores in zip(self.where, self.scores):
            for b in range(scores.shape[0]):
                text = texts.get(where[b][0]) if where else None
                if text is None:
                    found.append(False)
                    match.append(0)
                    continue
                n = where[b][1]
                history = TokenHistory()
                history.sync(text[:n], [])
                chain = history.propose(ngram, length)
                ahead = np.asarray(text[n: n + len(chain)], dtype=np.int64)
                same = chain[: len(ahead)] == ahead
                found.append(len(chain) > 0)
                match.append(int(same.size if same.all() else same.argmin()))
        self.chain_found, self.chain_match = torch.tensor(found, dtype=torch.bool), torch.tensor(match)

    def chain_rate(self, batch: int) -> float:
        """How often at least one of ``batch`` consecutive sequence-steps found a chain: the share of verify passes a
        lookup widens (the pass is as wide as its widest tree). With fewer traced sequences than ``batch`` a group
        holds several steps of the same sequences, whose chains come and go together: an estimate, like
        :meth:`simulated_budget`'s groups."""
        if self.chain_found is None or not len(self.chain_found):
            return 0.0
        found = self.chain_found
        n = max(len(found) // batch * batch, batch)
        found = torch.nn.functional.pad(found, (0, max(0, n - len(found))))[:n]
        return float(found.view(-1, batch).any(1).float().mean())

    def stacked(self) -> dict[str, torch.Tensor]:
        """All recorded trees as ``[N, W]`` tensors (N = sequence-steps), padding marked invalid."""
        if self._stacked is not None:
            return self._stacked
        W = max(s.shape[1] for s in self.scores)

        def pad(xs, value):
            return torch.cat([torch.nn.functional.pad(x, (0, W - x.shape[1]), value=value) for x in xs])
        out = {"scores": pad(self.scores, float("-inf")), "parents": pad(self.parents, 0), "depth": pad(self.depth, 0),
               "valid": pad(self.valid, False), "accepted": pad(self.accepted, False)}
        out["reached"] = out["valid"] & out["accepted"].gather(1, out["parents"])  # the parent was accepted
        out["reached"][:, 0] = False
        out["confidence"] = (out["scores"] - out["scores"].gather(1, out["parents"])).exp().nan_to_num(0.0)
        drafted = out["valid"].clone()
        drafted[:, 0] = False                                                       # the root is nobody's sibling
        same_parent = out["parents"].unsqueeze(2) == out["parents"].unsqueeze(1)    # [N, W, W]
        better = out["scores"].unsqueeze(1) > out["scores"].unsqueeze(2)            # j beats i
        out["sibling_rank"] = (same_parent & better & drafted.unsqueeze(1)).sum(2)
        self._stacked = out
        return out

    def calibration(self, bins=CALIBRATION_BINS) -> list[dict]:
        """Draft confidence (the head's probability of a node's token given its parent) against how often the target
        accepted the node when it got to judge it (its parent was accepted): EAGLE-2's Figure 6."""
        t = self.stacked()
        conf, acc = t["confidence"][t["reached"]], t["accepted"][t["reached"]].float()
        edges = torch.tensor(bins)
        which = torch.bucketize(conf, edges[1:-1], right=True)
        rows = []
        for i in range(len(bins) - 1):
            sel = which == i
            n = int(sel.sum())
            rows.append({"bin_lo": bins[i], "bin_hi": bins[i + 1], "nodes": n,
                         "mean_confidence": float(conf[sel].mean()) if n else None,
                         "acceptance_rate": float(acc[sel].mean()) if n else None})
        return rows

    def simulated_tau(self, total_tokens: int, depth: int, top_k: int, lookup: int = 0) -> float:
        """Mean accepted length (bonus included) had the trees been cut to ``(total_tokens, depth, top_k)``, with
        ``lookup``-token prompt-lookup chains grafted on (needs :meth:`match_chains`; else none are counted).

        A node survives the cut when it is among its parent's ``top_k`` children, at most ``depth + 1`` deep, and
        among the ``total_tokens - 1`` best-scoring such nodes (the EAGLE-2 rerank). Greedy acceptance walks the
        target's path, so the cut tree accepts exactly the recorded path's nodes that survive, from the root down,
        and a grafted chain is one more path: the deeper of the two is accepted. The steps are the traced run's, so
        with chains this is an estimate (a deeper accept moves the following steps). Trees recorded with a larger
        budget are needed for larger cuts; missing nodes count as absent.
        """
        t = self.stacked()
        accepted = (self._cut(total_tokens, depth, top_k) & t["accepted"]).sum(1)
        if lookup and self.chain_match is not None and len(self.chain_match) == len(accepted):
            accepted = torch.maximum(accepted, self.chain_match.clamp(max=lookup))
        return float((accepted + 1).float().mean())

    def simulated_budget(self, total_tokens: int, depth: int, top_k: int, batch: int,
                         verify_cap: int) -> tuple[float, float]:
        """(tau, mean verify width) had the cut trees of every ``batch`` consecutive sequence-steps shared a verify
        pass capped at ``verify_cap`` nodes: the roots, then the best-scoring draft nodes across the batch
        (``spec.tree.fit_batch_budget``). The width is the largest kept tree of each group, as ``drop_padding``
        makes it."""
        t = self.stacked()
        chosen = self._cut(total_tokens, depth, top_k)
        N = chosen.shape[0] // batch * batch
        if N == 0:
            return 1.0, 1.0
        chosen, accepted = chosen[:N].view(-1, batch * chosen.shape[1]), t["accepted"][:N].view(N // batch, -1)
        key = torch.where(chosen, t["scores"][:N].view(N // batch, -1), float("-inf"))
        kept = torch.zeros_like(chosen)
        budget = verify_cap - batch
        if budget > 0:
            top = key.topk(min(budget, key.shape[1]), dim=1)
            kept.scatter_(1, top.indices, top.values > float("-inf"))
        per_seq = kept.view(N, -1)
        tau = float(((per_seq & accepted.view(N, -1)).sum(1) + 1).float().mean())
        width = float((per_seq.sum(1).view(-1, batch).max(1).values + 1).float().mean())
        return tau, width

    def _cut(self, total_tokens: int, depth: int, top_k: int) -> torch.Tensor:
        """[N, W] the draft nodes a ``(total_tokens, depth, top_k)`` tree keeps of each recorded tree."""
        t = self.stacked()
        scores, parents, valid = t["scores"], t["parents"], t["valid"]
        W = scores.shape[1]
        keep = valid & (t["sibling_rank"] < top_k) & (t["depth"] <= depth + 1)
        keep[:, 0] = False
        for _ in range(depth):  # a node whose parent is cut is cut too: one gather per level
            keep &= (t["depth"] <= 1) | keep.gather(1, parents)
        key = torch.where(keep, scores, float("-inf"))
        n_keep = min(total_tokens - 1, W - 1)
        chosen = torch.zeros_like(keep)
        if n_keep > 0:
            top = key.topk(n_keep, dim=1)
            chosen.scatter_(1, top.indices, top.values > float("-inf"))
        return chosen
