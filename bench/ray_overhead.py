"""Ray overhead of the batch job: generated tokens/s of jobs/batch.py (one actor) against the same engine run
directly in this process, over the same prompts and settings, in the same run -> JSON.

    .venv/bin/python bench/ray_overhead.py --num-prompts 24 --max-new-tokens 64 --out bench/results/ray_overhead.json
"""
import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from eagle_ray.config import SamplingParams
from eagle_ray.batch.config import JobConfig
from eagle_ray.batch.job import run_job
from eagle_ray.engine.engine import EagleEngine
from eagle_ray.prompts import first_turn_prompt, read_jsonl


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", default="eagle_ray/assets/benchmarks/mt_bench.jsonl")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    records = read_jsonl(a.prompts)[: a.num_prompts]
    rows = [{"id": f"p{i}", "messages": first_turn_prompt(r)} for i, r in enumerate(records)]
    params = SamplingParams(max_new_tokens=a.max_new_tokens)

    engine = EagleEngine.from_pretrained(max_batch_size=a.batch_size, threads=a.threads)
    engine.generate([rows[0]["messages"]], SamplingParams(max_new_tokens=8))  # warm-up
    t0 = time.perf_counter()
    outs = engine.generate([r["messages"] for r in rows], params)
    direct_wall = time.perf_counter() - t0
    direct_tokens = sum(len(o.token_ids) for o in outs)
    del engine

    with tempfile.TemporaryDirectory() as d:
        inp = Path(d) / "in.jsonl"
        inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        cfg = JobConfig(engine={"max_batch_size": a.batch_size, "threads": a.threads},
                        sampling=params.model_dump(), input={"uri": str(inp)}, output={"uri": str(Path(d) / "out")},
                        actors={"num_actors": 1, "num_cpus": a.threads, "batch_size": a.batch_size,
                                "max_concurrent_batches": 2})
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        summary = run_job(cfg)
    result = {
        "prompts": len(rows), "max_new_tokens": a.max_new_tokens, "batch_size": a.batch_size, "threads": a.threads,
        "direct_tokens": direct_tokens, "direct_tok_s": direct_tokens / direct_wall,
        "job_tokens": summary["generated_tokens_this_run"],
        "job_generation_tok_s": summary["generation_tokens_per_s"],
        "job_end_to_end_tok_s": summary["generated_tokens_per_s"], "job_wall_s": summary["wall_s"],
    }
    result["ratio_generation"] = result["job_generation_tok_s"] / result["direct_tok_s"]
    result["ratio_end_to_end"] = result["job_end_to_end_tok_s"] / result["direct_tok_s"]
    print(json.dumps(result, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
