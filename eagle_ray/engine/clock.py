"""Wall time of a step's phases, without making the step wait for the device unless asked to profile."""
from __future__ import annotations

import time

import torch


class Clock:
    """Wall time of a step's phases. Without profiling a phase's time is the host's (on CUDA that is launch time:
    the step stays asynchronous). With profiling on CUDA, marks are CUDA events and a phase's time is an
    :class:`Elapsed` that :func:`resolve_times` turns into seconds after one synchronisation at the step's end."""

    def __init__(self, device: torch.device, profile: bool = False):
        self.events = profile and torch.device(device).type == "cuda"

    def __call__(self):
        if not self.events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return _Mark(event)


class _Mark:
    def __init__(self, event):
        self.event = event

    def __sub__(self, start: "_Mark") -> "Elapsed":
        return Elapsed([(start.event, self.event)])


class Elapsed:
    """A sum of event spans (and plain seconds), read only once the events have completed."""

    def __init__(self, spans: list):
        self.spans = spans

    def __add__(self, other) -> "Elapsed":
        if isinstance(other, Elapsed):
            return Elapsed(self.spans + other.spans)
        return Elapsed(self.spans + ([float(other)] if other else []))

    __radd__ = __add__

    def seconds(self) -> float:
        return sum(s if isinstance(s, float) else s[0].elapsed_time(s[1]) / 1000 for s in self.spans)


def resolve_times(times) -> None:
    """Turn a dataclass's :class:`Elapsed` fields into seconds (one synchronisation, only if there are any)."""
    lazy = [f for f, v in vars(times).items() if isinstance(v, Elapsed)]
    if lazy:
        torch.cuda.synchronize()
        for f in lazy:
            setattr(times, f, getattr(times, f).seconds())
