"""Compiled forwards: the target's and the head's device parts (``run_block``) through ``torch.compile``, or the
target's decode passes as CUDA graphs captured by hand (``cuda-graphs``: model/graphs.py).

``run_block`` takes tensors and a :class:`BlockMeta` and neither reads the device nor changes Python state, so each
traces into one graph (``fullgraph=True``: a graph break is an error, not a silent slow path), and replays from
static buffers. Block widths and the key length vary every step, so Inductor compiles with dynamic shapes.
"""
from __future__ import annotations

import torch

from eagle_ray.model.guarded_compile import RECOMPILE_LIMIT

MODES = ("off", "inductor", "cuda-graphs")


def compile_forwards(target, draft, mode: str, backend: str = "inductor") -> None:
    """Replace ``run_block`` of the target and the head with compiled versions (``mode`` in :data:`MODES`).
    ``backend``: ``inductor`` generates kernels; ``aot_eager`` traces the same graphs without codegen (tests)."""
    if mode == "off":
        return
    if mode not in MODES:
        raise ValueError(f"compile mode must be one of {MODES}, got {mode!r}")
    if mode == "cuda-graphs":
        from eagle_ray.model.graphs import DecodeGraphs
        target.graphs = DecodeGraphs(target, target.cache.num_slots)
        return
    if target.numerics.cpu_linears == "packed":
        raise ValueError("compiled forwards need dense weights: Inductor cannot lower oneDNN-packed ones; use "
                         "cpu_linears: input_major (what cpu_linears: auto picks when model.compile is on)")
    # a graph per (contiguous slots or not) x (one row or more) x (one sequence or more) x (EAGLE-3 capture)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    torch.fx.experimental._config.use_duck_shape = False   # equal sizes by chance are not a rule
    options = {"fullgraph": True, "dynamic": True, "backend": backend}
    for model in (target, draft):
        if model is None:
            continue
        model.run_block = torch.compile(model.run_block, **options)
        # The cache's sizes are fixed for the engine's life: static, they give the tracer no symbols to reason
        # about (with them, sympy took most of each trace) and Inductor constant strides
        for t in (model.cache.kv, model.cache.k, model.cache.v):
            torch._dynamo.mark_static(t)
        # Inductor (torch 2.13, CPU) can read a slice of the cache that the same graph has just written by index
        # wrongly: a ragged prefill into slots 2..3 read stale keys in layer 0 and gave other tokens (found by the
        # golden test at batch 4, where sequences join in the middle of the cache). Reads by slot index are exact.
        model.cache.slice_reads = False
