"""Continuous batching: which sequences hold a KV slot, and what each of them does this step.

Waiting requests take free slots between steps. A prompt is prefilled in chunks: a step runs at most
``step_budget`` tokens: one token of every decoding sequence, prompt chunks (oldest first, padded) in what is left
(at least ``MIN_PREFILL``), and draft tree tokens only in the room the prompts leave. A 2,000-token prompt arriving
mid-stream so delays the running streams by a bounded chunk per step, never by its whole prefill; and tree tokens
never displace prompt tokens: in a full pass, where a token costs about the same wherever it sits, a tree of ``t``
nodes buys ``tau < t`` tokens with ``t - 1`` prompt tokens that must run later anyway, a loss. Finished or
aborted sequences leave at once. Memory is bounded up front: the KV cache has ``num_slots`` rows of ``max_len``
positions, and a request that cannot fit one row is refused when it is added.

The plan a step hands the model runner is finished: which prompt chunks run, which sequences grow and verify a tree
(with which tree and verify cap, from the :class:`TreePolicy`), which verify their root only, and in which head
passes the head first takes its pending (feature, token) pairs. The head is fed lazily: a sequence's pairs wait
until a step drafts for it, or until they reach ``Feeding.max_pending``; one that starts speculating again catches
up in at most ``MAX_EXTEND_PASSES`` bounded passes, verifying plainly until it has.
"""
from __future__ import annotations

import bisect
import collections
from dataclasses import dataclass, field

from eagle_ray.config import TreeConfig, is_plain
from eagle_ray.engine.budgets import max_emitted
from eagle_ray.engine.prefix_sharing import share_running_prefixes
from eagle_ray.engine.samples import prefill_end, share_prefixes
from eagle_ray.engine.sequence import Sequence
from eagle_ray.engine.tree_policy import TreePolicy


@dataclass
class PrefillChunk:
    """Prompt tokens ``[start, end)`` of ``seq`` run this step."""
    seq: Sequence
    start: int
    end: int

    @property
    def completes(self) -> bool:
        return self.end == len(self.seq.prompt_ids)


@dataclass
class StepPlan:
    """Everything one step runs, decided before its first forward."""
    prefill: list[PrefillChunk] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)    # every sequence past its prompt
    drafted: list[Sequence] = field(default_factory=list)   # grow and verify a tree (the head has caught up)
    plain: list[Sequence] = field(default_factory=list)     # verify their root only
    feed: list[Sequence] = field(default_factory=list)      # sequences the head takes pending pairs from ...
    passes: list[list[tuple[int, int]]] = field(default_factory=list)  # ... per pass: (index into feed, pairs)
    tree: TreeConfig | None = None       # the drafted sequences' tree
    verify_cap: int | None = None        # the most tree nodes their verify pass takes (None: no cap)
    speculating: int = 0                 # sequences that may speculate: what picked the tree (and records it)
    sampled: bool = False    # its decode rows ran one mode (every speculating sequence drafted, or none did): their
    #                          time, less prompt chunks and head feeding, samples that mode for the measured choice
    steady: bool = False     # decode only, sampled, and the head fed no more than the step's own tokens: a whole
    #                          step of one mode, as the tuner's costs predict it
    one_pass: bool = False   # the step's target rows (prompt chunks, trees, plain roots) run as one pass, each
    #                          weight read once; the chunks then run after drafting, so the head takes their pairs
    #                          at a later step (else they run first, in a pass of their own)

    @property
    def joined(self) -> bool:
        """Prompt chunks run in the decode rows' target pass."""
        return self.one_pass and bool(self.prefill) and bool(self.decode)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


@dataclass(frozen=True)
class Feeding:
    """How the head takes its pending pairs: ``extend_budget`` padded tokens a pass, and a sequence may hold at most
    ``max_pending`` pairs before a step must feed them even while it does not draft."""
    extend_budget: int
    max_pending: int = 1024


MAX_EXTEND_PASSES = 2   # head passes a step may run to feed pending pairs: the steady few pairs of every
                        # sequence, and one bounded pass of catch-up (a new prompt, or a return from plain steps)


def extend_passes(pending: list[int], budget: int) -> list[list[tuple[int, int]]]:
    """How the head consumes pending pairs in passes of at most ``budget`` padded tokens: per pass, (index into
    ``pending``, pairs taken). Shortest first, so a decode step's few pairs share one pass and a new prompt's
    thousands take the following ones."""
    left = {i: n for i, n in enumerate(pending) if n}
    todo, passes = list(left), []
    while todo:
        todo.sort(key=lambda i: left[i])
        group, width = [], 0
        for i in todo:
            w = max(width, min(left[i], budget))
            if group and (len(group) + 1) * w > budget:
                break
            group.append(i)
            width = w
        taken = [(i, min(left[i], width)) for i in group]
        for i, n in taken:
            left[i] -= n
        passes.append(taken)
        todo = [i for i in todo if left[i]]
    return passes


