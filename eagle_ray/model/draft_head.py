"""The EAGLE-1/2 draft head, in the SafeAILab checkpoint layout.

``fc(concat(embed(token), feature))`` (embedding first) feeds one Llama decoder layer whose input_layernorm is
absent; its output is a predicted target feature, scored by the *target's* lm_head. Keys on disk:
``embed_tokens.weight, fc.weight[, fc.bias], layers.0.self_attn.{q,k,v,o}_proj.weight[, q/k/v bias],
layers.0.mlp.{gate,up,down}_proj.weight, layers.0.post_attention_layernorm.weight``; config.json is a Llama
config with ``num_hidden_layers: 1`` plus ``bias`` (fc bias, default true) and ``qkv_bias``.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from eagle_ray.errors import CheckpointError, first_line
from eagle_ray.model.attention import decoder_layer, make_block_meta
from eagle_ray.model.kv_cache import KVCache
from eagle_ray.model.linears import Scorer, scorer
from eagle_ray.spec.context_vocab import context_topk
from eagle_ray.spec.tree import draft_log_probs

CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
               "pad_token_id", "bos_token_id", "eos_token_id", "head_dim")


class DraftHead(nn.Module):
    kind = "eagle2"
    feature_layers = None  # reads the target's final (post-norm) hidden state

    def __init__(self, config: LlamaConfig, bias: bool = True, qkv_bias: bool = False):
        super().__init__()
        config.num_hidden_layers = 1
        self.config, self.bias, self.qkv_bias = config, bias, qkv_bias
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d, padding_idx=config.pad_token_id)
        self.fc = nn.Linear(2 * d, d, bias=bias)
        layer = LlamaDecoderLayer(config, layer_idx=0)
        layer.input_layernorm = nn.Identity()  # EAGLE layer 0 attends to the fused input directly
        if qkv_bias:  # Qwen2 heads: bias on q/k/v only
            for name in ("q_proj", "k_proj", "v_proj"):
                old = getattr(layer.self_attn, name)
                setattr(layer.self_attn, name, nn.Linear(old.in_features, old.out_features, bias=True))
        self.layers = nn.ModuleList([layer])
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.cache: KVCache | None = None
        # Optional draft vocabulary: target token ids the draft may propose, most frequent first (vLLM's
        # token_map / EAGLE-3's d2t idea). Scoring 8k instead of 49k rows makes each draft level several times
        # cheaper on CPU; the target still verifies over its full vocabulary, so output is unchanged.
        self.token_map: torch.Tensor | None = None
        self.lm_score = None   # hidden -> logits over the scored vocabulary (bind_lm_head)
        self.lm_weight = None  # the target's lm_head rows, where a sequence's context tokens are scored
        self.outside_map = None   # host bool [vocab]: tokens the bound map lacks (spec/context_vocab.py)

    @classmethod
    def for_target(cls, target_config, bias: bool = True, intermediate_size: int | None = None) -> "DraftHead":
        """A fresh (random) head shaped for ``target_config``."""
        kw = {k: getattr(target_config, k) for k in CONFIG_KEYS if getattr(target_config, k, None) is not None}
        if intermediate_size:
            kw["intermediate_size"] = intermediate_size
        rope = getattr(target_config, "rope_parameters", None)
        if rope:
            kw["rope_parameters"] = dict(rope)
        cfg = LlamaConfig(**kw, num_hidden_layers=1, architectures=["LlamaForCausalLM"])
        return cls(cfg, bias=bias, qkv_bias=getattr(target_config, "model_type", "") == "qwen2")

    # ---- checkpoint I/O -------------------------------------------------------------------------------------
    def save(self, out_dir: str | Path, dtype: torch.dtype | None = None, include_embedding: bool = True) -> None:
        """Write config.json + model.safetensors in the reference layout. ``include_embedding=False`` drops the
        (frozen) copy of the target's embedding, as published heads for large vocabularies do; loading then takes
        it from the target."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        cfg = self.config.to_dict()
        cfg.update(num_hidden_layers=1, architectures=["LlamaForCausalLM"], bias=self.bias, qkv_bias=self.qkv_bias)
        add_legacy_rope_keys(cfg)
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        sd = {k: (v.to(dtype) if dtype else v).contiguous() for k, v in self.state_dict().items()
              if include_embedding or k != "embed_tokens.weight"}
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
        if self.token_map is not None:
            save_file({"token_map": self.token_map.cpu().contiguous()}, str(out / "token_map.safetensors"))

    @classmethod
    def load(cls, path: str | Path, target_config=None, target_embed: torch.Tensor | None = None,
             dtype: torch.dtype = torch.float32, device="cpu") -> "DraftHead":
        """Load a head; with ``target_config`` check it fits (hidden size, vocabulary) and name any mismatch."""
        path = Path(path)
        raw = cls.check_config(path, target_config)
        bias, qkv_bias = head_biases(raw)
        raw = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "transformers_version")}
        raw["num_hidden_layers"] = 1
        head = cls(LlamaConfig(**raw), bias=bias, qkv_bias=qkv_bias)
        state = read_state_dict(path)
        if "embed_tokens.weight" not in state:  # some published heads share the target's embedding
            if target_embed is None:
                raise CheckpointError(f"draft head {path} has no embed_tokens.weight and no target to take it from")
            state["embed_tokens.weight"] = target_embed.detach().to(torch.float32).cpu()
        load_checked(head, state, f"draft head {path}", "the EAGLE layout",
                     ignore={"layers.0.input_layernorm.weight"})
        tm = read_token_map(path, head.config.vocab_size)
        if tm is not None:
            head.token_map = tm
        return head.to(device=device, dtype=dtype).eval()

    @staticmethod
    def check_config(path: str | Path, target_config=None, raw: dict | None = None) -> dict:
        """The head's config.json (``raw``, if already read); with ``target_config``, fail unless hidden size and
        vocabulary match."""
        raw = read_config(path) if raw is None else raw
        if target_config is not None:
            for key in ("hidden_size", "vocab_size"):
                if raw.get(key) != getattr(target_config, key):
                    raise CheckpointError(
                        f"draft head {path} does not match the target: head {key}={raw.get(key)}, "
                        f"target {key}={getattr(target_config, key)}")
        return raw

    # ---- runtime ---------------------------------------------------------------------------------------------
    @property
    def feature_size(self) -> int:
        """Width of the target features the head consumes (the target's final hidden state)."""
        return self.config.hidden_size

    @property
    def draft_vocab_size(self) -> int:
        """How many tokens the head drafts from: its token map's (once bound), else the whole vocabulary."""
        return self.token_map.numel() if self.token_map is not None else self.config.vocab_size

    def allocate_cache(self, max_slots: int, max_len: int) -> None:
        p = self.fc.weight
        attn = self.layers[0].self_attn
        self.cache = KVCache(1, max_slots, self.config.num_key_value_heads, max_len, attn.head_dim, p.dtype, p.device)

    def bind_lm_head(self, lm_head, draft_vocab_size: int | None, layout: str = "native") -> None:
        """Score drafts with the target's lm_head, restricted to the first ``draft_vocab_size`` ids of the token
        map (None: the whole map if the head has one; 0: the full vocabulary).

        The full vocabulary is scored by the target's ``lm_head`` module itself (no copy: it is GBs at a 128k
        vocabulary); a draft vocabulary's rows are gathered once, in the CPU ``layout`` the target's linears use
        (``model/linears.py``). Neither is registered as (or saved with) the head's parameters."""
        full = draft_vocab_size == 0 or (self.token_map is None and not draft_vocab_size)
        if not full and self.token_map is None:
            raise CheckpointError("draft_vocab_size is set but this draft head has no token_map.safetensors")
        if full:
            self.token_map, self.lm_score = None, Scorer(lm_head)
            self.lm_weight = self.outside_map = None
        else:
            tm = self.token_map[:draft_vocab_size] if draft_vocab_size else self.token_map
            self.token_map = tm.to(lm_head.weight.device)
            self.lm_weight = lm_head.weight.detach()
            self.lm_score = scorer(self.lm_weight[self.token_map], layout)
            self.outside_map = np.ones(self.lm_weight.shape[0], dtype=bool)
            self.outside_map[self.token_map.cpu().numpy()] = False

    @torch.inference_mode()
    def topk(self, hidden: torch.Tensor, k: int, context: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k draft log-probs and target token ids of the draft's next-token distribution; with ``context``
        (``[B, E]`` target ids outside the map, ``-1`` padding) each sequence's context tokens compete too."""
        logits = self.lm_score(hidden)
        if context is not None:
            return context_topk(logits, hidden, self.lm_weight, self.token_map, context, k)
        logp, idx = draft_log_probs(logits).topk(k, dim=-1)
        return logp, (self.token_map[idx] if self.token_map is not None else idx)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, features: torch.Tensor, slots: list[int], depth: torch.Tensor,
                block_mask: torch.Tensor, offset: int = 0, n_valid: list[int] | None = None) -> torch.Tensor:
        """Predicted next features for pairs ``(features[b, t], tokens[b, t])``; see ``make_block_meta``."""
        assert self.cache is not None, "call allocate_cache() first"
        meta = make_block_meta(self.cache, slots, block_mask, offset, n_valid=n_valid)
        return self.run_block(tokens.contiguous(), features.contiguous(), depth.to(self.fc.weight.device).contiguous(),
                              meta)

    def run_block(self, tokens: torch.Tensor, features: torch.Tensor, depth: torch.Tensor, meta) -> torch.Tensor:
        """The device part of :meth:`forward`: graph-ready like ``TargetModel.run_block``."""
        x = self.fc(torch.cat([self.embed_tokens(tokens), features.to(self.fc.weight.dtype)], dim=-1))
        positions = meta.lengths.view(-1, 1) + depth
        cos, sin = self.rotary_emb(x, positions)
        return decoder_layer(self.layers[0], x, cos, sin, self.cache, 0, meta)


