"""How the engine, the batch job and Serve hold up under load and hostile traffic.

    python bench/load.py SUBCOMMAND --help

``serve``
    Start the Serve app on 127.0.0.1 (``--config``, the embedded pair by default), run concurrent streaming clients
    (the official ``openai`` client, :func:`run_load`) for a fixed time; every stream is checked for completeness
    (a finish reason, then [DONE]); reports TTFT p50/p99, tokens/s, errors and the engine's mean verify batch.

        python bench/load.py serve --clients 32 --duration 60 --out bench/results/<hardware>/serve_load.json

``stall``
    Serve under the ``mixed`` workload (prompts of 10 to 1,900 tokens, max_model_len 2048, max batch 8) from 16
    streaming clients while an attacker sends oversized bodies (3 MB and 20 MB), absurdly nested JSON, out-of-range
    sampling values and broken JSON, and a prober reads /health. A stream's longest gap between two chunks after its
    first is its stall (the wait for the first token is queueing, reported as TTFT). One normal request after the
    load must be served.

        python bench/load.py stall --duration 120 --out bench/results/<hardware>/serve_stall.json

``engine-stall``
    The engine's share of a stall: the same 16 streams through one in-process ``RequestQueue`` (fp32), no Serve,
    HTTP or attacker; each stream's longest gap between text chunks and the wall time of every engine step.

        python bench/load.py engine-stall --budget 64 --out bench/results/<hardware>/engine_stall_64.json

``job``
    The batch job (``jobs/batch.py``'s ``run_job``, one actor) against the same engine run directly in this
    process over the same prompts: Ray's overhead (generated tokens/s of each) and, greedy, whether every output of
    the job equals the direct run's (``--direct-batch 1``: one prompt at a time); no row may fail.

        python bench/load.py job --workload mixed --rows 200 --direct-batch 1 \
            --out bench/results/<hardware>/mixed_load.json
        python bench/load.py job --workload mt_bench --rows 24 --dtype auto \
            --out bench/results/<hardware>/ray_overhead.json

Every subcommand writes JSON naming the hardware, torch version, threads and command line (``harness.py``).
"""
from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time
from pathlib import Path

from harness import run_entry, subcommand, timed, write_result
from workloads import NAMES, mixed_length_prompts, prompts as workload

SCRIPT = "bench/load.py"
MODEL = "eagle-ray/smollm2-135m-instruct"


def percentile(sorted_values: list[float], q: float) -> float | None:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))] if sorted_values else None


def start_serve(cfg, name: str) -> str:
    """The Serve app of ``cfg`` on 127.0.0.1:``cfg.port``, once /health answers; returns its base URL."""
    import httpx
    from ray import serve

    from eagle_ray.cluster import ensure_ray
    from eagle_ray.serve.app import build_app
    ensure_ray()
    serve.start(http_options={"host": "127.0.0.1", "port": cfg.port})
    serve.run(build_app(json.loads(cfg.model_dump_json())), name=name, route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{cfg.port}"
    while True:
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return base
        except httpx.HTTPError:
            time.sleep(0.5)


# ---- serve: the load generator ------------------------------------------------------------------------------------
async def _stream(client, model: str, prompt: str, max_tokens: int, out: dict) -> None:
    """One streamed chat completion, counted as completed (timed), malformed or an error."""
    t0 = time.perf_counter()
    ttft, finish, tokens = None, None, 0
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True})
    async for c in stream:
        if c.choices and c.choices[0].delta.content and ttft is None:
            ttft = time.perf_counter() - t0
        if c.choices and c.choices[0].finish_reason:
            finish = c.choices[0].finish_reason
        if c.usage:
            tokens = c.usage.completion_tokens
    if finish not in ("stop", "length") or tokens == 0:
        out["malformed"] += 1
        return
    out["ttft"].append(ttft if ttft is not None else time.perf_counter() - t0)
    out["tokens"] += tokens
    out["completed"] += 1
    out["latency"].append(time.perf_counter() - t0)


