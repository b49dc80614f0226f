"""Tokens a request may not choose: outside its ``allowed_token_ids``, EOS and its stop tokens before ``min_tokens``
(EOS even where ``ignore_eos`` keeps it from stopping the output, as vLLM bars it), and a bad word's last token where
the output so far ends with the word's other tokens (vLLM's ``bad_words``; a one-token word everywhere).

Both are masks (-inf) on the target's logits at every node of a tree, as vLLM applies them in plain decoding. A node
at depth d chooses the sequence's output token number ``len(output) + d + 1``, so the stop tokens are barred at the
nodes where ``len(output) + d < min_tokens``: each node is masked as plain decoding would mask it had the node's
path been emitted, and acceptance, walking the masked choices, stays lossless for the masked distribution. A bad
word's prefix is matched against each node's own path: the node, its ancestors, then the output before the root.
Built per step on the device from small padded id arrays (staged with the step's other inputs): no loop over nodes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from eagle_ray.uploads import padded, uploads_for


def masked(seq) -> bool:
    """Whether a sequence's logits get a token mask now: an allowed list, or stop tokens still barred."""
    p = seq.params
    return (p.allowed_token_ids is not None or (len(seq.output_ids) < p.min_tokens and bool(seq.min_barred))
            or bool(seq.bad_words))


@dataclass
class TokenMaskBatch:
    """The masked rows of a block of sequences: each row's allowed ids (or every id) and its barred stop ids."""
    rows: torch.Tensor          # [R] which rows of the block are masked
    allowed: torch.Tensor       # [R, A] allowed ids padded with ``vocab`` (a dropped bin); a row of ``vocab + 1``
                                # alone (an id past the bin) allows every token
    barred: torch.Tensor        # [R, S] stop ids barred while the output is short, padded with ``vocab``
    short_by: torch.Tensor      # [R] output tokens still to come before a stop token may be chosen (0: none)
    words: torch.Tensor | None = None     # [R, W, P + 1] bad words: P prefix tokens, latest first (-2: any), then
                                          # the token barred after them (``vocab``: none)
    history: torch.Tensor | None = None   # [R, P] the output before the root, latest first (-1 past its start)

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
        return [rows, allowed, barred, short] + word_arrays(picked, vocab)

    @classmethod
    def of(cls, seqs: list, vocab: int, device) -> "TokenMaskBatch | None":
        arrays = cls.arrays_of(seqs, vocab)
        if not arrays:
            return None
        return cls(*(uploads_for(device).ints(a) for a in arrays))


def word_arrays(seqs: list, vocab: int) -> list:
    """``words`` and ``history`` (see :class:`TokenMaskBatch`) of ``seqs``; [] where none has a bad word."""
    if not any(s.bad_words for s in seqs):
        return []
    P = max(1, max(len(w) - 1 for s in seqs for w in s.bad_words))
    W = max(1, max(len(s.bad_words) for s in seqs))
    words = np.full((len(seqs), W, P + 1), -2, dtype=np.int64)
    words[:, :, P] = vocab
    history = np.full((len(seqs), P), -1, dtype=np.int64)
    for r, s in enumerate(seqs):
        for w, ids in enumerate(s.bad_words):
            words[r, w, : len(ids) - 1] = ids[-2::-1] if len(ids) > 1 else []
            words[r, w, P] = ids[-1]
        before = s.output_ids[-(P + 1):-1][::-1]   # the output before the root (the root is the tree's node 0)
        history[r, : len(before)] = before
    return [words, history]


def path_tokens(tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor, history: torch.Tensor
                ) -> torch.Tensor:
    """``[R, T, P]``: per node, its path's last P tokens, latest first: the node's, its ancestors' up to the root,
    then ``history`` (the output before the root). One gather per step back, not per node."""
    R, T = tokens.shape
    P = history.shape[1]
    out, at = [], torch.arange(T, device=tokens.device).expand(R, T)
    for j in range(P):
        from_history = history.gather(1, (j - depth - 1).clamp(0, P - 1))
        out.append(torch.where(depth >= j, tokens.gather(1, at), from_history))
        at = parents.gather(1, at)
    return torch.stack(out, -1)


def bad_word_bins(batch: TokenMaskBatch, tree, T: int, V: int) -> torch.Tensor:
    """``[R, T, V]``: the tokens a bad word bars at each node."""
    R, W, P1 = batch.words.shape
    prefix, last = batch.words[:, :, :-1], batch.words[:, :, -1]                 # [R, W, P], [R, W]
    if tree is None:   # a prompt's first token: no output yet, so only one-token words bar anything
        path = torch.full((R, T, P1 - 1), -1, dtype=torch.long, device=prefix.device)
    else:
        rows = batch.rows
        path = path_tokens(tree.tokens[rows], tree.parents[rows], tree.depth[rows], batch.history)
    hit = ((prefix.unsqueeze(1) == -2) | (prefix.unsqueeze(1) == path.unsqueeze(2))).all(-1)   # [R, T, W]
    bins = torch.zeros(R, T, V + 1, dtype=torch.bool, device=prefix.device)
    # words may share a last token (a word and its spaced form often do): a word that does not hit writes nowhere
    return bins.scatter_(2, torch.where(hit, last.unsqueeze(1), V), True)[:, :, :V]


def _bins(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """``ids [R, K]`` (padded with ``vocab``; ``vocab + 1`` for every id) as a boolean ``[R, vocab]``."""
    every = (ids == vocab + 1).any(1, keepdim=True)
    bins = torch.zeros(ids.shape[0], vocab + 2, dtype=torch.bool, device=ids.device)
    bins.scatter_(1, ids, True)
    return bins[:, :vocab] | every


def apply_token_masks(logits: torch.Tensor, batch: TokenMaskBatch, tree=None) -> torch.Tensor:
    """``logits [B, T, V]`` with the masked rows' barred tokens at -inf at every node (a new tensor). ``tree``: the
    block's tree (None: every row at depth 0 with no output yet, as a prompt's first token)."""
    B, T, V = logits.shape
    rows = batch.rows
    x = logits[rows]                                                             # [R, T, V]
    barred = ~_bins(batch.allowed, V).unsqueeze(1)                               # [R, 1, V]
    d = tree.depth[rows] if tree is not None else torch.zeros(len(rows), T, dtype=torch.long, device=x.device)
    early = (d < batch.short_by.view(-1, 1)).unsqueeze(-1)                       # [R, T, 1]
    barred = barred | (early & _bins(batch.barred, V).unsqueeze(1))
    if batch.words is not None:
        barred = barred | bad_word_bins(batch, tree, T, V)
    out = logits.clone()
    out[rows] = x.masked_fill(barred, float("-inf"))
    return out
