"""Continuous batching: which sequences hold a KV slot, and what each of them does this step.

Waiting requests take free slots between steps. A prompt is prefilled in chunks: a step runs at most
``step_budget`` tokens: one token of every decoding sequence, prompt chunks (oldest first, padded) in what is left
(at least ``MIN_PREFILL``), and draft tree tokens only in the room the prompts leave. A 2,000-token prompt arriving
mid-stream so delays the running streams by a bounded chunk per step, never by its whole prefill; and tree tokens
never displace prompt tokens: in a full pass, where a token costs about the same wherever it sits, a tree of ``t``
nodes buys ``tau < t`` tokens with ``t - 1`` prompt tokens that must run later anyway, a loss. Finished or
aborted sequences leave at once. Memory is bounded up front: the KV cache has ``num_slots`` rows of ``max_len``
positions, and a request that cannot fit one row is refused when it is added.
"""
from __future__ import annotations

import bisect
import collections
from dataclasses import dataclass

from eagle_ray.engine.sequence import Sequence


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
    prefill: list[PrefillChunk]
    decode: list[Sequence]
    verify_room: int | None = None   # verify tokens the speculative sequences may take in all (None: no limit)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


def plan_chunks(prompts: list[Sequence], budget: int) -> list[PrefillChunk]:
    """Prompt chunks for one padded pass of at most ``budget`` tokens (rows x width), oldest prompts first.

    Of every row count R the width is ``min(budget // R, longest remaining prompt of the first R)``; the R that
    runs the most real tokens wins (a short prompt does not narrow a long one's chunk to its own length).
    """
    remaining = [len(s.prompt_ids) - s.prefilled for s in prompts]
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
    def __init__(self, num_slots: int, step_budget: int):
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []          # in slot order after defragment()
        self.prefilling: list[Sequence] = []       # running sequences still in their prompt, oldest first
        self.free = list(range(num_slots))
        self.step_budget = step_budget
        self.max_running: int | None = None  # run fewer sequences than there are slots (benchmarks of batch size)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, room: dict[bool, int], max_len: int) -> StepPlan:
        """Admit waiting requests, then plan this step: a decode step for every sequence past its prompt and prompt
        chunks in the rest of the step's budget. ``room[speculative]`` is the most verify tokens a sequence's step
        takes. A speculative sequence whose next tree could overrun its slot decodes plainly from then on, so it
        ends where plain decoding would; one whose next token cannot fit finishes with ``length``. With prompt
        chunks in the step, ``verify_room`` is what they leave the speculative sequences (their roots included)."""
        self._admit()
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
        if not self.prefilling:
            return StepPlan([], decode)
        chunks = plan_chunks(self.prefilling, max(MIN_PREFILL, self.step_budget - len(decode)))
        n_spec = sum(s.speculative for s in decode)
        prompt_tokens = len(chunks) * max(c.end - c.start for c in chunks)   # the pass is padded
        left = self.step_budget - prompt_tokens - (len(decode) - n_spec)
        return StepPlan(chunks, decode, max(n_spec, left) if n_spec else None)

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
