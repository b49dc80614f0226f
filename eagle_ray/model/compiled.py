"""Compiled forwards: the target's and the head's decoder layers through ``torch.compile`` (regional compilation),
or the target's decode passes as CUDA graphs captured by hand (``cuda-graphs``: model/graphs.py).

A layer takes tensors, its weights and its ``LayerCache`` and neither reads the device nor changes Python state, so
it traces into one graph (``fullgraph=True``: a graph break is an error, not a silent slow path) that every layer of
the same shape replays: tracing and code generation cost one layer, not the model's depth. Block widths and the key
length vary every step, so Inductor compiles with dynamic shapes.
"""
from __future__ import annotations

import torch

from eagle_ray.model.attention import decoder_layer
from eagle_ray.model.guarded_compile import RECOMPILE_LIMIT

MODES = ("off", "inductor", "cuda-graphs")


def compile_forwards(target, draft, mode: str, backend: str = "inductor") -> None:
    """Compile the target's and the head's layers (``run_layer``; ``mode`` in :data:`MODES`).
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
    # a graph per layer kind x (contiguous slots or not) x (one row or more) x (one sequence or more)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    torch.fx.experimental._config.use_duck_shape = False   # equal sizes by chance are not a rule
    options = {"fullgraph": True, "dynamic": True, "backend": backend}
    # A decoder layer's graph serves every layer (each runs on its own LayerCache, so the graph holds no layer
    # index, and the weights are its inputs): tracing and code generation cost one layer, not the model's depth.
    # The EAGLE-2 head's layer is a decoder layer too, and shares the target's graphs where its shapes match.
    compiled = lambda fn: torch.compile(fn, **options)   # noqa: E731
    static = []
    if target.fused is None:
        target.run_layer = compiled(decoder_layer)
        static += [t for cache in target.cache.layers for t in (cache.kv, cache.k, cache.v)]
    else:   # the fused layers' attention is a closure made per forward: the whole block is one graph
        target.run_block = compiled(target.run_block)
        static += [target.cache.kv, target.cache.k, target.cache.v]
    if draft is not None:
        draft.run_layer = compiled(type(draft).run_layer)
        static += [draft.cache.kv, draft.cache.k, draft.cache.v]
    # The cache's sizes are fixed for the engine's life: static, they give the tracer no symbols to reason about
    # (with them, sympy took most of each trace) and Inductor constant strides
    for t in static:
        torch._dynamo.mark_static(t)
    for model in (target, draft):
        if model is None:
            continue
        # Inductor (torch 2.13, CPU) can read a slice of the cache that the same graph has just written by index
        # wrongly: a ragged prefill into slots 2..3 read stale keys in layer 0 and gave other tokens (found by the
        # golden test at batch 4, where sequences join in the middle of the cache). Reads by slot index are exact.
        model.cache.slice_reads = False
