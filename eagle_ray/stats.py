"""Per-request statistics: one definition used by the engine, the Ray job's Parquet schema, Serve and benchmarks.

``tau`` counts the bonus token, as vLLM and the EAGLE reference do: new tokens / verify steps (prefill excluded).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestStats:
    verify_steps: int = 0
    new_tokens: int = 0                                          # all output tokens (the prefill's first one too)
    step_tokens: int = 0                                         # tokens emitted by verify steps
    accept_hist: list[int] = field(default_factory=list)         # [k] = steps that accepted exactly k drafts
    accepted_per_depth: list[int] = field(default_factory=list)  # [d-1] = accepted draft tokens at tree depth d
    tree_tokens: int = 0                                         # sum of verified tree sizes (root included)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    other_s: float = 0.0
    ttft_s: float = 0.0
    total_s: float = 0.0
    head_version: int = 0                                        # the head it finished with (online adaptation)
    cached_prompt_tokens: int = 0   # prompt tokens copied from a running sequence's slot, not prefilled

    @property
    def tau(self) -> float:
        return self.step_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def mean_tree_size(self) -> float:
        return self.tree_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def record_step(self, accepted_drafts: int, tree_size: int, emitted: int) -> None:
        self.verify_steps += 1
        self.step_tokens += emitted
        self.tree_tokens += tree_size
        if len(self.accept_hist) <= accepted_drafts:
            self.accept_hist += [0] * (accepted_drafts + 1 - len(self.accept_hist))
        self.accept_hist[accepted_drafts] += 1
        if len(self.accepted_per_depth) < accepted_drafts:
            self.accepted_per_depth += [0] * (accepted_drafts - len(self.accepted_per_depth))
        for d in range(accepted_drafts):
            self.accepted_per_depth[d] += 1

    def merge(self, other: "RequestStats") -> None:
        """Add another request's counts and times (a multi-turn row is one row of stats)."""
        for name in ("verify_steps", "new_tokens", "step_tokens", "tree_tokens", "prefill_s", "draft_s", "verify_s",
                     "other_s", "total_s", "cached_prompt_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        if not self.ttft_s:
            self.ttft_s = other.ttft_s
        self.head_version = max(self.head_version, other.head_version)
        for name in ("accept_hist", "accepted_per_depth"):
            a, b = getattr(self, name), getattr(other, name)
            setattr(self, name, [x + y for x, y in zip(a + [0] * (len(b) - len(a)), b + [0] * (len(a) - len(b)))])

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(tau=self.tau, mean_tree_size=self.mean_tree_size, tokens_per_s=self.tokens_per_s)
        return d
