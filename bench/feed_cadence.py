"""When a step's tree is plain, speculative sequences keep the head's (feature, token) pairs. The engine feeds them
lazily: only once a sequence holds ``max_pending`` of them (its memory bound) or a step drafts for it. Against a
bound of 32 pairs and a bound of 1 (fed every step, as eager feeding would), and plain decoding that keeps nothing
(the floor); same engine, same prompts, modes interleaved -> JSON. Besides tokens/s (which on a shared 2-core VM
moves by more than the head costs) each mode reports the head's work: tokens through its forward, padding included.

    .venv/bin/python bench/feed_cadence.py --batch-sizes 8 32 --out bench/results/<hardware>/feed_cadence.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from eagle_ray.config import PLAIN, EngineConfig, SamplingParams
from eagle_ray.engine.engine import EagleEngine
from eagle_ray.engine.tuning import trace_prompts
from eagle_ray.model.device import cpu_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    prompts = trace_prompts(a.num_prompts)
    params = SamplingParams(max_new_tokens=a.max_new_tokens, ignore_eos=True)
    modes = {"lazy": (True, None), "bound_32": (True, 32), "every_step": (True, 1), "plain_floor": (False, None)}
    rows = []
    for bs in a.batch_sizes:
        engine = EagleEngine.from_config(EngineConfig(dtype=a.dtype, max_batch_size=bs, threads=a.threads))
        engine.set_trees(PLAIN)
        lazy = engine.runner.max_pending
        head_tokens, forward = [0], engine.draft.forward

        def counted(tokens, *args, **kw):
            head_tokens[0] += tokens.numel()
            return forward(tokens, *args, **kw)
        engine.draft.forward = counted
        work = {}
        engine.generate(prompts[:2], SamplingParams(max_new_tokens=4))
        seconds, outputs = {m: [] for m in modes}, {}
        for _ in range(a.rounds):
            for mode, (speculative, every) in modes.items():
                engine.runner.max_pending = every or lazy
                head_tokens[0] = 0
                t0 = time.perf_counter()
                outs = engine.generate(prompts, params, speculative=speculative)
                seconds[mode].append(time.perf_counter() - t0)
                work[mode] = head_tokens[0]
                outputs[mode] = [o.token_ids for o in outs]
        tokens = sum(map(len, outputs["plain_floor"]))
        row = {"max_batch": bs, "tokens": tokens, "lazy_bound": lazy,
               **{f"{m}_tok_s": round(tokens / statistics.median(s), 2) for m, s in seconds.items()},
               **{f"{m}_head_tokens": n for m, n in work.items()},
               "same_output": all(o == outputs["plain_floor"] for o in outputs.values())}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del engine
    result = {"cpu": cpu_model(), "dtype": a.dtype, "threads": a.threads, "prompts": a.num_prompts,
              "max_new_tokens": a.max_new_tokens, "rounds": a.rounds, "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
