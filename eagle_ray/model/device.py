"""Which device and dtype a model runs in, and what the hardware is called (recorded with every measurement)."""
from __future__ import annotations

import platform
from pathlib import Path

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


def packed_available() -> bool:
    """Whether this torch build has oneDNN's linear kernel over a packed weight (model/linears.py)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


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
