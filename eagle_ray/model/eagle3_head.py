"""The EAGLE-3 draft head, in the SafeAILab checkpoint layout (SpecForge's ``LlamaForCausalLMEagle3`` too).

Where an EAGLE-1/2 head reads the target's last hidden state and scores with the target's lm_head, an EAGLE-3 head
reads the target's hidden states at the inputs of three layers (low, middle, high: ``2, L // 2, L - 3``), fuses
them with ``fc [d, 3 * d_target]`` (no bias), and runs one decoder layer ("midlayer") whose q/k/v read
``concat(input_layernorm(embedding), hidden_norm(hidden))`` (2d wide) while the residual stream carries the hidden
state alone. Its own ``norm`` and ``lm_head [draft_vocab, d]`` score a draft vocabulary; ``d2t`` maps a draft id to a
target id (``target = draft + d2t[draft]``) and ``t2d`` marks the target ids the draft can propose. Deeper tree levels
feed the head its own output (before the norm), which is already d wide and skips ``fc``.

Keys on disk: ``fc.weight``, ``midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight``,
``midlayer.self_attn.{q,k,v,o}_proj.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``,
``lm_head.weight``, ``d2t``, ``t2d`` and, optionally, ``embed_tokens.weight`` (else the target's is used). config.json
is a Llama config with ``num_hidden_layers: 1``, ``draft_vocab_size`` and ``target_hidden_size``.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from eagle_ray.errors import CheckpointError
from eagle_ray.model.attention import FP32Rope, Part, attention, make_block_meta, mlp, with_attention_mask
from eagle_ray.model.checkpoint import (ARCHITECTURES, CONFIG_KEYS, HeadCheckpoint, add_legacy_rope_keys,
                                        head_config, load_checked, read_head, read_state_dict, saved_head_config)
from eagle_ray.model.decoder import DecoderLayer, RMSNorm, RotaryEmbedding, embedding
from eagle_ray.model.kv_cache import KVCache
from eagle_ray.model.numerics import attention_kernels
from eagle_ray.speculative.tree import draft_log_probs



def capture_layers(num_target_layers: int) -> tuple[int, int, int]:
    """Target layers whose inputs an EAGLE-3 head reads: low, middle and high."""
    L = num_target_layers
    if L < 7:   # fewer layers: 2, L/2 and L-3 are not three distinct layers (check_config refuses such a head)
        raise CheckpointError(f"an EAGLE-3 head reads three distinct target layers 2, L/2 and L-3, which needs at "
                              f"least 7 layers; this target has {L}")
    return (2, L // 2, L - 3)


def midlayer(layer, emb: torch.Tensor, hidden: torch.Tensor, parts: list, cache: KVCache) -> torch.Tensor:
    """The head's decoder layer: attention over its normed token embeddings beside its normed input states."""
    x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(hidden)], dim=-1)
    hidden = hidden + attention(layer.self_attn, x, parts, cache, 0)
    return hidden + mlp(layer, hidden, parts[0].meta.invariant)


