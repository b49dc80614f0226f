"""Which head a checkpoint holds, whether it fits its target, and loading it: EAGLE-1/2 or EAGLE-3."""
from __future__ import annotations

from pathlib import Path

import torch

from eagle_ray.errors import CheckpointError, first_line
from eagle_ray.model import eagle3_head
from eagle_ray.model.checkpoint import HeadCheckpoint, read_head
from eagle_ray.model.draft_head import DraftHead
from eagle_ray.model.eagle3_head import Eagle3Head
from eagle_ray.model.memory import head_on_meta


def check_head(head: str | Path | HeadCheckpoint, target_config) -> HeadCheckpoint:
    """Fail, naming the mismatch, unless the head fits ``target_config`` and its config builds a head; returns the
    checkpoint (its config read once). Called before the target's weights load, so a bad head fails in a second."""
    ckpt = read_head(head)
    if ckpt.kind == "eagle3":
        eagle3_head.check_config(ckpt.path, ckpt.config, target_config)
    else:
        DraftHead.check_config(ckpt.path, target_config, ckpt.config)
    check_buildable(ckpt, target_config)
    return ckpt


# the config fields a head's shapes come from: each must be a positive integer where given
SIZE_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "vocab_size", "draft_vocab_size", "target_hidden_size")


def check_buildable(ckpt: HeadCheckpoint, target_config) -> None:
    """The head's config.json holds sizes a head can have (positive integers, key heads dividing query heads,
    boolean switches) and builds one: checked on the meta device, so a bad value fails here naming the file
    instead of as a torch or transformers error deep in loading."""
    path, raw = ckpt.path, ckpt.config
    for key in SIZE_FIELDS:
        v = raw.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 < v < 2**31):
            raise CheckpointError(f"draft head {path}/config.json: {key} must be a positive integer, got {v!r}")
    heads, kv = raw.get("num_attention_heads"), raw.get("num_key_value_heads") or raw.get("num_attention_heads")
    if heads and kv and heads % kv:
        raise CheckpointError(f"draft head {path}/config.json: num_key_value_heads {kv} does not divide "
                              f"num_attention_heads {heads}")
    for key in ("bias", "qkv_bias"):
        if raw.get(key) is not None and not isinstance(raw[key], bool):
            raise CheckpointError(f"draft head {path}/config.json: {key} must be true or false, got {raw[key]!r}")
    try:
        head_on_meta(ckpt.kind, target_config, raw)
    except Exception as e:  # noqa: BLE001 - the config reader, RoPE's tables and torch's modules raise many types
        raise CheckpointError(f"draft head {path}/config.json does not describe a head this engine can build: "
                              f"{type(e).__name__}: {first_line(e)}") from None


def load_head(head: str | Path | HeadCheckpoint, target_config, target_embed: torch.Tensor | None = None,
              dtype: torch.dtype = torch.float32, device="cpu"):
    """An EAGLE-1/2 or EAGLE-3 head, whichever the checkpoint holds, checked against its target first."""
    ckpt = check_head(head, target_config)
    kind = Eagle3Head if ckpt.kind == "eagle3" else DraftHead
    return kind.load(ckpt, target_config, target_embed, dtype, device)
