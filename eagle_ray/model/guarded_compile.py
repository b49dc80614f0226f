"""``torch.compile`` behind a guard: a compile that fails, first or later, turns its key eager and says so.

torch.compile compiles again whenever a guard of the code it made fails (a new dtype, a new static size): a failure
then raises from inside a forward, and a function past ``recompile_limit`` compiles runs uncompiled without a word.
A :class:`GuardedCompile` is one such function (one of ``model/kernels.py``'s operations, flex attention): each call
names its key (a dtype; for flex, the static sizes too), and per key it counts the compiles the key's calls caused,
notices a call that ran uncompiled, and reports ``compiled`` or ``eager: why`` (:func:`compile_report`, what
bench/gpu_step.py writes). A key that failed runs the eager function from then on, with one warning; the other keys
stay compiled. The backend is an argument, so a test counts the compiles of the very same call sites without
Inductor (a counting backend).
"""
from __future__ import annotations

import collections
import warnings
from typing import Callable

import torch

from eagle_ray.errors import first_line

# Compiles one function may keep: torch's default (8) is per function, over every dtype and static shape it meets,
# and a run that passes it falls back silently. The engine's compiled functions count theirs in
# tests/test_compile_counts.py (their most over the GPU script's shapes, 8, is flex attention's at 4 static shapes).
RECOMPILE_LIMIT = 64

_REPORTED: dict[str, "GuardedCompile"] = {}   # what compile_report lists: the engine's own compiled functions


class GuardedCompile:
    """``fn`` through ``torch.compile(fn, backend=backend, **options)``, called as ``guarded(key, *args)``;
    ``eager`` (default ``fn``) runs where the key's compile failed. ``report``: listed by :func:`compile_report`."""

    def __init__(self, name: str, fn: Callable, backend="inductor", eager: Callable | None = None,
                 report: bool = False, **options):
        self.name, self.fn, self.eager = name, fn, eager or fn
        self.backend, self.options = backend, options
        self.status: dict[str, str] = {}        # per key (its label): "compiled", or "eager: why"
        self.compiles: collections.Counter = collections.Counter()   # per key (its label): graphs compiled
        self._compiled = None
        self._eager_keys: set = set()
        self._key = None
        self._ran = False
        if report:
            _REPORTED[name] = self

    def __call__(self, key, *args, **kwargs):
        if key in self._eager_keys:
            return self.eager(*args, **kwargs)
        if self._compiled is None:
            self._compiled = self._compile()
        self._key, self._ran = key, False
        try:
            out = self._compiled(*args, **kwargs)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - Dynamo, Inductor and Triton raise many types
            cause = getattr(e, "inner_exception", None) or e   # a backend's error comes wrapped
            self._fall_back(key, f"torch.compile failed ({type(cause).__name__}: {first_line(cause, 200)})")
            return self.eager(*args, **kwargs)
        if not self._ran:   # Dynamo ran the function uncompiled: the recompile limit, or a skip
            self._fall_back(key, "torch.compile left it uncompiled (recompile limit reached?)")
        elif label(key) not in self.status:
            self.status[label(key)] = "compiled"
        return out

    def _compile(self):
        # raised where the engine compiles, for its own functions: each of them counts its compiles (see above)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        inner = torch._dynamo.lookup_backend(self.backend)

        def counted(gm, example_inputs):
            self.compiles[label(self._key)] += 1
            compiled = inner(gm, example_inputs)

            def run(*args):
                self._ran = True
                return compiled(*args)
            return run
        counted.__name__ = getattr(inner, "__name__", type(inner).__name__)   # what torch's messages name
        return torch.compile(self.fn, backend=counted, **self.options)

    def _fall_back(self, key, why: str) -> None:
        self._eager_keys.add(key)
        self.status[label(key)] = f"eager: {why}"
        warnings.warn(f"{self.name} ({label(key)}) runs eagerly: {why}", stacklevel=3)


def label(key) -> str:
    """A key as reports write it: a dtype by its name, a named tuple as ``field=value`` (a dtype field bare)."""
    if isinstance(key, tuple) and hasattr(key, "_fields"):
        return " ".join(label(v) if isinstance(v, torch.dtype) else f"{f}={label(v)}" for f, v in zip(key._fields, key))
    return str(key).removeprefix("torch.")


def compile_report() -> dict[str, dict[str, dict]]:
    """Per compiled function of the engine and key: ``{"status": "compiled" | "eager: why", "compiles": n}``."""
    return {name: {key: {"status": g.status.get(key, "not run"), "compiles": g.compiles[key]}
                   for key in sorted(set(g.status) | set(g.compiles))}
            for name, g in _REPORTED.items()}
