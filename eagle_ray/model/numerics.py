"""Device facts in one table, and how a target computes on its device.

``DEVICE_DEFAULTS`` holds every default that depends on the kind of device (the config's ``auto`` values resolve
here); :func:`numerics_for` turns them and a dtype into the :class:`Numerics` a target runs with. What these were
measured on, and why, is in docs/design.md and docs/benchmarks.md, not here: figures go stale silently.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from eagle_ray.model.device import cpu_has_fast_bf16, packed_available


@dataclass(frozen=True)
class DeviceDefaults:
    """What a kind of device sets where the config says ``auto`` (or leaves a field unset)."""
    step_tokens: int              # cache.max_step_tokens: tokens a step runs, so a stall of the running streams
    #                               while prompts arrive lasts about one pass of this many tokens
    throughput_step_tokens: int   # ... where nothing streams (the batch job): wide enough that a step holds trees
    #                               beside the prompt chunks of sequences that just started
    auto_max_slots: int           # max_batch_size "auto" stops here (beyond it a step costs more than it batches)
    exact_low_precision: bool     # bf16/fp16 targets: exact top logits, fp32 activations, batch-invariant kernels
    cpu_layouts: bool             # the target's linears in a CPU layout (model/linears.py), by dtype and bf16 support
    kv_bucket: int                # key lengths a forward reads are rounded up to a multiple of this (masked): a new
    #                               shape every step would make shape-specialised kernels build again and again
    sdpa_backends: tuple[str, ...] | None   # attention kernels SDPA may pick, in order (None: its own choice);
    #                               CUDA leaves out cuDNN, which builds a new graph for every new key length
    fused_layers: bool            # decoder layers in few kernels (model/fused.py): where a launch costs more than its work
    tree_attention: str = "sdpa"  # the fused layers' attention: sdpa, or flex (model/tree_attention.py; not yet the
    #                               default anywhere: bench/gpu_step.py measures it against sdpa)
    one_target_pass: bool = True  # a step's prompt chunks, drafted trees and plain roots in one target pass, each
    #                               weight read once (engine/model_runner.py target_pass)
    packed_min_weights: int = 0   # fp32 weights with fewer elements stay input-major where the layout says packed:
    #                               oneDNN's call costs more than such a product (model/linears.py layout_of)
    verify_block_tokens: int | None = None   # drafted trees of different sizes verified in blocks of their own
    #                               widths, each further block counted as this many tokens (speculative/tree.py
    #                               split_by_size): where a padding row costs a token's compute and a host read costs
    #                               nothing; None: one block (graphs replay one width)


DEVICE_DEFAULTS = {
    "cpu": DeviceDefaults(step_tokens=48, throughput_step_tokens=256, auto_max_slots=32, exact_low_precision=True, cpu_layouts=True,
                          packed_min_weights=1 << 18, kv_bucket=1,
                          sdpa_backends=None, fused_layers=False, verify_block_tokens=8),
    "cuda": DeviceDefaults(step_tokens=8192, throughput_step_tokens=8192, auto_max_slots=256, exact_low_precision=False, cpu_layouts=False,
                           kv_bucket=256, sdpa_backends=("EFFICIENT_ATTENTION", "FLASH_ATTENTION", "MATH"),
                           fused_layers=True),
}


def defaults_for(device) -> DeviceDefaults:
    """``DEVICE_DEFAULTS`` of a device (a torch device, or its type); an accelerator not in the table is run as CUDA."""
    kind = device if isinstance(device, str) else torch.device(device).type
    return DEVICE_DEFAULTS.get(kind, DEVICE_DEFAULTS["cuda"])


def attention_kernels(device):
    """A context in which SDPA picks only the device's ``sdpa_backends`` (a no-op where the table says None)."""
    backends = defaults_for(device).sdpa_backends
    if backends is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([getattr(SDPBackend, b) for b in backends])


