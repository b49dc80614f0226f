"""Speculate or run plain, per batch size, from what the running engine measures.

The tuner predicts each batch size's best tree, plain decoding included, from decode-only passes timed at one
context length (``tuning.py``). A running job differs from that: prompt chunks share its steps, contexts grow, its
prompts accept more or less than the calibration ones. So the tuner's choice is only where each batch size starts.
From then on the decode rows of every step that ran one mode (``StepOutput.sampled``: every speculating sequence
drafted, or none did) are a sample of that mode's tokens per second: their seconds, less the step's prompt chunks and
the head's feeding. Prompt chunks join most steps of a job of short answers, so samples come from those steps too.
Speculation also pays the head's feeding (every prompt and every emitted token is fed to the head before a sequence
drafts; plain steps feed nothing), so its measured feeding seconds per emitted token are added to its sampled seconds
per token. Each batch size runs the mode measured faster, speculation only where it beats plain by ``MIN_GAIN``. The
other mode gets its first window as soon as the starting mode has filled one (a wrong prior must not last a short
job), then every ``explore_every`` sampled steps, so a choice follows the job; when a window confirms the choice,
the next one waits twice as long. Both modes give the target's own output: the choice changes speed, never tokens.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

from eagle_ray.config import TreeConfig, is_plain

MIN_GAIN = 1.05  # speculation must be (predicted or measured) this much faster than plain decoding to be chosen:
                 # two runs of the same work differ by several percent, so plain wins ties


@dataclass
class Bucket:
    """One batch-size bucket's choice and its recent samples: ``(seconds, tokens)`` of sampled steps per mode, and
    ``(feeding seconds, tokens)`` of every step that ran while speculation was the mode."""
    speculate: bool
    window: int
    explore_every: int
    samples: dict = field(default_factory=dict)
    catch_up: collections.deque = field(init=False)
    since_explore: int = 0      # sampled steps since the last exploration ended
    exploring: int = 0          # sampled steps of the other mode still to take
    explore_steps: int = 0      # steps (sampled or not) the running exploration has taken
    explorations: int = 0
    switches: int = 0
    base_every: int = field(init=False)

    def __post_init__(self):
        self.base_every = self.explore_every
        self.since_explore = self.explore_every - self.window   # the first comparison after one window
        self.samples = {m: collections.deque(maxlen=self.window) for m in (True, False)}
        self.catch_up = collections.deque(maxlen=8 * self.window)

    def rate(self, speculate: bool) -> float | None:
        """Tokens per second over the mode's recent sampled steps (None: no sample yet); speculation's with its
        catch-up seconds per token added."""
        s = list(self.samples[speculate])    # one atomic copy: Serve's /stats reads it from another thread
        seconds, tokens = sum(t for t, _ in s), sum(n for _, n in s)
        if not s or seconds <= 0 or not tokens:
            return None
        if speculate:
            c = list(self.catch_up)
            catch_up_tokens = sum(n for _, n in c)
            seconds += tokens * sum(t for t, _ in c) / catch_up_tokens if catch_up_tokens else 0.0
        return tokens / seconds

    def mode(self) -> bool:
        return self.speculate != bool(self.exploring)


class SpeculationChooser:
    """Per batch-size bucket (the keys of the tuned tree table: a step with ``n`` speculative sequences is in the
    largest key <= ``n``): whether steps draft trees, chosen from measured tokens per second."""

    def __init__(self, priors: dict[int, bool], window: int = 16, explore_every: int = 32,
                 min_gain: float = MIN_GAIN):
        self.buckets = {b: Bucket(spec, window, explore_every) for b, spec in sorted(priors.items())}
        self.min_gain = min_gain

    @classmethod
    def for_trees(cls, trees: dict[int, TreeConfig], **kw) -> "SpeculationChooser":
        """Buckets at a tree table's batch sizes, each starting where its tree is: speculation unless plain."""
        return cls({b: not is_plain(t) for b, t in trees.items()}, **kw)

    def bucket(self, batch: int) -> Bucket:
        fits = [b for b in self.buckets if b <= batch]
        return self.buckets[max(fits) if fits else min(self.buckets)]

    def speculate(self, batch: int) -> bool:
        """Whether a step with ``batch`` speculative sequences drafts trees."""
        return self.bucket(batch).mode()

    def record(self, batch: int, speculated: bool, seconds: float, tokens: int, sampled: bool,
               catch_up_s: float = 0.0) -> None:
        """One step's decode rows: ``speculated`` is whether they drafted, ``seconds`` their time without prompt
        chunks and head feeding, ``sampled`` whether they ran one mode; ``catch_up_s`` the seconds the head took
        pending pairs (never part of ``seconds``)."""
        b = self.bucket(batch)
        if b.mode():
            b.catch_up.append((catch_up_s, tokens))
        if b.exploring:
            b.explore_steps += 1
            if sampled and speculated == b.mode():
                b.samples[speculated].append((seconds, tokens))
                b.exploring -= 1
            if not b.exploring or b.explore_steps >= 4 * b.window:   # catching up can keep a window from filling
                self._decide(b)
            return
        if not sampled or speculated != b.speculate:
            return
        b.samples[speculated].append((seconds, tokens))
        b.since_explore += 1
        if b.since_explore >= b.explore_every and len(b.samples[speculated]) >= b.window:
            b.exploring, b.explore_steps = b.window, 0
            b.samples[not b.speculate].clear()       # compare with what the other mode does now
            b.explorations += 1

    def _decide(self, b: Bucket) -> None:
        spec, plain = b.rate(True), b.rate(False)
        choice = b.speculate if spec is None or plain is None else spec >= self.min_gain * plain
        if choice == b.speculate:
            b.explore_every *= 2
        else:
            b.speculate, b.explore_every = choice, b.base_every
            b.switches += 1
        b.exploring, b.since_explore = 0, 0

    def summary(self) -> dict:
        """Per bucket: the mode steps run now, the measured tokens/s of each mode (speculation's with its catch-up),
        explorations and switches."""
        out = {}
        for key, b in self.buckets.items():
            spec, plain = b.rate(True), b.rate(False)
            out[str(key)] = {"choice": "tree" if b.speculate else "plain",
                             "tree_tok_s": None if spec is None else round(spec, 2),
                             "plain_tok_s": None if plain is None else round(plain, 2),
                             "explorations": b.explorations, "switches": b.switches}
        return out
