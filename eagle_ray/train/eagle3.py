"""EAGLE-3 head training: the training-time test, a cross-entropy against the target over the draft vocabulary,
no feature loss.

Each conversation gives, per position i, the fused target states at i (three layer inputs), the next token x_{i+1}
and the target's distribution at i+1 (its lm_head on its final state, over the draft vocabulary, renormalised
there; a position whose target argmax lies outside the draft vocabulary is left out of training, as the reference
does, and counts as a miss in evaluation). Step 0 runs the head on the target's states; step s feeds it, at position i, its own output of step s-1
at i-1 (as tree level s does at inference, where that output is the feature of the drafted parent), attending to
the target-state keys up to i-s and to its own chain's keys at i-s+1 .. i. Step s's loss is weighted
``unroll_weight ** s`` (the reference trains 7 steps at 0.8). The loop, batching, checkpoints and resume are the
trainer's (``eagle_ray.train.trainer``); this module supplies the batch and the losses.
"""
from __future__ import annotations

import torch

from eagle_ray.train.unrolled import unrolled_attention


def collate(convs: list[dict], idx: list[int], max_len: int):
    """Pad a batch: tokens x[1..n), fused states aux[0..n-1), the target at each position, and the mask of assistant
    positions. The target is the target's final states h[1..n) (its distribution of the token after the next), or,
    for conversations that carry ``labels`` instead (online adaptation), the emitted token after x_{i+1}: a sample of
    that distribution (its argmax in greedy decoding), so the cross-entropy against it estimates the one against
    the distribution."""
    n = min(max(len(convs[i]["input_ids"]) for i in idx), max_len)
    first = convs[idx[0]]
    B, dev, labelled = len(idx), first["aux"].device, "labels" in first
    tokens = torch.zeros(B, n - 1, dtype=torch.long, device=dev)
    feats = torch.zeros(B, n - 1, first["aux"].shape[-1], device=dev)
    target = torch.zeros(B, n - 1, dtype=torch.long, device=dev) if labelled else \
        torch.zeros(B, n - 1, first["hidden"].shape[-1], device=dev)
    mask = torch.zeros(B, n - 1, device=dev)
    for b, i in enumerate(idx):
        c = convs[i]
        m = min(len(c["input_ids"]), n)
        tokens[b, : m - 1] = c["input_ids"][1:m]
        feats[b, : m - 1] = c["aux"][: m - 1].float()
        target[b, : m - 1] = c["labels"][: m - 1] if labelled else c["hidden"][1:m].float()
        mask[b, : m - 1] = c["loss_mask"][1:m].float()
    return tokens, feats, target, mask


def unrolled(head, tokens: torch.Tensor, feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The head's outputs (before its norm) for ``steps`` unrolled steps at every position (see the module doc)."""
    B, T = tokens.shape
    emb = head.embed_tokens(tokens)
    layer = head.midlayer
    attn = layer.self_attn
    first = head.fc(feats.to(head.fc.weight.dtype))
    cos, sin = head.rotary_emb(first, torch.arange(T, device=tokens.device).unsqueeze(0).expand(B, T))
    emb_normed = layer.input_layernorm(emb)
    keys, values, outs, inp = [], [], [], first
    for s in range(steps):
        x = torch.cat([emb_normed, layer.hidden_norm(inp)], dim=-1)
        h = inp + unrolled_attention(attn, x, s, keys, values, cos, sin)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        outs.append(h)
        inp = torch.cat([first[:, :1], h[:, :-1]], dim=1)
    return outs


def losses(head, lm_weight: torch.Tensor, batch, cfg, gen: torch.Generator | None, train: bool,
           steps: int | None = None):
    """Weighted cross-entropy of the unrolled steps against the target over the draft vocabulary; returns the same
    shape as the EAGLE-2 losses (feature loss 0) so the trainer's loop serves both heads. The batch's third part is
    the target's final states, or token labels (:func:`collate`): then the target is that token alone."""
    tokens, feats, target, mask = batch
    steps = steps or cfg.unroll_steps
    with torch.autocast(feats.device.type, dtype=torch.bfloat16, enabled=cfg.autocast_bf16):
        preds = unrolled(head, tokens, feats, steps)
    sel = mask.bool()
    if train and cfg.ce_fraction < 1.0:
        sel = sel & (torch.rand(mask.shape, generator=gen, device=mask.device) < cfg.ce_fraction)
    vocab = head.draft_to_target
    with torch.no_grad():
        if target.dtype == torch.long:           # labels: one-hot at the token's draft id (0 where it has none)
            t_top = target[sel]
            to_draft = torch.zeros(head.t2d.shape[0], dtype=torch.long, device=vocab.device)
            to_draft[vocab] = torch.arange(len(vocab), device=vocab.device)
            t_prob = torch.nn.functional.one_hot(to_draft[t_top], len(vocab)).float()
        else:
            full = target[sel] @ lm_weight.T
            t_logits, t_top = full[:, vocab], full.argmax(-1)
            t_prob = t_logits.softmax(-1)        # the target's distribution renormalised over the draft vocabulary
        if train:  # as the reference: positions whose target choice the draft cannot propose teach nothing
            in_vocab = head.t2d[t_top]
            sel_idx = sel.nonzero(as_tuple=True)
            sel = torch.zeros_like(sel)
            sel[sel_idx[0][in_vocab], sel_idx[1][in_vocab]] = True
            t_prob, t_top = t_prob[in_vocab], t_top[in_vocab]
    loss, steps_out = 0.0, []
    for s, pred in enumerate(preds):
        m = mask.clone()
        m[:, :s] = 0  # step s needs s predicted inputs before it
        keep = m[sel].bool()
        if not keep.any():
            steps_out.append({"top1": 0.0, "vloss": 0.0, "scored": 0})
            continue
        p_logits = head.lm_head(head.norm(pred[sel][keep])).float()
        loss = loss - cfg.unroll_weight ** s * (t_prob[keep] * p_logits.log_softmax(-1)).sum(-1).mean()
        top1 = (vocab[p_logits.argmax(-1)] == t_top[keep]).float().mean().item()
        steps_out.append({"top1": top1, "vloss": 0.0, "scored": int(keep.sum())})
    if not torch.is_tensor(loss):
        loss = preds[0].sum() * 0
    zero = loss.detach() * 0
    return zero, loss, steps_out[0]["top1"], steps_out[0]["scored"], steps_out
