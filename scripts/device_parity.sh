#!/usr/bin/env bash
# The GPU script's CPU smoke run on the NVIDIA device image's versions (Python 3.12, torch 2.11.0, transformers
# 5.17.0), before any GPU time is spent: what breaks on those versions and not on the repository's own breaks here.
# Not run in CI (the venv is about 5 GB: PyPI's Linux torch wheel is a CUDA build, which runs on the CPU).
#
#     bash scripts/device_parity.sh bench/results/<hardware>      # e.g. bench/results/epyc-avx2-2core
#
# Makes (once) a venv with torch, transformers, pyarrow and what they pull in (on bench/device/packages.txt), fetches
# the carried wheels (scripts/device_wheels.sh) and installs them into a target folder as bench/device/run.sh does on
# the device, then runs the smoke from the repository root with that folder on PYTHONPATH and nothing installed, four
# times: the CPU's device table as it is, and the CUDA row forced on the CPU (--cuda-defaults-on-cpu: key-length
# buckets, step sizes, fused layers, restricted SDPA), each in fp32 and bf16. Each run's JSON lines go to
# <results>/gpu_step_smoke_torch2.11_<table>_<dtype>.jsonl, and pass/fail with seconds to gpu_step_smoke_torch2.11.json.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${1:?usage: bash scripts/device_parity.sh bench/results/<hardware>}
VENV=${EAGLE_RAY_PARITY_VENV:-/tmp/eagle-ray-torch2.11}
SITE=${VENV}-site
PY312=${PY312:-/root/.pyenv/versions/3.12.1/bin/python3.12}
SMOKE="--device cpu --shapes tiny --batches 1,2 --steps 2 --context 32 --prompts 3 --tokens 8 --probe-steps 2"   # the fast tier's

# torch and transformers at the device's versions, and the one other image package the run imports (pyarrow, through
# eagle_ray.batch); what they pull in is on the image's list too
[ -x "$VENV/bin/python" ] || "$PY312" -m venv "$VENV" || exit 1
"$VENV/bin/python" -m pip install -q torch==2.11.0 transformers==5.17.0 pyarrow==26.0.1 || exit 1
bash scripts/device_wheels.sh > /dev/null || exit 1
rm -rf "$SITE"
"$VENV/bin/python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
  .whl/*.whl || exit 1
mkdir -p "$RESULTS"
runs=()
for table in as-is cuda-defaults; do
  for dtype in float32 bfloat16; do
    short=$([ "$dtype" = float32 ] && echo fp32 || echo bf16)
    out="$RESULTS/gpu_step_smoke_torch2.11_${table}_${short}.jsonl"
    flags="$SMOKE --dtype $dtype $([ "$table" = cuda-defaults ] && echo --cuda-defaults-on-cpu)"
    echo "== $table $dtype: python bench/gpu_step.py $flags --out $out"
    start=$(date +%s%N)
    PYTHONPATH="$SITE" "$VENV/bin/python" bench/gpu_step.py $flags --out "$out" > "/tmp/gpu_step_parity_${table}_${short}.log" 2>&1
    rc=$?
    ms=$(( ($(date +%s%N) - start) / 1000000 ))
    tail -3 "/tmp/gpu_step_parity_${table}_${short}.log"
    runs+=("$table $dtype $rc $ms $out python bench/gpu_step.py $flags --out $out")
  done
done
printf '%s\n' "${runs[@]}" | PYTHONPATH="$SITE" "$VENV/bin/python" -c '
import json, platform, sys
import torch, transformers
sys.path.insert(0, "bench")
import repo_root  # noqa: F401
from eagle_ray.model.device import cpu_model
runs = []
for row in sys.stdin.read().splitlines():
    table, dtype, rc, ms, out, command = row.split(" ", 5)
    try:
        lines = [json.loads(x) for x in open(out)]
    except (OSError, ValueError):
        lines = []
    errors = [x["section"] + ": " + x["error"] for x in lines if "error" in x]
    fid = next((x for x in lines if x["section"] == "fidelity" and "prompts" in x), {})
    flex = next((x for x in lines if x["section"] == "fidelity_flex" and "prompts" in x), {})
    equal = {k: fid.get(k) for k in ("eagle_equals_plain", "fused_equals_modules", "graphs_eagle_equal_eager",
                                     "graphs_plain_equal_eager")} | {"flex_equals_modules": flex.get("flex_equals_modules")}
    done = bool(lines) and lines[-1]["section"] == "done"
    ok = rc == "0" and done and not errors and all(v == fid.get("prompts") for v in equal.values())
    runs.append({"table": table, "dtype": dtype, "pass": ok, "seconds": round(int(ms) / 1e3, 1), "exit": int(rc),
                 "prompts": fid.get("prompts"), "equal": equal, "errors": errors, "file": out.rsplit("/", 1)[-1],
                 "command": command})
result = {"what": "bench/gpu_step.py CPU smoke on the device image versions, run from the repository root with the "
                  "carried wheels on PYTHONPATH and nothing installed (scripts/device_parity.sh)",
          "command": "bash scripts/device_parity.sh " + sys.argv[1],
          "hardware": {"cpu": cpu_model(), "python": platform.python_version(), "torch": torch.__version__,
                       "transformers": transformers.__version__, "threads": torch.get_num_threads()},
          "runs": runs, "pass": all(r["pass"] for r in runs)}
open(sys.argv[1] + "/gpu_step_smoke_torch2.11.json", "w").write(json.dumps(result, indent=1) + "\n")
print(json.dumps([{k: r[k] for k in ("table", "dtype", "pass", "seconds", "errors")} for r in runs], indent=1))
sys.exit(0 if result["pass"] else 1)
' "$RESULTS"
