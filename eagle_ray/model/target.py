"""The target model runtime: the decoder's modules, our KV cache, block/tree forwards.

``decoder_config`` reads the config; transformers gives tokenizer, chat template and scaled RoPE's tables. The modules
are ``decoder.py``'s (or a transformers model's, which hold the same names), run with :func:`decoder_layer`, so a
tree of candidate tokens is verified in one pass. ``forward`` returns the final
post-norm hidden states: the draft head's input features, and the lm_head's input.
"""
from __future__ import annotations

from pathlib import Path

import torch

from eagle_ray.errors import CheckpointError
from eagle_ray.model import decoder
from eagle_ray.model.attention import Part, decoder_layer, make_block_meta, masked_sdpa, pad_rows, with_attention_mask
from eagle_ray.model.decoder_config import DEFAULTS, read_decoder_config
from eagle_ray.model.fused import RopeTables, fuse_layer, fused_decoder_layer
from eagle_ray.model.kv_cache import KVCache
from eagle_ray.model.linears import lay_out_linears
from eagle_ray.model.tree_attention import FLEX_MAX_BLOCK, flex_tree_attention, tree_block_mask
from eagle_ray.model.logits import RefinedLogits
from eagle_ray.model.numerics import attention_kernels, defaults_for, numerics_for

SUPPORTED_MODEL_TYPES = set(DEFAULTS)


