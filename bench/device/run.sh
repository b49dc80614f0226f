#!/usr/bin/env bash
# The device command: the GPU script on an NVIDIA device machine, from a copy of the repository with the carried
# wheels (.whl/, scripts/device_wheels.sh) and nothing installed. docs/benchmarks.md quotes the call:
#
#     bash bench/device/run.sh            (carry: [".whl"], timeout_s: 600; results come back from $OUT)
#
# The wheels go to a target folder on the import path; the script's budget (540 s from its start) ends the run a
# minute under the 10-minute cap and `timeout` stops it at 575 s whatever happens; its JSON lines and log land in $OUT.
# Extra arguments go to bench/gpu_step.py (e.g. --budget-s 300 --shapes llama-3.1-8b).
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "run.sh: the carried wheels did not install (run scripts/device_wheels.sh and carry .whl)"; exit 3; }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$OUT/nvidia_smi.csv" 2>&1
timeout -k 10 575 python3 bench/gpu_step.py --out "$OUT/gpu_step.jsonl" "$@" 2>&1 | tee "$OUT/gpu_step.log"
