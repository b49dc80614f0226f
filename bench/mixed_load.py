"""Mixed-length load through the batch job: prompts of 10 to 1,900 tokens at max_model_len 2048, continuous
batching at max batch 8, then the same prompts one at a time in-process; greedy fp32 outputs must be identical and
no row may fail.

    .venv/bin/python bench/mixed_load.py --rows 200 --out bench/results/mixed_load_200.json

Prompts are cut from the bundled CNN/DM articles (sum.jsonl) at token boundaries, lengths spread evenly over the
range and shuffled, so long prompts arrive while others are deep in their slots.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def mixed_prompts(tokenizer, n: int, lo: int, hi: int, seed: int = 0) -> list[str]:
    from eagle_ray.prompts import benchmark_path, read_jsonl
    corpus = "\n\n".join(t for r in read_jsonl(benchmark_path("sum")) for t in r["turns"])
    ids = tokenizer(corpus)["input_ids"]
    lengths = [round(lo + (hi - lo) * i / max(1, n - 1)) for i in range(n)]
    random.Random(seed).shuffle(lengths)
    out, pos = [], 0
    for k in lengths:
        if pos + k > len(ids):
            pos = 0
        out.append(tokenizer.decode(ids[pos:pos + k]))
        pos += k // 3 + 17
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=200)
    p.add_argument("--min-tokens", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=1900)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    import torch
    from transformers import AutoTokenizer

    from eagle_ray.config import SamplingParams, TreeConfig
    from eagle_ray.batch.config import JobConfig
    from eagle_ray.batch.job import read_output, run_job
    from eagle_ray.engine.engine import EagleEngine
    from eagle_ray.model.device import cpu_model
    from eagle_ray.model.loading import resolve_target
    from fsspec.implementations.local import LocalFileSystem

    tok = AutoTokenizer.from_pretrained(str(resolve_target(None)))
    prompts = mixed_prompts(tok, a.rows, a.min_tokens, a.max_tokens)
    work = Path(tempfile.mkdtemp(prefix="mixed-load-"))
    with open(work / "in.jsonl", "w") as f:
        for i, text in enumerate(prompts):
            f.write(json.dumps({"id": f"m{i}", "prompt": text}) + "\n")
    tree = TreeConfig()
    engine_cfg = {"dtype": "float32", "max_batch_size": a.batch_size, "max_model_len": 2048,
                  "tree": tree.model_dump(), "threads": a.threads}
    cfg = JobConfig(engine=engine_cfg, sampling={"max_new_tokens": a.max_new_tokens, "temperature": 0.0},
                    input={"uri": str(work / "in.jsonl")}, output={"uri": str(work / "out"), "rows_per_file": 50},
                    actors={"num_actors": 1, "num_cpus": a.threads, "batch_size": 8, "max_concurrent_batches": 4})
    t0 = time.perf_counter()
    summary = run_job(cfg)
    job_s = time.perf_counter() - t0
    rows = {r["id"]: r for r in read_output(LocalFileSystem(), str(work / "out")).to_pylist()}

    engine = EagleEngine.from_pretrained(dtype="float32", max_batch_size=1, max_model_len=2048, tree=tree,
                                         threads=a.threads)
    t0 = time.perf_counter()
    ref = engine.generate(prompts, SamplingParams(max_new_tokens=a.max_new_tokens, temperature=0.0))
    ref_s = time.perf_counter() - t0
    lengths = [len(o.prompt_token_ids) for o in ref]
    differ = [f"m{i}" for i, o in enumerate(ref) if rows[f"m{i}"]["output_token_ids"] != o.token_ids]
    result = {
        "cpu": cpu_model(), "threads": a.threads, "torch": torch.__version__, "dtype": "float32",
        "rows": a.rows, "prompt_tokens": {"min": min(lengths), "max": max(lengths), "mean": sum(lengths) / len(lengths)},
        "max_new_tokens": a.max_new_tokens, "max_model_len": 2048, "max_batch_size": a.batch_size, "tree": tree.model_dump(),
        "job": {"rows": summary["rows"], "errors": summary["errors"], "error_kinds": summary["error_kinds"],
                "wall_s": job_s, "generation_tokens_per_s": summary["generation_tokens_per_s"],
                "tau_mean": summary["tau_mean"]},
        "batch1_reference": {"wall_s": ref_s, "tokens": sum(len(o.token_ids) for o in ref)},
        "outputs_differing_from_batch1": differ,
        "finish_reasons": {k: sum(1 for r in rows.values() if r["finish_reason"] == k) for k in ("stop", "length")},
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0 if not differ and summary["errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
