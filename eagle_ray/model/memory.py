"""What an engine will hold in device memory, computed before anything is allocated.

Weights are the parameter and buffer bytes of the modules built from their configs on the ``meta`` device (no
memory, exact shapes, tied embeddings counted once); KV caches follow :class:`eagle_ray.model.kv_cache.KVCache`'s
layout; logits and workspace are estimates with the sizes written below. A plan has a fixed part (weights, lm_head
copies, workspace) and a per-slot part (target KV, draft KV, logits rows), so ``total(n)`` is linear in the slot
count and ``max_slots(free)`` inverts it.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eagle_ray.errors import InsufficientMemoryError
from eagle_ray.model.checkpoint import ARCHITECTURES, HeadCheckpoint, head_biases
from eagle_ray.model.draft_head import DraftHead
from eagle_ray.model.eagle3_head import Eagle3Head
from eagle_ray.model.linears import packs
from eagle_ray.model.numerics import defaults_for, numerics_for

GiB = 2**30

# Activations and scratch not held by any named tensor: cuBLAS/cuBLASLt and SDPA workspaces, the caching
# allocator's block rounding and fragmentation, the sampler's temporaries, tokenizer and Python objects. A few
# hundred MiB on a GPU in practice; 512 MiB keeps a plan that "just fits" from failing at its first step.
WORKSPACE_FIXED = 512 * 2**20
# Verify logits are fp32 [rows, vocab]; the sampler's softmax (or RefinedLogits' bf16 product before its exact
# rows are scattered in) is a second tensor of the same size alive at the same time.
LOGITS_COPIES = 2
# The head's pending (feature, token) pairs (engine/model_runner.py feeds the head lazily): a sequence holds at most
# this many bytes of them (max_pending_pairs), features counted in the dtype the target's activations run in.
PENDING_BYTES_PER_SLOT = 2 * 2**20
# Online adaptation's training step (train/online.py): fp32 logits over the scored vocabulary for each of its
# ``batch_tokens`` pairs: the candidate's, the target's (EAGLE-2 learns its distribution), their softmaxes and the
# gradient, about this many alive at once.
ADAPT_LOGITS_COPIES = 4

# Usable memory of common GPUs: the total nvidia-smi reports (MiB), less CUDA_CONTEXT for the CUDA context and
# driver reservations, which torch.cuda.mem_get_info already excludes on a live device.
GPU_TOTAL_MIB = {"A10G": 23028, "L4": 23034, "L40S": 46068, "A100-40GB": 40960, "A100-80GB": 81920,
                 "H100-80GB": 81559}
CUDA_CONTEXT = 1 * GiB


def gpu_usable_bytes(gpu: str) -> int:
    """What an engine can plan for on a GPU of this type (see ``GPU_TOTAL_MIB``)."""
    return GPU_TOTAL_MIB[gpu] * 2**20 - CUDA_CONTEXT


@dataclass(frozen=True)
class Copies:
    """lm_head copies an engine keeps besides the modules' own weights."""
    fp32_lm_head: bool       # RefinedLogits.weight_fp32: [vocab, hidden] fp32, for rows its bound cannot settle
    out_major_lm_head: bool  # RefinedLogits.weight: its own [vocab, hidden] copy in the model dtype
    input_major: bool        # every linear in a CPU layout (model/linears.py): a tied lm_head gets its own copy,
    #                          and the draft scores the full vocabulary with that lm_head itself
    packed: bool = False     # oneDNN-packed: the lm_head keeps its dense weight beside the packed one, tied or not
    #                          (where the layout packs a weight its size: ``linears.packs``)


