#!/usr/bin/env bash
# First command of the README: set up, then run the embedded default pair (SmolLM2-135M-Instruct + its EAGLE
# head) over the bundled demo prompts with EAGLE-2, printing one JSON line per request.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export RAY_USAGE_STATS_ENABLED=0
.venv/bin/eagle-ray generate --max-new-tokens 96 "$@"
