"""The draft vocabulary: target token ids ordered by how often the target writes them in the training data."""
from __future__ import annotations

import torch


def frequent_tokens(convs: list[dict], vocab_size: int, size: int, always: list[int] = ()) -> torch.Tensor:
    """The ``size`` most frequent assistant-written token ids (plus ``always``, e.g. EOS), most frequent first."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for c in convs:
        ids = c["input_ids"][c["loss_mask"].bool()].cpu()
        counts += torch.bincount(ids, minlength=vocab_size)
    for t in always:
        counts[t] = counts.max() + 1
    return counts.argsort(descending=True)[:size]


def coverage(convs: list[dict], token_map: torch.Tensor, vocab_size: int) -> float:
    """Fraction of assistant tokens that the map contains (an upper bound on what the draft can propose)."""
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[token_map] = True
    hit = tot = 0
    for c in convs:
        ids = c["input_ids"][c["loss_mask"].bool()].cpu()
        hit += int(inside[ids].sum())
        tot += len(ids)
    return hit / max(tot, 1)
