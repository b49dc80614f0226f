"""The target's decode passes replayed as CUDA graphs captured by hand (``model.compile: cuda-graphs``).

An eager 8B verify pass launches about 12 kernels a layer, some 400 a pass: on a GPU the host's launches, not the
weights' read, then set the step's time. Captured once, a pass is one graph launch. The pattern is the one SGLang,
vLLM and gpt-fast use: every input a pass reads lives in static buffers that each step overwrites before replaying,
batch sizes and block widths are padded up to buckets (so a handful of graphs serve every step), and all graphs draw
their memory from one pool. The key length a pass reads is bucketed too (powers of two from 256 columns, masked),
so a graph is keyed by (batch, width, key length) buckets. Every batch bucket's graphs at the widths the engine's
trees verify are captured at load, largest first (``capture_at_load``); a graph a step needs and nobody captured
(a longer context's key length) is captured then. Each capture follows a warm-up on a side stream (the warm-up runs
are the pass itself on the same inputs: they write the same K/V).

What stays eager: prompt chunks (wider than ``max_width``), the lm_head and acceptance (a few kernels each; the
logits of a padded batch would hold graph memory of ``batch x width x vocab``), and the head's draft loop.
Padding rows and columns write to the cache's scratch position and see only its first column (``make_block_meta``
with ``n_valid``), so they neither touch a real row's keys nor produce NaNs.

``backend="replay"`` is the CPU stand-in the tests use: it runs the pass again on the static buffers where CUDA
replays it, and copies the result into the output captured first, so the buffers, the padding and the output's
lifetime are exercised exactly as on a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle_ray.model.attention import BlockMeta, make_block_meta

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
WIDTH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
KV_FIRST_BUCKET = 256


def bucket(n: int, buckets) -> int | None:
    return next((b for b in buckets if b >= n), None)


def kv_buckets(max_len: int) -> list[int]:
    """Key lengths graphs are captured at: 256, 512, ... and the whole cache (``max_len + 1`` columns)."""
    out, n = [], KV_FIRST_BUCKET
    while n < max_len + 1:
        out.append(n)
        n *= 2
    return out + [max_len + 1]


class Replayed:
    """The CPU stand-in for ``torch.cuda.CUDAGraph``: replay runs the captured function again and writes its result
    into the output of the capture, as a graph's replay overwrites its static output."""

    def __init__(self):
        self.fn, self.out = None, None

    def capture(self, fn):
        self.fn, self.out = fn, fn()
        return self.out

    def replay(self) -> None:
        new = self.fn()
        for old, fresh in zip(as_tuple(self.out), as_tuple(new)):
            old.copy_(fresh)


def as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


class CudaGraph:
    """One captured CUDA graph of ``fn`` (warm-up on a side stream first; memory from the shared ``pool``)."""

    def __init__(self, pool):
        self.graph, self.pool = torch.cuda.CUDAGraph(), pool

    def capture(self, fn):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):   # Inductor's kernels of model/kernels.py compile and cuBLAS picks its algorithms
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


@dataclass
class Captured:
    """One graph and the static buffers it reads and writes."""
    graph: object
    tokens: torch.Tensor       # [B, W]
    depth: torch.Tensor        # [B, W]
    meta: BlockMeta            # its tensors are the static buffers (slot_index, write_pos, key_mask, lengths)
    out: tuple                 # hidden [B, W, d] (and the EAGLE-3 features)


