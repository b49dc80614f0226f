"""The engine's share of a stream stall: the Serve stall load without Serve, HTTP or the attacker.

16 client threads stream prompts of 10 to 1,900 tokens (64 new tokens, greedy) through one in-process
RequestQueue (max batch 8, max_model_len 2048, fp32) for --duration seconds. Reported: each stream's longest gap
between two text chunks, and the wall time of every engine step. Compare with bench/serve_stall.py on the same
machine to see what the Serve path adds.

    .venv/bin/python bench/engine_stall.py --budget 64 --out bench/results/<hardware>/engine_stall_64.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=int, default=None, help="max_step_tokens (default: the device's)")
    p.add_argument("--tree", default="8,2,3", help="total_tokens,depth,top_k")
    p.add_argument("--duration", type=float, default=90)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    from eagle_ray.config import SamplingParams, TreeConfig
    from eagle_ray.engine.engine import EagleEngine
    from eagle_ray.engine.queue import RequestQueue
    from eagle_ray.model.device import cpu_model
    from mixed_load import mixed_prompts

    total, depth, top_k = (int(x) for x in a.tree.split(","))
    tree = TreeConfig(total_tokens=total, depth=depth, top_k=top_k)
    engine = EagleEngine.from_pretrained(dtype="float32", max_batch_size=8, max_model_len=2048, tree=tree, threads=2,
                                         max_step_tokens=a.budget)
    prompts = mixed_prompts(engine.tokenizer, 48, 10, 1900)
    queue = RequestQueue(engine)
    gaps, steps, stop = [], [], time.time() + a.duration
    step = engine.step

    def timed_step():
        t = time.perf_counter()
        try:
            return step()
        finally:
            steps.append(time.perf_counter() - t)
    engine.step = timed_step

    def client(i: int) -> None:
        n = i
        while time.time() < stop:
            times = [time.perf_counter() for d in queue.stream(prompts[n % len(prompts)],
                                                              SamplingParams(max_new_tokens=64, temperature=0))
                     if d.text]
            n += 16
            gaps.append(max((b - x for x, b in zip(times, times[1:])), default=0.0))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    queue.shutdown()
    gaps.sort()
    steps.sort()
    result = {"cpu": cpu_model(), "tree": tree.model_dump(), "step_budget": engine.scheduler.step_budget,
              "streams": len(gaps), "max_stall_s": gaps[-1], "median_stall_s": statistics.median(gaps),
              "streams_over_1s": sum(g > 1 for g in gaps), "steps": len(steps),
              "step_median_s": statistics.median(steps), "step_p90_s": steps[int(0.9 * (len(steps) - 1))],
              "step_max_s": steps[-1], "duration_s": a.duration}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