def add_legacy_rope_keys(cfg: dict) -> None:
    """Readers on transformers 4.x (the reference among them) take RoPE from top-level keys; without them they
    silently fall back to rope_theta 10,000. Written beside ``rope_parameters``."""
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope:
        cfg.setdefault("rope_theta", rope["rope_theta"])
        cfg.setdefault("rope_scaling", None if rope.get("rope_type", "default") == "default" else rope)


def head_biases(raw: dict) -> tuple[bool, bool]:
    """(fc bias, q/k/v bias) of an EAGLE-1/2 config, popped from ``raw``: absent or null means the reference's
    defaults (a biased fc, bias-free projections)."""
    bias, qkv_bias = raw.pop("bias", None), raw.pop("qkv_bias", None)
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


def head_kind(path: str | Path) -> str:
    """``eagle3`` or ``eagle2``, read from the checkpoint's config.json."""
    from eagle_ray.model.eagle3_head import is_eagle3_config
    return "eagle3" if is_eagle3_config(read_config(path)) else "eagle2"


def check_head(path: str | Path, target_config) -> str:
    """Fail, naming the mismatch, unless the head at ``path`` fits ``target_config`` and its config builds a
    head; returns its kind. Read before the target's weights, so a bad head fails in a second."""
    from eagle_ray.model import eagle3_head
    raw = read_config(path)
    kind = "eagle3" if eagle3_head.is_eagle3_config(raw) else "eagle2"
    if kind == "eagle3":
        eagle3_head.check_config(path, raw, target_config)
    else:
        DraftHead.check_config(path, target_config, raw)
    check_buildable(path, kind, raw, target_config)
    return kind


