"""Eager against torch.compile (inductor) on the embedded pair, in one run: forward costs and batch-1 decoding.

Measures, eager first and then with ``compile_forwards(..., "inductor")`` on the same engine:
- the target's verify pass (batch 1 and 8, 1 and 8 tree tokens, 256-token prefix) and a draft tree (depth 2,
  top-k 3: draft extend plus three head levels), median of repeated runs (``engine/tuning.py``);
- greedy batch-1 decoding of MT-bench first turns (tokens/s), with the outputs compared token for token;
- the time spent compiling (the first calls after ``compile_forwards``).

    .venv/bin/python bench/compile_speed.py --out bench/results/<hardware>/compile_speed.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    import torch

    from eagle_ray.config import SamplingParams
    from eagle_ray.engine.engine import EagleEngine
    from eagle_ray.engine.tuning import draft_seconds, verify_seconds
    from eagle_ray.model.compiled import compile_forwards
    from eagle_ray.model.device import cpu_model
    from eagle_ray.prompts import first_turn_prompt, load_dataset

    engine = EagleEngine.from_pretrained(dtype=a.dtype, max_batch_size=8, threads=a.threads)
    prompts = [first_turn_prompt(r) for r in load_dataset("mt_bench")[1][: a.num_prompts]]
    params = SamplingParams(max_new_tokens=a.max_new_tokens)
    shapes = [(1, 1), (1, 8), (8, 1), (8, 8)]

    def forwards() -> dict:
        out = {f"verify_b{b}_w{w}_ms": 1e3 * verify_seconds(engine, b, w, repeats=7) for b, w in shapes}
        out["draft_tree_b1_ms"] = 1e3 * draft_seconds(engine, 1, 2, 3, repeats=7)
        out["draft_tree_b8_ms"] = 1e3 * draft_seconds(engine, 8, 2, 3, repeats=7)
        return out

    def decode() -> tuple[float, list]:
        engine.scheduler.max_running = 1
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        dt = time.perf_counter() - t0
        return sum(len(o.token_ids) for o in outs) / dt, [o.token_ids for o in outs]

    engine.generate(prompts[:1], SamplingParams(max_new_tokens=8))  # warm-up
    eager = forwards()
    eager_tps, eager_ids = decode()
    print("eager", eager, eager_tps, flush=True)

    compile_forwards(engine.target, engine.draft, "inductor")
    t0 = time.perf_counter()
    forwards()                                             # every shape compiles here (and in the warm-up below)
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=8))
    compile_s = time.perf_counter() - t0
    compiled = forwards()
    compiled_tps, compiled_ids = decode()
    print("compiled", compiled, compiled_tps, flush=True)

    result = {
        "what": "embedded pair, eager against torch.compile(fullgraph=True, dynamic=True, backend=inductor)",
        "cpu": cpu_model(), "threads": a.threads, "dtype": str(engine.target.dtype), "torch": torch.__version__,
        "command": "bench/compile_speed.py " + " ".join(sys.argv[1:]),
        "eager": eager, "compiled": compiled,
        "speedup": {k: eager[k] / compiled[k] for k in eager},
        "decode_batch1": {"prompts": a.num_prompts, "max_new_tokens": a.max_new_tokens,
                          "eager_tokens_per_s": eager_tps, "compiled_tokens_per_s": compiled_tps,
                          "speedup": compiled_tps / eager_tps, "same_tokens": eager_ids == compiled_ids},
        "compile_s": compile_s,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result["speedup"], indent=1), result["decode_batch1"], f"compile {compile_s:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
