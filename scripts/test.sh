#!/usr/bin/env bash
# Second command of the README (and what CI runs): set up, then the whole test suite, the embedded-model tests
# included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export RAY_USAGE_STATS_ENABLED=0
.venv/bin/python -m pytest -q "$@"