def check_model_type(config) -> None:
    """The target must be a decoder this runtime runs (its layers are driven by ``decoder_layer``)."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"target model_type '{config.model_type}' is not supported; eagle-ray runs "
                              f"Llama-family decoders: {sorted(SUPPORTED_MODEL_TYPES)}")


class TargetModel:
    # a decoder layer on its own LayerCache (no layer index): compiled once for every layer (model/compiled.py)
    run_layer = staticmethod(decoder_layer)

    def __init__(self, hf_model, max_slots: int, max_len: int, fp32_logits="auto", fp32_activations="auto",
                 batch_invariant="auto", cpu_linears="auto", fused_layers="auto", tree_attention="auto", row_sum=None):
        """The precision switches are True, False or "auto" (resolved for the device by ``numerics_for``). ``row_sum``:
        where ``hf_model`` is one shard of a target split over ranks, the hook that sums its row-split products
        (``tensor_parallel.RowSum``); the engine then holds it through ``tensor_parallel.ShardedTarget``."""
        cfg = hf_model.config
        check_model_type(cfg)
        self.hf = hf_model.eval()
        self.config = cfg
        param = next(hf_model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.numerics = numerics_for(self.device, self.dtype, fp32_logits, fp32_activations, batch_invariant,
                                     cpu_linears, fused_layers, tree_attention)
        lay_out_linears(hf_model, self.numerics.cpu_linears, keep_dense=("lm_head",))  # see model/linears.py
        self.model = hf_model.model
        self.layers = list(self.model.layers)
        self.lm_head = hf_model.lm_head
        self.max_len = min(max_len, cfg.max_position_embeddings)
        self.capture_layers: tuple[int, ...] = ()   # layers whose inputs forward(capture=...) returns
        # bf16 logits tie often (8 significant bits): a last-bit difference in a hidden state then flips a
        # greedy choice between verify and plain decoding. ``fp32_logits`` makes every logit that can decide the
        # choice exact fp32 (see logits.RefinedLogits); ``False`` keeps the model dtype's logits.
        self._refined = None
        if self.numerics.fp32_logits:
            self._refined = RefinedLogits(self.lm_head_weight, pad=self.device.type == "cpu")
        # bf16 SDPA rounds a 1-row decode and an 8-row tree block differently (a few of 576 outputs per layer
        # differ in the last bit), and a bf16 residual stream carries every such flip on; over 30 layers greedy
        # choices with logit gaps up to ~0.15 flip. fp32 activations (residual, norms, attention; the projections
        # stay bf16) make verify and plain decoding agree. See decoder_layer.
        self.fp32_activations = self.numerics.fp32_activations
        # Tokens computed the same whatever shares the pass (CPU kernels; see attention.pad_rows and
        # invariant_attention): bf16 verify and plain decoding then differ only on last-bit near-ties.
        self.batch_invariant = self.numerics.batch_invariant
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        world = 1 if row_sum is None else row_sum.world   # a shard holds its share of the KV heads
        self.cache = KVCache(len(self.layers), max_slots, cfg.num_key_value_heads // world, self.max_len, head_dim,
                             self.dtype, self.device)
        self.cache.kv_bucket = defaults_for(self.device).kv_bucket
        self.fused = [fuse_layer(layer, row_sum) for layer in self.layers] if self.numerics.fused_layers else None
        self.graphs = None   # DecodeGraphs (model/graphs.py) where compile is cuda-graphs
        self.flex_attend = None   # flex tree attention's kernel (tree_attention.py's default: compiled on CUDA)

    def restart(self) -> None:
        """Empty every slot (the engine's restart)."""
        self.cache.lengths[:] = 0

    def close(self) -> None:
        """Nothing to stop: a target in one process holds nothing outside it (see ``ShardedTarget.close``)."""

    @classmethod
    def load(cls, path: str | Path, dtype: torch.dtype, device, max_slots: int, max_len: int, config=None,
             **precision) -> "TargetModel":
        """The target's weights (safetensors only, never a pickle; see ``decoder.load``); ``config``: its
        ``DecoderConfig`` (or transformers config), if already read (it is not read again)."""
        if config is None:
            config = read_decoder_config(path)
        check_model_type(config)
        return cls(decoder.load(path, config, dtype, device), max_slots, max_len, **precision)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.lm_head.out_features

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[vocab, hidden], whichever layout the lm_head module stores."""
        return self.lm_head.weight

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, slots: list[int], depth: torch.Tensor,
                block_mask: torch.Tensor, n_valid: list[int] | None = None,
                capture: tuple[int, ...] | None = None, graphed: bool = True):
        """Run ``tokens [B, T]`` on top of each slot's committed prefix; returns post-norm hidden ``[B, T, d]``.

        Row ``t`` of slot ``b`` sits at position ``lengths[b] + depth[b, t]`` and attends to the prefix plus the
        block columns where ``block_mask[b, t]`` is True. K/V land at ``[lengths, lengths + T)``; the caller
        commits them (prefill) or keeps the accepted ones (verify). ``n_valid``: see ``make_block_meta``.
        With ``capture`` (layer indices) it also returns the hidden states at the inputs of those layers,
        concatenated ``[B, T, len(capture) * d]`` (an EAGLE-3 head's features), from the same pass.
        ``graphed``: a decode block may replay a captured graph (``self.graphs``); prompt chunks pass False. The
        outputs are then views of the graph's memory: read them before the next forward.
        """
        if capture:
            self.capture_layers = tuple(capture)  # an attribute, not an argument: traced as a constant
        B, T = tokens.shape
        if graphed and self.graphs is not None:
            if self.graphs.fits(max(slots) + 1, T, block_mask.shape[-1], 0):
                return self.graphs.run(tokens.to(self.device), slots, depth.to(self.device), block_mask, n_valid,
                                       bool(capture))
            self.graphs.skipped += 1
        meta = make_block_meta(self.cache, slots, block_mask, invariant=self.batch_invariant, n_valid=n_valid)
        with attention_kernels(self.device):
            return self.run_block(tokens.to(self.device).contiguous(), depth.to(self.device).contiguous(), meta,
                                  bool(capture))

    @torch.inference_mode()
    def forward_parts(self, blocks, capture: tuple[int, ...] | None = None, graphed: bool = True) -> list:
        """Several blocks in one pass: ``blocks`` of ``(tokens, slots, depth, block_mask, n_valid)`` as
        :meth:`forward` takes them (no slot in two blocks); returns each block's output as :meth:`forward` does.
        Every weight is read once for all of them (a step's prompt chunks, drafted trees and plain roots); each
        block attends over its own rows' keys. A single block is :meth:`forward` (and may replay a graph)."""
        if len(blocks) == 1:
            tokens, slots, depth, block_mask, n_valid = blocks[0]
            return [self.forward(tokens, slots, depth, block_mask, n_valid, capture, graphed)]
        if capture:
            self.capture_layers = tuple(capture)
        inputs = [(tokens.to(self.device).contiguous(), depth.to(self.device).contiguous(),
                   make_block_meta(self.cache, slots, block_mask, invariant=self.batch_invariant, n_valid=n_valid))
                  for tokens, slots, depth, block_mask, n_valid in blocks]
        with attention_kernels(self.device):
            return self.run_parts(inputs, bool(capture))

    def run_block(self, tokens: torch.Tensor, depth: torch.Tensor, meta, capture: bool = False):
        """The device part of :meth:`forward`: tensors in, tensors out, no host reads and no Python state
        changes (the K/V writes are in-place tensor updates), so it traces into one graph."""
        return self.run_parts([(tokens, depth, meta)], capture)[0]

    def run_parts(self, blocks, capture: bool = False) -> list:
        """The device part of :meth:`forward_parts`: ``blocks`` of ``(tokens [B, T], depth [B, T], meta)`` run as
        one pass (``attention.Part``); returns each block's output as :meth:`forward` does."""
        layers = self.capture_layers if capture else ()
        flat = [tokens.reshape(-1) for tokens, _, _ in blocks]
        hidden = self.model.embed_tokens(flat[0] if len(flat) == 1 else torch.cat(flat))   # [M, d]
        heads, kv_heads = self.config.num_attention_heads, self.config.num_key_value_heads
        scaling = self.layers[0].self_attn.scaling
        parts = []
        for _, depth, meta in blocks:
            cos, sin = self.model.rotary_emb(hidden, meta.lengths.view(-1, 1) + depth)  # model dtype, like q and k
            meta = with_attention_mask(meta, heads, kv_heads)
            part = Part(meta, cos, sin)
            if self.fused is not None:
                part.rope, part.attend = RopeTables.of(cos, sin), self.attention_of(meta, scaling)
            parts.append(part)
        if self.fp32_activations:
            hidden = hidden.float()
        captured = [hidden] * len(layers)
        for i, layer in enumerate(self.layers):
            for j, wanted in enumerate(layers):
                if wanted == i:
                    captured[j] = hidden
            if self.fused is not None:
                hidden = fused_decoder_layer(self.fused[i], hidden, parts, self.cache, i)
            else:
                hidden = self.run_layer(layer, hidden, parts, self.cache.layers[i], 0)
        hidden = self.model.norm(hidden)
        features = torch.cat(captured, dim=-1) if capture else None
        outs, start = [], 0
        for part in parts:
            B, T = part.shape
            rows = slice(start, start + B * T)
            start += B * T
            out = hidden[rows].view(B, T, -1)
            outs.append((out, features[rows].view(B, T, -1)) if capture else out)
        return outs

    def attention_of(self, meta, scale: float):
        """The fused layers' ``attend(q, layer)`` for this forward: flex tree attention over the cache as it lies
        (its block mask built here, once), or SDPA over the rows' keys read with the forward's mask."""
        if self.numerics.tree_attention == "flex" and meta.key_mask.shape[2] <= FLEX_MAX_BLOCK:
            block_mask = tree_block_mask(meta, self.cache)
            attend = self.flex_attend
            return lambda q, i: flex_tree_attention(q, self.cache, i, meta, block_mask, scale, attend)
        return lambda q, i: masked_sdpa(q, *self.cache.read(i, meta.slots, meta.kv_len), meta, scale)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of post-norm ``hidden``."""
        if self._refined is not None:
            return self._refined(hidden)
        rows = hidden.shape[:-1]
        if self.batch_invariant:  # a token's logits must not depend on what else is in the pass (see pad_rows)
            return self.lm_head(pad_rows(hidden.to(self.dtype)))[: rows.numel()].float().view(*rows, -1)
        return self.lm_head(hidden.to(self.dtype)).float()

    @torch.inference_mode()
    def next_token_logits(self, ids: list[int], slot: int = 0) -> torch.Tensor:
        """fp32 logits after ``ids`` computed on this runtime (clobbers ``slot``'s cache; for diagnostics)."""
        self.cache.reset(slot)
        T = len(ids)
        idx = torch.arange(T, device=self.device)
        causal = (idx.view(-1, 1) >= idx.view(1, -1)).unsqueeze(0)
        hidden = self.forward(torch.tensor([ids], device=self.device), [slot], idx.view(1, -1), causal)
        return self.logits(hidden[0, -1])
