"""``jobs/batch.py`` that stops itself (SIGSTOP) right after it commits its ``STOP_AFTER_PARTS``-th part.

The job's fault tests signal a driver at a known point of its work (2 parts written, the rest still to run)
instead of polling the output folder for a part: on a fast machine the tiny pair finishes every row between two
polls, and a test that meant to kill a driver mid-run would kill a finished one.

Run as ``python tests/stopping_driver.py --config job.yaml`` with ``STOP_AFTER_PARTS`` set; the test waits for
the stop with :func:`wait_stopped`, then signals the process (SIGKILL, SIGTERM, SIGCONT).
"""
from __future__ import annotations

import os
import runpy
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def wait_stopped(pid: int, timeout_s: float = 300) -> None:
    """Until process ``pid`` is stopped (state T in /proc); raises if it exits or the time runs out first."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            raise AssertionError(f"process {pid} exited before it stopped") from None
        if state == "T":
            return
        if state in "ZX":
            raise AssertionError(f"process {pid} exited before it stopped")
        time.sleep(0.02)
    raise AssertionError(f"process {pid} did not stop within {timeout_s} s")


def acting_after_part(n: int, action):
    """``PartWriter._commit`` that calls ``action(writer, first_row)`` once the writer's ``n``-th part is written
    (``first_row``: that part's first row, a one-row table), whether or not the commit then raises."""
    from eagle_ray.batch.job import PartWriter
    commit = PartWriter._commit

    def committing_then_acting(self, *args, **kwargs):
        before, first_row = self.parts, self.buffer[0].slice(0, 1)
        try:
            return commit(self, *args, **kwargs)
        finally:
            if before < n <= self.parts:
                action(self, first_row)

    return committing_then_acting


if __name__ == "__main__":
    from eagle_ray.batch.job import PartWriter
    PartWriter._commit = acting_after_part(int(os.environ["STOP_AFTER_PARTS"]),
                                           lambda writer, row: os.kill(os.getpid(), signal.SIGSTOP))
    sys.argv[0] = str(ROOT / "jobs" / "batch.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
