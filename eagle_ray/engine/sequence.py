"""Per-request state: tokens, sampling, stop rules, the pending draft inputs and stats."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eagle_ray.config import SamplingParams
from eagle_ray.stats import RequestStats


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    generator: torch.Generator | None = None
    slot: int = -1
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    # draft pairs (target feature f_i, next token x_{i+1}) the head has not consumed yet
    draft_tokens: list[int] = field(default_factory=list)
    draft_features: torch.Tensor | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    start_time: float = 0.0
    stop_text: str | None = None  # output text cut before a matched stop string
    speculative: bool = True

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def root(self) -> int:
        """The last emitted token: the target has not run it yet, it roots the next draft tree."""
        return self.output_ids[-1]

    def append(self, tokens: list[int]) -> int:
        """Append emitted tokens up to the first stop condition; returns how many were kept."""
        for n, tok in enumerate(tokens, 1):
            self.output_ids.append(tok)
            if tok in self.stop_ids:
                self.finish_reason = "stop"
                return n
            if len(self.output_ids) >= self.params.max_new_tokens:
                self.finish_reason = "length"
                return n
        return len(tokens)
