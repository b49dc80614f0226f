"""Which side fp32 takes where bf16 greedy outputs part beyond a near-tie.

``eagle-ray measure --compare-hf`` lists, for a bf16 target, the prompts whose output leaves transformers' bf16
``generate()`` at a top-2 gap over one bf16 unit. For each, this regenerates ``generate()``'s prefix, then scores
both candidate tokens with the fp32 target: the exact model's preference says whose rounding went astray.

    .venv/bin/python bench/bf16_arbiter.py bench/results/<hardware>/lossless_bf16_40x128.json \
        --out bench/results/<hardware>/bf16_arbiter.json
"""
import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from eagle_ray.engine.engine import EagleEngine
from eagle_ray.model.device import cpu_model
from eagle_ray.prompts import first_turn_prompt, read_jsonl


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("measured", help="a bf16 `eagle-ray measure --compare-hf` result")
    p.add_argument("--prompts", default="eagle_ray/assets/benchmarks/mt_bench.jsonl")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    real = json.loads(Path(a.measured).read_text())["summary"]["mismatches_vs_hf"]["real"]
    engine = EagleEngine.from_pretrained(draft="none", dtype="float32", max_batch_size=1)
    records = {r["question_id"]: r for r in read_jsonl(a.prompts)}
    bf16 = AutoModelForCausalLM.from_pretrained(str(engine.target_dir), dtype=torch.bfloat16).eval()
    fp32 = AutoModelForCausalLM.from_pretrained(str(engine.target_dir), dtype=torch.float32).eval()
    rows = []
    for m in real:
        ids = engine.encode(first_turn_prompt(records[m["id"]]))
        with torch.inference_mode():
            gen = bf16.generate(torch.tensor([ids]), max_new_tokens=m["index"] + 1, do_sample=False)[0, len(ids):]
            assert int(gen[m["index"]]) == m["ref_token"], "generate() did not reproduce the measured output"
            logits = fp32(torch.tensor([ids + gen[: m["index"]].tolist()])).logits[0, -1]
        row = {"id": m["id"], "index": m["index"], "bf16_gap": m["gap"], "generate_token": m["ref_token"],
               "engine_token": m["got_token"], "fp32_argmax": int(logits.argmax()),
               "fp32_generate_minus_engine": float(logits[m["ref_token"]] - logits[m["got_token"]])}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"cpu": cpu_model(), "measured": a.measured, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
