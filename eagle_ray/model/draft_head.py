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

from eagle_ray.errors import CheckpointError
from eagle_ray.model.attention import FP32Rope, Part, decoder_layer, make_block_meta, with_attention_mask
from eagle_ray.model.checkpoint import (CONFIG_KEYS, HeadCheckpoint, add_legacy_rope_keys, head_biases, head_config,
                                        load_checked, read_head, read_state_dict, read_token_map,
                                        saved_head_config)
from eagle_ray.model.decoder import DecoderLayer, RotaryEmbedding, embedding
from eagle_ray.model.kv_cache import KVCache
from eagle_ray.model.linears import Scorer, scorer
from eagle_ray.model.numerics import attention_kernels
from eagle_ray.speculative.context_vocab import context_topk
from eagle_ray.speculative.tree import draft_log_probs



class DraftHead(nn.Module):
    kind = "eagle2"
    feature_layers = None  # reads the target's final (post-norm) hidden state
    run_layer = staticmethod(decoder_layer)   # compiled alone, sharing the target's layer graphs (model/compiled.py)

    def __init__(self, config, bias: bool = True, qkv_bias: bool = False):
        super().__init__()
        config.num_hidden_layers = 1
        self.config, self.bias, self.qkv_bias = config, bias, qkv_bias
        d = config.hidden_size
        self.embed_tokens = embedding(config.vocab_size, d, config.pad_token_id)
        self.fc = nn.Linear(2 * d, d, bias=bias)
        layer = DecoderLayer(config)
        layer.input_layernorm = nn.Identity()  # EAGLE layer 0 attends to the fused input directly
        if qkv_bias:  # Qwen2 heads: bias on q/k/v only
            for name in ("q_proj", "k_proj", "v_proj"):
                old = getattr(layer.self_attn, name)
                setattr(layer.self_attn, name, nn.Linear(old.in_features, old.out_features, bias=True))
        self.layers = nn.ModuleList([layer])
        self.rotary_emb = RotaryEmbedding(config)
        self.rope_fp32 = FP32Rope(self.rotary_emb)
        self.cache: KVCache | None = None
        # Optional draft vocabulary: target token ids the draft may propose, most frequent first (vLLM's
        # token_map / EAGLE-3's d2t idea). Scoring 8k instead of 49k rows makes each draft level several times
        # cheaper on CPU; the target still verifies over its full vocabulary, so output is unchanged.
        self.token_map: torch.Tensor | None = None
        self.lm_score = None   # hidden -> logits over the scored vocabulary (bind_lm_head)
        self.lm_weight = None  # the target's lm_head rows, where a sequence's context tokens are scored
        self.outside_map = None   # host bool [vocab]: tokens the bound map lacks (speculative/context_vocab.py)

    def _apply(self, fn, recurse=True):
        """Any cast of the head keeps its RoPE frequencies in fp32 (see ``FP32Rope``)."""
        super()._apply(fn, recurse)
        self.rope_fp32.restore()
        return self

    @classmethod
    def for_target(cls, target_config, bias: bool = True, intermediate_size: int | None = None) -> "DraftHead":
        """A fresh (random) head shaped for ``target_config``."""
        kw = {k: getattr(target_config, k) for k in CONFIG_KEYS if getattr(target_config, k, None) is not None}
        if intermediate_size:
            kw["intermediate_size"] = intermediate_size
        rope = getattr(target_config, "rope_parameters", None)
        if rope:
            kw["rope_parameters"] = dict(rope)
        cfg = head_config({**kw, "architectures": ["LlamaForCausalLM"]})
        return cls(cfg, bias=bias, qkv_bias=getattr(target_config, "model_type", "") == "qwen2")

    # ---- checkpoint I/O -------------------------------------------------------------------------------------
    def save(self, out_dir: str | Path, dtype: torch.dtype | None = None, include_embedding: bool = True) -> None:
        """Write config.json + model.safetensors in the reference layout. ``include_embedding=False`` drops the
        (frozen) copy of the target's embedding, as published heads for large vocabularies do; loading then takes
        it from the target."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        cfg = saved_head_config(self.config)
        cfg.update(num_hidden_layers=1, architectures=["LlamaForCausalLM"], bias=self.bias, qkv_bias=self.qkv_bias)
        add_legacy_rope_keys(cfg)
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        sd = {k: (v.to(dtype) if dtype else v).contiguous() for k, v in self.state_dict().items()
              if include_embedding or k != "embed_tokens.weight"}
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
        if self.token_map is not None:
            save_file({"token_map": self.token_map.cpu().contiguous()}, str(out / "token_map.safetensors"))

    @classmethod
    def load(cls, head: str | Path | HeadCheckpoint, target_config=None, target_embed: torch.Tensor | None = None,
             dtype: torch.dtype = torch.float32, device="cpu") -> "DraftHead":
        """Load a head; with ``target_config`` check it fits (hidden size, vocabulary) and name any mismatch."""
        ckpt = read_head(head)
        path = ckpt.path
        cls.check_config(path, target_config, ckpt.config)
        bias, qkv_bias = head_biases(ckpt.config)
        head = cls(ckpt.layer_config(), bias=bias, qkv_bias=qkv_bias)
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
    def check_config(path: str | Path, target_config, raw: dict) -> None:
        """Fail unless the head's hidden size and vocabulary (``raw``: its config.json) match the target's."""
        if target_config is not None:
            for key in ("hidden_size", "vocab_size"):
                if raw.get(key) != getattr(target_config, key):
                    raise CheckpointError(
                        f"draft head {path} does not match the target: head {key}={raw.get(key)}, "
                        f"target {key}={getattr(target_config, key)}")

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
        with attention_kernels(self.fc.weight.device):
            return self.run_block(tokens.contiguous(), features.contiguous(),
                                  depth.to(self.fc.weight.device).contiguous(), meta)

    def run_block(self, tokens: torch.Tensor, features: torch.Tensor, depth: torch.Tensor, meta) -> torch.Tensor:
        """The device part of :meth:`forward`: graph-ready like ``TargetModel.run_block``."""
        x = self.fc(torch.cat([self.embed_tokens(tokens), features.to(self.fc.weight.dtype)], dim=-1))
        positions = meta.lengths.view(-1, 1) + depth
        cos, sin = self.rotary_emb(x, positions)
        meta = with_attention_mask(meta, self.config.num_attention_heads, self.config.num_key_value_heads)
        return self.run_layer(self.layers[0], x, [Part(meta, cos, sin)], self.cache, 0)


