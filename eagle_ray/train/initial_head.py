"""The head a drafter run starts from: its draft vocabulary (chosen before training, since the cross-entropy runs
over it), a fresh EAGLE-2 or EAGLE-3 head for the target, and, with ``--init``, an existing head's weights (its MLP
widened where asked)."""
from __future__ import annotations

import torch

from eagle_ray.model.draft_head import DraftHead
from eagle_ray.model.eagle3_head import Eagle3Head
from eagle_ray.model.heads import load_head
from eagle_ray.train.token_map import frequent_tokens
from eagle_ray.train.trainer import widen_mlp


def draft_vocabulary(job, init, convs: list[dict], vocab_size: int, eos_id):
    """The ``--init`` head's token map with ``--keep-token-map``; otherwise the most frequent assistant tokens
    (EOS always in), or None for the full vocabulary."""
    if job.keep_token_map:
        if init is None or init.kind != "eagle2" or job.head_type != "eagle2":
            raise SystemExit("--keep-token-map needs --init with an EAGLE-2 head and --head-type eagle2")
        return init.token_map
    return frequent_tokens(convs, vocab_size, job.token_map_size,
                           always=[t for t in (eos_id,) if t is not None]) if job.token_map_size else None


def fresh_head(job, target, convs: list[dict], lm_weight: torch.Tensor, draft_vocab, widen_later: bool):
    """A new head for the target with its embedding; an EAGLE-3 head's scorer from the target's with
    ``--lm-head-init target``."""
    if job.head_type == "eagle3":
        if any("aux" not in c for c in convs):
            raise SystemExit("EAGLE-3 training needs features extracted with `eagle-ray extract --eagle3`")
        head = Eagle3Head.for_target(target.config, draft_vocab=draft_vocab)
        if job.lm_head_init == "target":
            head.init_scorer_from_target(lm_weight, target.model.norm.weight.detach())
    else:
        head = DraftHead.for_target(target.config, intermediate_size=None if widen_later else job.intermediate_size)
        head.token_map = draft_vocab
    head.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight)
    return head


def start_from_init(job, head, init, draft_vocab, seed: int):
    """``head`` with the ``--init`` head's weights, its MLP first widened to ``--intermediate-size`` where that
    differs (the same function at the start)."""
    if init.kind != head.kind:
        raise SystemExit(f"--init {job.init} is an {init.kind} head; this run trains an {head.kind} head")
    if job.intermediate_size and init.kind == "eagle2" and \
            job.intermediate_size != init.layers[0].mlp.gate_proj.out_features:
        init = widen_mlp(init, job.intermediate_size, seed)
        head = DraftHead(init.config, bias=init.bias, qkv_bias=init.qkv_bias)
        head.token_map = draft_vocab
    head.load_state_dict(init.state_dict())
    return head


def initial_head(job, target, convs: list[dict], lm_weight: torch.Tensor, seed: int):
    """(head to train, its draft vocabulary). The seed is set before the head is built, so a head trained from
    scratch starts from the same weights for the same seed."""
    init = load_head(job.init, target.config, target.model.embed_tokens.weight) if job.init else None
    draft_vocab = draft_vocabulary(job, init, convs, lm_weight.shape[0], target.config.eos_token_id)
    torch.manual_seed(seed)
    head = fresh_head(job, target, convs, lm_weight, draft_vocab, widen_later=init is not None)
    if init is not None:
        head = start_from_init(job, head, init, draft_vocab, seed)
    return head, draft_vocab
