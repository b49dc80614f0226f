"""Serve under a mixed-length load with hostile requests arriving: does any stream stall?

16 concurrent streaming clients send prompts of 10 to 1,900 tokens (max_model_len 2048, max batch 8), while an
attacker sends oversized bodies (3 MB and 20 MB), absurdly nested JSON, out-of-range sampling values and broken
JSON, and a prober reads /health. For every stream, the longest gap between two chunks after its first one is a
stall (waiting for a free slot before the first token is queueing, reported separately as time to first token).
After the load, one normal request must be served.

    .venv/bin/python bench/serve_stall.py --duration 120 --out bench/results/epyc-avx2-2core/serve_stall.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MODEL = "eagle-ray/smollm2-135m-instruct"


async def stream_client(http, base: str, prompts: list[str], i: int, stop_at: float, max_tokens: int, out: list):
    n = i
    while time.perf_counter() < stop_at:
        prompt = prompts[n % len(prompts)]
        n += 16
        t0 = time.perf_counter()
        times, finish, error = [], None, None
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        try:
            async with http.stream("POST", base + "/v1/completions", json=body, timeout=600) as r:
                if r.status_code != 200:
                    error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                else:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            error = chunk["error"]["message"]
                            break
                        if chunk["choices"][0].get("text"):
                            times.append(time.perf_counter())
                        finish = chunk["choices"][0].get("finish_reason") or finish
        except Exception as e:  # noqa: BLE001 - reported
            error = repr(e)[:200]
        gaps = [b - a for a, b in zip(times, times[1:])]
        out.append({"client": i, "ttft_s": (times[0] - t0) if times else None, "max_gap_s": max(gaps, default=0.0),
                    "chunks": len(times), "finish": finish, "error": error})


async def attacker(http, base: str, stop_at: float, out: list):
    big3 = {"model": MODEL, "prompt": "hello " * 500_000}                      # ~3 MB, under the body limit
    big20 = b'{"model": "' + MODEL.encode() + b'", "prompt": "' + b"x" * 20_000_000 + b'"}'
    attacks = [
        ("3 MB prompt", lambda: http.post(base + "/v1/completions", json=big3, timeout=120)),
        ("3 MB prompt, streamed", lambda: http.post(base + "/v1/completions", json=big3 | {"stream": True},
                                                    timeout=120)),
        ("20 MB body", lambda: http.post(base + "/v1/completions", content=big20,
                                         headers={"content-type": "application/json"}, timeout=120)),
        ("nested 100,000 deep", lambda: http.post(base + "/v1/completions", content=b'{"model": "m", "prompt": '
                                                  + b"[" * 100_000 + b"]" * 100_000 + b"}", timeout=60)),
        ("seed -1", lambda: http.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x", "seed": -1,
                                                                      "stream": True}, timeout=60)),
        ("top_k 2**40", lambda: http.post(base + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_k": 2**40}, timeout=60)),
        ("broken JSON", lambda: http.post(base + "/v1/completions", content=b'{"model": ', timeout=60)),
    ]
    i = 0
    while time.perf_counter() < stop_at:
        name, send = attacks[i % len(attacks)]
        i += 1
        t0 = time.perf_counter()
        try:
            r = await send()
            status, shaped = r.status_code, "error" in r.json()
        except Exception as e:  # noqa: BLE001
            status, shaped = repr(e)[:100], False
        out.append({"attack": name, "status": status, "openai_shaped": shaped, "s": time.perf_counter() - t0})
        await asyncio.sleep(0.5)


async def prober(http, base: str, stop_at: float, out: list):
    while time.perf_counter() < stop_at:
        t0 = time.perf_counter()
        r = await http.get(base + "/health", timeout=60)
        out.append(time.perf_counter() - t0 if r.status_code == 200 else None)
        await asyncio.sleep(0.25)


async def run(base: str, prompts: list[str], duration: float, max_tokens: int) -> dict:
    import httpx
    streams, attacks, health = [], [], []
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=32)
    async with httpx.AsyncClient(limits=limits) as http:
        stop_at = time.perf_counter() + duration
        await asyncio.gather(*(stream_client(http, base, prompts, i, stop_at, max_tokens, streams) for i in range(16)),
                             attacker(http, base, stop_at, attacks), prober(http, base, stop_at, health))
        r = await http.post(base + "/v1/completions", json={"model": MODEL, "prompt": "The capital of France is",
                                                            "max_tokens": 8, "temperature": 0}, timeout=120)
        after = {"status": r.status_code, "text": r.json()["choices"][0]["text"] if r.status_code == 200 else r.text}
    done = [s for s in streams if s["error"] is None]
    gaps = sorted(s["max_gap_s"] for s in done)
    return {
        "streams": len(streams), "stream_errors": [s for s in streams if s["error"]][:5],
        "max_stall_s": gaps[-1] if gaps else None, "p99_stall_s": gaps[int(0.99 * (len(gaps) - 1))] if gaps else None,
        "median_stall_s": statistics.median(gaps) if gaps else None,
        "streams_over_1s": sum(1 for g in gaps if g > 1.0),
        "ttft_median_s": statistics.median(s["ttft_s"] for s in done if s["ttft_s"] is not None) if done else None,
        "attacks": {name: {"statuses": sorted({str(a["status"]) for a in attacks if a["attack"] == name}),
                           "all_openai_shaped": all(a["openai_shaped"] for a in attacks if a["attack"] == name),
                           "max_s": max((a["s"] for a in attacks if a["attack"] == name), default=None)}
                    for name in sorted({a["attack"] for a in attacks})},
        "health_max_s": max((h for h in health if h is not None), default=None),
        "health_failures": sum(1 for h in health if h is None),
        "after_load": after,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=120)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    from ray import serve
    from transformers import AutoTokenizer

    from eagle_ray.serve.config import ServeConfig
    from eagle_ray.cluster import ensure_ray
    from eagle_ray.model.device import cpu_model
    from eagle_ray.model.numerics import step_tokens
    from eagle_ray.model.loading import resolve_target
    from eagle_ray.serve.app import build_app
    from mixed_load import mixed_prompts

    import httpx
    prompts = mixed_prompts(AutoTokenizer.from_pretrained(str(resolve_target(None))), 48, 10, 1900)
    cfg = ServeConfig(engine={"dtype": "float32", "max_batch_size": 8, "max_model_len": 2048},   # tuned trees
                      port=a.port, num_cpus=2, max_tokens_cap=256)
    ensure_ray(num_cpus=2)
    serve.start(http_options={"host": "127.0.0.1", "port": a.port})
    serve.run(build_app(json.loads(cfg.model_dump_json())), name="stall", route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{a.port}"
    while True:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    result = asyncio.run(run(base, prompts, a.duration, a.max_tokens))
    result.update(cpu=cpu_model(), duration_s=a.duration, config=json.loads(cfg.model_dump_json()),
                  step_budget=step_tokens(cfg.engine.cache.max_step_tokens, "cpu"))
    serve.shutdown()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
