"""The target's decode passes replayed as CUDA graphs captured by hand (``model.compile: cuda-graphs``).

An eager 8B verify pass launches about 12 kernels a layer, some 400 a pass: on a GPU the host's launches, not the
weights' read, then set the step's time. Captured once, a pass is one graph launch. The pattern is the one SGLang,
vLLM and gpt-fast use: every input a pass reads lives in static buffers that each step overwrites before replaying,
block widths are padded up to buckets (so a handful of graphs serve every step), and all graphs draw their memory
from one pool. A graph's rows are the cache's slots ``[0, Bb)``, ``Bb`` the batch bucket that covers the pass's
highest slot (buckets stop at the slot count): a row's keys are read as a slice of the cache, as eager attention
reads contiguous slots, never gathered, and a pass's rows are scattered into their slots' rows of the graph. The
scheduler keeps running sequences in the lowest slots (``Scheduler.defragment``), so a pass over every running
sequence covers exactly its batch's bucket; a pass over some of them (the drafted rows apart from the plain ones)
also reads the padding slots between them, at most up to the bucket of the highest slot. Key lengths are bucketed
on the grid eager attention uses on CUDA (``DEVICE_DEFAULTS['cuda'].kv_bucket`` columns, masked), so a graph reads
the keys eager would. A graph is keyed by (batch, width, key length) buckets. Every batch bucket's graphs at the
widths the engine's trees verify are captured at load at the first key-length bucket, largest first
(``capture_at_load``); a graph a step needs and nobody captured (a longer context's key length) is captured then:
``graphs`` and ``captured_late`` count them. Each capture follows a warm-up on a side stream shared by every capture
on the device (the warm-up runs are the pass itself on the same inputs: they write the same K/V).

What stays eager: prompt chunks (wider than ``max_width``), the lm_head and acceptance (a few kernels each; the
logits of a padded batch would hold graph memory of ``batch x width x vocab``). The head's draft loop has graphs of
its own (``model/draft_graphs.py``).
Padding rows and columns write to their slot's scratch position and see only its first column (``make_block_meta``
with ``n_valid``), so they neither touch a real row's keys nor produce NaNs.

Nothing here refers back to the target strongly (the target holds its graphs): ``del engine`` frees the cache and
the graph memory at once, without a garbage collection.

``backend="replay"`` is the CPU stand-in the tests use: it runs the pass again on the static buffers where CUDA
replays it, and copies the result into the output captured first, so the buffers, the padding and the output's
lifetime are exercised exactly as on a GPU.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from eagle_ray.model.attention import BlockMeta, make_block_meta
from eagle_ray.model.numerics import DEVICE_DEFAULTS

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
WIDTH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
KV_STEP = DEVICE_DEFAULTS["cuda"].kv_bucket   # key-length buckets: eager CUDA attention's grid


def bucket(n: int, buckets) -> int | None:
    return next((b for b in buckets if b >= n), None)


def batch_buckets(slots: int) -> tuple[int, ...]:
    """Batch buckets of a cache of ``slots`` slots: a graph's rows are slots, so the last bucket is the slot count."""
    return tuple(b for b in BATCH_BUCKETS if b < slots) + (slots,)


def kv_buckets(max_len: int, step: int = KV_STEP) -> list[int]:
    """Key lengths graphs are captured at: ``step``, ``2 step``, ... and the whole cache (``max_len + 1`` columns)."""
    return list(range(step, max_len + 1, step)) + [max_len + 1]