async def _client(client, model: str, prompts: list[str], max_tokens: int, stop_at: float, out: dict, i: int):
    n = i
    while time.perf_counter() < stop_at:
        prompt = prompts[n % len(prompts)]
        n += 1
        try:
            await _stream(client, model, prompt, max_tokens, out)
        except Exception as e:  # noqa: BLE001 - counted and reported
            out["errors"] += 1
            out["error_samples"].append(repr(e)[:200])


async def run_load(base_url: str, model: str, prompts: list[str], clients: int = 32, duration_s: float = 60.0,
                   max_tokens: int = 64, api_key: str = "none") -> dict:
    """``clients`` concurrent streaming clients of an OpenAI-compatible server for ``duration_s``."""
    import openai
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
    out = {"ttft": [], "latency": [], "tokens": 0, "completed": 0, "errors": 0, "malformed": 0, "error_samples": []}
    t0 = time.perf_counter()
    await asyncio.gather(*(_client(client, model, prompts, max_tokens, t0 + duration_s, out, i)
                           for i in range(clients)))
    wall = time.perf_counter() - t0
    ttft = sorted(out["ttft"])
    return {"clients": clients, "duration_s": duration_s, "wall_s": wall, "completed": out["completed"],
            "errors": out["errors"], "malformed": out["malformed"], "error_samples": out["error_samples"][:5],
            "generated_tokens": out["tokens"], "tokens_per_s": out["tokens"] / wall,
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
            "latency_mean_s": statistics.mean(out["latency"]) if out["latency"] else None}


def cmd_serve(a) -> int:
    import httpx
    from ray import serve

    from eagle_ray.serve.config import ServeConfig
    cfg = ServeConfig.from_yaml(a.config, {"port": a.port})
    base = start_serve(cfg, "load")
    prompts = [p if isinstance(p, str) else p[0]["content"] for p in workload(a.workload)]
    before = httpx.get(base + "/stats").json()
    result = asyncio.run(run_load(base + "/v1", cfg.model_name, prompts, a.clients, a.duration, a.max_tokens))
    after = httpx.get(base + "/stats").json()
    passes = after["decode_passes"] - before["decode_passes"]
    result["mean_verify_batch"] = (after["decode_sequences"] - before["decode_sequences"]) / passes if passes else 0
    result["free_slots_after"] = after["free_slots"]
    result["config"] = json.loads(cfg.model_dump_json())
    serve.shutdown()
    result = write_result(a.out, result, a.command)
    print(json.dumps({k: v for k, v in result.items() if k != "config"}, indent=1))
    return 0


# ---- stall: streams, an attacker and a prober against Serve -------------------------------------------------------
async def _read_stream(r) -> tuple[list[float], str | None, str | None]:
    """Chunk arrival times, finish reason and error of one streamed completion response."""
    if r.status_code != 200:
        return [], None, f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
    times, finish = [], None
    async for line in r.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            return times, finish, chunk["error"]["message"]
        if chunk["choices"][0].get("text"):
            times.append(time.perf_counter())
        finish = chunk["choices"][0].get("finish_reason") or finish
    return times, finish, None


async def stream_client(http, base: str, prompts: list[str], i: int, stop_at: float, max_tokens: int, out: list):
    n = i
    while time.perf_counter() < stop_at:
        body = {"model": MODEL, "prompt": prompts[n % len(prompts)], "max_tokens": max_tokens, "temperature": 0,
                "stream": True}
        n += 16
        t0 = time.perf_counter()
        try:
            async with http.stream("POST", base + "/v1/completions", json=body, timeout=600) as r:
                times, finish, error = await _read_stream(r)
        except Exception as e:  # noqa: BLE001 - reported
            times, finish, error = [], None, repr(e)[:200]
        gaps = [b - a for a, b in zip(times, times[1:])]
        out.append({"client": i, "ttft_s": (times[0] - t0) if times else None, "max_gap_s": max(gaps, default=0.0),
                    "chunks": len(times), "finish": finish, "error": error})


