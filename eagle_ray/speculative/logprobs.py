"""Log-probabilities of tokens, read from the target's logits of the pass that chose (or ran) them.

Raw, as vLLM's default ``logprobs_mode``: the log-softmax of the target's logits before temperature, top-k, top-p
or any other processing, so a token's value says what the model itself gives it, however it was picked. Under
speculation an emitted token's logits are its parent's row of the verify pass that accepted it; a plain step's is
its one row: the same numbers either way, never the draft head's.

Everything here runs on the device for a whole block at once; the results travel back inside the step's one read
of int64 values (a float32 as its bit pattern), and :func:`unpack` turns that read into host values.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

MAX_TOP = 20   # alternatives a token may ask for (OpenAI's top_logprobs bound)


def width(k: int, ranked: bool = False) -> int:
    """int64 columns a token's packed log-probabilities take: its value, then ``k`` ids and ``k`` values (and its
    rank, ``ranked``)."""
    return 1 + 2 * k + ranked


def packed(logits: torch.Tensor, tokens: torch.Tensor, k: int, ranked: bool = False) -> torch.Tensor:
    """``logits [..., V]`` (any float type) and the ``tokens [...]`` chosen there: ``[..., width(k, ranked)]`` int64
    holding each token's log-probability and the ``k`` most probable tokens with theirs, most probable first (and,
    ``ranked``, the token's rank in the vocabulary: vLLM's, 1 + the tokens above it, ties counted above). A token
    and its alternatives subtract the same normaliser, so a greedy token's value equals its top alternative's
    exactly."""
    x = logits.float()
    norm = torch.logsumexp(x, dim=-1, keepdim=True)
    raw = x.gather(-1, tokens.unsqueeze(-1))
    parts = [bits(raw - norm)]
    if k:
        values, ids = x.topk(k, dim=-1)
        parts += [ids, bits(values - norm)]
    if ranked:
        parts.append((x >= raw).sum(-1, keepdim=True))
    return torch.cat(parts, dim=-1)


def bits(values: torch.Tensor) -> torch.Tensor:
    """float32 values as int64 holding their bit patterns (so they ride in an int64 read)."""
    return values.float().contiguous().view(torch.int32).long()


def floats(ints) -> np.ndarray:
    """The inverse of :func:`bits` on the host: int64 values back to float32 values."""
    return np.asarray(ints, dtype=np.int64).astype(np.int32).view(np.float32)


def unpack(rows: list[list[int]], k: int, ranked: bool = False) -> list["TokenLogprobs"]:
    """Per row of packed tokens (``n`` tokens of ``width(k, ranked)`` values each): their host values."""
    out = []
    w = width(k, ranked)
    for row in rows:
        a = np.asarray(row, dtype=np.int64).reshape(-1, w)
        values = floats(a[:, 0]).astype(float).tolist()
        ids = a[:, 1:1 + k].tolist()
        tops = floats(a[:, 1 + k:1 + 2 * k]).astype(float).tolist() if k else [[] for _ in values]
        ranks = a[:, -1].tolist() if ranked else None
        out.append(TokenLogprobs(values, [list(zip(i, t)) for i, t in zip(ids, tops)], ranks))
    return out


@dataclass
class TokenLogprobs:
    """Per token of an output (or a prompt): its log-probability and its top alternatives ``(token id, logprob)``,
    most probable first. A prompt's first token has none: ``None`` in both."""
    values: list[float | None] = field(default_factory=list)
    top: list[list[tuple[int, float]] | None] = field(default_factory=list)
    ranks: list[int | None] | None = None   # each token's rank in the vocabulary, where computed (a prompt's)

    def __post_init__(self):
        if self.ranks is None:
            self.ranks = [None] * len(self.values)

    def __len__(self) -> int:
        return len(self.values)

    def extend(self, other: "TokenLogprobs", n: int | None = None, k: int | None = None) -> None:
        """Append the first ``n`` tokens of ``other`` (all: None), each with at most ``k`` alternatives."""
        n = len(other) if n is None else n
        self.values += other.values[:n]
        self.top += [t if t is None or k is None else t[:k] for t in other.top[:n]]
        self.ranks += other.ranks[:n]

    def keep(self, n: int) -> None:
        """Keep the first ``n`` tokens (an output cut at a stop string)."""
        del self.values[n:]
        del self.top[n:]
        del self.ranks[n:]

    def slice(self, start: int, end: int | None = None) -> "TokenLogprobs":
        return TokenLogprobs(self.values[start:end], self.top[start:end], self.ranks[start:end])
