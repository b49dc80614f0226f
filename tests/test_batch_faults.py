"""A batch job survives what breaks engines: a row that breaks the engine every time becomes one error row while the
rest of its batch is answered, and a step that never returns fails the engine within its bound instead of hanging.

The job's actor is ``GenerateStage``; here it runs in this process (no Ray), exactly as an actor calls it."""
import asyncio
import json
import threading
import time

import pyarrow as pa
import pytest

from eagle_ray.batch.config import JobConfig
from eagle_ray.batch.rows import ENGINE_FAILED
from eagle_ray.batch.stage import GenerateStage
from eagle_ray.config import SamplingParams
from eagle_ray.engine.engine import EagleEngine
from eagle_ray.engine.queue import RequestQueue, StallBound
from eagle_ray.errors import EngineDeadError, EngineStalledError

POISON = "row-17"


def stage_for(tiny_dir, tmp_path, **actors) -> GenerateStage:
    cfg = JobConfig(engine={"target": str(tiny_dir), "draft": "random", "dtype": "float32", "max_batch_size": 8,
                            "max_model_len": 128, "tree": {"total_tokens": 6, "depth": 2, "top_k": 2}},
                    sampling={"max_new_tokens": 8, "ignore_eos": True},
                    input={"uri": str(tmp_path / "in.jsonl")}, output={"uri": str(tmp_path / "out")},
                    actors=actors)
    return GenerateStage(cfg.model_dump_json())


def poison(engine, row_id: str) -> list[int]:
    """Make ``engine`` raise in every step that runs ``row_id``'s request (as an input that breaks a kernel would);
    returns the list of step failures it caused."""
    step, failures = engine.step, []

    def broken():
        if any(s.request_id.startswith(row_id + "/") for s in engine.scheduler.running):
            failures.append(1)
            raise RuntimeError("an input this kernel cannot take")
        return step()

    engine.step = broken
    return failures


def batch_of(n: int) -> pa.Table:
    return pa.Table.from_pylist([{"id": f"row-{i}", "row_index": i, "error": None, "error_kind": None,
                                  "payload": json.dumps({"prompt": f"w{i % 50} w{(3 * i) % 50} w7"})}
                                 for i in range(n)])


def test_a_row_that_breaks_the_engine_every_time_costs_its_batch_only_that_row(tiny_dir, tmp_path):
    stage = stage_for(tiny_dir, tmp_path, row_retries=2)
    failures = poison(stage.engine, POISON)
    t0 = time.monotonic()
    rows = asyncio.run(stage(batch_of(64))).to_pylist()
    assert time.monotonic() - t0 < 120
    failed = [r for r in rows if r["error"]]
    assert [r["id"] for r in failed] == [POISON] and failed[0]["error_kind"] == ENGINE_FAILED
    assert "run alone (2 of 2 tries)" in failed[0]["error"] and "an input this kernel cannot take" in failed[0]["error"]
    assert len(failures) == 3                         # in the batch, then alone twice
    assert all(r["output_tokens"] == 8 for r in rows if not r["error"]) and len(rows) == 64
    assert stage.queue.healthy                        # the actor goes on with a restarted engine
    again = asyncio.run(stage(batch_of(4))).to_pylist()
    assert not any(r["error"] for r in again)
    stage.queue.shutdown(drain=False, timeout=10)


def test_the_restarted_engine_answers_as_a_fresh_one(tiny_dir, tmp_path):
    """Restarting forgets the failed requests and their cache; answers equal a fresh engine's."""
    stage = stage_for(tiny_dir, tmp_path)
    poison(stage.engine, POISON)
    rows = asyncio.run(stage(batch_of(20))).to_pylist()
    other = stage_for(tiny_dir, tmp_path)
    fresh = asyncio.run(other(batch_of(20))).to_pylist()
    assert [r["output_token_ids"] for r in rows if not r["error"]] == \
        [r["output_token_ids"] for r in fresh if r["id"] != POISON]
    for s in (stage, other):
        s.queue.shutdown(drain=False, timeout=10)


