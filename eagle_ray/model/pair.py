"""The target and its EAGLE head, read and loaded in the order that fails fastest: resolve the pair, read both
checkpoints' configs once (a head that does not fit its target fails before any weight loads), plan the memory (a
plan that does not fit fails before anything is allocated), then load the weights.

The engine's builder (``engine/builder.py``) calls :func:`load_pair` once, then wires the engine around what it
returns; the batch job checks a local pair with :func:`check_local_pair` before it starts its actors.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from eagle_ray.config import EngineConfig, ModelConfig
from eagle_ray.model.checkpoint import HeadCheckpoint
from eagle_ray.model.device import pick_device, pick_dtype
from eagle_ray.model.draft_head import DraftHead
from eagle_ray.model.eagle3_head import Eagle3Head
from eagle_ray.model.heads import check_head, load_head
from eagle_ray.model.loading import (check_gguf_path, resolve_draft, resolve_target, target_config_and_tokenizer,
                                     use_chat_template)
from eagle_ray.model.sizing import size_engine
from eagle_ray.model.target import TargetModel

RANDOM_HEADS = ("random", "random-eagle3")  # untrained heads (EAGLE-2, EAGLE-3): lossless-test fixtures


@dataclass
class Checkpoints:
    """The pair's configs, each read once: what every later step checks, plans and loads from."""
    target_dir: Path
    target_config: object        # the transformers config
    tokenizer: object
    head: HeadCheckpoint | None  # None: no head, or an untrained one (``draft``: none / random / random-eagle3)


@dataclass
class LoadedPair:
    target: TargetModel
    draft: DraftHead | Eagle3Head | None
    tokenizer: object
    config: EngineConfig         # with max_batch_size an int that fits the device
    checkpoints: Checkpoints


def read_checkpoints(config: EngineConfig, storage_options: dict | None = None) -> Checkpoints:
    """Resolve the target and the head (local, S3 or the embedded pair) and read their configs and the tokenizer
    (with ``model.chat_template`` in place of its own, tried with ``chat_template_kwargs``); a head that does not
    fit its target fails here, naming the mismatch."""
    m = config.model
    target_dir = resolve_target(m.target, storage_options)
    target_config, tokenizer = target_config_and_tokenizer(target_dir)
    if m.chat_template is not None or m.chat_template_kwargs:
        use_chat_template(tokenizer, m.chat_template, m.chat_template_kwargs)
    head = None
    if m.draft not in ("none", *RANDOM_HEADS):
        head = check_head(resolve_draft(m.draft, storage_options), target_config)
    return Checkpoints(target_dir, target_config, tokenizer, head)


def check_local_pair(m: ModelConfig) -> None:
    """A local target or head path that does not exist, a head that does not fit its target, or a chat template
    the target's tokenizer cannot render with, fails here in one line; S3, the embedded pair and a GGUF's
    dequantised copy are left to the loader."""
    local = lambda path: path is not None and not str(path).startswith("s3://")  # noqa: E731
    target_dir = draft_dir = None
    if local(m.target):
        if str(m.target).endswith(".gguf"):   # its dequantised copy is made by the loader, once
            check_gguf_path(Path(m.target).expanduser())
        else:
            target_dir = resolve_target(m.target)
    if local(m.draft) and m.draft not in ("none",) + RANDOM_HEADS:
        draft_dir = resolve_draft(m.draft)
    chat = m.chat_template is not None or m.chat_template_kwargs
    if target_dir is not None and (draft_dir is not None or chat):
        target_config, tokenizer = target_config_and_tokenizer(target_dir)
        if draft_dir is not None:
            check_head(draft_dir, target_config)
        if chat:
            use_chat_template(tokenizer, m.chat_template, m.chat_template_kwargs)


def load_pair(config: EngineConfig, demand: tuple[int, int, int], storage_options: dict | None = None) -> LoadedPair:
    """Read, check, plan and load the target and its head for ``config``; ``demand``: what the engine's largest
    trees need per sequence (verify tokens, draft-cache room, draft rows), which the memory plan holds."""
    m = config.model
    if m.threads:
        torch.set_num_threads(m.threads)
    device = pick_device(m.device)
    dtype = pick_dtype(m.dtype, device)
    ckpts = read_checkpoints(config, storage_options)
    if m.compile != "off" and config.precision.cpu_linears == "auto":
        config = config.replace(cpu_linears="input_major")   # Inductor lowers dense weights, not packed ones
    # plan the memory before allocating any: max_batch_size "auto" becomes an int, one that does not fit fails
    config = size_engine(config, ckpts.target_config, ckpts.head, device, dtype, demand)
    if m.tensor_parallel > 1:
        target = load_sharded_target(config, ckpts, dtype, device)
    else:
        target = TargetModel.load(ckpts.target_dir, dtype, device, config.cache.max_batch_size,
                                  config.cache.max_model_len, config=ckpts.target_config,
                                  **config.precision.model_dump())
    return LoadedPair(target, load_draft(m.draft, ckpts, target, dtype, device), ckpts.tokenizer, config, ckpts)


def load_sharded_target(config: EngineConfig, ckpts: Checkpoints, dtype: torch.dtype, device):
    """A target split over ``model.tensor_parallel`` processes (``tensor_parallel.ShardedTarget``: rank 0's shard,
    the other ranks started and following)."""
    from eagle_ray.errors import ConfigError
    from eagle_ray.model import tensor_parallel

    m = config.model
    if m.compile == "cuda-graphs":
        raise ConfigError("compile: cuda-graphs does not yet capture a target split over ranks (tensor_parallel > 1)")
    tensor_parallel.check_shardable(ckpts.target_config, m.tensor_parallel)
    spec = tensor_parallel.Spec(str(ckpts.target_dir), ckpts.target_config, str(dtype).removeprefix("torch."),
                                str(device), config.cache.max_batch_size, config.cache.max_model_len,
                                config.precision.model_dump(), m.threads)
    return tensor_parallel.start(spec, m.tensor_parallel, TargetModel, m.collective_timeout_s)


def load_draft(draft: str | None, ckpts: Checkpoints, target: TargetModel, dtype: torch.dtype, device):
    """The head ``draft`` names: its checkpoint, an untrained one (a strong test of losslessness, useless for
    speed), or None."""
    if ckpts.head is not None:
        return load_head(ckpts.head, target.config, target.model.embed_tokens.weight, dtype, device)
    if draft not in RANDOM_HEADS:
        return None
    torch.manual_seed(0)
    head = (Eagle3Head if draft == "random-eagle3" else DraftHead).for_target(target.config)
    head.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight)
    return head.to(device=device, dtype=dtype).eval()
