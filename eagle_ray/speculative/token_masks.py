"""Tokens a request may not choose: outside its ``allowed_token_ids``, or EOS and its stop tokens before
``min_tokens`` (EOS even where ``ignore_eos`` keeps it from stopping the output, as vLLM bars it).

Both are masks (-inf) on the target's logits at every node of a tree, as vLLM applies them in plain decoding. A node
at depth d chooses the sequence's output token number ``len(output) + d + 1``, so the stop tokens are barred at the
nodes where ``len(output) + d < min_tokens``: each node is masked as plain decoding would mask it had the node's
path been emitted, and acceptance, walking the masked choices, stays lossless for the masked distribution.
Built per step on the device from small padded id arrays (staged with the step's other inputs): no loop over nodes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle_ray.uploads import padded, uploads_for


def masked(seq) -> bool:
    """Whether a sequence's logits get a token mask now: an allowed list, or stop tokens still barred."""
    p = seq.params
    return p.allowed_token_ids is not None or (len(seq.output_ids) < p.min_tokens and bool(seq.min_barred))


@dataclass
class TokenMaskBatch:
    """The masked rows of a block of sequences: each row's allowed ids (or every id) and its barred stop ids."""
    rows: torch.Tensor          # [R] which rows of the block are masked
    allowed: torch.Tensor       # [R, A] allowed ids padded with ``vocab`` (a dropped bin); a row of ``vocab + 1``
                                # alone (an id past the bin) allows every token
    barred: torch.Tensor        # [R, S] stop ids barred while the output is short, padded with ``vocab``
    short_by: torch.Tensor      # [R] output tokens still to come before a stop token may be chosen (0: none)

    @staticmethod
    def arrays_of(seqs: list, vocab: int) -> list:
        """The host arrays a block's masks need (staged with the step's other small inputs); [] when none."""
        rows = [i for i, s in enumerate(seqs) if masked(s)]
        if not rows:
            return []
        picked = [seqs[i] for i in rows]
        allowed = padded([s.params.allowed_token_ids or [vocab + 1] for s in picked], vocab)
        short = [max(0, s.params.min_tokens - len(s.output_ids)) for s in picked]
        barred = padded([sorted(s.min_barred) if n else [] for s, n in zip(picked, short)], vocab)
        return [rows, allowed, barred, short]

    @classmethod
    def of(cls, seqs: list, vocab: int, device) -> "TokenMaskBatch | None":
        arrays = cls.arrays_of(seqs, vocab)
        if not arrays:
            return None
        return cls(*(uploads_for(device).ints(a) for a in arrays))


def _bins(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """``ids [R, K]`` (padded with ``vocab``; ``vocab + 1`` for every id) as a boolean ``[R, vocab]``."""
    every = (ids == vocab + 1).any(1, keepdim=True)
    bins = torch.zeros(ids.shape[0], vocab + 2, dtype=torch.bool, device=ids.device)
    bins.scatter_(1, ids, True)
    return bins[:, :vocab] | every


def apply_token_masks(logits: torch.Tensor, batch: TokenMaskBatch, depth: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """``logits [B, T, V]`` with the masked rows' barred tokens at -inf at every node (a new tensor). ``depth
    [B, T]``: each node's depth in its tree (None: every row at depth 0, as a prompt's first token)."""
    B, T, V = logits.shape
    rows = batch.rows
    x = logits[rows]                                                             # [R, T, V]
    barred = ~_bins(batch.allowed, V).unsqueeze(1)                               # [R, 1, V]
    d = depth[rows] if depth is not None else torch.zeros(len(rows), T, dtype=torch.long, device=x.device)
    early = (d < batch.short_by.view(-1, 1)).unsqueeze(-1)                       # [R, T, 1]
    barred = barred | (early & _bins(batch.barred, V).unsqueeze(1))
    out = logits.clone()
    out[rows] = x.masked_fill(barred, float("-inf"))
    return out