def test_a_stalled_step_fails_the_engine_within_its_bound(tiny_dir):
    engine = EagleEngine.from_pretrained(str(tiny_dir), "random", dtype="float32", max_batch_size=2)
    step, calls, stalled_at, release = engine.step, [], [], threading.Event()

    def stalls():
        calls.append(1)
        if len(calls) == 4:
            stalled_at.append(time.monotonic())
            release.wait(30)   # a kernel that does not return within the bound
        return step()

    engine.step = stalls
    queue = RequestQueue(engine, StallBound(floor_s=1.0, factor=0))   # 1 s, however long the steps before took
    future = queue.submit([5, 6, 7], SamplingParams(max_new_tokens=32, ignore_eos=True))
    try:
        with pytest.raises(EngineDeadError, match="past its bound"):
            future.result(timeout=30)
        assert stalled_at, f"an earlier step was failed: {queue.dead!r}"
        assert time.monotonic() - stalled_at[0] < 5 and not queue.healthy
    finally:
        release.set()
    assert isinstance(queue.dead, EngineStalledError) and "engine step 4" in str(queue.dead)


def test_the_stall_bound_follows_the_slowest_step():
    bound = StallBound(floor_s=120, factor=10)
    assert bound.seconds(0.5) == 120 and bound.seconds(30) == 300


def test_the_progress_line_says_rows_rates_tau_and_time_left_at_a_steady_cadence():
    from eagle_ray.batch.job import Progress
    now, lines = [0.0], []
    progress = Progress(200, every_s=10, print_fn=lines.append, clock=lambda: now[0])
    for step in range(1, 11):
        now[0] = 4.0 * step
        progress.add(pa.Table.from_pylist([{"output_tokens": 50, "verify_steps": 20, "tau": 2.5}] * 20))
    assert len(lines) == 4   # at 12, 24 and 36 s, and the last row at 40 s
    assert lines[0] == "eagle-ray job: 60/200 rows (30%), 5.00 rows/s, 250.0 tok/s, tau 2.50, ETA 28 s"
    assert lines[-1].startswith("eagle-ray job: 200/200 rows (100%)") and lines[-1].endswith("ETA 0 s")


class Ledger:
    """The pool's BatchLedger as the stage calls it (``await ledger.begin.remote(key)``), in this process."""

    def __init__(self, deaths: int):
        from eagle_ray.batch.stage import BatchLedger
        self.book, self.calls = BatchLedger(), []
        self.deaths = deaths
        outer = self

        class Method:
            def __init__(self, name):
                self.name = name

            def remote(self, key):
                outer.calls.append(self.name)
                if self.name == "begin":
                    for _ in range(outer.deaths):   # earlier starts that never ended: actors that died under it
                        outer.book.begin(key)
                    outer.deaths = 0
                result = getattr(outer.book, self.name)(key)
                if self.name == "end":
                    return None   # fire and forget, as the stage sends it

                async def done():
                    return result
                return done()
        self.begin, self.end = Method("begin"), Method("end")


def test_a_batch_under_which_three_actors_died_comes_back_as_engine_failed_rows_instead_of_running_again(tiny_dir,
                                                                                                         tmp_path):
    """Restarts and retries are unbounded (a lost node must not end the job), so a batch that kills every actor it
    runs on would loop for ever: the ledger counts the deaths, and the third ends it, with rows a resume runs
    again."""
    from eagle_ray.batch.stage import DEATHS_PER_BATCH, BatchLedger, batch_key
    book = BatchLedger()
    assert [book.begin("k") for _ in range(3)] == [0, 1, 2] and book.end("k") is None and book.begin("k") == 0
    stage = stage_for(tiny_dir, tmp_path)
    step, steps = stage.engine.step, []
    stage.engine.step = lambda: steps.append(1) or step()
    try:
        stage.ledger = Ledger(deaths=DEATHS_PER_BATCH - 1)   # two deaths: it runs again
        rows = asyncio.run(stage(batch_of(4))).to_pylist()
        assert [r["error_kind"] for r in rows] == [None] * 4 and steps
        assert stage.ledger.calls == ["begin", "end"] and not stage.ledger.book.open
        steps.clear()
        stage.ledger = Ledger(deaths=DEATHS_PER_BATCH)
        rows = asyncio.run(stage(batch_of(4))).to_pylist()
    finally:
        stage.queue.shutdown(drain=False, timeout=10)
    assert not steps and [r["id"] for r in rows] == [f"row-{i}" for i in range(4)]
    assert [r["error_kind"] for r in rows] == [ENGINE_FAILED] * 4
    assert rows[0]["error"].startswith("3 actors died while this row's batch ran on them")
    assert batch_key(batch_of(4).to_pylist()) != batch_key(batch_of(5).to_pylist())
