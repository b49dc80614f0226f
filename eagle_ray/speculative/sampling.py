"""Logits processors (temperature, min-p, top-k, top-p) and token choice, shared by plain decoding and verification.

Per-row parameters are tensors, so one call serves a batch whose requests sample differently.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle_ray.uploads import uploads_for


@dataclass
class SamplingBatch:
    """Sampling parameters of B sequences as tensors (rows of a [B, T, V] logits block share their sequence's).

    Which rows sample, and whether any uses top-k or top-p, are host facts taken from the requests: deciding them
    never reads the device."""
    temperature: torch.Tensor  # [B] float, 0 = greedy
    top_k: torch.Tensor        # [B] long, 0 = off
    top_p: torch.Tensor        # [B] float, 1 = off
    seed: torch.Tensor         # [B] long: with the position, keys the sampling noise
    sampled_rows: list[int] | None = None   # rows with temperature > 0 (None: read from ``temperature``)
    need_k: bool | None = None
    need_p: bool | None = None
    min_p: torch.Tensor | None = None       # [B] float, 0 = off (None: off for every row)

    def __post_init__(self):
        if self.sampled_rows is None:  # built from tensors (tests): the flags come from them once
            t = self.temperature.tolist()
            self.sampled_rows = [i for i, x in enumerate(t) if x >= 1e-5]
            self.need_k = bool((self.top_k > 0).any())
            self.need_p = bool((self.top_p < 1.0).any())

    @property
    def all_greedy(self) -> bool:
        return not self.sampled_rows

    @staticmethod
    def params_of(seqs: list) -> list[list[float]]:
        return [[s.params.temperature, s.params.top_k, s.params.top_p, s.params.min_p] for s in seqs]

    @staticmethod
    def seeds_of(seqs: list) -> list[int]:
        return [s.seed for s in seqs]

    @classmethod
    def of(cls, seqs: list, device) -> "SamplingBatch":
        """From sequences' ``params`` and ``seed`` (one host-to-device copy when any row samples)."""
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if not sampled:  # all greedy: nothing else is read
            zeros = torch.zeros(len(seqs), device=device)
            return cls(zeros, zeros.long(), zeros + 1, zeros.long(), [], False, False)
        upload = uploads_for(device)
        rows = upload.floats(cls.params_of(seqs))
        seeds = upload.ints(cls.seeds_of(seqs))
        min_p = rows[:, 3].float() if any(s.params.min_p > 0 for s in seqs) else None
        return cls(rows[:, 0].float(), rows[:, 1].long(), rows[:, 2].float(), seeds, sampled,
                   any(s.params.top_k > 0 for s in seqs), any(s.params.top_p < 1.0 for s in seqs), min_p)


_MIX64 = ((30, -4658895280553007687), (27, -7723592293110705685), (31, None))   # splitmix64's finaliser
_MIX32 = ((16, -2048144789), (13, -1028477387), (16, None))                     # murmur3's fmix32
_GOLDEN32 = -1640531527   # 0x9E3779B9 as a signed 32-bit integer: spreads consecutive token ids over the key space


def _mix_(x: torch.Tensor, rounds) -> torch.Tensor:
    """An xorshift-multiply finaliser, in place on ``x`` (int64 with ``_MIX64``, int32 with ``_MIX32``): a bijection
    of the integers whose outputs pass as independent uniforms. Products wrap; masks make the shifts logical."""
    bits = 8 * x.element_size()
    t = torch.empty_like(x)
    for shift, mul in rounds:
        torch.bitwise_right_shift(x, shift, out=t)
        x.bitwise_xor_(t.bitwise_and_((1 << (bits - shift)) - 1))
        if mul is not None:
            x.mul_(mul)
    return x


def position_noise(seed: torch.Tensor, position: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise ``[..., V]`` that depends only on (seed, position, token): ``seed [N]``, ``position [N]``.

    Sampling draws ``argmax(p / E)`` (an exponential race: a draw from ``p``). Keyed by the position the sampled
    token will take, the draw at a position is the same whether the token is decoded alone, inside a verified
    tree, or next to any other requests: a seeded request's output does not depend on its batch, its tree or on
    speculation at all, and distinct positions get independent noise, so every token is an exact draw. (A race,
    not an inverse CDF: only the leading tokens' rounding can change its winner, where a CDF summed in vocabulary
    order moves every boundary with the rounding of the tokens before it.) A row's key is mixed in 64 bits, the
    row's tokens in 32, cheaper than 64-bit products over a vocabulary-wide row.
    """
    key = _mix_(_mix_(seed.long().clone(), _MIX64).bitwise_xor_(position.long()), _MIX64)        # [N]
    key = key.bitwise_right_shift_(32).int()                                                       # its top 32 bits
    tokens = torch.arange(vocab, dtype=torch.int32, device=seed.device).mul_(_GOLDEN32)
    h = _mix_(torch.bitwise_xor(tokens, key.unsqueeze(-1)), _MIX32)
    u = h.bitwise_right_shift_(8).bitwise_and_((1 << 24) - 1).float().add_(0.5).mul_(2.0 ** -24)   # (0, 1], 24 bits
    # float32 rounds the top value (1 - 2^-25) to 1: noise 0 would make a token of probability 0 (masked by a
    # grammar, cut by top-k) win the race as 0/0, and any other one win it outright
    return u.clamp_(max=1.0 - 2.0 ** -24).log_().neg_()


def processed_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor, need_k: bool | None = None, need_p: bool | None = None,
                    min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Target distribution after temperature, then min-p, then top-k, then top-p (temperature, top-k and top-p in
    the order of HF and the EAGLE reference; min-p where vLLM applies it, before top-k and top-p).

    ``logits [N, V]`` float32, parameters ``[N]``. Min-p drops the tokens less probable than ``min_p`` times the
    most probable one. Top-p keeps the smallest prefix of the sorted distribution whose mass reaches ``top_p`` (at
    least one token). ``need_k`` / ``need_p``: whether any row uses top-k / top-p, when the caller knows (None:
    read from the tensors); ``min_p`` None: no row uses it.
    """
    logits = logits / temperature.clamp(min=1e-5).unsqueeze(-1)
    if min_p is not None:
        probs = logits.softmax(-1)
        floor = min_p.unsqueeze(-1) * probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    need_k = bool((top_k > 0).any()) if need_k is None else need_k
    need_p = bool((top_p < 1.0).any()) if need_p is None else need_p
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


def choose_tokens(logits: torch.Tensor, sampling: SamplingBatch, positions: torch.Tensor) -> torch.Tensor:
    """The target's choice at every row of ``logits [B, T, V]``: argmax for greedy sequences, a sample from the
    processed distribution otherwise. ``positions [B, T]``: the position the chosen token takes in its sequence
    (keys the noise, see :func:`position_noise`); rows at distinct positions are independent draws."""
    B, T, V = logits.shape
    greedy = logits.argmax(-1)
    if sampling.all_greedy:
        return greedy
    rows = uploads_for(logits.device).ints(sampling.sampled_rows)
    rep = lambda x: x[rows].unsqueeze(1).expand(-1, T).reshape(-1)  # noqa: E731
    probs = processed_probs(logits[rows].reshape(-1, V).float(), rep(sampling.temperature), rep(sampling.top_k),
                            rep(sampling.top_p), sampling.need_k, sampling.need_p,
                            None if sampling.min_p is None else rep(sampling.min_p))
    noise = position_noise(rep(sampling.seed), positions[rows].reshape(-1), V)
    sampled = (probs / noise).argmax(-1).view(len(sampling.sampled_rows), T)
    out = greedy.clone()
    out[rows] = sampled
    return out