def fed_in_full(pending: list[int], passes: list[list[tuple[int, int]]]) -> list[bool]:
    """Which sequences ``passes`` leave with no pending pair."""
    taken = [0] * len(pending)
    for group in passes:
        for i, n in group:
            taken[i] += n
    return [t == n for t, n in zip(taken, pending)]


def plan_decode(plan: StepPlan, policy: TreePolicy, feeding: Feeding | None, room: int | None = None) -> StepPlan:
    """Complete ``plan`` (its chunks and decoding sequences chosen): the tree and cap of its speculative sequences
    (``room``: the verify tokens the step's prompt chunks leave them), the head passes that feed them (and this
    step's prompt chunks) their pending pairs, and which of them grow a tree: those the passes leave with none
    pending. The rest verify their root only."""
    spec = [s for s in plan.decode if s.speculative] if feeding else []
    plan.speculating = n = len(spec)
    tree = policy.step_tree(n) if spec else None
    cap = policy.verify_cap(n, room) if spec else None
    drafting = bool(spec) and not is_plain(tree) and not (cap is not None and cap < 2 * n)
    # a chunk prefilled this step adds a pending pair per token before the head runs, unless it joins the decode
    # rows' pass (it then runs after drafting: the head takes those pairs at a later step)
    chunked = {id(c.seq): 0 if plan.joined else c.end - c.start for c in plan.prefill if c.seq.speculative} \
        if feeding else {}
    prompts = [c.seq for c in plan.prefill if id(c.seq) in chunked]
    pending = {id(s): len(s.pending) + chunked.get(id(s), 0) for s in spec + prompts}
    if drafting:
        feed, most = spec + prompts, MAX_EXTEND_PASSES
    else:
        feed, most = [s for s in spec + prompts if pending[id(s)] >= feeding.max_pending] if feeding else [], 1
    counts = [pending[id(s)] for s in feed]
    passes = extend_passes(counts, feeding.extend_budget)[:most] if feed else []
    done = dict(zip(map(id, feed), fed_in_full(counts, passes)))
    plan.drafted = [s for s in spec if done.get(id(s))] if drafting else []
    drafted = set(map(id, plan.drafted))
    plan.plain = [s for s in plan.decode if id(s) not in drafted]
    plan.feed, plan.passes = feed, passes
    plan.tree, plan.verify_cap = tree, cap
    plan.sampled = bool(plan.decode) and (len(plan.drafted) == n if drafting else True)
    plan.steady = not plan.prefill and plan.sampled and (
        all(pending[id(s)] <= max_emitted(tree) for s in spec) if drafting else not passes)
    return plan


