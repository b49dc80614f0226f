"""Bytes of the KV cache a decode pass's attention reads, eager and through captured graphs, counted on the CPU.

A decode pass at batch 8 and more is the cache's read as much as the weights': what attention reads is counted here
by a dispatch mode over the pass (``AttentionReads``): the keys and values each attention call (SDPA) reads, plus
every gather that copies part of the cache (a gathered copy is written, then read again). Eager attention reads
contiguous slots as a slice of the cache, key lengths rounded up on CUDA's grid (``DEVICE_DEFAULTS['cuda']
.kv_bucket``, set on the cache here); graphs run on the replay stand-in (``model/graphs.py``), which runs the
captured pass as CUDA replays it. Ragged lengths: each row's committed length is drawn at random below ``--below``.

    python bench/graph_reads.py --code before=../base --code after=. --out bench/results/<hardware>/graph_reads.json

Counts, not timings: the same on any machine for the same code.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

GATHERS = {"index", "index_select", "gather", "take", "_unsafe_index"}


class AttentionReads(TorchDispatchMode):
    """Bytes attention reads from ``cache`` while active: the key and value operands of every SDPA call, plus the
    output of every gather whose source is the cache (``sdpa`` and ``gathered`` separately)."""

    def __init__(self, cache):
        super().__init__()
        self.storage = cache.kv.untyped_storage().data_ptr()
        self.sdpa = self.gathered = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if "scaled_dot_product" in name:
            self.sdpa += sum(t.numel() * t.element_size() for t in args[1:3])
        elif name in GATHERS and isinstance(args[0], torch.Tensor) and \
                args[0].untyped_storage().data_ptr() == self.storage:
            self.gathered += out.numel() * out.element_size()
        return out

    @property
    def total(self) -> int:
        return self.sdpa + self.gathered


def small_target(slots: int, max_len: int, layers: int = 2):
    """A random fp32 Llama target with fused layers and SDPA tree attention (what CUDA runs), on the CPU, its cache
    bucketing key lengths as eager attention does on CUDA."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle_ray.model.numerics import DEVICE_DEFAULTS
    from eagle_ray.model.target import TargetModel
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=max_len + 64)).eval()
    target = TargetModel(hf, slots, max_len, fp32_logits=False, fp32_activations=False, batch_invariant=False,
                         cpu_linears="native", fused_layers=True, tree_attention="sdpa")
    target.cache.kv_bucket = DEVICE_DEFAULTS["cuda"].kv_bucket
    return target


def pass_reads(target, slots: list[int], width: int, graphed: bool) -> AttentionReads:
    """What one decode pass of ``width`` tokens over ``slots`` reads; graphed: a replay (its capture done first)."""
    B = len(slots)
    idx = torch.arange(width)
    block = ((idx.view(-1, 1) >= idx.view(1, -1)).expand(B, width, width), idx.expand(B, width))
    tokens = torch.randint(3, 60, (B, width), generator=torch.Generator().manual_seed(B))
    if graphed:
        target.forward(tokens, slots, block[1], block[0])   # the capture (and a first replay)
    reads = AttentionReads(target.cache)
    with reads:
        target.forward(tokens, slots, block[1], block[0])
    return reads


def measure(batches=(1, 8, 32), widths=(1, 8), below: int = 700, max_len: int = 1024, seed: int = 0) -> list[dict]:
    """Eager and graphed bytes per decode pass, per batch (rows in slots 0..B-1) and width, and for a pass over
    scattered slots (the drafted rows of a step whose plain rows run apart)."""
    from eagle_ray.model.graphs import DecodeGraphs
    slots_total = max(batches)
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, below, (slots_total,), generator=gen).numpy()
    cases = [(f"batch {b}", list(range(b))) for b in batches] + [("scattered 0,2,5", [0, 2, 5])]
    rows = []
    for name, slots in cases:
        for width in widths:
            target = small_target(slots_total, max_len)
            target.cache.lengths[:] = lengths
            eager = pass_reads(target, slots, width, graphed=False)
            target.graphs = DecodeGraphs(target, slots_total, backend="replay")
            graphs = pass_reads(target, slots, width, graphed=True)
            need = int(max(lengths[s] for s in slots)) + width
            rows.append({"case": name, "batch": len(slots), "width": width, "max_keys": need,
                         "eager_bytes": eager.total, "eager_gathered": eager.gathered,
                         "graph_bytes": graphs.total, "graph_gathered": graphs.gathered,
                         "graph_key": list(next(iter(target.graphs.graphs)))[:3],
                         "graph_over_eager": round(graphs.total / eager.total, 3)})
    return rows


def measure_code(path: str, batches, below: int) -> list[dict]:
    """``measure`` run on the eagle_ray package under ``path`` (another checkout: the code before a change), in a
    child process so that each version imports its own package."""
    import json
    import os
    import subprocess
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(path).resolve()), str(Path(__file__).parent)]))
    code = (f"import json, runpy; m = runpy.run_path({str(Path(__file__).resolve())!r}); "
            f"print(json.dumps(m['measure']({tuple(batches)!r}, below={below})))")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=path, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    from harness import command_line, write_result
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--below", type=int, default=700, help="rows' lengths are drawn below this")
    p.add_argument("--code", action="append", default=None, metavar="NAME=PATH",
                   help="measure the eagle_ray package of each checkout (default: after=. , this one)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    batches = tuple(int(b) for b in a.batches.split(","))
    codes = dict(c.split("=", 1) for c in (a.code or ["after=."]))
    results = {name: measure_code(path, batches, a.below) for name, path in codes.items()}
    for name, rows in results.items():
        for r in rows:
            print(name, r)
    write_result(a.out, {"what": "bytes of the KV cache attention reads per decode pass (2-layer fp32 target, 2 kv "
                                 "heads x 16 dims, key lengths on a 256-column grid); counts, not timings",
                         "code": codes, "rows": results},
                 command_line("bench/graph_reads.py", argv))
    return 0

if __name__ == "__main__":
    sys.exit(main())