def copies_for(device_type: str, dtype: torch.dtype | str, precision=None) -> Copies:
    """The one rule for lm_head copies, read off the target's numerics (``numerics.numerics_for``).

    CPU: linears are stored in a CPU layout (``device.cpu_linears_for``). The oneDNN-packed lm_head (where the layout
    packs one of its size, ``linears.packs``, which ``plan_memory`` checks) keeps its dense weight beside the packed
    one, and RefinedLogits reads that dense weight; an input-major lm_head has no out-major weight, so RefinedLogits
    keeps its own copy. Either way RefinedLogits adds the fp32 copy when a bf16/fp16 target
    has ``fp32_logits`` on (``auto``: on), and the draft head scores with the laid-out lm_head itself.
    CUDA: native bf16 (``fp32_logits: auto`` is off), logits from the model-dtype lm_head with fp32 accumulation,
    the draft scoring with the target's own weight: no copies, unless ``fp32_logits: true`` asks for the fp32 one
    (the nn.Linear weight is already out-major).
    """
    n = _numerics(device_type, dtype, precision)
    return Copies(fp32_lm_head=n.fp32_logits, out_major_lm_head=n.fp32_logits and n.cpu_linears == "input_major",
                  input_major=n.input_major_weights, packed=n.cpu_linears == "packed")


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes an engine needs; ``total(n)`` for ``n`` KV slots."""
    device_type: str
    dtype: str
    max_len: int               # positions per slot (max_model_len clipped to the target's max_position_embeddings)
    target_weights: int
    draft_weights: int
    lm_head_copies: int        # per ``copies_for``, plus the draft's gathered rows when it scores a token map
    workspace: int             # WORKSPACE_FIXED + one step's activations
    kv_per_slot: int           # target: layers x 2 x kv_heads x (max_len + 1) x head_dim x dtype size
    draft_kv_per_slot: int     # draft: 1 layer, max_len + tree room + 1 positions (+1 scratch)
    logits_per_slot: int       # verify rows x vocab x 4 x LOGITS_COPIES + draft top-k rows x draft vocab x 4
    pending_per_slot: int = 0  # the head's pending pairs: max_pending_pairs x feature bytes
    adaptation: int = 0        # online adaptation: the fp32 lm_head and candidate head, its optimizer state, the
    #                            buffered pairs (fp32) and a training step's logits
    adaptation_per_slot: int = 0   # ... and every pair a running sequence gives the head, kept until it finishes

    @property
    def weights(self) -> int:
        return self.target_weights + self.draft_weights + self.lm_head_copies

    @property
    def fixed(self) -> int:
        return self.weights + self.workspace + self.adaptation

    @property
    def per_slot(self) -> int:
        return (self.kv_per_slot + self.draft_kv_per_slot + self.logits_per_slot + self.pending_per_slot
                + self.adaptation_per_slot)

    def total(self, num_slots: int) -> int:
        return self.fixed + num_slots * self.per_slot

    def max_slots(self, free_bytes: int) -> int:
        """The most slots whose total fits ``free_bytes`` (0 if the fixed part alone does not)."""
        return max(0, (free_bytes - self.fixed) // self.per_slot)

    def breakdown(self, num_slots: int) -> str:
        g = _gib
        return (f"{g(self.total(num_slots))} = target weights {g(self.target_weights)} + draft head "
                f"{g(self.draft_weights)} + lm_head copies {g(self.lm_head_copies)} + workspace {g(self.workspace)} "
                + (f"+ online adaptation {g(self.adaptation)} " if self.adaptation else "")
                + f"+ {num_slots} slots x {g(self.per_slot)} (KV {g(self.kv_per_slot)}, draft KV "
                f"{g(self.draft_kv_per_slot)}, logits {g(self.logits_per_slot)}"
                + (f", pending head inputs {g(self.pending_per_slot)}" if self.pending_per_slot else "")
                + (f", pairs kept to adapt on {g(self.adaptation_per_slot)}" if self.adaptation_per_slot else "")
                + f") at max_model_len {self.max_len}")

    def as_dict(self, *slot_counts: int) -> dict:
        return {**asdict(self), "fixed": self.fixed, "per_slot": self.per_slot,
                "total": {str(n): self.total(n) for n in slot_counts}}


# ---- the plan -------------------------------------------------------------------------------------------------
def plan_memory(target_config, head_kind: str | None, head_config: dict | None, dtype: torch.dtype | str,
                device_type: str, max_model_len: int, tree_budget: int, *, draft_room: int | None = None,
                top_k: int = 1, precision=None, draft_vocab: int | None = None,
                step_tokens: int = 0, tensor_parallel: int = 1, adaptation=None) -> MemoryPlan:
    """What an engine with this target, head and cache shape needs.

    ``head_kind``: ``eagle2``, ``eagle3`` or None (no head); ``head_config``: the head checkpoint's config.json
    (None: the head ``for_target`` would build). ``tree_budget``: verify tokens per sequence (root included);
    ``draft_room``: tree tokens stacked on a slot's draft cache (default ``tree_budget``); ``top_k``: draft rows a
    sequence scores per level; ``draft_vocab``: rows of a token-mapped EAGLE-2 draft vocabulary (None: the full
    vocabulary); ``step_tokens``: tokens one step may run (the cache config's step budget). ``tensor_parallel``:
    the target split over that many ranks: the plan is rank 0's (its slices of the layers and of the KV heads, the
    replicated embedding and lm_head, and the head, logits and workspace that only rank 0 holds). ``adaptation``:
    the engine's ``AdaptationConfig`` (counted where enabled and there is a head).
    """
    dt = _dtype(dtype)
    size = dt.itemsize
    cfg = target_config
    hidden, vocab = cfg.hidden_size, cfg.vocab_size
    max_len = min(max_model_len, getattr(cfg, "max_position_embeddings", None) or max_model_len)
    head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
    kv_width = cfg.num_key_value_heads * head_dim

    copies = copies_for(device_type, dt, precision)
    lm_copies = vocab * hidden * (4 * copies.fp32_lm_head + size * copies.out_major_lm_head)
    lm_head_packed = copies.packed and packs(vocab * hidden, dt, device_type)
    if lm_head_packed or (copies.input_major and getattr(cfg, "tie_word_embeddings", False)):
        lm_copies += vocab * hidden * size

    draft_weights = draft_kv = draft_scoring = pending = adapt = adapt_per_slot = 0
    if head_kind is not None:
        head = head_on_meta(head_kind, cfg, head_config)
        draft_weights = module_bytes(head.to(dt))
        attn = (head.midlayer if head_kind == "eagle3" else head.layers[0]).self_attn
        room = tree_budget if draft_room is None else draft_room
        draft_kv = 2 * head.config.num_key_value_heads * (max_len + room + 2) * attn.head_dim * size
        if head_kind == "eagle3":
            scored = head.draft_vocab_size       # its own lm_head: part of its weights
            lm_copies += scored * 8              # bind_lm_head's draft-to-target id map (int64)
        else:
            scored = vocab if draft_vocab is None else draft_vocab
            if draft_vocab is not None:          # bind_lm_head gathers the map's rows, and keeps the map
                lm_copies += draft_vocab * (hidden * size + 8)
        draft_scoring = top_k * scored * 4
        pair = pending_pair_bytes(head.feature_size, dt, _numerics(device_type, dt, precision).fp32_activations)
        pending = max_pending_pairs(pair, max_len) * pair
        if adaptation is not None and adaptation.enabled:
            adapt = adaptation_bytes(head, vocab * hidden, scored, adaptation, max_len)
            adapt_per_slot = max_len * pair

    workspace = WORKSPACE_FIXED + step_tokens * _activation_bytes_per_token(cfg, kv_width, size)
    return MemoryPlan(
        device_type=device_type, dtype=str(dt).removeprefix("torch."), max_len=max_len,
        target_weights=target_weight_bytes(cfg, dt, tensor_parallel), draft_weights=draft_weights,
        lm_head_copies=lm_copies, workspace=workspace,
        kv_per_slot=cfg.num_hidden_layers * 2 * (max_len + 1) * kv_width * size // tensor_parallel,
        draft_kv_per_slot=draft_kv,
        logits_per_slot=tree_budget * vocab * 4 * LOGITS_COPIES + draft_scoring, pending_per_slot=pending,
        adaptation=adapt, adaptation_per_slot=adapt_per_slot)


def adaptation_bytes(head, lm_head_numel: int, scored: int, cfg, max_len: int) -> int:
    """The fixed bytes of online adaptation (``train/online.py``): the adapter's fp32 copy of the target's lm_head,
    the candidate (an fp32 copy of ``head``: built on the meta device) with a gradient and AdamW's two moments for
    every parameter but the frozen embedding, the buffered pairs (``buffer_tokens`` to train on and a quarter as
    many held back, each over by at most one sequence of ``max_len``; fp32 features) and one training step's
    logits (``ADAPT_LOGITS_COPIES``)."""
    params = sum(p.numel() for p in head.parameters())
    trainable = params - head.embed_tokens.weight.numel()
    buffered = cfg.buffer_tokens + cfg.buffer_tokens // 4 + 2 * max_len
    return 4 * (lm_head_numel + params + 3 * trainable + buffered * head.feature_size
                + cfg.batch_tokens * scored * ADAPT_LOGITS_COPIES)


def pending_pair_bytes(feature_size: int, dtype: torch.dtype, fp32_activations: bool) -> int:
    """Bytes of one pending pair's feature (the target's activations: fp32 where they run in fp32)."""
    return feature_size * (4 if fp32_activations else dtype.itemsize)


def max_pending_pairs(pair_bytes: int, max_len: int) -> int:
    """Pending (feature, token) pairs one sequence may hold: ``PENDING_BYTES_PER_SLOT``, at most a context's
    worth, at least one (a bound that low feeds the head every step, as eager feeding would)."""
    return max(1, min(max_len, PENDING_BYTES_PER_SLOT // pair_bytes))


def target_weight_bytes(target_config, dtype: torch.dtype | str, tensor_parallel: int = 1) -> int:
    """Parameter and buffer bytes of the target built from its config on the meta device (one rank's, split over
    ``tensor_parallel`` ranks: see ``model/tensor_parallel.py``)."""
    from eagle_ray.model.decoder import on_meta
    from eagle_ray.model.tensor_parallel import split_dim
    model = on_meta(target_config, _dtype(dtype))
    if tensor_parallel == 1:
        return module_bytes(model)
    split = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if split_dim(name) is not None)
    return module_bytes(model) - split + split // tensor_parallel


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers, each shared tensor once."""
    tensors = {id(t): t for t in list(module.parameters()) + list(module.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def head_on_meta(kind: str, target_config, head_config: dict | None):
    """The draft head module, on the meta device, as the engine would build or load it."""
    with torch.device("meta"):
        if head_config is None:
            if kind == "eagle2":
                return DraftHead.for_target(target_config)
            # Eagle3Head.for_target fills its vocabulary map with ops meta tensors lack (unique): build the same
            # module from the same config without it
            cfg = DraftHead.for_target(target_config).config
            cfg.architectures = [ARCHITECTURES[0]]
            cfg.draft_vocab_size, cfg.target_hidden_size = target_config.vocab_size, target_config.hidden_size
            return Eagle3Head(cfg, target_config.num_hidden_layers)
        layer_config = HeadCheckpoint(Path("."), head_config).layer_config()
        if kind == "eagle3":
            return Eagle3Head(layer_config, target_config.num_hidden_layers)
        bias, qkv_bias = head_biases(head_config)
        return DraftHead(layer_config, bias=bias, qkv_bias=qkv_bias)


def _activation_bytes_per_token(cfg, kv_width: int, size: int) -> int:
    """Live activations per token of one decoder layer (layers run one after another): the fp32 residual stream,
    its normed copy, the attention output and the layer's sum (4 x hidden x 4 bytes), q/k/v/o in the model dtype,
    and the MLP's gate, up and gated product."""
    q_width = cfg.num_attention_heads * (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    return 16 * cfg.hidden_size + (2 * q_width + 2 * kv_width) * size + 3 * cfg.intermediate_size * size


# ---- the device ---------------------------------------------------------------------------------------------------
def free_memory(device, share: float | None = None) -> int:
    """Bytes free for a new engine: CUDA's free memory on the device, or the host's available memory (the smaller
    of /proc/meminfo's MemAvailable and what a cgroup v2 limit leaves); with ``share``, at most that share of the
    GPU's total memory (engines sharing a GPU each plan for their part, not for what the first left free)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free if share is None else min(free, share * total))
    return _host_available()


def _host_available() -> int:
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    if avail is None:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    cg = Path("/sys/fs/cgroup")
    try:
        limit = (cg / "memory.max").read_text().strip()
        if limit != "max":
            stat = dict(line.split() for line in (cg / "memory.stat").read_text().splitlines())
            # the page cache is reclaimable, so it does not count as used
            used = int((cg / "memory.current").read_text()) - int(stat.get("inactive_file", 0))
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return max(0, avail)


# ---- the decision -------------------------------------------------------------------------------------------------
def fit_slots(plan: MemoryPlan, max_batch_size: int | str, free_bytes: int) -> int:
    """The KV slot count to allocate: ``max_batch_size`` if its plan fits ``free_bytes``, for ``"auto"`` the most
    slots that fit (at most the device's ``auto_max_slots``, ``numerics.DEVICE_DEFAULTS``); else :class:`InsufficientMemoryError` naming both numbers."""
    where = "one GPU" if plan.device_type == "cuda" else f"this {plan.device_type} device"
    if plan.fixed > free_bytes:
        split = (" Split the target over more GPUs (model.tensor_parallel: each GPU then holds its share of the "
                 "layers; docs/memory.md), or use a GPU with more memory."
                 if plan.device_type == "cuda" else " Use a smaller target or free some memory.")
        raise InsufficientMemoryError(
            f"the target does not fit {where}: weights alone need {_gib(plan.weights)} (plus {_gib(plan.workspace)} "
            f"workspace) but {_gib(free_bytes)} is free.{split}")
    fits = plan.max_slots(free_bytes)
    if max_batch_size == "auto":
        if fits < 1:
            raise InsufficientMemoryError(
                f"max_batch_size=auto: not even one KV slot fits: needs {plan.breakdown(1)}, {_gib(free_bytes)} "
                f"free; lower max_model_len")
        return min(fits, defaults_for(plan.device_type).auto_max_slots)
    n = int(max_batch_size)
    if plan.total(n) > free_bytes:
        hint = f"max_batch_size <= {fits} fits" if fits else "not even one slot fits at this max_model_len"
        raise InsufficientMemoryError(
            f"max_batch_size={n} does not fit {where}: needs {plan.breakdown(n)}, but {_gib(free_bytes)} is free "
            f"({hint}); lower max_batch_size or max_model_len, or set max_batch_size: auto")
    return n


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def _dtype(dtype) -> torch.dtype:
    return getattr(torch, dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype


def _numerics(device_type: str, dtype, precision):
    """The target's numerics for a device type, dtype and precision switches (see ``numerics.numerics_for``)."""
    switches = {k: _switch(precision, k) for k in ("fp32_logits", "fp32_activations", "batch_invariant",
                                                   "cpu_linears")}
    return numerics_for(torch.device(device_type), _dtype(dtype), **switches)


def _switch(precision, name: str):
    """A precision switch (True, False or "auto") from a PrecisionConfig, a dict or None (all "auto")."""
    value = precision.get(name) if isinstance(precision, dict) else getattr(precision, name, None)
    return "auto" if value is None else value
