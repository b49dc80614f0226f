"""Serve under load: start the app on 127.0.0.1 (embedded pair by default), run 32 concurrent streaming clients
for 60 s, report TTFT p50/p99, tokens/s, errors and the engine's observed verify batch size -> JSON.

    .venv/bin/python bench/serve_load.py --out bench/results/serve_load.json
"""
import argparse
import asyncio
import json
import os
import time
from pathlib import Path

import httpx

from eagle_ray.serve.config import ServeConfig
from eagle_ray.prompts import first_turn_prompt, read_jsonl
from eagle_ray.serve.load import run_load


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/serve-embedded.yaml")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompts", default="eagle_ray/assets/benchmarks/mt_bench.jsonl")
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    import ray
    from ray import serve

    from eagle_ray.serve.app import build_app
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
    cfg = ServeConfig.from_yaml(a.config)
    cfg.port = a.port
    serve.start(http_options={"host": "127.0.0.1", "port": a.port})
    serve.run(build_app(json.loads(cfg.model_dump_json())), name="load", route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{a.port}"
    while True:
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(1)
    prompts = [first_turn_prompt(r)[0]["content"] for r in read_jsonl(a.prompts)]
    before = httpx.get(base + "/stats").json()
    result = asyncio.run(run_load(base + "/v1", cfg.model_name, prompts, a.clients, a.duration, a.max_tokens))
    after = httpx.get(base + "/stats").json()
    passes = after["decode_passes"] - before["decode_passes"]
    result["mean_verify_batch"] = (after["decode_sequences"] - before["decode_sequences"]) / passes if passes else 0
    result["free_slots_after"] = after["free_slots"]
    result["config"] = json.loads(cfg.model_dump_json())
    print(json.dumps({k: v for k, v in result.items() if k != "config"}, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    serve.shutdown()


if __name__ == "__main__":
    main()
