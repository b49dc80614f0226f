"""Count what makes a GPU step wait for the host or the host wait for the GPU: reads back and blocking copies up.

A GPU engine that reads a tensor back to the host (``.tolist()``, ``.item()``, ``int(t)``, ``if t:``, ``t.cpu()``)
waits for every kernel queued before it; a step that does so twenty times runs at the host's pace, not the GPU's.
A copy of host data to the device from pageable memory (``torch.tensor(list, device=d)``, ``host_tensor.to(d)``,
``device_tensor.copy_(host_tensor)``) blocks the same way. The engine keeps its host bookkeeping in Python ints and
NumPy arrays and sends a step's small inputs in one pinned, non-blocking copy (``uploads.Uploads``), so on any
device every call counted here is one a GPU step pays: the count measured on a CPU is the count on a GPU.
"""
from __future__ import annotations

import contextlib
import traceback
import weakref
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


class HostTensors:
    """A set of tensors by identity (tensors compare by value), forgetting each when it is freed."""

    def __init__(self):
        self.refs: dict[int, weakref.ref] = {}

    def add(self, t: torch.Tensor) -> None:
        self.refs[id(t)] = weakref.ref(t)

    def discard(self, t: torch.Tensor) -> None:
        self.refs.pop(id(t), None)

    def has(self, t: torch.Tensor) -> bool:
        ref = self.refs.get(id(t))
        return ref is not None and ref() is t


@contextlib.contextmanager
def count_host_reads():
    """Within the block, count calls of :data:`READ_METHODS` on tensors and of ``torch.cuda.synchronize``, and
    blocking copies of host data to a device: ``torch.tensor`` / ``torch.as_tensor`` of Python or NumPy data with a
    ``device``, and ``.to(device)`` / ``.cuda()`` / ``copy_`` of a tensor made on the host (``torch.tensor``,
    ``torch.zeros``... without a device, ``torch.from_numpy``) that is not pinned.

    A read made inside another counted read (``tolist`` calling ``__index__``) counts once."""
    reads = HostReads()
    originals = {name: getattr(torch.Tensor, name) for name in READ_METHODS + ("to", "cuda", "copy_")}
    factories = {name: getattr(torch, name) for name in ("tensor", "as_tensor", "from_numpy")}
    host_made = {name: getattr(torch, name) for name in ("zeros", "ones", "empty", "full", "arange")}
    sync = torch.cuda.synchronize
    host = HostTensors()   # tensors made on the host
    depth = [0]

    def record(what: str) -> None:
        reads.count += 1
        reads.sites.append(f"{_caller(('host_reads.py', 'torch/_tensor.py'))} {what}")

    def wrap(name, fn):
        def counted(self, *args, **kwargs):
            if depth[0] == 0:
                if name in READ_METHODS:
                    record(name)
                elif name == "copy_" and args and torch.is_tensor(args[0]) and host.has(args[0]) \
                        and not args[0].is_pinned():
                    record("copy_ from the host")
                elif name in ("to", "cuda") and host.has(self) and not self.is_pinned() and \
                        (name == "cuda" or kwargs.get("device") is not None or any(
                            isinstance(a, (str, torch.device)) or torch.is_tensor(a) for a in args)):
                    record(f"{name}(device) from the host")
                    host.discard(self)   # on a CPU the copy is the tensor itself, now the device's
            depth[0] += 1
            try:
                return fn(self, *args, **kwargs)
            finally:
                depth[0] -= 1
        return counted

    def wrap_factory(name, fn):
        def made(data, *args, **kwargs):
            out = fn(data, *args, **kwargs)
            if depth[0] == 0 and not torch.is_tensor(data):
                if kwargs.get("device") is not None:
                    record(f"{name}(device=)")
                elif out.device.type == "cpu":
                    host.add(out)
            return out
        return made

    def wrap_host_made(fn):
        def made(*args, **kwargs):
            out = fn(*args, **kwargs)
            if kwargs.get("device") is None and out.device.type == "cpu":   # a host buffer, filled on the host
                host.add(out)
            return out
        return made

    def counted_sync(*args, **kwargs):
        reads.count += 1
        reads.sites.append(f"{_caller(('host_reads.py',))} cuda.synchronize")
        return sync(*args, **kwargs)

    try:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, wrap(name, fn))
        for name, fn in factories.items():
            setattr(torch, name, wrap_factory(name, fn))
        for name, fn in host_made.items():
            setattr(torch, name, wrap_host_made(fn))
        torch.cuda.synchronize = counted_sync
        yield reads
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
        for name, fn in {**factories, **host_made}.items():
            setattr(torch, name, fn)
        torch.cuda.synchronize = sync