def plan_chunks(prompts: list[Sequence], budget: int) -> list[PrefillChunk]:
    """Prompt chunks for one padded pass of at most ``budget`` tokens (rows x width), oldest prompts first.

    Of every row count R the width is ``min(budget // R, longest remaining prompt of the first R)``; the R that
    runs the most real tokens wins (a short prompt does not narrow a long one's chunk to its own length).
    """
    remaining = [prefill_end(s) - s.prefilled for s in prompts]   # a shared prefix's end may pause one
    best, best_useful = (0, 0), 0
    for rows in range(1, len(prompts) + 1):
        width = min(budget // rows, max(remaining[:rows]))
        if width < 1:
            break
        useful = sum(min(r, width) for r in remaining[:rows])
        if useful > best_useful:
            best, best_useful = (rows, width), useful
    rows, width = best
    return [PrefillChunk(s, s.prefilled, s.prefilled + min(r, width)) for s, r in zip(prompts[:rows], remaining)]


MIN_PREFILL = 16  # prompt tokens a step runs even when decoding fills its budget: waiting prompts always progress


class Scheduler:
    def __init__(self, num_slots: int, step_budget: int, policy: TreePolicy, feeding: Feeding | None = None,
                 one_pass: bool = False, prefix_sharing: bool = True):
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []          # in slot order after defragment()
        self.prefilling: list[Sequence] = []       # running sequences still in their prompt, oldest first
        self.free = list(range(num_slots))
        self.step_budget = step_budget
        self.policy = policy                       # the tree and verify cap of a step, by its batch size
        self.feeding = feeding                     # how the head takes its pairs (None: no head)
        self.max_running: int | None = None  # run fewer sequences than there are slots (benchmarks of batch size)
        self.one_pass = one_pass                   # StepPlan.one_pass of every step
        self.prefix_sharing = prefix_sharing       # prompts copy the start they share with a running sequence

    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` behind every waiting sequence of its priority or lower (vLLM's: lower is earlier), so
        equal priorities keep their arrival order and a request's samples stay together."""
        at = len(self.waiting)
        while at and self.waiting[at - 1].params.priority > seq.params.priority:
            at -= 1
        self.waiting.insert(at, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, max_len: int, fork=None) -> StepPlan:
        """Admit waiting requests, then plan this step: a decode step for every sequence past its prompt, prompt
        chunks in the rest of the step's budget, and the trees (``plan_decode``). A speculative sequence whose next
        tree could overrun its slot decodes plainly from then on, so it ends where plain decoding would; one whose
        next token cannot fit finishes with ``length``. With prompt chunks in the step, the speculative sequences'
        verify tokens (their roots included) take only what the chunks leave. A sequence sharing its prompt's start
        with others (``engine/samples.py``), or with any sequence in a slot (``engine/prefix_sharing.py``), copies it
        with ``fork`` where another holds it."""
        self._admit()
        share_prefixes(self.prefilling, fork)
        room = {True: self.policy.max_verify_budget(), False: 1}   # verify tokens a sequence's step may take
        decode = []
        for s in self.running:
            if s.finished or s.in_prefill:
                continue
            if s.speculative and s.cached_len + room[True] > max_len:
                s.speculative = False    # the context's last tokens: one a step, and no more head inputs
                s.pending.clear()
                s.draft_hidden = None
            if s.cached_len + room[s.speculative] > max_len:
                s.finish_reason = "length"
            else:
                decode.append(s)
        # not those waiting for a shared prefix, nor one paused at its end until they copy it
        prompts = [s for s in self.prefilling if s.fork_ready and prefill_end(s) > s.prefilled]
        if not prompts:
            return plan_decode(StepPlan([], decode, one_pass=self.one_pass), self.policy, self.feeding)
        chunks = plan_chunks(prompts, max(MIN_PREFILL, self.step_budget - len(decode)))
        if self.prefix_sharing and fork is not None:
            share_running_prefixes(chunks, self.running, fork)
        n_spec = sum(s.speculative for s in decode)
        prompt_tokens = len(chunks) * max(c.end - c.start for c in chunks)   # the pass is padded
        left = self.step_budget - prompt_tokens - (len(decode) - n_spec)
        return plan_decode(StepPlan(chunks, decode, one_pass=self.one_pass), self.policy, self.feeding,
                           max(n_spec, left) if n_spec else None)

    def _admit(self) -> None:
        """Waiting sequences enter free slots, lowest slot first (batches stay contiguous when they can)."""
        while self.waiting and self.free and (self.max_running is None or len(self.running) < self.max_running):
            seq = self.waiting.popleft()
            seq.slot = self.free.pop(0)
            seq.prefilled = 0
            self.running.append(seq)
            self.prefilling.append(seq)

    def prefill_done(self, seq: Sequence) -> None:
        self.prefilling.remove(seq)

    def defragment(self) -> list[tuple[int, int]]:
        """Move running sequences from the highest slots into free lower ones; returns the ``(src, dst)`` slot moves
        for the caches to copy.

        With the running sequences in slots ``0..n-1`` (and listed in slot order) a forward reads the KV cache as
        one slice instead of gathering every slot's keys and values each layer, each step.
        """
        moves = []
        self.running.sort(key=lambda s: s.slot)
        while self.free and self.running and self.free[0] < self.running[-1].slot:
            seq, dst = self.running.pop(), self.free.pop(0)
            moves.append((seq.slot, dst))
            bisect.insort(self.free, seq.slot)
            seq.slot = dst
            bisect.insort(self.running, seq, key=lambda s: s.slot)
        return moves

    def retire_finished(self) -> list[Sequence]:
        done = [s for s in self.running if s.finished]
        for seq in done:
            self._release(seq)
        return done

    def abort(self, request_id: str) -> Sequence | None:
        """Drop a request wherever it is; returns it (finish reason ``abort``) or None if unknown."""
        for seq in list(self.waiting):
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.finish_reason = "abort"
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                seq.finish_reason = "abort"
                self._release(seq)
                return seq
        return None

    def _release(self, seq: Sequence) -> None:
        self.running.remove(seq)
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        bisect.insort(self.free, seq.slot)
        seq.slot = -1
