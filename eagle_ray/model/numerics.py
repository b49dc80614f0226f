"""How a target computes on its device: the one place where device facts decide numeric choices.

"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle_ray.model.device import cpu_has_fast_bf16


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