# the config fields a head's shapes come from: each must be a positive integer where given
SIZE_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "vocab_size", "draft_vocab_size", "target_hidden_size")


def check_buildable(path, kind: str, raw: dict, target_config) -> None:
    """The head's config.json holds sizes a head can have (positive integers, key heads dividing query heads,
    boolean switches) and builds one: checked on the meta device, so a bad value fails here naming the file
    instead of as a torch or transformers error deep in loading."""
    from eagle_ray.model.memory import head_on_meta
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
        head_on_meta(kind, target_config, raw)
    except Exception as e:  # noqa: BLE001 - transformers' config classes and torch's modules raise many types
        raise CheckpointError(f"draft head {path}/config.json does not describe a head this engine can build: "
                              f"{type(e).__name__}: {first_line(e)}") from None


def load_head(path: str | Path, target_config, target_embed: torch.Tensor | None = None,
              dtype: torch.dtype = torch.float32, device="cpu"):
    """An EAGLE-1/2 or EAGLE-3 head, whichever the checkpoint holds."""
    from eagle_ray.model.eagle3_head import Eagle3Head
    if check_head(path, target_config) == "eagle3":
        return Eagle3Head.load(path, target_config, target_embed, dtype, device)
    return DraftHead.load(path, target_config, target_embed, dtype, device)
