"""Continuous batching: which sequences hold a KV slot this step.

Waiting requests enter free slots between steps (and are prefilled together); finished or aborted ones leave and
free their slot at once. Memory is bounded up front: the KV cache has ``num_slots`` rows of ``max_len`` positions,
and a request that cannot fit one row is refused when it is added, never mid-run.
"""
from __future__ import annotations

import bisect
import collections

from eagle_ray.engine.sequence import Sequence


class Scheduler:
    def __init__(self, num_slots: int):
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.free = list(range(num_slots))
        self.max_running: int | None = None  # run fewer sequences than there are slots (benchmarks of batch size)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into free slots (lowest slot first, so batches stay contiguous when they can)."""
        admitted = []
        while self.waiting and self.free and (self.max_running is None or len(self.running) + len(admitted)
                                              < self.max_running):
            seq = self.waiting.popleft()
            seq.slot = self.free.pop(0)
            admitted.append(seq)
        self.running += admitted
        return admitted

    def pack(self) -> list[tuple[int, int]]:
        """Move running sequences from the highest slots into free lower ones; returns the ``(src, dst)`` moves.

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
        self.free.append(seq.slot)
        self.free.sort()
        seq.slot = -1

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)
