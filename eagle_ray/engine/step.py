"""One decoding step for a batch of running sequences: draft -> tree -> verify -> accept -> compact.

Everything is batched over sequences; the only Python loops run over sequences (to pack ragged inputs and hand
out results), never over tree nodes. ``StepTimer`` splits the step into draft forwards, target forwards and the
rest, which is the overhead we keep small.
"""
from __future__ import annotations

import time

import torch

from eagle_ray.config import TreeConfig
from eagle_ray.engine.sequence import Sequence
from eagle_ray.model.draft_head import DraftHead
from eagle_ray.model.target import TargetModel
from eagle_ray.spec.accept import accept
from eagle_ray.spec.sampling import SamplingBatch, choose_tokens
from eagle_ray.spec.tree import Tree, fit_batch_budget, grow_tree, pack


class StepTimer:
    """Wall time of the draft and target forwards inside a step (synchronising CUDA at the edges)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.draft_s = 0.0
        self.verify_s = 0.0
        self.verify_width = 0    # columns of the padded verify pass (B x width target tokens)
        self.tree_nodes = 0      # real (non-padding) tree nodes in it

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def sampling_batch(seqs: list[Sequence], device) -> SamplingBatch:
    return SamplingBatch.from_params([s.params for s in seqs], [s.generator for s in seqs], device)


def causal_block(lengths: list[int], width: int, device) -> torch.Tensor:
    """[B, W, W] causal masks for ragged blocks; rows past a sequence's length see only themselves."""
    n = torch.tensor(lengths, device=device).view(-1, 1, 1)
    idx = torch.arange(width, device=device)
    causal = idx.view(1, -1, 1) >= idx.view(1, 1, -1)
    real = (idx.view(1, -1, 1) < n) & (idx.view(1, 1, -1) < n)
    return (causal & real) | torch.eye(width, dtype=torch.bool, device=device)


def prefill(target: TargetModel, seqs: list[Sequence], timer: StepTimer) -> None:
    """Run the prompts (one padded forward), emit each first token; queue every (feature, next token) pair for
    the draft head."""
    device = target.device
    n = [len(s.prompt_ids) for s in seqs]
    B, T = len(seqs), max(n)
    ids = torch.zeros(B, T, dtype=torch.long, device=device)
    for b, s in enumerate(seqs):
        ids[b, : n[b]] = torch.tensor(s.prompt_ids, device=device)
    last = torch.tensor(n, device=device) - 1
    t0 = timer.now()
    hidden = target.forward(ids, [s.slot for s in seqs], torch.arange(T, device=device).expand(B, T),
                            causal_block(n, T, device))
    logits = target.logits(hidden[torch.arange(B, device=device), last].unsqueeze(1))
    timer.verify_s += timer.now() - t0
    first = choose_tokens(logits, sampling_batch(seqs, device))[:, 0].tolist()
    for b, s in enumerate(seqs):
        target.cache.lengths[s.slot] = n[b]
        s.draft_tokens = s.prompt_ids[1:] + [first[b]]
        s.draft_features = hidden[b, : n[b]]
        s.append([first[b]])


def draft_tree(target: TargetModel, draft: DraftHead, seqs: list[Sequence], slots: list[int], tree_cfg: TreeConfig,
               timer: StepTimer) -> Tree:
    """Feed each sequence's pending pairs to the head (committing them to its cache), then grow the trees."""
    device = target.device
    B = len(seqs)
    n = [len(s.draft_tokens) for s in seqs]
    N = max(n)
    d = target.hidden_size
    tokens = torch.zeros(B, N, dtype=torch.long, device=device)
    feats = torch.zeros(B, N, d, dtype=target.dtype, device=device)
    for b, s in enumerate(seqs):
        tokens[b, : n[b]] = torch.tensor(s.draft_tokens, device=device)
        feats[b, : n[b]] = s.draft_features
    def topk_fn(hidden, k):
        t0 = timer.now()
        logp, tok = draft.topk(hidden, k)
        timer.draft_s += timer.now() - t0
        return logp, tok

    def draft_fn(tok, feat, level, block_mask, offset):
        t0 = timer.now()
        depth = torch.full(tok.shape, level, dtype=torch.long, device=device)
        out = draft.forward(tok, feat, slots, depth, block_mask, offset)
        timer.draft_s += timer.now() - t0
        return out

    t0 = timer.now()
    hidden = draft.forward(tokens, feats, slots, torch.arange(N, device=device).expand(B, N),
                           causal_block(n, N, device))
    timer.draft_s += timer.now() - t0
    draft.cache.lengths[slots] += torch.tensor(n)
    root_hidden = hidden[torch.arange(B, device=device), torch.tensor(n, device=device) - 1]
    roots = torch.tensor([s.root for s in seqs], device=device)
    return grow_tree(draft_fn, topk_fn, root_hidden, roots, tree_cfg)


