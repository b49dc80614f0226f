"""Which device and dtype a model runs in, and what the CPU can do (recorded with every measurement)."""
from __future__ import annotations

import platform
from dataclasses import dataclass
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
    input_major_weights: bool   # weights stored [in, out] (and the draft's lm_head copy): faster few-row sgemm


def numerics_for(device: torch.device, dtype: torch.dtype, fp32_logits="auto", fp32_activations="auto",
                 batch_invariant="auto") -> Numerics:
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
    return Numerics(logits, activations, invariant, input_major_weights=cpu)
