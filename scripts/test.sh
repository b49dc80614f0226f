#!/usr/bin/env bash
# Second command of the README (and what CI runs): set up, then both test tiers: the fast tier (`pytest`: unit
# tests on tiny models) and the slow tier (`pytest -m slow`: a real local Ray, Serve over HTTP, S3 on moto, the
# embedded 135M model); times measured per machine in docs/benchmarks.md ("Test time").
# Each tier runs on one test process per core, up to 4 (pytest-xdist; EAGLE_RAY_TEST_WORKERS overrides, 0 runs
# in this process); the fast tier's processes take tests from each other's queues as they run dry (worksteal), the
# slow tier keeps each file in one process, so a file's engines and Ray apps load once.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export RAY_USAGE_STATS_ENABLED=0
WORKERS=${EAGLE_RAY_TEST_WORKERS:-$(.venv/bin/python -c "import os; print(min(4, len(os.sched_getaffinity(0))))")}
.venv/bin/python -m pytest -q -n "$WORKERS" --dist worksteal --durations=30 "$@"
.venv/bin/python -m pytest -q -m slow -n "$WORKERS" --dist loadfile --durations=30 "$@"
