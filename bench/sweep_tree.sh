#!/usr/bin/env bash
# Batch-1 tree-shape sweep on the embedded pair: every configuration runs EAGLE and plain decoding over the same
# MT-bench first turns in one process, so the speedup is a same-run ratio. Results: bench/results/sweep_*.json
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPTS=${PROMPTS:-../shared/benchmarks/eagle/mt_bench.jsonl}
N=${N:-8}; TOK=${TOK:-96}; DTYPE=${DTYPE:-float32}
run() {  # name, then tree args
  local name=$1; shift
  .venv/bin/eagle-ray measure --prompts "$PROMPTS" --num-prompts "$N" --max-new-tokens "$TOK" --dtype "$DTYPE" \
    --threads 2 "$@" --out "bench/results/sweep_${DTYPE}_${name}.json" > /dev/null 2>&1
  .venv/bin/python - "$name" "bench/results/sweep_${DTYPE}_${name}.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[2]))["summary"]
print(f"{sys.argv[1]:>14} tau {s['tau_mean']:.2f}  spec {s['spec_tok_s']:.1f} tok/s  plain {s['plain_tok_s']:.1f} tok/s"
      f"  speedup {s['speedup_median']:.2f}  split {json.dumps({k: round(v, 2) for k, v in s['time_split'].items()})}")
PY
}
CONFIGS=${CONFIGS:-"dyn-6-2-2 dyn-8-2-3 dyn-12-3-4 dyn-16-4-4 dyn-24-5-6 chain-2 chain-3 static"}
for c in $CONFIGS; do
  case $c in
    dyn-*) IFS=- read -r _ t d k <<< "$c"; run "$c" --total-tokens "$t" --depth "$d" --top-k "$k" ;;
    chain-*) run "$c" --tree-mode chain --depth "${c#chain-}" ;;
    static) run static --tree-mode static ;;
  esac
done
