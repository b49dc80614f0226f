"""What the reference did in one ``eagenerate`` call, recorded by wrapping from the outside the functions it calls
once per cycle (the reference's files are not edited): every verify step's accepted length and the first draft
tree with its scores."""
from __future__ import annotations

import torch


class Recorder:
    """Collects what the reference did for one ``eagenerate`` call."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.accept_lengths: list[int] = []
        self.best_candidates: list[int] = []
        self.capture_next_tree = True
        self.first_tree: dict | None = None


def install_wrappers(ea_model_mod, model, rec: Recorder, vocab_size: int):
    """Wrap ``evaluate_posterior`` (module global of ea_model, called once per verify step) and the head instance's
    ``topK_genrate`` (the first call after prefill is captured, with every ``torch.topk`` it makes)."""
    orig_evaluate = ea_model_mod.evaluate_posterior

    def evaluate_posterior(logits, candidates, logits_processor):
        best, accept, sample_p = orig_evaluate(logits, candidates, logits_processor)
        rec.accept_lengths.append(int(accept))
        rec.best_candidates.append(int(best))
        return best, accept, sample_p

    ea_model_mod.evaluate_posterior = evaluate_posterior

    layer = model.ea_layer
    orig_topk_genrate = layer.topK_genrate  # bound method of the reference's head

    def topK_genrate(hidden_states, input_ids, head, logits_processor):
        if not rec.capture_next_tree:
            return orig_topk_genrate(hidden_states, input_ids, head, logits_processor)
        rec.capture_next_tree = False
        calls = []
        real_topk = torch.topk

        def recording_topk(inp, k, *args, **kwargs):
            out = real_topk(inp, k, *args, **kwargs)
            calls.append(
                (
                    inp.detach().clone(),
                    out.indices.detach().clone(),
                    out.values.detach().clone(),
                )
            )
            return out

        torch.topk = recording_topk
        try:
            result = orig_topk_genrate(hidden_states, input_ids, head, logits_processor)
        finally:
            torch.topk = real_topk
        rec.first_tree = describe_tree(
            layer, result, calls, hidden_states, input_ids, vocab_size
        )
        return result

    layer.topK_genrate = topK_genrate


def tree_parents(mask: torch.Tensor) -> list[int]:
    """Each node's parent, read from the tree mask: its nearest ancestor (-1 for the root)."""
    parents = [-1]
    for i in range(1, mask.shape[0]):
        anc = [j for j in range(i) if bool(mask[i, j])]
        parents.append(max(anc))
    return parents


def draft_to_target(layer):
    """Whether the head maps draft ids with ``d2t``, and the mapping from draft ids to target ids.

    EAGLE-3 with draft_vocab_size < vocab_size maps draft ids with d2t; otherwise draft ids are target ids (the
    EAGLE-1/2 class, cnets1.Model, keeps no config and has no d2t)."""
    cfg = getattr(layer, "config", None)
    d2t = getattr(layer, "d2t", None)
    mapped = (
        cfg is not None
        and d2t is not None
        and getattr(cfg, "draft_vocab_size", cfg.vocab_size) != cfg.vocab_size
    )

    def to_target(ids: torch.Tensor) -> torch.Tensor:
        return ids + d2t[ids] if mapped else ids

    return mapped, to_target


def candidate_pool(calls, k: int, depth: int, to_target):
    """The candidate pool the reference ranked, in its flat order: level 1 (k), then k*k per depth step, as target
    tokens and the pool index of each candidate's parent."""
    pool_tokens = [to_target(calls[0][1].view(-1))]
    pool_parent = [torch.full((k,), -1, dtype=torch.long)]  # -1 = root
    frontier = torch.arange(k)  # pool indices of the frontier (level 1 at first)
    offset = k
    for i in range(depth):
        _, row_idx, _ = calls[1 + 2 * i]  # [k, k] draft ids per frontier row
        _, cs_idx, _ = calls[2 + 2 * i]  # chosen flat indices into the k*k block
        pool_tokens.append(to_target(row_idx.reshape(-1)))
        pool_parent.append(frontier.repeat_interleave(k))
        frontier = offset + cs_idx.view(-1)
        offset += k * k
    return torch.cat(pool_tokens), torch.cat(pool_parent)


def scored_nodes(calls, pool_tokens_t: torch.Tensor, pool_parent_t: torch.Tensor):
    """The drafted nodes' scores and pool indices (the final top-k over the pool), and the pool itself."""
    pool_scores, chosen, _ = calls[-1]
    pool_scores = pool_scores.view(-1)
    chosen_sorted = torch.sort(chosen.view(-1)).values
    fields = {
        "scores": [None] + [float(s) for s in pool_scores[chosen_sorted].tolist()],
        "pool_index": [None] + [int(i) for i in chosen_sorted.tolist()],
        "pool": {
            "tokens": [int(t) for t in pool_tokens_t.tolist()],
            "scores": [float(s) for s in pool_scores.tolist()],
            "parent_pool_index": [int(p) for p in pool_parent_t.tolist()],
        },
        "root_topk_logprobs": [float(v) for v in calls[0][2].view(-1).tolist()],
    }
    return fields, chosen_sorted


def describe_tree(layer, result, calls, hidden_states, input_ids, vocab_size) -> dict:
    """Turn one ``topK_genrate`` result (+ its recorded ``torch.topk`` calls) into plain lists.

    Call order inside topK_genrate: [root top-k over the draft vocabulary], then per depth step
    [top-k of each frontier row over the draft vocabulary, global top-k of the k*k cumulative scores], then the
    final top-(total_token-1) over the flat pool of k + depth*k^2 candidate scores.
    """
    draft_tokens, retrieve_indices, tree_mask, tree_position_ids = result
    k, depth = layer.top_k, layer.depth
    mask = tree_mask[0, 0].bool()
    mapped, to_target = draft_to_target(layer)
    expected_calls = 1 + 2 * depth + 1
    tree = {
        "tokens": [int(t) for t in draft_tokens[0].tolist()],
        "parents": tree_parents(mask),
        "depths": [int(d) for d in tree_position_ids.tolist()],
        "retrieve_indices": retrieve_indices.tolist(),
        "tree_mask": [[int(v) for v in row] for row in mask.int().tolist()],
        "num_nodes": mask.shape[0],
        "head_input": {
            "feature_shape": list(hidden_states.shape),
            "draft_input_len": int(input_ids.shape[1]) - 1,
        },
        "draft_vocab_mapped_with_d2t": bool(mapped),
        "topk_calls": len(calls),
    }
    if len(calls) != expected_calls:
        tree["warning"] = (
            f"expected {expected_calls} torch.topk calls, saw {len(calls)}; pool/scores not decoded"
        )
        return tree
    pool_tokens_t, pool_parent_t = candidate_pool(calls, k, depth, to_target)
    fields, chosen_sorted = scored_nodes(calls, pool_tokens_t, pool_parent_t)
    tree.update(fields)
    # self-check: the nodes' tokens are the pool tokens at the chosen indices
    tree["pool_consistent"] = bool(
        torch.equal(pool_tokens_t[chosen_sorted], draft_tokens[0, 1:].cpu())
    )
    return tree
