"""An EngineConfig's memory plan, checked against the device before the engine allocates anything.

The pair's loader (``model/pair.py``) calls :func:`size_engine` once it knows the target's config, the head and the
device: ``max_batch_size: auto`` becomes the most slots that fit, an int that does not fit fails here, naming what
it needs and what is free, instead of an out-of-memory error half-way through loading. What the trees need per
sequence (``demand``) comes from the tree's budget arithmetic (``engine/budgets.py tree_demand``).
"""
from __future__ import annotations

import torch

from eagle_ray.config import EngineConfig
from eagle_ray.model.checkpoint import HeadCheckpoint, read_token_map
from eagle_ray.model.memory import MemoryPlan, fit_slots, free_memory, plan_memory
from eagle_ray.model.numerics import step_tokens


def head_for(draft: str | None, head: HeadCheckpoint | None) -> tuple[str | None, dict | None]:
    """(kind, checkpoint config) of the head the builder will load: None for ``draft: none``, the config
    ``for_target`` builds (None) for the random heads."""
    if head is not None:
        return head.kind, head.config
    return {"random": ("eagle2", None), "random-eagle3": ("eagle3", None)}.get(draft, (None, None))


def draft_vocab_for(kind: str | None, head: HeadCheckpoint | None, draft_vocab_size: int | None) -> int | None:
    """Rows of the token-mapped vocabulary an EAGLE-2 head will score (None: the full vocabulary)."""
    if kind != "eagle2" or draft_vocab_size == 0:
        return None
    tm = None if head is None else read_token_map(head.path)
    if tm is None:
        return draft_vocab_size  # bind_lm_head refuses a draft_vocab_size without a map
    n = tm.numel()
    return min(n, draft_vocab_size) if draft_vocab_size else n


def plan_engine(config: EngineConfig, target_config, head: HeadCheckpoint | None, device: torch.device,
                dtype: torch.dtype, demand: tuple[int, int, int]) -> MemoryPlan:
    """The memory plan of the engine about to load; ``demand``: (verify tokens, draft-cache room, draft rows) per
    sequence of the largest trees it may grow."""
    kind, head_config = head_for(config.model.draft, head)
    verify, room, rows = demand
    return plan_memory(target_config, kind, head_config, dtype, device.type, config.cache.max_model_len, verify,
                       draft_room=room, top_k=rows, precision=config.precision,
                       draft_vocab=draft_vocab_for(kind, head, config.speculation.draft_vocab_size),
                       step_tokens=step_tokens(config.cache.max_step_tokens, device, config.cache.step_goal),
                       tensor_parallel=config.model.tensor_parallel, adaptation=config.adaptation)


def size_engine(config: EngineConfig, target_config, head: HeadCheckpoint | None, device: torch.device,
                dtype: torch.dtype, demand: tuple[int, int, int], free_bytes: int | None = None) -> EngineConfig:
    """``config`` with ``max_batch_size`` an int that fits the device (``free_bytes``: default its free memory
    now); raises :class:`eagle_ray.errors.InsufficientMemoryError` if it does not fit."""
    plan = plan_engine(config, target_config, head, device, dtype, demand)
    free = free_memory(device, config.cache.memory_share) if free_bytes is None else free_bytes
    n = fit_slots(plan, config.cache.max_batch_size, free)
    return config if n == config.cache.max_batch_size else config.replace(max_batch_size=n)