_WARMUP_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def warmup_stream(device) -> torch.cuda.Stream:
    """One side stream per device for every capture's warm-up (each stream keeps a cuBLAS workspace of its own)."""
    device = torch.device(device)
    if device not in _WARMUP_STREAMS:
        _WARMUP_STREAMS[device] = torch.cuda.Stream(device)
    return _WARMUP_STREAMS[device]


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
    """One captured CUDA graph of ``fn`` (warm-up on the device's side stream first; memory from the shared
    ``pool``)."""

    def __init__(self, pool):
        self.graph, self.pool = torch.cuda.CUDAGraph(), pool

    def capture(self, fn):
        stream = warmup_stream(torch.cuda.current_device())
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
    meta: BlockMeta            # its tensors are the static buffers (write_pos, key_mask, lengths); rows are slots
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
        self._target = weakref.ref(target)   # the target holds these graphs: no cycle
        self.backend = backend
        self.batch_buckets = batch_buckets(target.cache.num_slots)
        self.max_batch = bucket(min(max_batch, target.cache.num_slots), self.batch_buckets)
        self.max_width = max_width
        self.kv_buckets = kv_buckets(target.cache.max_len)
        self.pool = torch.cuda.graph_pool_handle() if backend == "cuda" else None
        self.graphs: dict[tuple[int, int, int, bool], Captured] = {}
        self.replays = 0
        self.skipped = 0        # decode passes that ran eagerly (wider or larger than any graph)
        self.captured_late = 0  # graphs captured by a step (a key length or shape capture_at_load did not cover)

    @property
    def target(self):
        return self._target()

    def fits(self, rows: int, T: int, N: int, offset: int) -> bool:
        """Whether a block of ``T`` tokens whose rows are slots below ``rows`` (block mask ``N`` wide, written at
        ``offset``) runs here."""
        return rows <= self.max_batch and T <= self.max_width and N == T and offset == 0

    def key(self, rows: int, T: int, kv_needed: int, capture: bool) -> tuple[int, int, int, bool]:
        return bucket(rows, self.batch_buckets), bucket(T, WIDTH_BUCKETS), bucket(kv_needed, self.kv_buckets), capture

    @torch.inference_mode()
    def capture_at_load(self, widths: list[int], capture: bool = False) -> int:
        """Capture the graphs of every batch bucket up to ``max_batch`` at the width buckets of ``widths`` and the
        first key-length bucket, largest batch first (the pool grows to the largest pass once and the smaller ones
        reuse it), before the first request; longer key lengths are captured when a step first needs them. Each
        capture runs padding rows only, which write the cache's scratch position: no slot changes. Returns the
        number of graphs captured."""
        device = self.target.cache.k.device
        before, late = len(self.graphs), self.captured_late
        for B in sorted((b for b in self.batch_buckets if b <= self.max_batch), reverse=True):
            for W in sorted({bucket(w, WIDTH_BUCKETS) for w in widths if w <= self.max_width}, reverse=True):
                zeros = torch.zeros(B, W, dtype=torch.long, device=device)
                self.run(zeros, list(range(B)), zeros, torch.ones(B, W, W, dtype=torch.bool, device=device),
                         [0] * B, capture)
        self.captured_late = late
        return len(self.graphs) - before

    def run(self, tokens: torch.Tensor, slots: list[int], depth: torch.Tensor, block_mask: torch.Tensor,
            n_valid: list[int] | None, capture: bool):
        """``target.run_block`` of this block through its graph; returns its output rows (views of the graph's
        static output where the rows are slots ``0..B-1``: read them before the next pass)."""
        cache = self.target.cache
        B, T = tokens.shape
        valid = list(n_valid) if n_valid is not None else [T] * B
        kv_needed = int((cache.lengths[slots] + valid).max())
        key = self.key(max(slots) + 1, T, kv_needed, capture)
        Bb, Tb, kv_len, _ = key
        device = cache.k.device
        padded = torch.zeros(B, Tb, Tb, dtype=torch.bool, device=device)
        padded[:, :T, :T] = block_mask.to(device)
        meta = make_block_meta(cache, slots, padded, n_valid=valid, kv_len=kv_len)
        prefix = slots == list(range(B))   # rows 0..B-1: slices, else scattered into their slots' rows
        entry = self.graphs.get(key)
        fresh = entry is None
        if fresh:
            entry = self.graphs[key] = self._buffers(Bb, Tb, kv_len)
        self._fill(entry, B, T, tokens, depth, meta, prefix)
        if fresh:
            self.captured_late += 1
            try:
                entry.out = as_tuple(entry.graph.capture(_pass_of(self, key)))
            except BaseException:
                del self.graphs[key]
                raise
        entry.graph.replay()
        self.replays += 1
        rows = slice(0, B) if prefix else meta.slot_index.view(-1)
        outs = tuple(o[rows, :T] for o in entry.out)
        return outs if capture else outs[0]

    def _pass(self, entry: Captured, capture: bool):
        from eagle_ray.model.numerics import attention_kernels
        target = self.target
        with attention_kernels(target.device):
            return target.run_block(entry.tokens, entry.depth, entry.meta, capture)

    def _buffers(self, B: int, T: int, kv_len: int) -> Captured:
        target = self.target
        cache = target.cache
        device = cache.k.device
        long = dict(dtype=torch.long, device=device)
        slot_index = torch.arange(B, **long).view(B, 1)   # row r is slot r
        meta = BlockMeta(slice(0, B), slot_index, torch.full((B, T), cache.scratch, **long),
                         torch.zeros(B, 1, T, kv_len, dtype=torch.bool, device=device), kv_len,
                         torch.zeros(B, **long), invariant=target.batch_invariant)
        return Captured(Replayed() if self.backend == "replay" else CudaGraph(self.pool), torch.zeros(B, T, **long),
                        torch.zeros(B, T, **long), meta, ())

    def _fill(self, entry: Captured, B: int, T: int, tokens, depth, meta: BlockMeta, prefix: bool) -> None:
        """This block's inputs into the static buffers, each row into its slot's row; the other rows become
        padding (scratch writes, first column seen), whatever an earlier block left there."""
        s = entry.meta
        entry.tokens.zero_()
        entry.depth.zero_()
        if prefix:   # rows 0..B-1 as slices, padding from B on
            rows, pad = slice(0, B), slice(B, None) if B < s.lengths.shape[0] else None
        else:
            rows, pad = meta.slot_index.view(-1), slice(None)
        if pad is not None:
            s.write_pos[pad] = self.target.cache.scratch
            s.key_mask[pad] = False
            s.key_mask[pad, :, :, 0] = True
            s.lengths[pad] = 0
        entry.tokens[rows, :T] = tokens
        entry.depth[rows, :T] = depth
        s.write_pos[rows] = meta.write_pos
        s.key_mask[rows] = meta.key_mask
        s.lengths[rows] = meta.lengths


def _pass_of(graphs: DecodeGraphs, key):
    """The pass a graph captures (and the replay stand-in reruns), holding its owner weakly: a replay stand-in's
    function must not keep the graphs, and through them the target, alive."""
    owner = weakref.ref(graphs)

    def run():
        g = owner()
        return g._pass(g.graphs[key], key[3])
    return run
