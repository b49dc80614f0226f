"""Several sequences over one prompt: ``n`` samples of a request, a row's continuations to score.

The members of a :class:`ForkGroup` share their first ``shared`` tokens. One member prefills them; each other
member, once it holds a slot, copies those positions' K/V from a member that has them (slot to slot on the device,
the target's cache and the head's: ``copy_prefix``) and prefills only the rest of its own prompt. ``shared`` stops
one token short of a sample's prompt, so that each sample runs the prompt's last token itself and draws its own first
token from it; for scoring, one short of the context, so that each continuation's first token is scored by its own
pass. A member admitted while the member that prefills the prefix is still on its way there waits, holding its slot
(and that member's prefill pauses at the prefix's end until it has copied it); one that finds no member holding the prefix (they finished before it got a slot) prefills it itself, and others may
copy from it in turn.

A sample's sampling noise is keyed by its own seed, derived from the request's seed and its index
(:func:`sample_seed`), so seeded sample ``i`` is the same whatever ``n`` and whatever else runs beside it; sample 0
keeps the request's seed, so ``n = 1`` is the request as before.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from eagle_ray.engine.sequence import PendingPairs, Sequence
from eagle_ray.engine.text import Detokenizer, StopStrings
from eagle_ray.speculative.logprobs import TokenLogprobs

_MASK64 = (1 << 64) - 1


def sample_seed(seed: int, index: int) -> int:
    """Sample ``index``'s seed: the request's own for sample 0, else a splitmix64 mix of (seed, index) below 2**63
    (a valid seed, independent of every other sample's)."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def may_copy_from(source: Sequence, seq: Sequence) -> bool:
    """Whether ``seq`` may take its first positions from ``source`` with :func:`copy_prefix` (as far as ``source``
    has prefilled): ``source`` runs in a slot with its own prefix in place, and where ``seq`` drafts, or keeps its
    pairs for online adaptation, ``source`` does too (every (feature, token) pair, in the head's cache or pending)."""
    return (source is not seq and source.slot >= 0 and not source.finished and source.fork_ready
            and (source.speculative or not seq.speculative)
            and (seq.pending.kept is None or source.pending.kept is not None))


@dataclass(eq=False)
class ForkGroup:
    """Sequences whose prompts begin with the same ``shared`` tokens (``shared`` 0: nothing to share)."""
    shared: int
    members: list[Sequence] = field(default_factory=list)
    forks: int = 0          # members that copied the prefix instead of prefilling it (tests count them)

    def source_for(self, seq: Sequence) -> Sequence | None:
        """A member holding the prefix in its slot (:func:`may_copy_from`)."""
        for m in self.members:
            if may_copy_from(m, seq) and m.prefilled >= self.shared:
                return m
        return None

    def on_its_way(self, seq: Sequence) -> bool:
        """Whether a member in a slot is prefilling the prefix (``seq`` may wait for it)."""
        return any(m is not seq and m.slot >= 0 and not m.finished and m.fork_ready and m.prefilled < self.shared
                   for m in self.members)


def group(seqs: list[Sequence], shared: int) -> list[Sequence]:
    """Make ``seqs`` one :class:`ForkGroup` sharing their first ``shared`` prompt tokens (none when under one)."""
    if len(seqs) > 1 and shared >= 1:
        g = ForkGroup(shared, list(seqs))
        for s in seqs:
            s.fork, s.fork_ready = g, False
    return seqs


def samples_of(first: Sequence, n: int) -> list[Sequence]:
    """``first`` (sample 0, made by ``EagleEngine.make_sequence``) and ``n - 1`` more samples of its prompt, each
    with its own seed, request id ``<id>#<i>`` (``first``'s becomes ``<id>#0``), sharing all but the prompt's last
    token."""
    if n == 1:
        return [first]
    rid = first.request_id
    seqs = [first] + [sibling(first, f"{rid}#{i}", sample_seed(first.seed, i), i) for i in range(1, n)]
    first.request_id = f"{rid}#0"
    return group(seqs, len(first.prompt_ids) - 1)


def sibling(seq: Sequence, request_id: str, seed: int, index: int, prompt_ids: list[int] | None = None) -> Sequence:
    """A fresh sequence like ``seq`` (its sampling, stops, speculation, what it returns), with its own id and seed,
    over ``prompt_ids`` (``seq``'s by default)."""
    ids = list(seq.prompt_ids if prompt_ids is None else prompt_ids)
    tokenizer = seq.detok.tokenizer if seq.detok is not None else None
    return Sequence(request_id, ids, seq.params, seq.stop_ids, seed,
                    detok=None if tokenizer is None else Detokenizer(tokenizer, ids, seq.params.skip_special_tokens),
                    speculative=seq.speculative, stops=StopStrings(seq.params.stop) if seq.params.stop else None,
                    sample_index=index, logprobs=TokenLogprobs() if seq.logprobs is not None else None,
                    prompt_only=seq.prompt_only, prompt_logprobs_k=seq.prompt_logprobs_k,
                    prompt_logprobs_from=seq.prompt_logprobs_from,
                    prompt_logprobs=TokenLogprobs() if seq.prompt_logprobs is not None else None,
                    guide=seq.guide.fresh() if seq.guide is not None else None, min_barred=seq.min_barred,
                    bad_words=seq.bad_words, prediction=seq.prediction, reason_ids=seq.reason_ids)


def prefill_end(seq: Sequence) -> int:
    """Where ``seq``'s prefill may run to this step: a member prefilling its group's prefix stops there while others
    wait for it (so that it still holds the prefix when they copy it, even if it would finish right after), else its
    prompt's end."""
    g = seq.fork
    if g is not None and seq.prefilled < g.shared and any(not m.fork_ready and m.slot >= 0 for m in g.members):
        return g.shared
    return len(seq.prompt_ids)


def share_prefixes(prefilling: list[Sequence], fork) -> None:
    """Before a step's prompt chunks are planned: each newly admitted group member copies its group's prefix from
    a member holding it (``fork(source, seq, shared)``, then it prefills from there), waits for the member on its
    way to it, or, where there is neither (or no ``fork`` to copy with), prefills the prefix itself."""
    for seq in prefilling:
        g = seq.fork
        if g is None or seq.fork_ready:
            continue
        source = g.source_for(seq) if fork is not None else None
        if source is not None:
            fork(source, seq, g.shared)
            seq.prefilled, seq.fork_ready = g.shared, True
            g.forks += 1
        elif fork is None or not g.on_its_way(seq):
            seq.fork_ready = True


def copy_prefix(target, draft, source: Sequence, seq: Sequence, shared: int) -> None:
    """Give ``seq`` (in a fresh slot) ``source``'s first ``shared`` positions: the target's K/V, and where ``seq``
    drafts, the head's state of them: its cache up to what the head has consumed of them, and the rest as pending
    (feature, token) pairs (pair ``i`` is position ``i``'s feature and token ``i + 1``: the same for every member)."""
    target.cache.copy_prefix(source.slot, seq.slot, shared)
    if draft is None:
        return
    if not seq.speculative:
        draft.cache.reset(seq.slot)
        return
    consumed = min(int(draft.cache.lengths[source.slot]), shared)
    draft.cache.copy_prefix(source.slot, seq.slot, consumed)
    pending = PendingPairs()
    pending.kept = None if seq.pending.kept is None else source.pending.kept_first(consumed)
    rest = shared - consumed
    if rest:
        pending.add(source.pending.tokens[:rest], source.pending.features()[:rest])
    seq.pending, seq.draft_hidden = pending, None
