"""When a step's tree is plain, speculative sequences keep the head's (feature, token) pairs: fed to it every
``FEED_EVERY`` pairs in one bounded pass (accumulate-then-feed), or every step (``FEED_EVERY = 1``). Both against
plain decoding that keeps nothing (the floor), same engine, same prompts, modes interleaved -> JSON.

    .venv/bin/python bench/feed_cadence.py --batch-sizes 8 32 --out bench/results/<hardware>/feed_cadence.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import eagle_ray.engine.model_runner as model_runner
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
    accumulate = model_runner.FEED_EVERY
    modes = {f"accumulate_{accumulate}": (True, accumulate), "every_step": (True, 1), "plain_floor": (False, None)}
    rows = []
    for bs in a.batch_sizes:
        engine = EagleEngine.from_config(EngineConfig(dtype=a.dtype, max_batch_size=bs, threads=a.threads))
        engine.set_trees(PLAIN)
        engine.generate(prompts[:2], SamplingParams(max_new_tokens=4))
        seconds, outputs = {m: [] for m in modes}, {}
        for _ in range(a.rounds):
            for mode, (speculative, every) in modes.items():
                model_runner.FEED_EVERY = every or accumulate
                t0 = time.perf_counter()
                outs = engine.generate(prompts, params, speculative=speculative)
                seconds[mode].append(time.perf_counter() - t0)
                outputs[mode] = [o.token_ids for o in outs]
        model_runner.FEED_EVERY = accumulate
        tokens = sum(map(len, outputs["plain_floor"]))
        row = {"max_batch": bs, "tokens": tokens,
               **{f"{m}_tok_s": round(tokens / statistics.median(s), 2) for m, s in seconds.items()},
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
