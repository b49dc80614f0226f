"""A sequence's own context tokens join its draft vocabulary.

A head with a token map proposes only the map's tokens (the most frequent ones of its training answers), so a
token an answer copies from its prompt (a name, a rare word, an identifier) can never be drafted. On the embedded
pair's answers to EAGLE-2's six benchmark files, 6-19% of the answer tokens fall outside the 8k map, and 62-92% of
those already stand earlier in the same sequence. So each sequence also scores up to ``cap`` tokens of its own
context (prompt and output so far) that the map lacks, against the same lm_head rows the map's tokens use. The
target verifies every draft, so output is unchanged; the cost is ``cap`` more rows per scored row, gathered per
step (the map's rows are gathered once).

``ContextTokens`` is the host side (one per sequence, fed the tokens as they come); ``context_topk`` the device
side (the head's top-k over its map plus each sequence's context tokens).
"""
from __future__ import annotations

import numpy as np
import torch

from eagle_ray.speculative.tree import draft_log_probs


class ContextTokens:
    """The tokens of one sequence's context that the draft vocabulary lacks, newest last, at most ``cap``: a token
    seen again moves to the end, and the oldest one leaves when a new one would pass ``cap``."""

    def __init__(self, outside: np.ndarray, cap: int):
        self.outside, self.cap = outside, cap     # outside[t]: token t is not in the head's map
        self.ids: dict[int, None] = {}
        self.read = 0                             # context tokens looked at so far
        self._array: np.ndarray | None = None

    def update(self, prompt: list[int], output: list[int]) -> None:
        """Look at the context tokens (``prompt`` then ``output``, which only grows) not looked at yet."""
        n = len(prompt)
        new = (prompt[self.read:] + output) if self.read < n else output[self.read - n:]
        self.read = n + len(output)
        for tok in new:
            if not self.outside[tok]:
                continue
            if tok in self.ids:
                del self.ids[tok]
            elif len(self.ids) >= self.cap:
                del self.ids[next(iter(self.ids))]
            self.ids[tok] = None
            self._array = None

    def array(self) -> np.ndarray:
        if self._array is None:
            self._array = np.fromiter(self.ids, dtype=np.int64, count=len(self.ids))
        return self._array


def context_rows(contexts: list[ContextTokens]) -> np.ndarray | None:
    """The batch's context tokens ``[B, E]`` (``-1`` pads a shorter row); None when no sequence has one."""
    width = max(len(c.ids) for c in contexts)
    if not width:
        return None
    rows = np.full((len(contexts), width), -1, dtype=np.int64)
    for b, c in enumerate(contexts):
        rows[b, : len(c.ids)] = c.array()
    return rows


def context_topk(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, token_map: torch.Tensor,
                 context: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k log-probs and target ids over the map and each sequence's context tokens.

    ``logits`` ``[B, ..., V]`` are the map's, ``hidden`` ``[B, ..., d]`` the head's outputs they came from,
    ``weight`` the target's lm_head ``[vocab, d]``, ``context`` ``[B, E]`` target ids (``-1``: none). The softmax
    runs over the map and the sequence's context tokens together, so scores stay comparable across sequences."""
    B, d = context.shape[0], hidden.shape[-1]
    rows = weight[context.clamp(min=0)]                                               # [B, E, d]
    extra = torch.bmm(hidden.reshape(B, -1, d).to(rows.dtype), rows.transpose(1, 2)).float()   # [B, R, E]
    padding = (context < 0).unsqueeze(1)
    extra = extra.masked_fill(padding, float("-inf"))
    both = draft_log_probs(torch.cat([logits.reshape(B, extra.shape[1], -1).float(), extra], dim=-1))
    both[..., logits.shape[-1]:] = both[..., logits.shape[-1]:].masked_fill(padding, float("-inf"))   # never drafted
    logp, idx = both.topk(k, dim=-1)                                                  # [B, R, k]
    vocab = torch.cat([token_map.expand(B, -1), context], dim=1)                      # [B, V + E]
    ids = vocab.gather(1, idx.reshape(B, -1))
    shape = hidden.shape[:-1] + (k,)
    return logp.view(shape), ids.view(shape)
