"""Load generator for the Serve app: N concurrent streaming clients (the official ``openai`` client) for a fixed
time; every stream is checked for completeness (a finish reason, then [DONE]) and timed (time to first token)."""
import asyncio
import statistics
import time


async def _client(client, model: str, prompts: list[str], max_tokens: int, stop_at: float, out: dict, i: int):
    n = i
    while time.perf_counter() < stop_at:
        prompt = prompts[n % len(prompts)]
        n += 1
        t0 = time.perf_counter()
        ttft, text, finish, chunks = None, "", None, 0
        try:
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
                stream=True, stream_options={"include_usage": True})
            tokens = 0
            async for c in stream:
                chunks += 1
                if c.choices and c.choices[0].delta.content:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text += c.choices[0].delta.content
                if c.choices and c.choices[0].finish_reason:
                    finish = c.choices[0].finish_reason
                if c.usage:
                    tokens = c.usage.completion_tokens
            if finish not in ("stop", "length") or tokens == 0:
                out["malformed"] += 1
            else:
                out["ttft"].append(ttft if ttft is not None else time.perf_counter() - t0)
                out["tokens"] += tokens
                out["completed"] += 1
                out["latency"].append(time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - counted and reported
            out["errors"] += 1
            out["error_samples"].append(repr(e)[:200])


async def run_load(base_url: str, model: str, prompts: list[str], clients: int = 32, duration_s: float = 60.0,
                   max_tokens: int = 64, api_key: str = "none") -> dict:
    import openai
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
    out = {"ttft": [], "latency": [], "tokens": 0, "completed": 0, "errors": 0, "malformed": 0, "error_samples": []}
    t0 = time.perf_counter()
    await asyncio.gather(*(_client(client, model, prompts, max_tokens, t0 + duration_s, out, i)
                           for i in range(clients)))
    wall = time.perf_counter() - t0
    ttft = sorted(out["ttft"])

    def pct(q):
        return ttft[min(len(ttft) - 1, int(q * len(ttft)))] if ttft else None
    return {"clients": clients, "duration_s": duration_s, "wall_s": wall, "completed": out["completed"],
            "errors": out["errors"], "malformed": out["malformed"], "error_samples": out["error_samples"][:5],
            "generated_tokens": out["tokens"], "tokens_per_s": out["tokens"] / wall,
            "ttft_p50_s": pct(0.5), "ttft_p99_s": pct(0.99),
            "latency_mean_s": statistics.mean(out["latency"]) if out["latency"] else None}
