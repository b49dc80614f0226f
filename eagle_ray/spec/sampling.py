"""Logits processors (temperature, top-k, top-p) and token choice, shared by plain decoding and verification.

Per-row parameters are tensors, so one call serves a batch whose requests sample differently.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingBatch:
    """Sampling parameters of B sequences as tensors (rows of a [B, T, V] logits block share their sequence's)."""
    temperature: torch.Tensor  # [B] float, 0 = greedy
    top_k: torch.Tensor        # [B] long, 0 = off
    top_p: torch.Tensor        # [B] float, 1 = off
    generators: list[torch.Generator | None]

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperature < 1e-5).all())

    @classmethod
    def from_params(cls, params: list, generators: list, device) -> "SamplingBatch":
        return cls(torch.tensor([p.temperature for p in params], device=device),
                   torch.tensor([p.top_k for p in params], device=device),
                   torch.tensor([p.top_p for p in params], device=device), generators)


def processed_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor) -> torch.Tensor:
    """Target distribution after temperature, then top-k, then top-p (the order of HF and the EAGLE reference).

    ``logits [N, V]`` float32, parameters ``[N]``. Top-p keeps the smallest prefix of the sorted distribution whose
    mass reaches ``top_p`` (at least one token).
    """
    logits = logits / temperature.clamp(min=1e-5).unsqueeze(-1)
    need_k = bool((top_k > 0).any())
    need_p = bool((top_p < 1.0).any())
    if need_k or need_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        V = logits.shape[-1]
        rank = torch.arange(V, device=logits.device).unsqueeze(0)
        remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if need_k:
            k = torch.where(top_k > 0, top_k, V).unsqueeze(-1)
            remove |= rank >= k
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        if need_p:
            probs = sorted_logits.softmax(-1)
            mass_before = probs.cumsum(-1) - probs
            remove = (mass_before >= top_p.unsqueeze(-1)) & (rank > 0)
            sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits.softmax(-1)


def choose_tokens(logits: torch.Tensor, sampling: SamplingBatch) -> torch.Tensor:
    """The target's choice at every row of ``logits [B, T, V]``: argmax for greedy sequences, a sample from the
    processed distribution otherwise. Each row is drawn independently (what lossless tree acceptance needs)."""
    B, T, V = logits.shape
    greedy = logits.argmax(-1)
    if sampling.all_greedy:
        return greedy
    rows = (sampling.temperature >= 1e-5).nonzero().flatten()
    rep = lambda x: x[rows].repeat_interleave(T)  # noqa: E731
    probs = processed_probs(logits[rows].reshape(-1, V).float(), rep(sampling.temperature), rep(sampling.top_k),
                            rep(sampling.top_p)).view(len(rows), T, V)
    # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) is a draw from p; noise per sequence generator.
    noise = torch.empty_like(probs)
    for j, b in enumerate(rows.tolist()):
        noise[j].exponential_(generator=sampling.generators[b])
    sampled = (probs / noise).argmax(-1)
    out = greedy.clone()
    out[rows] = sampled
    return out