def attacks(http, base: str) -> list:
    big3 = {"model": MODEL, "prompt": "hello " * 500_000}                      # ~3 MB, under the body limit
    big20 = b'{"model": "' + MODEL.encode() + b'", "prompt": "' + b"x" * 20_000_000 + b'"}'
    url = base + "/v1/completions"
    return [
        ("3 MB prompt", lambda: http.post(url, json=big3, timeout=120)),
        ("3 MB prompt, streamed", lambda: http.post(url, json=big3 | {"stream": True}, timeout=120)),
        ("20 MB body", lambda: http.post(url, content=big20, headers={"content-type": "application/json"},
                                         timeout=120)),
        ("nested 100,000 deep", lambda: http.post(url, content=b'{"model": "m", "prompt": ' + b"[" * 100_000
                                                  + b"]" * 100_000 + b"}", timeout=60)),
        ("seed -1", lambda: http.post(url, json={"model": MODEL, "prompt": "x", "seed": -1, "stream": True},
                                      timeout=60)),
        ("top_k 2**40", lambda: http.post(base + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_k": 2**40}, timeout=60)),
        ("broken JSON", lambda: http.post(url, content=b'{"model": ', timeout=60)),
    ]


async def attacker(http, base: str, stop_at: float, out: list):
    sends, i = attacks(http, base), 0
    while time.perf_counter() < stop_at:
        name, send = sends[i % len(sends)]
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
        r, seconds = await timed_async(http.get(base + "/health", timeout=60))
        out.append(seconds if r.status_code == 200 else None)
        await asyncio.sleep(0.25)


async def timed_async(awaitable):
    t0 = time.perf_counter()
    out = await awaitable
    return out, time.perf_counter() - t0


def stall_summary(streams: list, attacked: list, health: list, after: dict) -> dict:
    done = [s for s in streams if s["error"] is None]
    gaps = sorted(s["max_gap_s"] for s in done)
    return {
        "streams": len(streams), "stream_errors": [s for s in streams if s["error"]][:5],
        "max_stall_s": gaps[-1] if gaps else None, "p99_stall_s": gaps[int(0.99 * (len(gaps) - 1))] if gaps else None,
        "median_stall_s": statistics.median(gaps) if gaps else None,
        "streams_over_1s": sum(1 for g in gaps if g > 1.0),
        "ttft_median_s": statistics.median(s["ttft_s"] for s in done if s["ttft_s"] is not None) if done else None,
        "attacks": {name: {"statuses": sorted({str(x["status"]) for x in attacked if x["attack"] == name}),
                           "all_openai_shaped": all(x["openai_shaped"] for x in attacked if x["attack"] == name),
                           "max_s": max((x["s"] for x in attacked if x["attack"] == name), default=None)}
                    for name in sorted({x["attack"] for x in attacked})},
        "health_max_s": max((h for h in health if h is not None), default=None),
        "health_failures": sum(1 for h in health if h is None),
        "after_load": after,
    }


async def stall_run(base: str, prompts: list[str], duration: float, max_tokens: int) -> dict:
    import httpx
    streams, attacked, health = [], [], []
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=32)
    async with httpx.AsyncClient(limits=limits) as http:
        stop_at = time.perf_counter() + duration
        await asyncio.gather(*(stream_client(http, base, prompts, i, stop_at, max_tokens, streams) for i in range(16)),
                             attacker(http, base, stop_at, attacked), prober(http, base, stop_at, health))
        r = await http.post(base + "/v1/completions", json={"model": MODEL, "prompt": "The capital of France is",
                                                            "max_tokens": 8, "temperature": 0}, timeout=120)
        after = {"status": r.status_code, "text": r.json()["choices"][0]["text"] if r.status_code == 200 else r.text}
    return stall_summary(streams, attacked, health, after)


def cmd_stall(a) -> int:
    from ray import serve

    from eagle_ray.model.numerics import step_tokens
    from eagle_ray.serve.config import ServeConfig
    prompts = workload("mixed", 48)
    cfg = ServeConfig(engine={"dtype": "float32", "max_batch_size": 8, "max_model_len": 2048},   # tuned trees
                      port=a.port, num_cpus=2, max_tokens_cap=256)
    base = start_serve(cfg, "stall")
    result = asyncio.run(stall_run(base, prompts, a.duration, a.max_tokens))
    result.update(duration_s=a.duration, config=json.loads(cfg.model_dump_json()),
                  step_budget=step_tokens(cfg.engine.cache.max_step_tokens, "cpu"))
    serve.shutdown()
    print(json.dumps(write_result(a.out, result, a.command), indent=1, default=str))
    return 0


# ---- engine-stall: the same streams on an in-process queue --------------------------------------------------------
def cmd_engine_stall(a) -> int:
    from eagle_ray.config import SamplingParams, TreeConfig
    from eagle_ray.engine.engine import EagleEngine
    from eagle_ray.engine.queue import RequestQueue
    tree = TreeConfig.from_spec(a.tree)
    engine = EagleEngine.from_pretrained(dtype="float32", max_batch_size=8, max_model_len=2048, tree=tree, threads=2,
                                         max_step_tokens=a.budget)
    prompts = mixed_length_prompts(engine.tokenizer, 48, 10, 1900)
    queue = RequestQueue(engine)
    gaps, steps, stop = [], [], time.time() + a.duration
    step = engine.step

    def timed_step():
        out, seconds = timed(step)
        steps.append(seconds)
        return out
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
    result = {"tree": tree.model_dump(), "step_budget": engine.scheduler.step_budget,
              "streams": len(gaps), "max_stall_s": gaps[-1], "median_stall_s": statistics.median(gaps),
              "streams_over_1s": sum(g > 1 for g in gaps), "steps": len(steps),
              "step_median_s": statistics.median(steps), "step_p90_s": steps[int(0.9 * (len(steps) - 1))],
              "step_max_s": steps[-1], "duration_s": a.duration}
    print(json.dumps(write_result(a.out, result, a.command), indent=1))
    return 0


# ---- job: the batch job against the same engine in-process --------------------------------------------------------
def engine_settings(a) -> dict:
    """What both runs' engines hold: the default tree, or the tuner's (``--tree-policy auto``)."""
    from eagle_ray.config import TreeConfig
    tree = {"tree_policy": "auto"} if a.tree_policy == "auto" else {"tree": TreeConfig().model_dump()}
    return {"dtype": a.dtype, "max_model_len": a.max_model_len, "threads": a.threads, **tree}


def direct_run(prompts: list, a) -> tuple[list, float]:
    """The engine the job runs, in this process at max batch ``a.direct_batch``: outputs and wall seconds."""
    from eagle_ray.config import EngineConfig, SamplingParams
    from eagle_ray.engine.engine import EagleEngine
    engine = EagleEngine.from_config(EngineConfig(**engine_settings(a), max_batch_size=a.direct_batch or a.batch_size))
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=8))   # warm-up
    return timed(engine.generate, prompts, SamplingParams(max_new_tokens=a.max_new_tokens, temperature=0.0))