class DecodeGraphs:
    """The target's ``run_block`` for decode-sized blocks, one graph per (batch, width, key length) bucket."""

    def __init__(self, target, max_batch: int, max_width: int = WIDTH_BUCKETS[-1], backend: str = "cuda"):
        if backend not in ("cuda", "replay"):
            raise ValueError(f"graph backend must be cuda or replay, got {backend!r}")
        if backend == "cuda" and target.device.type != "cuda":
            raise ValueError(f"compile: cuda-graphs needs a CUDA target; this one is on {target.device}")
        if target.numerics.tree_attention == "flex":
            raise ValueError("compile: cuda-graphs captures SDPA tree attention (precision.tree_attention: sdpa); "
                             "flex builds its block mask in every forward")
        self.target, self.backend = target, backend
        self.max_batch = bucket(max_batch, BATCH_BUCKETS) or max_batch
        self.max_width = max_width
        self.kv_buckets = kv_buckets(target.cache.max_len)
        self.pool = torch.cuda.graph_pool_handle() if backend == "cuda" else None
        self.graphs: dict[tuple[int, int, int, bool], Captured] = {}
        self.replays = 0
        self.skipped = 0   # decode passes that ran eagerly (wider or larger than any graph)

    def fits(self, B: int, T: int, N: int, offset: int) -> bool:
        """Whether a block of ``B`` rows x ``T`` tokens (block mask ``N`` wide, written at ``offset``) runs here."""
        return B <= self.max_batch and T <= self.max_width and N == T and offset == 0

    def key(self, B: int, T: int, kv_needed: int, capture: bool) -> tuple[int, int, int, bool]:
        kv = bucket(kv_needed, self.kv_buckets)
        return bucket(B, BATCH_BUCKETS) or B, bucket(T, WIDTH_BUCKETS), kv, capture

    def capture_at_load(self, widths: list[int], capture: bool = False) -> int:
        """Capture the graphs of every batch bucket up to ``max_batch`` at the width buckets of ``widths`` and the
        first key-length bucket, largest batch first (the pool grows to the largest pass once and the smaller ones
        reuse it), before the first request; longer key lengths are captured when a step first needs them. Each
        capture runs padding rows only, which write the cache's scratch position: no slot changes. Returns the
        number of graphs captured."""
        cache = self.target.cache
        device = cache.k.device
        before = len(self.graphs)
        for B in sorted((b for b in BATCH_BUCKETS if b <= self.max_batch), reverse=True):
            rows = min(B, cache.num_slots)   # bucket(rows) is B: max_batch is the bucket of the slot count
            for W in sorted({bucket(w, WIDTH_BUCKETS) for w in widths if w <= self.max_width}, reverse=True):
                zeros = torch.zeros(rows, W, dtype=torch.long, device=device)
                self.run(zeros, list(range(rows)), zeros, torch.ones(rows, W, W, dtype=torch.bool, device=device),
                         [0] * rows, capture)
        return len(self.graphs) - before

    def run(self, tokens: torch.Tensor, slots: list[int], depth: torch.Tensor, block_mask: torch.Tensor,
            n_valid: list[int] | None, capture: bool):
        """``target.run_block`` of this block through its graph; returns views of the graph's static output (read
        them before the next pass)."""
        cache = self.target.cache
        B, T = tokens.shape
        valid = list(n_valid) if n_valid is not None else [T] * B
        kv_needed = int((cache.lengths[slots] + valid).max())
        key = self.key(B, T, kv_needed, capture)
        Bb, Tb, kv_len, _ = key
        device = cache.k.device
        padded = torch.zeros(B, Tb, Tb, dtype=torch.bool, device=device)
        padded[:, :T, :T] = block_mask.to(device)
        meta = make_block_meta(cache, slots, padded, n_valid=valid, kv_len=kv_len)
        entry = self.graphs.get(key)
        fresh = entry is None
        if fresh:
            entry = self._buffers(Bb, Tb, kv_len)
        self._fill(entry, B, T, tokens, depth, meta)
        if fresh:
            entry.out = as_tuple(entry.graph.capture(lambda: self._pass(entry, capture)))
            self.graphs[key] = entry
        entry.graph.replay()
        self.replays += 1
        outs = tuple(o[:B, :T] for o in entry.out)
        return outs if capture else outs[0]

    def _pass(self, entry: Captured, capture: bool):
        from eagle_ray.model.numerics import attention_kernels
        with attention_kernels(self.target.device):
            return self.target.run_block(entry.tokens, entry.depth, entry.meta, capture)

    def _buffers(self, B: int, T: int, kv_len: int) -> Captured:
        cache = self.target.cache
        device = cache.k.device
        long = dict(dtype=torch.long, device=device)
        slot_index = torch.zeros(B, 1, **long)
        meta = BlockMeta(slot_index.view(-1), slot_index, torch.full((B, T), cache.scratch, **long),
                         torch.zeros(B, 1, T, kv_len, dtype=torch.bool, device=device), kv_len,
                         torch.zeros(B, **long), invariant=self.target.batch_invariant)
        return Captured(Replayed() if self.backend == "replay" else CudaGraph(self.pool), torch.zeros(B, T, **long),
                        torch.zeros(B, T, **long), meta, ())

    def _fill(self, entry: Captured, B: int, T: int, tokens, depth, meta: BlockMeta) -> None:
        """This block's inputs into the static buffers; rows past ``B`` become padding (scratch writes, first
        column seen), whatever an earlier, larger block left there."""
        s = entry.meta
        entry.tokens.zero_()
        entry.tokens[:B, :T] = tokens
        entry.depth.zero_()
        entry.depth[:B, :T] = depth
        s.slot_index[:B] = meta.slot_index
        s.write_pos[:B] = meta.write_pos
        s.key_mask[:B] = meta.key_mask
        s.lengths[:B] = meta.lengths
        if B < s.slot_index.shape[0]:
            s.slot_index[B:] = 0
            s.write_pos[B:] = self.target.cache.scratch
            s.key_mask[B:] = False
            s.key_mask[B:, :, :, 0] = True
            s.lengths[B:] = 0
