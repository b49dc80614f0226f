"""Automatic prefix sharing: a prompt that begins like one already in a KV slot starts where the two part.

Batch and eval jobs send many prompts under one system prompt or one set of few-shot examples. When a step plans
a prompt's first chunk, the prompt looks among the sequences in slots for the one whose prompt begins with most of
its own tokens, copies those positions' K/V and the head's state of them (``copy_prefix``, as the ``n`` samples of
one prompt do, ``engine/samples.py``), and the chunk runs from there. The copy stops one token short of where the
prompts part (the head's input at a position holds the next token) and short of the prompt's last token (the first
output token is drawn from the prompt's own pass), so a prompt prefills at least one token of its own.

Only sequences in slots are sources: a prompt that starts in the same step as its twins, or after all of them have
finished, prefills in full (finished prompts are not kept). Prompts that ask for their prompt logprobs, and the
members of a sample or scoring group (which share their prompt within the group), prefill as they did.
"""
from __future__ import annotations

from eagle_ray.engine.samples import may_copy_from
from eagle_ray.engine.sequence import Sequence

MIN_SHARED = 16   # shared tokens worth a copy of every layer's slot (fewer prefill with the rest of the prompt)


def common_start(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` begin with in common (slices compared in C, halving the range)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n            # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def may_share(seq: Sequence) -> bool:
    """Whether ``seq`` may start from another sequence's positions: not started, in no group, no prompt logprobs,
    a prompt long enough to leave ``MIN_SHARED`` tokens and one of its own."""
    return (seq.prefilled == 0 and seq.fork is None and seq.prompt_logprobs is None and not seq.prompt_only
            and len(seq.prompt_ids) > MIN_SHARED + 1)


def best_source(seq: Sequence, running: list[Sequence]) -> tuple[Sequence | None, int]:
    """The sequence in a slot that gives ``seq`` the most positions, and how many (at least ``MIN_SHARED``; else
    ``(None, 0)``), among those ``seq`` may copy from (``samples.may_copy_from``), no further than each has
    prefilled."""
    head = seq.prompt_ids[:MIN_SHARED + 1]
    best, most = None, MIN_SHARED - 1
    for m in running:
        if m.prefilled < MIN_SHARED or m.prompt_ids[:MIN_SHARED + 1] != head or not may_copy_from(m, seq):
            continue
        n = min(common_start(m.prompt_ids, seq.prompt_ids) - 1, m.prefilled, len(seq.prompt_ids) - 1)
        if n > most:
            best, most = m, n
    return (best, most) if best is not None else (None, 0)


def share_running_prefixes(chunks: list, running: list[Sequence], fork) -> None:
    """A step's prompt chunks as planned (``scheduler.PrefillChunk``): each that starts a prompt copies the longest
    start its prompt shares with a sequence in a slot (``fork(source, seq, n)``) and runs from there instead, as
    wide as planned."""
    for c in chunks:
        if c.start == 0 and may_share(c.seq):
            source, n = best_source(c.seq, running)
            if source is not None:
                fork(source, c.seq, n)
                c.seq.prefilled = c.seq.stats.cached_prompt_tokens = n
                c.start, c.end = n, min(len(c.seq.prompt_ids), n + c.end)
