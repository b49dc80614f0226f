"""Small host integers bound for the device (slots, cache lengths, roots, sampling rows), sent in one copy a step."""
from __future__ import annotations

import numpy as np
import torch


class Uploads:
    """Small host integers bound for the device (slots, cache lengths, roots, sampling rows), sent in one copy.

    A decode step knows all of its small inputs before its first kernel. The runner hands them to :meth:`stage`
    together: one transfer (pinned and non-blocking on CUDA), and every later :meth:`ints` call asking for the
    same values gets a view of it instead of its own small copy. Values nobody staged are sent alone and counted in
    ``misses``, so a test can hold a step to one copy. Views are shared: callers never write into them.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.staged: dict[bytes, torch.Tensor] = {}
        self.copies = 0
        self.misses = 0

    def stage(self, arrays) -> None:
        """Send ``arrays`` (int sequences) in one copy and serve them until the next :meth:`stage` or :meth:`clear`."""
        parts, keys = [], []
        for a in arrays:
            a = np.ascontiguousarray(a, dtype=np.int64).ravel()
            key = a.tobytes()
            if key and key not in keys:
                parts.append(a)
                keys.append(key)
        self.staged = {}
        if not parts:
            return
        sent, offset = self._send(np.concatenate(parts)), 0
        for key, a in zip(keys, parts):
            self.staged[key] = sent[offset: offset + a.size]
            offset += a.size

    def ints(self, values) -> torch.Tensor:
        """``values`` as an int64 device tensor of their shape: a staged view when staged, else a copy of its own."""
        a = np.ascontiguousarray(values, dtype=np.int64)
        if not a.size:
            return torch.zeros(a.shape, dtype=torch.long, device=self.device)
        hit = self.staged.get(a.tobytes())
        if hit is not None:
            return hit.view(a.shape)
        self.misses += 1
        return self._send(a.ravel().copy()).view(a.shape)   # a copy: on CPU the tensor must not alias the caller's array

    def floats(self, values) -> torch.Tensor:
        """``values`` as a float64 device tensor (staged as their bit patterns by :meth:`float_bits`)."""
        return self.ints(self.float_bits(values)).view(torch.float64)

    @staticmethod
    def float_bits(values) -> np.ndarray:
        return np.ascontiguousarray(values, dtype=np.float64).view(np.int64)

    def clear(self) -> None:
        self.staged = {}

    def _send(self, flat: np.ndarray) -> torch.Tensor:
        self.copies += 1
        host = torch.from_numpy(flat)
        if self.device.type == "cpu":
            return host
        # the caching host allocator keeps the pinned block until the copy that reads it has run
        return host.pin_memory().to(self.device, non_blocking=True)


def padded(rows: list[list[int]], pad: int) -> np.ndarray:
    """Rows of ids of any lengths as one ``[len(rows), longest]`` array, filled out with ``pad`` (at least one
    column)."""
    width = max(1, max(len(r) for r in rows))
    out = np.full((len(rows), width), pad, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


_UPLOADS: dict[str, Uploads] = {}


def uploads_for(device: torch.device | str) -> Uploads:
    """The device's :class:`Uploads` (one per device and process: target and head share a step's staged values)."""
    key = str(torch.device(device))
    if key not in _UPLOADS:
        _UPLOADS[key] = Uploads(torch.device(device))
    return _UPLOADS[key]
