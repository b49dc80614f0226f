"""Why compiled forwards are slow here: their cost grows with the KV cache, eager's does not.

A tiny random Llama (2 layers, hidden 64) with a small and a large KV cache (8 slots x 256 or 4,096 positions):
one target pass of 8 tree tokens on a 128-token prefix, eager and through ``compile_forwards(..., "inductor")``,
median of 9. The K/V writes mutate the whole cache tensor, and the compiled graph pays per call in proportion to
that tensor.

    .venv/bin/python bench/compile_cache_size.py --out bench/results/<hardware>/compile_cache_size.json
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    import torch
    from tiny import save_target

    from eagle_ray.engine.engine import EagleEngine
    from eagle_ray.engine.tuning import verify_seconds
    from eagle_ray.model.compiled import compile_forwards
    from eagle_ray.model.device import cpu_model

    torch.set_num_threads(2)
    target = save_target(Path(tempfile.mkdtemp()), hidden=64, max_positions=8192)
    rows = []
    for max_len in (256, 4096):
        torch._dynamo.reset()
        engine = EagleEngine.from_pretrained(str(target), "none", dtype="float32", max_batch_size=8,
                                             max_model_len=max_len)
        eager = verify_seconds(engine, 1, 8, context=128, repeats=9)
        compile_forwards(engine.target, None, "inductor")
        verify_seconds(engine, 1, 8, context=128, repeats=2)          # compiles
        compiled = verify_seconds(engine, 1, 8, context=128, repeats=9)
        rows.append({"max_model_len": max_len, "kv_cache_mib": engine.target.cache.nbytes() / 2**20,
                     "eager_ms": 1e3 * eager, "compiled_ms": 1e3 * compiled})
        print(rows[-1], flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"cpu": cpu_model(), "torch": torch.__version__, "rows": rows,
                                       "command": "bench/compile_cache_size.py " + " ".join(sys.argv[1:])}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
