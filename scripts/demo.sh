#!/usr/bin/env bash
# First command of the README: set up, then run the main job (jobs/batch.py, the Ray Data batch job) on the
# embedded default pair (SmolLM2-135M-Instruct + its EAGLE head) over the bundled demo prompts, on a local Ray
# bound to 127.0.0.1. Results: outputs/demo/part-*.parquet and outputs/demo/summary.json. Re-running resumes
# (nothing is generated twice); extra arguments go to jobs/batch.py (e.g. --output outputs/demo2).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export RAY_USAGE_STATS_ENABLED=0 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
.venv/bin/python jobs/batch.py --config configs/embedded.yaml "$@"
.venv/bin/python - <<'PY'
import pyarrow.parquet as pq, glob
files = sorted(glob.glob("outputs/demo/part-*.parquet"))
if files:
    t = pq.read_table(files[0], columns=["id", "output", "tau", "output_tokens"]).to_pylist()[0]
    print(f"\nfirst row ({t['id']}, tau {t['tau']:.2f}, {t['output_tokens']} tokens):\n{t['output'][:400]}")
PY
