"""Benchmark job: EAGLE-2's Table 1 (methods x tasks x temperatures x batch sizes) on this machine.

    python jobs/benchmark.py --out bench/report --num-prompts 10 --max-new-tokens 128
    ray job submit --working-dir . -- python jobs/benchmark.py --ray --actor-gpus 1 --out bench/report  (one actor per method)

Writes ``results.parquet`` (one row per request), ``summary.json``, ``report.md`` and PNG plots. All options:
``eagle-ray benchmark --help``.
"""
from __future__ import annotations

import sys

from eagle_ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["benchmark", "--command", "python jobs/benchmark.py " + " ".join(sys.argv[1:])] + sys.argv[1:]))
