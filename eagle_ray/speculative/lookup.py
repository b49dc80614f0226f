"""Prompt-lookup drafts: the tokens that followed the latest earlier occurrence of a sequence's last n tokens.

Text often repeats itself: code restates a signature, a summary quotes its article, a small model loops. Where
the last ``ngram`` tokens occurred before (in the prompt or the output), the tokens that followed them then are a
cheap guess at what follows now, and one that can run deeper than the head's tree. ``graft_chain``
(``speculative/tree.py``) adds that guess to the draft tree; the target verifies it like any other branch, so output is
unchanged and only the number of accepted tokens can grow.

A request's predicted output (OpenAI's ``prediction``: the text being edited, say) is a second source
(:meth:`TokenHistory.propose_predicted`): the output's last tokens are found in the prediction near where the
output has reached in it, and what follows them there is proposed.
"""
from __future__ import annotations

import numpy as np


PREDICTION_WINDOW = 2048   # tokens either side of where the output has reached in a prediction, searched first


class TokenHistory:
    """A sequence's prompt and output ids in one growing array, so a lookup scans them without a list copy, and
    its predicted output's ids, where it has one."""

    def __init__(self, prediction: np.ndarray | None = None):
        self.ids = np.zeros(0, dtype=np.int64)
        self.n = 0
        self.prompt_len = 0
        self.prediction = prediction if prediction is not None and len(prediction) else None
        self.shift = 0   # where the output is in the prediction, against where it would be were they aligned

    def sync(self, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Append what the sequence gained since the last call (prompt and output only grow)."""
        self.prompt_len = len(prompt_ids)
        total = len(prompt_ids) + len(output_ids)
        if total <= self.n:
            return
        if total > len(self.ids):
            grown = np.zeros(max(total, 2 * len(self.ids), 64), dtype=np.int64)
            grown[: self.n] = self.ids[: self.n]
            self.ids = grown
        new = (prompt_ids[self.n:] + output_ids) if self.n < len(prompt_ids) else \
            output_ids[self.n - len(prompt_ids):]
        self.ids[self.n: total] = new
        self.n = total

    def propose(self, ngram: int, length: int) -> np.ndarray:
        """Up to ``length`` tokens that followed the latest earlier occurrence of the last ``ngram`` tokens
        (empty when they never occurred before); with a prediction, what follows them in it, unless the output is
        still shorter than ``ngram`` and the history has a whole match."""
        own = self.propose_own(ngram, length)
        if self.prediction is None:
            return own
        predicted = self.propose_predicted(ngram, length)
        short = self.n - self.prompt_len < ngram
        return own if (short and len(own)) or not len(predicted) else predicted

    def propose_predicted(self, ngram: int, length: int) -> np.ndarray:
        """Up to ``length`` tokens that follow the output's last ``ngram`` tokens (fewer while the output is
        shorter) in the prediction, at the occurrence nearest where the output has reached in it."""
        out = self.ids[self.prompt_len: self.n]
        m, pred = min(ngram, len(out)), self.prediction
        if m == 0 or len(pred) <= m or length <= 0:
            return pred[:0]
        aligned = len(out) - m
        place = aligned + self.shift
        found = _occurrences(pred, out[len(out) - m:], place - PREDICTION_WINDOW, place + PREDICTION_WINDOW)
        if not found.size:   # near the place first (a step's cost does not grow with the prediction), then all of
            found = _occurrences(pred, out[len(out) - m:], 0, len(pred))   # it (an edit moved far)
        if not found.size:
            return pred[:0]
        at = int(found[np.argmin(np.abs(found - place))])
        self.shift = at - aligned
        return pred[at + m: at + m + length]

    def propose_own(self, ngram: int, length: int) -> np.ndarray:
        """The history's own proposal (see :meth:`propose`)."""
        ids, n = self.ids, self.n
        if n <= ngram or length <= 0:
            return ids[:0]
        found = _occurrences(ids[:n], ids[n - ngram: n], 0, n)   # each followed by a token: not the suffix itself
        if not found.size:
            return ids[:0]
        follow = found[-1] + ngram
        seen = ids[follow: n]     # if the text repeats from there, it repeats with period n - follow
        return np.resize(seen, length) if len(seen) < length else seen[:length]


def _occurrences(ids: np.ndarray, tokens: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Where ``tokens`` start in ``ids`` between ``lo`` and ``hi``, followed by at least one token."""
    m = len(tokens)
    lo, hi = max(0, lo), min(len(ids) - m, hi)
    if hi <= lo:
        return np.zeros(0, dtype=np.int64)
    hit = np.ones(hi - lo, dtype=bool)
    for k in range(m):
        hit &= ids[lo + k: hi + k] == tokens[k]
    return np.flatnonzero(hit) + lo


def lookup_rows(histories: list[TokenHistory], ngram: int, length: int) -> np.ndarray:
    """``[B, length + 1]`` int64: each sequence's proposal, zero padded, then its length in the last column (one
    array, so the step sends it to the device with its other small inputs)."""
    rows = np.zeros((len(histories), length + 1), dtype=np.int64)
    for b, h in enumerate(histories):
        p = h.propose(ngram, length)
        rows[b, : len(p)] = p
        rows[b, -1] = len(p)
    return rows