class Eagle3Head(nn.Module):
    kind = "eagle3"
    run_layer = staticmethod(midlayer)   # compiled alone (model/compiled.py)
    outside_map = None   # no context tokens in its draft vocabulary (see topk)

    def __init__(self, config, num_target_layers: int):
        super().__init__()
        config.num_hidden_layers = 1
        self.config = config
        d = config.hidden_size
        target_d = getattr(config, "target_hidden_size", None) or d
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.embed_tokens = embedding(config.vocab_size, d, config.pad_token_id)
        self.fc = nn.Linear(3 * target_d, d, bias=False)
        layer = DecoderLayer(config)
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):  # q/k/v read concat(normed embedding, normed hidden)
            old = getattr(attn, name)
            setattr(attn, name, nn.Linear(2 * d, old.out_features, bias=old.bias is not None))
        layer.hidden_norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.midlayer = layer
        self.norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(d, self.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool) if
                             self.draft_vocab_size == config.vocab_size else
                             torch.zeros(config.vocab_size, dtype=torch.bool))
        self.rotary_emb = RotaryEmbedding(config)
        self.rope_fp32 = FP32Rope(self.rotary_emb)
        self.feature_layers = capture_layers(num_target_layers)
        self.cache: KVCache | None = None

    # ---- checkpoint I/O -----------------------------------------------------------------------------------------
    def _apply(self, fn, recurse=True):
        """Any cast of the head keeps its RoPE frequencies in fp32 (see ``FP32Rope``)."""
        super()._apply(fn, recurse)
        self.rope_fp32.restore()
        return self

    @classmethod
    def for_target(cls, target_config, draft_vocab: torch.Tensor | None = None,
                   intermediate_size: int | None = None) -> "Eagle3Head":
        """A fresh (random) head for ``target_config``; ``draft_vocab`` lists the target ids the draft may propose
        (most frequent first; default: the whole vocabulary)."""
        kw = {k: getattr(target_config, k) for k in CONFIG_KEYS if getattr(target_config, k, None) is not None}
        if intermediate_size:
            kw["intermediate_size"] = intermediate_size
        rope = getattr(target_config, "rope_parameters", None)
        if rope:
            kw["rope_parameters"] = dict(rope)
        vocab = target_config.vocab_size
        draft_ids = torch.arange(vocab) if draft_vocab is None else draft_vocab.long()
        cfg = head_config({**kw, "architectures": [ARCHITECTURES[0]], "draft_vocab_size": len(draft_ids),
                           "target_hidden_size": target_config.hidden_size})
        head = cls(cfg, target_config.num_hidden_layers)
        head.set_draft_vocab(draft_ids)
        return head

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """The target ids the draft may propose. Draft id i is the i-th smallest of them (the reference's order, in
        which its training aligns the target's restricted distribution with the draft rows); ``d2t`` stores the
        offsets, ``t2d`` the membership."""
        ids = target_ids.long().unique().to(self.d2t.device)  # sorted ascending
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    @torch.no_grad()
    def init_scorer_from_target(self, target_lm_head: torch.Tensor, target_norm: torch.Tensor) -> None:
        """Start ``norm`` and ``lm_head`` as the target's own (its lm_head rows of the draft vocabulary), so that a
        head whose state matches the target's last hidden state scores the draft vocabulary exactly as the target
        does, and training starts by learning that state (the reference starts the scorer at random)."""
        self.lm_head.weight.copy_(target_lm_head[self.draft_to_target.to(target_lm_head.device)])
        self.norm.weight.copy_(target_norm)

    @property
    def draft_to_target(self) -> torch.Tensor:
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    def save(self, out_dir: str | Path, dtype: torch.dtype | None = None, include_embedding: bool | None = None) -> None:
        """config.json + model.safetensors. ``target_hidden_size`` is written only when it differs from the head's
        width: the reference takes the embedding from the target only when that key is absent, so a head that
        needs the key ships its embedding (``include_embedding`` defaults to that)."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        cfg = saved_head_config(self.config)
        cfg.update(num_hidden_layers=1, architectures=[ARCHITECTURES[0]], draft_vocab_size=self.draft_vocab_size)
        target_d = self.fc.in_features // 3
        cfg.pop("target_hidden_size", None)
        if target_d != self.config.hidden_size:
            cfg["target_hidden_size"] = target_d
        if include_embedding is None:
            include_embedding = "target_hidden_size" in cfg
        add_legacy_rope_keys(cfg)
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        sd = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous()
              for k, v in self.state_dict().items() if include_embedding or k != "embed_tokens.weight"}
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})

    @classmethod
    def load(cls, head: str | Path | HeadCheckpoint, target_config, target_embed: torch.Tensor | None = None,
             dtype: torch.dtype = torch.float32, device="cpu") -> "Eagle3Head":
        ckpt = read_head(head)
        path = ckpt.path
        check_config(path, ckpt.config, target_config)
        head = cls(ckpt.layer_config(), target_config.num_hidden_layers)
        state = read_state_dict(path)
        state = {k.removeprefix("model."): v for k, v in state.items()}  # some exporters nest the keys
        if "embed_tokens.weight" not in state:
            if target_embed is None:
                raise CheckpointError(f"EAGLE-3 head {path} has no embed_tokens.weight and no target to take it from")
            state["embed_tokens.weight"] = target_embed.detach().to(torch.float32).cpu()
        if head.draft_vocab_size == target_config.vocab_size:  # the whole vocabulary: the map may be left out
            state.setdefault("d2t", torch.zeros(head.draft_vocab_size, dtype=torch.long))
            state.setdefault("t2d", torch.ones(target_config.vocab_size, dtype=torch.bool))
        load_checked(head, state, f"EAGLE-3 head {path}", "the layout")
        to_target = head.draft_to_target
        if to_target.min() < 0 or to_target.max() >= target_config.vocab_size:
            raise CheckpointError(f"EAGLE-3 head {path}: d2t maps draft ids outside the target vocabulary "
                                  f"[0, {target_config.vocab_size})")
        return head.to(device=device, dtype=dtype).eval()

    # ---- runtime -----------------------------------------------------------------------------------------------
    @property
    def feature_size(self) -> int:
        """Width of the target features the head consumes: three of the target's hidden states."""
        return self.fc.in_features

    def allocate_cache(self, max_slots: int, max_len: int) -> None:
        p = self.fc.weight
        attn = self.midlayer.self_attn
        self.cache = KVCache(1, max_slots, self.config.num_key_value_heads, max_len, attn.head_dim, p.dtype, p.device)

    def bind_lm_head(self, lm_head, draft_vocab_size: int | None, layout: str = "native") -> None:
        """EAGLE-3 heads score with their own lm_head over their own draft vocabulary."""
        self.to_target = self.draft_to_target

    @torch.inference_mode()
    def topk(self, hidden: torch.Tensor, k: int, context: None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k draft log-probs over the draft vocabulary, as target token ids (its lm_head is its own, so a
        token outside its vocabulary has no row: no context tokens, ``outside_map`` is None)."""
        logits = self.lm_head(self.norm(hidden.to(self.lm_head.weight.dtype))).float()
        logp, idx = draft_log_probs(logits).topk(k, dim=-1)
        return logp, self.to_target[idx]

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, features: torch.Tensor, slots: list[int], depth: torch.Tensor,
                block_mask: torch.Tensor, offset: int = 0, n_valid: list[int] | None = None) -> torch.Tensor:
        """The head's output (before its norm) for pairs ``(features[b, t], tokens[b, t])``: ``features`` are the
        target's fused states (3 x d_target wide, through ``fc``) or the head's own outputs (d wide)."""
        assert self.cache is not None, "call allocate_cache() first"
        meta = make_block_meta(self.cache, slots, block_mask, offset, n_valid=n_valid)
        with attention_kernels(self.fc.weight.device):
            return self.run_block(tokens.contiguous(), features.contiguous(),
                                  depth.to(self.fc.weight.device).contiguous(), meta)

    def run_block(self, tokens: torch.Tensor, features: torch.Tensor, depth: torch.Tensor, meta) -> torch.Tensor:
        """The device part of :meth:`forward`: graph-ready like ``TargetModel.run_block``."""
        w = self.fc.weight.dtype
        emb = self.embed_tokens(tokens)
        hidden = features.to(w)
        if hidden.shape[-1] != emb.shape[-1]:
            hidden = self.fc(hidden)
        positions = meta.lengths.view(-1, 1) + depth
        cos, sin = self.rotary_emb(hidden, positions)
        meta = with_attention_mask(meta, self.config.num_attention_heads, self.config.num_key_value_heads)
        return self.run_layer(self.midlayer, emb, hidden, [Part(meta, cos, sin)], self.cache)


def check_config(path, raw: dict, target_config) -> None:
    """An EAGLE-3 head must fit its target: vocabulary, the width of the fused states, enough target layers."""
    target_d = raw.get("target_hidden_size") or raw.get("hidden_size")
    checks = [("vocab_size", raw.get("vocab_size"), target_config.vocab_size),
              ("target_hidden_size", target_d, target_config.hidden_size)]
    for key, head_v, target_v in checks:
        if head_v != target_v:
            raise CheckpointError(f"EAGLE-3 head {path} does not match the target: head {key}={head_v}, target "
                                  f"{'hidden_size' if key == 'target_hidden_size' else key}={target_v}")
    if raw.get("hidden_size") == 3 * target_d:   # the head tells the target's fused states from its own by width
        raise CheckpointError(f"EAGLE-3 head {path}: hidden_size={raw['hidden_size']} is three times the target's "
                              f"hidden_size={target_d}, so its own states and the target's fused ones have the same "
                              f"width; such heads are not supported")
    if target_config.num_hidden_layers < 7:   # fewer layers: 2, L/2 and L-3 are not three distinct layers
        raise CheckpointError(f"EAGLE-3 head {path} needs a target with at least 7 layers (it reads three distinct "
                              f"layers 2, L/2 and L-3); the target has {target_config.num_hidden_layers}")