def root_only_tree(seqs: list[Sequence], device) -> Tree:
    """Plain decoding is verification of a one-node tree."""
    B = len(seqs)
    tokens = torch.tensor([[s.root] for s in seqs], device=device)
    zeros = torch.zeros(B, 1, dtype=torch.long, device=device)
    return Tree(tokens, zeros, zeros, torch.ones(B, 1, dtype=torch.bool, device=device),
                torch.ones(B, 1, 1, dtype=torch.bool, device=device), torch.zeros(B, 1, device=device))


def decode_step(target: TargetModel, draft: DraftHead | None, seqs: list[Sequence], tree_cfg: TreeConfig | None,
                timer: StepTimer, max_verify_tokens: int | None = None, trace=None) -> list[list[int]]:
    """One step for ``seqs``; returns the tokens each sequence emits (accepted drafts + bonus).

    With ``draft is None`` this is plain autoregressive decoding on the same runtime. ``max_verify_tokens`` caps
    the tree nodes of the whole batch (see :func:`fit_batch_budget`); trees are then packed to the widest one.
    ``trace`` (a :class:`~eagle_ray.spec.trace.TreeTrace`) records each verified tree and its accepted path.
    """
    device = target.device
    slots = [s.slot for s in seqs]
    speculative = draft is not None
    if speculative:
        tree = draft_tree(target, draft, seqs, slots, tree_cfg, timer)
        if max_verify_tokens:
            tree = fit_batch_budget(tree, max_verify_tokens)
        tree = pack(tree)
    else:
        tree = root_only_tree(seqs, device)
    timer.verify_width = tree.tokens.shape[1]
    timer.tree_nodes = int(tree.valid.sum())

    t0 = timer.now()
    hidden = target.forward(tree.tokens, slots, tree.depth, tree.ancestors)
    logits = target.logits(hidden)
    timer.verify_s += timer.now() - t0

    choice = choose_tokens(logits, sampling_batch(seqs, device))
    acc = accept(tree, choice)
    if trace is not None and speculative:
        trace.record(tree, acc.nodes)

    lengths = target.cache.lengths[slots]
    A = acc.nodes.shape[1]
    base = lengths.to(device).view(-1, 1)
    src = acc.nodes + base
    i = torch.arange(A, device=device).view(1, -1)
    dst = torch.where(i < acc.count.view(-1, 1), base + i, src)
    if A > 1 or bool((acc.nodes[:, 0] != 0).any()):
        target.cache.compact(torch.tensor(slots, device=device), src, dst)
    count = acc.count.cpu()
    target.cache.lengths[slots] += count

    nodes, counts = acc.nodes.tolist(), count.tolist()
    tree_tokens = tree.tokens.gather(1, acc.nodes).tolist()
    bonus = acc.bonus.tolist()
    sizes = tree.size.tolist()
    emitted = []
    for b, s in enumerate(seqs):
        c = counts[b]
        new = tree_tokens[b][1:c] + [bonus[b]]
        if speculative:
            s.draft_tokens = list(new)
            s.draft_features = hidden[b, nodes[b][:c]]
        kept = s.append(new)
        s.stats.record_step(c - 1, sizes[b], kept)
        emitted.append(new[:kept])
    return emitted
