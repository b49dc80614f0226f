"""Draft-head checkpoints in the SafeAILab layout: config.json read once into a :class:`HeadCheckpoint`, tensors
read and checked against the layout, with errors that name the file and the key.

Both head kinds (``draft_head.py``: EAGLE-1/2, ``eagle3_head.py``: EAGLE-3) read and write through this module; which
kind a checkpoint holds is read from its config.json (``heads.py`` builds the right one).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from eagle_ray.errors import CheckpointError, first_line
from eagle_ray.model.decoder_config import DecoderConfig, decoder_config

CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
               "pad_token_id", "bos_token_id", "eos_token_id", "head_dim")
ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclass(frozen=True)
class HeadCheckpoint:
    """A head's directory and its config.json, read once: every check, the memory plan and the load use this."""
    path: Path
    config: dict

    @property
    def kind(self) -> str:
        """``eagle3`` or ``eagle2``."""
        return "eagle3" if is_eagle3_config(self.config) else "eagle2"

    def layer_config(self) -> DecoderConfig:
        """The one-layer Llama config the head's modules are built from."""
        raw = {k: v for k, v in self.config.items() if k not in ("architectures", "model_type", "transformers_version",
                                                                  "bias", "qkv_bias")}
        return head_config(raw)


def head_config(fields: dict) -> DecoderConfig:
    """A head's one-layer Llama config from ``fields`` (its config.json's, or its target's)."""
    return decoder_config({**fields, "num_hidden_layers": 1}, "llama")


def saved_head_config(config) -> dict:
    """A head's config as transformers' ``LlamaConfig`` writes it: every field named, as readers on transformers
    4.x (the reference among them) expect. Imported here, on saving, not where an engine process loads a head."""
    from transformers import LlamaConfig
    return LlamaConfig(**{k: v for k, v in config.to_dict().items() if k != "model_type"}).to_dict()


def read_head(path: str | Path | HeadCheckpoint) -> HeadCheckpoint:
    """A head checkpoint (its config.json read now), or ``path`` itself if it is one already."""
    if isinstance(path, HeadCheckpoint):
        return path
    return HeadCheckpoint(Path(path), read_config(path))


def is_eagle3_config(raw: dict) -> bool:
    archs = raw.get("architectures")
    return "draft_vocab_size" in raw or "target_hidden_size" in raw or \
        isinstance(archs, list) and any(a in ARCHITECTURES for a in archs)


def add_legacy_rope_keys(cfg: dict) -> None:
    """Readers on transformers 4.x (the reference among them) take RoPE from top-level keys; without them they
    silently fall back to rope_theta 10,000. Written beside ``rope_parameters``."""
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope:
        cfg.setdefault("rope_theta", rope["rope_theta"])
        cfg.setdefault("rope_scaling", None if rope.get("rope_type", "default") == "default" else rope)


def head_biases(raw: dict) -> tuple[bool, bool]:
    """(fc bias, q/k/v bias) of an EAGLE-1/2 config: absent or null means the reference's defaults (a biased fc,
    bias-free projections)."""
    bias, qkv_bias = raw.get("bias"), raw.get("qkv_bias")
    return (True if bias is None else bias), (False if qkv_bias is None else qkv_bias)


def read_config(path: str | Path) -> dict:
    """A head's config.json as a dict; a missing, unreadable or malformed file fails naming itself."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"draft head {path} has no config.json")
    try:
        raw = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"draft head {cfg_file} cannot be read as JSON: {first_line(e)}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"draft head {cfg_file} must hold a JSON object, got {type(raw).__name__}")
    return raw


def read_tensors(file: Path, name: str) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file (or a ``.bin`` torch archive, tensors only); a damaged file (an
    interrupted copy, say) fails naming it."""
    from safetensors.torch import load_file
    try:
        if file.suffix == ".bin":
            tensors = torch.load(file, map_location="cpu", weights_only=True)
        else:
            tensors = load_file(str(file))
    except Exception as e:  # noqa: BLE001  (safetensors and torch.load raise their own error types)
        raise CheckpointError(f"{name}: {file.name} cannot be read ({type(e).__name__}: {first_line(e)}); "
                              "is the file complete?") from None
    if not isinstance(tensors, dict):
        raise CheckpointError(f"{name}: {file.name} must hold a mapping of names to tensors, got "
                              f"{type(tensors).__name__}")
    bad = next(((k, v) for k, v in tensors.items() if not isinstance(k, str) or not torch.is_tensor(v)), None)
    if bad is not None:
        raise CheckpointError(f"{name}: {file.name} must hold a mapping of names to tensors; {bad[0]!r} holds "
                              f"a {type(bad[1]).__name__} (a nested state dict?)")
    return tensors


def read_token_map(path: Path, vocab_size: int | None = None) -> torch.Tensor | None:
    """The head's ``token_map.safetensors`` (its draft vocabulary, target ids), checked: one non-empty 1-D
    integer tensor named ``token_map``, ids inside ``[0, vocab_size)``; None where the head has no map."""
    file = Path(path) / "token_map.safetensors"
    if not file.exists():
        return None
    tm = read_tensors(file, f"draft head {path}").get("token_map")
    if tm is None or tm.dim() != 1 or tm.is_floating_point() or tm.is_complex() or tm.dtype == torch.bool:
        raise CheckpointError(f"draft head {path}: token_map.safetensors must hold one 1-D integer tensor "
                              f"'token_map', got {None if tm is None else (tuple(tm.shape), str(tm.dtype))}")
    tm = tm.long()
    if not tm.numel():
        raise CheckpointError(f"draft head {path}: token_map is empty (the head would propose nothing)")
    if vocab_size is not None and (tm.min() < 0 or tm.max() >= vocab_size):
        raise CheckpointError(f"draft head {path}: token_map holds ids outside [0, {vocab_size})")
    return tm


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    for file in (path / "model.safetensors", path / "pytorch_model.bin"):
        if file.exists():
            return read_tensors(file, f"draft head {path}")
    raise CheckpointError(f"draft head {path} has neither model.safetensors nor pytorch_model.bin")


def load_checked(head: nn.Module, state: dict, name: str, layout: str, ignore: set[str] = frozenset()) -> None:
    """Load ``state`` into ``head`` strictly, failing first with a message naming missing and unexpected keys
    (``ignore`` lists keys some writers add and the head does not use) and any tensor whose shape differs from what
    the config implies."""
    expected = head.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected) - set(ignore))
    if missing or unexpected:
        raise CheckpointError(f"{name} keys do not match {layout}: missing {missing}, unexpected {unexpected}")
    for k, v in expected.items():
        if tuple(state[k].shape) != tuple(v.shape):
            raise CheckpointError(f"{name}: {k} has shape {tuple(state[k].shape)}, config implies {tuple(v.shape)}")
        if v.is_floating_point() != state[k].is_floating_point() or state[k].is_complex():
            raise CheckpointError(f"{name}: {k} is {str(state[k].dtype).removeprefix('torch.')}, the layout holds "
                                  f"{'floating-point' if v.is_floating_point() else 'integer'} values there")
        w = state[k]
        if w.is_floating_point() and not torch.isfinite(w.float() if w.element_size() == 1 else w).all():   # fp8
            raise CheckpointError(f"{name}: {k} holds NaN or infinite values (a diverged or damaged checkpoint)")
    head.load_state_dict({k: state[k] for k in expected}, strict=True)