def step_tokens(max_step_tokens: int | None, device, goal: str = "latency") -> int:
    """Tokens per step (verify and prompt chunks): the configured ``cache.max_step_tokens``, else the device's
    budget for the goal (``cache.step_goal``: latency for Serve, throughput for the batch job)."""
    if max_step_tokens is not None:
        return max_step_tokens
    facts = defaults_for(device)
    return facts.throughput_step_tokens if goal == "throughput" else facts.step_tokens


@dataclass(frozen=True)
class Numerics:
    """How a target computes on its device: every device-specific numeric choice is made here, once.

    The CPU's exactness switches buy exactness where the CPU kernels need it: a bf16 residual stream, a 1-row and an
    8-row attention, or a GEMM's leftover rows round differently on CPU, and a bf16 verify then drifts from bf16
    plain decoding. On CUDA they would buy nothing the fused kernels do not already give, and cost memory (an fp32
    lm_head copy is GBs at a 128k vocabulary) and speed (fp32 activations rule out the fused SDPA kernels).
    """
    fp32_logits: bool           # top logits recomputed exactly in fp32 (model/logits.py RefinedLogits)
    fp32_activations: bool      # fp32 residual stream, norms and attention; projections stay low precision
    batch_invariant: bool       # row-invariant GEMM shapes and chunked attention (attention.pad_rows)
    cpu_linears: str            # the linears' layout: native | input_major | packed (see model/linears.py)
    fused_layers: bool = False  # merged projections and fused norms (model/fused.py)
    tree_attention: str = "sdpa"  # the fused layers' attention kernel: sdpa | flex (model/tree_attention.py)

    @property
    def input_major_weights(self) -> bool:
        """Every linear's dense weight is replaced by a CPU layout of the same size (a tied lm_head gets its own)."""
        return self.cpu_linears != "native"


def numerics_for(device: torch.device, dtype: torch.dtype, fp32_logits="auto", fp32_activations="auto",
                 batch_invariant="auto", cpu_linears="auto", fused_layers="auto", tree_attention="auto") -> Numerics:
    """Resolve the precision switches (``True``, ``False`` or ``"auto"``) for a device and dtype.

    ``auto``: the device's ``exact_low_precision`` for a bf16/fp16 target (an fp32 target needs none of them).
    Batch-invariant kernels exist on CPU only and need fp32 activations. Fused layers need the modules' own
    weights (native linears) and a residual stream in the model dtype; flex tree attention runs in fused layers.
    """
    facts, cpu, low = defaults_for(device), device.type == "cpu", dtype != torch.float32

    def pick(value, default: bool) -> bool:
        return default if value == "auto" else bool(value)

    logits = low and pick(fp32_logits, facts.exact_low_precision)
    activations = low and pick(fp32_activations, facts.exact_low_precision)
    invariant = activations and cpu and pick(batch_invariant, True)
    linears = cpu_linears_for(device, dtype) if cpu_linears == "auto" or not cpu else cpu_linears
    fused = pick(fused_layers, facts.fused_layers) and linears == "native" and not activations
    kernel = (facts.tree_attention if tree_attention == "auto" else tree_attention) if fused else "sdpa"
    return Numerics(logits, activations, invariant, cpu_linears=linears, fused_layers=fused, tree_attention=kernel)


def cpu_linears_for(device: torch.device, dtype: torch.dtype) -> str:
    """CUDA: as loaded. CPU: oneDNN's packed weights for fp32, and for bf16 where the CPU has native bf16;
    ``nn.Linear``'s own layout otherwise (fp16, bf16 without it: oneDNN packs neither, and an emulated product
    over an input-major weight costs several times one over the out-major weight; docs/benchmarks.md)."""
    if not defaults_for(device).cpu_layouts:
        return "native"
    if dtype == torch.float32:
        return "packed" if packed_available() else "input_major"
    return "packed" if dtype == torch.bfloat16 and cpu_has_fast_bf16() and packed_available() else "native"
