"""The head's draft loop as captured graphs: every level of an EAGLE-2 dynamic tree (the head's pass, top-k, the
frontier's bookkeeping) and the rerank into the tree, one graph per (batch, key length) bucket and tree shape.

Eager, a depth-3 tree costs about 80 operations a level plus the rerank: several hundred kernel launches a step, as
many as a captured target pass saves again. The loop's shapes depend only on the batch, the tree's ``top_k`` and
``depth`` and the key length, so it replays like the target's decode pass (``model/graphs.py``: static buffers,
buckets, one pool, one warm-up stream per device; nothing in it refers back to itself, so it dies with its owner
without a garbage collection). Rows past the batch are padding: their head K/V go to the scratch position
(``n_valid`` 0).
Context tokens (``speculative/context_vocab.py``) are padded to the configured count with ``-1`` (never drafted).
Static trees, chains, the lookup graft and the verify cap stay eager (their shapes come from the host).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, fields

import torch

from eagle_ray.config import TreeConfig, is_plain
from eagle_ray.model.attention import block_meta
from eagle_ray.model.graphs import BATCH_BUCKETS, CudaGraph, Replayed, bucket, kv_buckets
from eagle_ray.model.numerics import attention_kernels
from eagle_ray.speculative.tree import Tree, grow_dynamic
from eagle_ray.uploads import uploads_for


@dataclass
class DraftBuffers:
    graph: object
    root_hidden: torch.Tensor    # [B, d]
    roots: torch.Tensor          # [B]
    lengths: torch.Tensor        # [B] the head cache's committed positions (where the levels stack up)
    slot_index: torch.Tensor     # [B, 1]
    n_valid: torch.Tensor        # [B] 0 for padding rows: their writes go to the scratch position
    context: torch.Tensor | None  # [B, E] context tokens (-1: none)
    out: tuple = ()              # the tree's tensors in graph memory (Tree's first six fields)
    flags: tuple = ()            # the tree's host facts (max_depth, padded)


class DraftGraphs:
    def __init__(self, draft, max_batch: int, context_vocab: int = 0, backend: str = "cuda"):
        if backend not in ("cuda", "replay"):
            raise ValueError(f"graph backend must be cuda or replay, got {backend!r}")
        self.draft, self.backend, self.context_vocab = draft, backend, context_vocab
        self.max_batch = bucket(max_batch, BATCH_BUCKETS) or max_batch
        self.kv_buckets = kv_buckets(draft.cache.max_len)
        self.pool = torch.cuda.graph_pool_handle() if backend == "cuda" else None
        self.graphs: dict[tuple, DraftBuffers] = {}
        self.replays = 0
        self._cache = draft.cache   # graphs captured over this cache; a new one (the head reallocated) drops them

    def fits(self, B: int, cfg: TreeConfig, context: torch.Tensor | None) -> bool:
        return cfg.mode == "dynamic" and B <= self.max_batch and (
            context is None or context.shape[1] <= self.context_vocab)

    @torch.inference_mode()
    def capture_at_load(self, tree_of) -> int:
        """Capture the draft loop of every batch bucket up to ``max_batch`` (``tree_of(batch)``: the tree a step of
        that many sequences grows; plain, static and chain trees have no graph), largest first, at the first
        key-length bucket and without context tokens. The loops run on empty slots (their head K/V are written
        past a length of 0, so nothing committed changes). Returns the number of graphs captured."""
        cache, before = self.draft.cache, len(self.graphs)
        device, d = self.draft.fc.weight.device, self.draft.config.hidden_size
        for B in sorted((b for b in BATCH_BUCKETS if b <= self.max_batch), reverse=True):
            rows, cfg = min(B, cache.num_slots), tree_of(B)
            if not self.fits(rows, cfg, None) or is_plain(cfg):
                continue
            self.grow(list(range(rows)), torch.zeros(rows, d, dtype=self.draft.fc.weight.dtype, device=device),
                      torch.zeros(rows, dtype=torch.long, device=device), None, cfg)
        return len(self.graphs) - before

    def grow(self, slots: list[int], root_hidden: torch.Tensor, roots: torch.Tensor, context: torch.Tensor | None,
             cfg: TreeConfig) -> Tree:
        """The trees of ``slots`` (as ``grow_dynamic`` grows them), through the bucket's graph; the returned tree
        is the caller's own (copied out of graph memory)."""
        cache = self.draft.cache
        if cache is not self._cache:
            self.graphs, self._cache = {}, cache
        B = len(slots)
        lengths = cache.lengths[slots]
        need = int(lengths.max()) + cfg.depth * cfg.top_k
        shape = (cfg.top_k, cfg.depth, cfg.total_tokens, cfg.min_cum_prob)
        key = (bucket(B, BATCH_BUCKETS) or B, bucket(need, self.kv_buckets), context is not None, shape)
        entry = self.graphs.get(key)
        fresh = entry is None
        if fresh:
            entry = self._buffers(key[0], root_hidden, context is not None)
        self._fill(entry, slots, lengths, root_hidden, roots, context)
        if fresh:
            entry.out = entry.graph.capture(_loop_of(self, entry, key[1], cfg))
            self.graphs[key] = entry
        entry.graph.replay()
        self.replays += 1
        return Tree(*(t[:B].clone() for t in entry.out), *entry.flags)

    def _loop(self, entry: DraftBuffers, kv_len: int, cfg: TreeConfig) -> Tree:
        draft, cache = self.draft, self.draft.cache

        def draft_fn(tok, feat, level, block_mask, offset):
            meta = block_meta(entry.lengths, entry.slot_index, block_mask, offset, kv_len, cache.scratch,
                              entry.n_valid)
            depth = torch.full(tok.shape, level, dtype=torch.long, device=tok.device)
            return draft.run_block(tok, feat, depth, meta)

        def topk_fn(hidden, k):
            return draft.topk(hidden, k, entry.context)

        with attention_kernels(cache.k.device):
            tree = grow_dynamic(draft_fn, topk_fn, entry.root_hidden, entry.roots, cfg)
        entry.flags = (tree.max_depth, tree.padded)
        return tuple(getattr(tree, f.name) for f in fields(Tree)[:6])

    def _buffers(self, B: int, root_hidden: torch.Tensor, with_context: bool) -> DraftBuffers:
        device = root_hidden.device
        long = dict(dtype=torch.long, device=device)
        graph = Replayed() if self.backend == "replay" else CudaGraph(self.pool)
        return DraftBuffers(graph, root_hidden.new_zeros(B, root_hidden.shape[1]), torch.zeros(B, **long),
                            torch.zeros(B, **long), torch.zeros(B, 1, **long), torch.zeros(B, **long),
                            torch.full((B, self.context_vocab), -1, **long) if with_context else None)

    def _fill(self, entry: DraftBuffers, slots, lengths, root_hidden, roots, context) -> None:
        B = len(slots)
        device = entry.roots.device
        entry.root_hidden[:B] = root_hidden
        entry.root_hidden[B:] = 0
        entry.roots.zero_()
        entry.roots[:B] = roots
        entry.lengths.zero_()
        entry.lengths[:B] = _up(lengths, device)
        entry.slot_index.zero_()
        entry.slot_index[:B, 0] = _up(slots, device)
        entry.n_valid.zero_()
        entry.n_valid[:B] = 1 << 30   # every level's rows are real
        if entry.context is not None:
            entry.context.fill_(-1)
            entry.context[:B, : context.shape[1]] = context


def _loop_of(graphs: DraftGraphs, entry: DraftBuffers, kv_len: int, cfg: TreeConfig):
    """The loop a graph captures (and the replay stand-in reruns), holding its owner and buffers weakly: the
    stand-in keeps this function in the buffers, which must not keep themselves, the graphs or the head alive."""
    owner, buffers = weakref.ref(graphs), weakref.ref(entry)
    return lambda: owner()._loop(buffers(), kv_len, cfg)


def _up(values, device) -> torch.Tensor:
    return uploads_for(device).ints(values)
