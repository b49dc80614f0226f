"""Per-request state: prompt, output, where its prefill stands, the head's pending inputs, sampling, stop rules,
output text and stats. The scheduler owns sequences; the model runner reads them and returns tokens."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eagle_ray.config import SamplingParams
from eagle_ray.engine.text import Detokenizer, StopStrings
from eagle_ray.stats import RequestStats


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    seed: int                                   # sampling noise is keyed by (seed, position): see spec/sampling.py
    detok: Detokenizer | None = None
    slot: int = -1
    speculative: bool = True
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prefilled: int = 0                          # prompt tokens whose K/V are in the target cache
    # the head's pending inputs: pairs (target feature f_i, next token x_{i+1}) it has not consumed yet
    draft_tokens: list[int] = field(default_factory=list)
    draft_features: torch.Tensor | None = None
    draft_hidden: torch.Tensor | None = None    # the head's output at the last pair it consumed: the tree's root
    stats: RequestStats = field(default_factory=RequestStats)
    start_time: float = 0.0
    stops: StopStrings | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def in_prefill(self) -> bool:
        return self.prefilled < len(self.prompt_ids)

    @property
    def root(self) -> int:
        """The last emitted token: the target has not run it yet, it roots the next draft tree."""
        return self.output_ids[-1]

    @property
    def cached_len(self) -> int:
        """Positions of this sequence in the target's KV cache (prompt + output minus the root)."""
        return self.prefilled + max(0, len(self.output_ids) - 1)

    @property
    def text(self) -> str:
        return self.detok.text if self.detok is not None else ""

    def append(self, tokens: list[int]) -> int:
        """Append emitted tokens up to the first stop token or ``max_new_tokens``; returns how many were kept."""
        for n, tok in enumerate(tokens, 1):
            self.output_ids.append(tok)
            if tok in self.stop_ids:
                self.finish_reason = "stop"
                return n
            if len(self.output_ids) >= self.params.max_new_tokens:
                self.finish_reason = "length"
                return n
        return len(tokens)

    def add_pending(self, tokens: list[int], features: torch.Tensor) -> None:
        """Queue (feature, token) pairs for the head."""
        if not self.draft_tokens or self.draft_features is None:
            self.draft_tokens, self.draft_features = list(tokens), features
        else:
            self.draft_tokens += tokens
            self.draft_features = torch.cat([self.draft_features, features])

    def take_pending(self, n: int) -> tuple[list[int], torch.Tensor]:
        """Remove and return the first ``n`` pending pairs."""
        tokens, feats = self.draft_tokens[:n], self.draft_features[:n]
        self.draft_tokens = self.draft_tokens[n:]
        self.draft_features = self.draft_features[n:] if self.draft_tokens else None
        return tokens, feats

    def update_text(self) -> None:
        """Detokenise the new tokens; a stop string ends the sequence there (its text and tokens are cut)."""
        if self.detok is None:
            return
        new = self.detok.add(self.output_ids[len(self.detok.ids):])
        if self.stops is None:
            return
        at = self.stops.find(self.detok.text, len(new))
        if at is None:
            return
        keep = self.detok.tokens_reaching(at)
        del self.output_ids[keep:]
        self.detok.truncate(keep, at)
        self.finish_reason = "stop"
