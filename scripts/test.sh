#!/usr/bin/env bash
# Second command of the README (and what CI runs): set up, then both test tiers: the fast tier (`pytest`: unit
# tests on tiny models, about 5 minutes on 2 cores) and the slow tier (`pytest -m slow`: a real local Ray, Serve over
# HTTP, S3 on moto, the embedded 135M model).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export RAY_USAGE_STATS_ENABLED=0
.venv/bin/python -m pytest -q --durations=30 "$@"
.venv/bin/python -m pytest -q -m slow --durations=30 "$@"
