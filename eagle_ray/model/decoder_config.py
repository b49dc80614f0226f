"""A decoder's config.json read as transformers' Llama, Mistral, Qwen2 and Qwen3 config classes read it: the same
fields with the same defaults, RoPE's settings gathered into ``rope_parameters``, a wrong type refused.

It exists because those classes validate through ``transformers.activations``, whose imports reach transformers'
weight conversion, accelerate and ``torch.distributed.tensor``: about 2 s of CPU at every engine process's start, for
a dozen numbers. ``tests/test_decoder_config.py`` holds it to transformers' classes field by field.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

_LLAMA = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
              num_attention_heads=32, num_key_value_heads=None, head_dim=None, hidden_act="silu",
              max_position_embeddings=2048, rms_norm_eps=1e-6, pad_token_id=None, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
_QWEN = dict(_LLAMA, vocab_size=151936, intermediate_size=22016, num_key_value_heads=32,
             max_position_embeddings=32768, bos_token_id=None, eos_token_id=None)
_NO_BIAS_KEYS = ("attention_bias", "mlp_bias")

# each model type's fields and defaults, as its transformers config class declares them (a field the class lacks is
# absent here too: Mistral and Qwen2 take their biases from the model type, Qwen2 its head width from the sizes)
DEFAULTS = {
    "llama": _LLAMA,
    "mistral": {k: v for k, v in dict(_LLAMA, intermediate_size=14336, num_key_value_heads=8,
                                      max_position_embeddings=131072).items() if k not in _NO_BIAS_KEYS},
    "qwen2": {k: v for k, v in _QWEN.items() if k not in _NO_BIAS_KEYS and k != "head_dim"},
    "qwen3": {k: v for k, v in dict(_QWEN, head_dim=128).items() if k != "mlp_bias"},
}
DEFAULT_ROPE_THETA = 10000.0
SCALED_ROPE = ("llama3", "yarn", "longrope")   # kinds that keep the pretraining length in their parameters
PER_LAYER_ROPE = ("full_attention", "sliding_attention")
SILU_ACTIVATIONS = ("silu", "swish")   # the Llama family's SwiGLU: what the MLP and the fused layers compute

_INT = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "max_position_embeddings")
_OPTIONAL_INT = ("num_key_value_heads", "head_dim", "pad_token_id", "bos_token_id")
_BOOL = ("tie_word_embeddings", "attention_bias", "mlp_bias")


class DecoderConfig(SimpleNamespace):
    """config.json's fields as attributes, defaults filled (transformers' config objects are read the same way)."""

    def to_dict(self) -> dict:
        return copy.deepcopy(vars(self))


def read_decoder_config(path: str | Path) -> DecoderConfig:
    """``path/config.json`` as a :class:`DecoderConfig`; ``ValueError`` naming the key where it is not one."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"must hold a JSON object, got {type(raw).__name__}")
    if "model_type" not in raw:
        raise ValueError("names no model_type")
    return decoder_config(raw, raw["model_type"])


def decoder_config(raw: dict, model_type: str) -> DecoderConfig:
    """``raw`` (config.json's object) with ``model_type``'s defaults; ``ValueError`` naming a wrong field."""
    if model_type not in DEFAULTS:
        raise ValueError(f"model_type {model_type!r} is not supported; eagle-ray runs Llama-family decoders: "
                         f"{sorted(DEFAULTS)}")
    fields = {**DEFAULTS[model_type], **copy.deepcopy(raw), "model_type": model_type}
    fields["rope_parameters"] = rope_parameters(fields)
    for key in ("rope_scaling", "rope_theta", "partial_rotary_factor"):
        fields.pop(key, None)   # gathered into rope_parameters, as transformers does
    check_types(fields)
    if fields.get("num_key_value_heads") is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    if "head_dim" in DEFAULTS[model_type] and fields.get("head_dim") is None:
        if fields["hidden_size"] % fields["num_attention_heads"]:
            raise ValueError(f"hidden_size {fields['hidden_size']} is not a multiple of num_attention_heads "
                             f"{fields['num_attention_heads']}")
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    return DecoderConfig(**fields)


def rope_parameters(fields: dict) -> dict:
    """RoPE's settings in one dict with ``rope_type`` and ``rope_theta``, from either spelling of a config
    (``rope_parameters``, or the older top-level ``rope_theta`` and ``rope_scaling``), as transformers gathers them."""
    params = fields.get("rope_scaling") or fields.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters must be an object, got {params!r}")
    if any(key in params for key in PER_LAYER_ROPE):
        raise ValueError("RoPE set per layer type (rope_parameters by attention kind) is not supported")
    params = dict(params)
    params.setdefault("rope_theta", fields.get("rope_theta", DEFAULT_ROPE_THETA))
    if fields.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", fields["partial_rotary_factor"])
    params.setdefault("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor {params['partial_rotary_factor']} is not supported: the Llama "
                         "family rotates whole heads")
    if params["rope_type"] in SCALED_ROPE:   # (a top-level original_max_position_embeddings is not read there)
        params.setdefault("original_max_position_embeddings", fields["max_position_embeddings"])
    return params


def check_types(fields: dict) -> None:
    def wrong(key, kind):
        raise ValueError(f"{key} must be {kind}, got {fields[key]!r}")

    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    for key in _INT:
        if not is_int(fields[key]) or fields[key] <= 0:
            wrong(key, "a positive integer")
    for key in _OPTIONAL_INT:
        if fields.get(key) is not None and not is_int(fields[key]):
            wrong(key, "an integer or null")
    for key in _BOOL:
        if key in fields and not isinstance(fields[key], bool):
            wrong(key, "true or false")
    eos = fields.get("eos_token_id")
    if eos is not None and not is_int(eos) and not (isinstance(eos, list) and all(map(is_int, eos))):
        wrong("eos_token_id", "an integer, a list of integers or null")
    if not isinstance(fields["rms_norm_eps"], (int, float)) or isinstance(fields["rms_norm_eps"], bool):
        wrong("rms_norm_eps", "a number")
    if fields["hidden_act"] not in SILU_ACTIVATIONS:
        wrong("hidden_act", "'silu' (the Llama family's SwiGLU; the fused layers compute silu)")
