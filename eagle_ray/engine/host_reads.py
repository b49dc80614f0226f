"""Count device-to-host reads: every one stalls a GPU step until the device catches up.

A GPU engine that reads a tensor back to the host (``.tolist()``, ``.item()``, ``int(t)``, ``if t:``, ``t.cpu()``)
waits for every kernel queued before it; a step that does so twenty times runs at the host's pace, not the GPU's.
The engine keeps its host bookkeeping in Python ints and NumPy arrays, so on any device every call counted here is
a read of a tensor the models computed, and the count measured on a CPU is the count a GPU step pays.
"""
from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass, field

import torch

READ_METHODS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__index__", "__float__")


@dataclass
class HostReads:
    count: int = 0
    sites: list[str] = field(default_factory=list)   # "file:function method" of each read, in order

    def by_site(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.sites:
            out[s] = out.get(s, 0) + 1
        return out


def _caller(skip_files: tuple[str, ...]) -> str:
    for frame in reversed(traceback.extract_stack()[:-1]):
        if not frame.filename.endswith(skip_files):
            return f"{frame.filename.rsplit('/eagle_ray/', 1)[-1]}:{frame.name}"
    return "?"


@contextlib.contextmanager
def count_host_reads():
    """Within the block, count calls of :data:`READ_METHODS` on tensors and of ``torch.cuda.synchronize``.

    A read made inside another counted read (``tolist`` calling ``__index__``) counts once."""
    reads = HostReads()
    originals = {name: getattr(torch.Tensor, name) for name in READ_METHODS}
    sync = torch.cuda.synchronize
    depth = [0]

    def wrap(name, fn):
        def counted(self, *args, **kwargs):
            if depth[0] == 0:
                reads.count += 1
                reads.sites.append(f"{_caller(('host_reads.py', 'torch/_tensor.py'))} {name}")
            depth[0] += 1
            try:
                return fn(self, *args, **kwargs)
            finally:
                depth[0] -= 1
        return counted

    def counted_sync(*args, **kwargs):
        reads.count += 1
        reads.sites.append(f"{_caller(('host_reads.py',))} cuda.synchronize")
        return sync(*args, **kwargs)

    try:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, wrap(name, fn))
        torch.cuda.synchronize = counted_sync
        yield reads
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
        torch.cuda.synchronize = sync
