"""The A/B harness of every bench entry point: runs that take turns, so a machine whose speed drifts slows each run
alike, and one way to write a result file that says what ran, on what, and with which command.

- :func:`interleaved`: item by item, the runs in turn, the order reversed every other item (A B, B A, ...);
- :func:`rounds`: whole runs, A B B A ... over a number of rounds;
- :func:`timed` and :func:`median_seconds`: a call's wall time, and the median of repeated calls;
- :func:`hardware`: the device's and CPU's names, torch version, threads, machine;
- :func:`write_result`: a result as JSON with ``hardware`` and ``command`` (the exact command line) added;
- :func:`run_entry` and :func:`subcommand`: an entry point's main and subcommands, and its one-line errors.

A module, not a command: ``bench/speed.py``, ``acceptance.py``, ``costs.py``, ``load.py`` and ``fidelity.py``'s
eagle-ray side (``against_reference.py``, ``lossless.py``) import it as a sibling (``python bench/<entry>.py`` puts bench/ first on the import path; ``repo_root`` adds the repository
root, so nothing needs installing).
"""
from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import repo_root  # noqa: F401 - the repository root on the import path, before eagle_ray is imported
import torch

from eagle_ray.errors import CheckpointError, ConfigError
from eagle_ray.model.device import cpu_model, device_name


def interleaved(runs: dict[str, Callable[[int], object]], n: int) -> tuple[dict[str, list], dict[str, list[float]]]:
    """Times every run on items ``0..n-1`` item by item, the runs in turn and in reverse order every other item
    (A B C, C B A), so a slow stretch of a shared machine lands on every run alike and each item's ratio compares
    neighbouring timings. ``runs[name](i)`` does run ``name`` on item ``i``; returns outputs and wall seconds per
    run."""
    names = list(runs)
    outs: dict[str, list] = {m: [] for m in names}
    walls: dict[str, list[float]] = {m: [] for m in names}
    for i in range(n):
        for m in names if i % 2 == 0 else names[::-1]:
            out, seconds = timed(runs[m], i)
            outs[m].append(out)
            walls[m].append(seconds)
    return outs, walls


def rounds(runs: dict[str, Callable[[], object]], k: int) -> tuple[dict[str, list], dict[str, list[float]]]:
    """Each run whole, ``k`` times, in the order A B B A ...: the output and wall seconds of every round, per run."""
    return interleaved({m: (lambda i, f=f: f()) for m, f in runs.items()}, k)


def timed(fn: Callable, *args, **kwargs) -> tuple[object, float]:
    """``fn(*args, **kwargs)`` and its wall seconds."""
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    return statistics.median(timed(fn)[1] for _ in range(repeats))


def hardware(device="cpu") -> dict:
    """What a result ran on: the device's name (the CPU's model on CPU), the CPU, torch, threads, machine."""
    return {"device": device_name(device), "cpu": cpu_model(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "machine": platform.machine(), "python": platform.python_version()}


def command_line(script: str, argv: list[str]) -> str:
    return shlex.join(["python", script, *argv])


def write_result(path: str | Path | None, result: dict, command: str, device="cpu") -> dict:
    """``result`` with ``hardware`` and ``command`` added, written as JSON to ``path`` (nothing written if None)."""
    result = {"command": command, "hardware": hardware(device), **result}
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=1, default=str) + "\n")
    return result


def subcommand(sub, name: str, run: Callable, help: str, out_required: bool = False) -> argparse.ArgumentParser:
    """A subcommand whose function ``run(a)`` answers it, with its ``--out`` (the result JSON)."""
    p = sub.add_parser(name, help=help)
    p.add_argument("--out", required=out_required, default=None)
    p.set_defaults(run=run)
    return p


def run_entry(doc: str, script: str, subcommands, argv: list[str] | None = None) -> int:
    """An entry point's main: its docstring as help, each of ``subcommands(sub)`` adding its parsers, then the chosen
    subcommand run with ``a.command`` set to the command line. What the user gave wrong (a ConfigError or
    CheckpointError) is said in one line, exit status 2, as ``eagle-ray`` does."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="question", required=True, metavar="SUBCOMMAND")
    for add in subcommands:
        add(sub)
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parser.parse_args(argv)
    a.command = command_line(script, argv)
    try:
        return a.run(a) or 0
    except (ConfigError, CheckpointError) as e:
        print(f"{script} {a.question}: {e}", file=sys.stderr)
        return 2


def check_out(path: str | None, directory: bool = False) -> None:
    """Refuse, before anything runs, an output path that could not be written at the end."""
    from eagle_ray.config import out_path_problem
    problem = path and out_path_problem(path, directory=directory)
    if problem:
        raise ConfigError(f"--out {problem}")
