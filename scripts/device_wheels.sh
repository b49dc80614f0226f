#!/usr/bin/env bash
# The wheels the GPU run needs and the device image lacks (bench/device/wheels.txt), fetched here for the device's
# Python 3.12 on manylinux x86_64 into .whl/ (ignored by git; it travels with the working tree, `carry: [".whl"]`).
# One version of each: wheels of a name at another version are removed first (two would stop the install there).
#
#     bash scripts/device_wheels.sh        # then the device command of docs/benchmarks.md (bench/device/run.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
mkdir -p .whl
grep -v '^\s*#' bench/device/wheels.txt | grep -v '^\s*$' | while read -r spec; do
  name=${spec%%==*}
  version=${spec#*==}
  stem=$(echo "$name" | tr '[:upper:]-.' '[:lower:]__')   # a wheel file's name: lower case, '_' for '-' and '.'
  for old in .whl/*.whl; do
    [ -e "$old" ] || continue
    base=$(basename "$old" | tr '[:upper:]' '[:lower:]')
    if [[ "$base" == "${stem}-"* && "$base" != "${stem}-${version}-"* ]]; then rm -f "$old"; fi
  done
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$spec"
done
ls -l .whl
du -sh .whl
