"""Which device and dtype a model runs in, and what the CPU can do (recorded with every measurement)."""
from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from eagle_ray.errors import ConfigError


def pick_device(device: str) -> torch.device:
    """``device`` as a torch device ("auto": CUDA where there is one); a ConfigError, before anything loads, where
    the name is not a device or names a CUDA device this machine does not have."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ConfigError(f"device {device!r} is not a device torch knows ({str(e).splitlines()[0]})") from None
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        raise ConfigError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s) that "
                          "torch can use")
    return dev


def cpu_has_fast_bf16() -> bool:
    """bf16 pays off on CPUs with native bf16 dot products (AVX512-BF16 / AMX); elsewhere fp32 is faster."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_model() -> str:
    """The CPU's model name and whether it has native bf16: the same code runs ~2x apart on CPUs with and without
    it, so every result file records this."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}{' (native bf16)' if cpu_has_fast_bf16() else ''}"


def device_name(device) -> str:
    """The accelerator's model name (``NVIDIA H200``) or, on CPU, ``cpu_model()``: results name the hardware."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" or cpu_has_fast_bf16() else torch.float32
    return getattr(torch, dtype)


@dataclass(frozen=True)
class Numerics:
    """How a target computes on its device: every device-specific numeric choice is made here, once.

    The CPU tricks buy exactness where the CPU kernels need it: a bf16 residual stream, a 1-row and an 8-row
    attention, or a GEMM's leftover rows round differently on CPU, and a bf16 verify then drifts from bf16 plain
    decoding. On CUDA they would buy nothing the fused kernels do not already give, and cost memory (an fp32
    lm_head copy is GBs at a 128k vocabulary) and speed (fp32 activations rule out the fused SDPA kernels).
    """
    fp32_logits: bool           # top logits recomputed exactly in fp32 (model/logits.py RefinedLogits)
    fp32_activations: bool      # fp32 residual stream, norms and attention; projections stay low precision
    batch_invariant: bool       # row-invariant GEMM shapes and chunked attention (attention.pad_rows)
    cpu_linears: str            # the linears' layout: native | input_major | packed (see model/linears.py)

    @property
    def input_major_weights(self) -> bool:
        """Every linear's dense weight is replaced by a CPU layout of the same size (a tied lm_head gets its own)."""
        return self.cpu_linears != "native"


def numerics_for(device: torch.device, dtype: torch.dtype, fp32_logits="auto", fp32_activations="auto",
                 batch_invariant="auto", cpu_linears="auto") -> Numerics:
    """Resolve the precision switches (``True``, ``False`` or ``"auto"``) for a device and dtype.

    ``auto``: exact logits, fp32 activations and batch-invariant kernels for a bf16/fp16 target on CPU only;
    CUDA runs natively in its dtype. An fp32 target needs none of them. Batch-invariant kernels exist on CPU
    only and need fp32 activations.
    """
    cpu, low = device.type == "cpu", dtype != torch.float32

    def pick(value, default: bool) -> bool:
        return default if value == "auto" else bool(value)

    logits = low and pick(fp32_logits, cpu)
    activations = low and pick(fp32_activations, cpu)
    invariant = activations and cpu and pick(batch_invariant, True)
    linears = cpu_linears_for(device, dtype) if cpu_linears == "auto" or not cpu else cpu_linears
    return Numerics(logits, activations, invariant, cpu_linears=linears)


def cpu_linears_for(device: torch.device, dtype: torch.dtype) -> str:
    """CUDA: as loaded. CPU: oneDNN's packed weights for fp32, and for bf16 where the CPU has native bf16 (a 1-row
    product there takes about 0.6x the input-major time); input-major weights otherwise (fp16, bf16 without it)."""
    from eagle_ray.model.linears import packed_available
    if device.type != "cpu":
        return "native"
    fast = dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_has_fast_bf16())
    return "packed" if fast and packed_available() else "input_major"


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


_UPLOADS: dict[str, Uploads] = {}


def uploads_for(device: torch.device | str) -> Uploads:
    """The device's :class:`Uploads` (one per device and process: target and head share a step's staged values)."""
    key = str(torch.device(device))
    if key not in _UPLOADS:
        _UPLOADS[key] = Uploads(torch.device(device))
    return _UPLOADS[key]


class Clock:
    """Wall time of a step's phases. Without profiling a phase's time is the host's (on CUDA that is launch time:
    the step stays asynchronous). With profiling on CUDA, marks are CUDA events and a phase's time is an
    :class:`Elapsed` that :func:`resolve_times` turns into seconds after one synchronisation at the step's end."""

    def __init__(self, device: torch.device, profile: bool = False):
        self.events = profile and torch.device(device).type == "cuda"

    def __call__(self):
        if not self.events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return _Mark(event)


class _Mark:
    def __init__(self, event):
        self.event = event

    def __sub__(self, start: "_Mark") -> "Elapsed":
        return Elapsed([(start.event, self.event)])


class Elapsed:
    """A sum of event spans (and plain seconds), read only once the events have completed."""

    def __init__(self, spans: list):
        self.spans = spans

    def __add__(self, other) -> "Elapsed":
        if isinstance(other, Elapsed):
            return Elapsed(self.spans + other.spans)
        return Elapsed(self.spans + ([float(other)] if other else []))

    __radd__ = __add__

    def seconds(self) -> float:
        return sum(s if isinstance(s, float) else s[0].elapsed_time(s[1]) / 1000 for s in self.spans)


def resolve_times(times) -> None:
    """Turn a dataclass's :class:`Elapsed` fields into seconds (one synchronisation, only if there are any)."""
    lazy = [f for f, v in vars(times).items() if isinstance(v, Elapsed)]
    if lazy:
        torch.cuda.synchronize()
        for f in lazy:
            setattr(times, f, getattr(times, f).seconds())
