"""Which device and dtype a model runs in, and what the CPU can do (recorded with every measurement)."""
from __future__ import annotations

import platform
from pathlib import Path

import torch


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


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


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" or cpu_has_fast_bf16() else torch.float32
    return getattr(torch, dtype)
