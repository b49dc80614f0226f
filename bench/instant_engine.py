"""A stand-in engine that answers every row at once with fixed tokens, so that the batch job's pipeline (Ray Data,
the actors' row handling, the driver's writes and summary) is measured alone.

:func:`install` replaces, in the process it runs in, what builds an actor's engine and what runs a row's turns:
the actor (``GenerateStage``) keeps its own parsing, error rows, metrics and output table, and each row gets
``EAGLE_RAY_INSTANT_TOKENS`` tokens (8 unless set) with its stats filled in as a real engine's would be. Pass it as
Ray's ``worker_process_setup_hook`` (:func:`ray_runtime_env`) and every actor of the job runs it; nothing in
``eagle_ray`` knows of it. A module, not a command.
"""
from __future__ import annotations

import os
import threading
import zlib
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

TOKENS_ENV = "EAGLE_RAY_INSTANT_TOKENS"


class InstantEngine:
    """What ``GenerateStage`` reads of an engine when rows never reach it: its config, no draft head (no online
    adaptation), the driving lock a ``RequestQueue`` takes, the codec's flag and the tree policy's summary."""

    def __init__(self, config):
        self.config = config
        self.draft = None
        self.driving = threading.Lock()
        self.codec = SimpleNamespace(split_special_tokens=False)
        self.policy = SimpleNamespace(summary=lambda: {"instant": True})

    def has_unfinished(self) -> bool:
        return False


def instant_answer(rid: str, tokens: int) -> dict:
    """A row's answer: ``tokens`` token ids and their text, and stats whose tau varies by row (1.0 to 4.99) so that
    the summary's percentiles have something to order."""
    from eagle_ray.stats import RequestStats
    tau = 1.0 + (zlib.crc32(rid.encode("utf-8", "surrogatepass")) % 400) / 100
    steps = max(1, round((tokens - 1) / tau))
    stats = RequestStats(verify_steps=steps, new_tokens=tokens, step_tokens=tokens - 1, tree_tokens=8 * steps,
                         accept_hist=[1, steps - 1] if steps > 1 else [1], accepted_per_depth=[steps - 1],
                         total_s=1e-3, ttft_s=1e-4)
    ids = [(i * 7) % 1000 for i in range(tokens)]
    d = stats.to_dict()
    d.pop("step_tokens")
    d.pop("tree_tokens")
    return {"output": " ".join(f"w{t}" for t in ids), "turn_outputs": None, "output_token_ids": ids,
            "prompt_tokens": 12, "output_tokens": tokens, "finish_reason": "length", **d}


async def _instant_run(self, req, row: dict, rid: str) -> None:
    """``GenerateStage.run`` without an engine: every turn answered at once."""
    answer = instant_answer(rid, int(os.environ.get(TOKENS_ENV, "8")))
    turns = len(req.turns or [None])
    answer["turn_outputs"] = [answer["output"]] * turns
    row.update(answer)


def install() -> None:
    """Make every actor in this process build an :class:`InstantEngine` and answer rows at once."""
    from eagle_ray.batch.stage import GenerateStage
    from eagle_ray.engine.engine import EagleEngine
    EagleEngine.from_config = classmethod(lambda cls, config, *a, **k: InstantEngine(config))
    GenerateStage.run = _instant_run


def ray_runtime_env(tokens: int, code: str | Path | None = None) -> dict:
    """The runtime environment of a Ray whose workers run the instant engine (answers of ``tokens`` tokens), with
    ``code`` (a checkout whose ``eagle_ray`` they import; this one's by default) and bench/ on their import path."""
    here = Path(__file__).resolve().parent
    path = [str(code)] if code else []
    path += [str(here)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"worker_process_setup_hook": "instant_engine.install",
            "env_vars": {TOKENS_ENV: str(tokens), "PYTHONPATH": os.pathsep.join(path)}}


def now() -> datetime:
    return datetime.now(timezone.utc)
