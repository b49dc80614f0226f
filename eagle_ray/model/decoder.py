"""The Llama-family decoder's modules (Llama, Mistral, Qwen2, Qwen3) and the reading of their safetensors.

The modules carry transformers' names and layout (``model.layers.N.self_attn.q_proj``, ...), so checkpoints, heads and
the layer functions (``attention.decoder_layer``, ``fused.fuse_layer``) read them as they read transformers' own,
and each computes what transformers' module computes, op for op. They exist so that an engine process does not
import transformers' modelling code and its compiler and distributed imports (about 2 s of every actor's and
replica's start); ``decoder_config`` reads their configs, and transformers reads the tokenizer and computes scaled
RoPE's frequency tables.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from eagle_ray.errors import CheckpointError, first_line
from eagle_ray.model.decoder_config import SILU_ACTIVATIONS

# RoPE kinds whose frequency table grows with the sequence (transformers recomputes it as positions pass its
# original length): keys cached under one table would meet queries rotated by another
SEQUENCE_DEPENDENT_ROPE = ("dynamic", "longrope")


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos and sin of each position's angles (fp32 table, outputs in the input's dtype)."""

    def __init__(self, config):
        super().__init__()
        params = getattr(config, "rope_parameters", None) or {}
        kind = params.get("rope_type", "default")
        if kind in SEQUENCE_DEPENDENT_ROPE:
            raise CheckpointError(f"RoPE type '{kind}' changes its frequencies with the sequence length, which a KV "
                                  "cache cannot follow; eagle-ray runs fixed tables (default, linear, llama3, yarn)")
        cpu = torch.device("cpu")   # also under the meta device, where torch.arange would import torch's compiler
        if kind == "default":
            dim = head_dim_of(config)
            base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            steps = torch.arange(0, dim, 2, dtype=torch.float, device=cpu)
            inv_freq, self.attention_scaling = 1.0 / (base ** (steps / dim)), 1.0
        else:
            from transformers import PreTrainedConfig   # transformers' base config: none of a model's imports
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
            try:
                if not isinstance(config, PreTrainedConfig):   # a DecoderConfig: RoPE's functions call its methods
                    config = PreTrainedConfig(**config.to_dict())
                inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[kind](config, cpu)
            except (KeyError, TypeError, ValueError) as e:
                raise CheckpointError(f"rope_parameters {params} do not describe a '{kind}' RoPE: {e}") from None
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """``q, k [B, H, T, D]`` rotated by ``cos, sin [B, T, D]``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def biases_of(config) -> tuple[bool, bool, bool]:
    """(q/k/v bias, o bias, MLP bias) as each model type's transformers module has them."""
    kind = getattr(config, "model_type", "llama")
    if kind == "qwen2":
        return True, False, False
    if kind == "mistral":
        return False, False, False
    attention = bool(getattr(config, "attention_bias", False))
    return attention, attention, bool(getattr(config, "mlp_bias", False)) if kind == "llama" else False


def embedding(vocab: int, width: int, padding_idx: int | None) -> nn.Embedding:
    """``nn.Embedding``, drawn at random except on the meta device: a random draw there imports torch's compiler
    (a second of an engine process's start, which builds its modules on meta before reading the weights)."""
    if torch.empty(0).device.type == "meta":
        return nn.Embedding(vocab, width, padding_idx=padding_idx, _weight=torch.empty(vocab, width))
    return nn.Embedding(vocab, width, padding_idx=padding_idx)


class Attention(nn.Module):
    """The projections (and Qwen3's per-head q/k norms); ``attention.attention`` runs them over our cache."""

    def __init__(self, config):
        super().__init__()
        self.head_dim = head_dim_of(config)
        self.scaling = self.head_dim ** -0.5
        d, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        qkv_bias, o_bias, _ = biases_of(config)
        self.q_proj = nn.Linear(d, heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(d, kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(d, kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * self.head_dim, d, bias=o_bias)
        if getattr(config, "model_type", "llama") == "qwen3":
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        bias = biases_of(config)[2]
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        if config.hidden_act not in SILU_ACTIVATIONS:   # a transformers config is not checked by decoder_config
            raise CheckpointError(f"hidden_act {config.hidden_act!r} is not supported: the Llama family's MLP is "
                                  "SwiGLU (silu), which the fused layers compute")
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Built in transformers' order (attention, MLP, norms), so a seeded random layer draws the same weights."""

    def __init__(self, config):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Decoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class CausalLM(nn.Module):
    """``model`` (the decoder) and ``lm_head``, tied to the embedding where the config says so."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.generation_config = SimpleNamespace(eos_token_id=config.eos_token_id)


def on_meta(config, dtype: torch.dtype) -> CausalLM:
    """The model of ``config`` without storage (shapes and byte counts), its rotary table fp32 as when loaded."""
    with torch.device("meta"):
        model = CausalLM(config)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those its index names where it has one (a folder may also hold a
    differently named consolidated copy), else every one."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        return sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    return sorted(path.glob("*.safetensors"))


def load(path: str | Path, config, dtype: torch.dtype, device, shard=None) -> CausalLM:
    """``config``'s model holding the checkpoint's tensors, read one at a time onto ``device``; a tensor the files
    lack or hold in another shape fails here, naming it. ``shard(name, piece)``: where the model is one rank's
    shard, the part of a tensor (a safetensors slice) this rank holds, else None for the whole tensor."""
    from safetensors import safe_open
    path = Path(path)
    model = on_meta(config, dtype)
    params = dict(model.named_parameters())   # a tied lm_head is not listed: it is the embedding
    loaded, reshaped = set(), []
    try:
        for file in weight_files(path):
            with safe_open(str(file), framework="pt", device="cpu") as st:
                for stored in st.keys():
                    name = stored if stored in params or f"model.{stored}" not in params else f"model.{stored}"
                    if name not in params or name in loaded:
                        continue
                    piece = st.get_slice(stored)
                    if tuple(piece.get_shape()) != tuple(params[name].shape):
                        reshaped.append(name)
                        continue
                    part = shard(name, piece) if shard is not None else None
                    tensor = piece[:] if part is None else part
                    owner, _, attr = name.rpartition(".")
                    setattr(model.get_submodule(owner), attr,
                            nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False))
                    loaded.add(name)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors raises its own errors, OSError, ValueError for a bad file
        raise CheckpointError(f"cannot load target from {path}: {type(e).__name__}: {first_line(e)}") from None
    refuse_incomplete(path, sorted(set(params) - loaded - set(reshaped)) + sorted(reshaped))
    if getattr(config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb.to(device)   # its table was computed on the CPU, also under the meta device
    generation = path / "generation_config.json"
    if generation.exists():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        if eos is not None:
            model.generation_config.eos_token_id = eos
    return model.eval()


def refuse_incomplete(path, names: list[str]) -> None:
    """A target whose files lack tensors of its config (or hold them in another shape) is refused, naming them:
    filled with random values (as transformers does, with a log line), it would load and generate garbage."""
    if names:
        raise CheckpointError(f"target {path} lacks {len(names)} of the model's tensors or holds them in another "
                              f"shape ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}): not a complete "
                              "checkpoint of this config")