def job_run(prompts: list, a, work: Path) -> tuple[dict, dict, float]:
    """jobs/batch.py's job over ``prompts`` (one actor): its summary, its rows by id, and its wall seconds."""
    from fsspec.implementations.local import LocalFileSystem

    from eagle_ray.batch.config import JobConfig
    from eagle_ray.batch.job import read_output, run_job
    with open(work / "in.jsonl", "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"id": f"m{i}", "prompt" if isinstance(p, str) else "messages": p}) + "\n")
    cfg = JobConfig(engine={**engine_settings(a), "max_batch_size": a.batch_size},
                    sampling={"max_new_tokens": a.max_new_tokens, "temperature": 0.0},
                    input={"uri": str(work / "in.jsonl")}, output={"uri": str(work / "out"), "rows_per_file": 50},
                    actors={"num_actors": 1, "num_cpus": a.threads, "batch_size": a.batch_size,
                            "max_concurrent_batches": 4})
    summary, wall = timed(run_job, cfg)
    rows = {r["id"]: r for r in read_output(LocalFileSystem(), str(work / "out")).to_pylist()}
    return summary, rows, wall


def cmd_job(a) -> int:
    import tempfile
    prompts = workload(a.workload, a.rows)
    direct, direct_s = direct_run(prompts, a)
    summary, rows, job_s = job_run(prompts, a, Path(tempfile.mkdtemp(prefix="bench-job-")))
    lengths = [len(o.prompt_token_ids) for o in direct]
    differ = [f"m{i}" for i, o in enumerate(direct) if rows[f"m{i}"]["output_token_ids"] != o.token_ids]
    direct_tok_s = sum(len(o.token_ids) for o in direct) / direct_s
    result = {
        "workload": a.workload, "rows": len(prompts), "engine": engine_settings(a), "max_batch_size": a.batch_size,
        "max_new_tokens": a.max_new_tokens,
        "prompt_tokens": {"min": min(lengths), "max": max(lengths), "mean": sum(lengths) / len(lengths)},
        "job": {"rows": summary["rows"], "errors": summary["errors"], "error_kinds": summary["error_kinds"],
                "wall_s": job_s, "generation_tokens_per_s": summary["generation_tokens_per_s"],
                "end_to_end_tokens_per_s": summary["generated_tokens_per_s"], "tau_mean": summary["tau_mean"]},
        "direct": {"max_batch_size": a.direct_batch or a.batch_size, "wall_s": direct_s, "tokens_per_s": direct_tok_s},
        "ratio_generation": summary["generation_tokens_per_s"] / direct_tok_s,
        "ratio_end_to_end": summary["generated_tokens_per_s"] / direct_tok_s,
        "outputs_differing_from_direct": differ,
        "finish_reasons": {k: sum(1 for r in rows.values() if r["finish_reason"] == k) for k in ("stop", "length")},
    }
    print(json.dumps(write_result(a.out, result, a.command), indent=1))
    return 0 if not differ and summary["errors"] == 0 else 1


# ---- the command line ---------------------------------------------------------------------------------------------
def add_serve(sub) -> None:
    p = subcommand(sub, "serve", cmd_serve, "concurrent streaming clients against the Serve app: TTFT, tokens/s")
    p.add_argument("--config", default="configs/serve-embedded.yaml")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--workload", default="mt_bench", help=f"{', '.join(NAMES)}, or name=path.jsonl")
    p.add_argument("--port", type=int, default=8011)
    p = subcommand(sub, "stall", cmd_stall, "Serve under mixed-length streams and hostile requests: any stall?",
                   out_required=True)
    p.add_argument("--duration", type=float, default=120)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--port", type=int, default=8765)


def add_engine(sub) -> None:
    p = subcommand(sub, "engine-stall", cmd_engine_stall, "the same streams on an in-process RequestQueue",
                   out_required=True)
    p.add_argument("--budget", type=int, default=None, help="max_step_tokens (default: the device's)")
    p.add_argument("--tree", default="8/2/3", help="total/depth/top_k")
    p.add_argument("--duration", type=float, default=90)
    p = subcommand(sub, "job", cmd_job, "the batch job against the same engine in-process: overhead, same outputs",
                   out_required=True)
    p.add_argument("--workload", default="mixed", help=f"{', '.join(NAMES)}, or name=path.jsonl")
    p.add_argument("--rows", type=int, default=200)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8, help="the job's max batch size")
    p.add_argument("--direct-batch", type=int, default=None, help="the direct run's (default: the job's)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tree-policy", default="fixed", choices=["fixed", "auto"], help="both runs' trees")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)


def main(argv=None) -> int:
    return run_entry(__doc__, SCRIPT, (add_serve, add_engine), argv)


if __name__ == "__main__":
    raise SystemExit(main())
