"""Which CPU layout for the target's linears (``model/linears.py``): few-row products are what a verify pass and a
tree level run, and on CPU the kernel behind ``nn.Linear`` makes them cost several one-row products.

Two tables, in one run, layouts interleaved: (1) one linear of each of the target's shapes for 1-64 rows;
(2) the whole target verify pass (forward + fp32 logits) of B sequences x T tokens on a 256-token context, with
every linear in each layout. fp32 (the dtype ``auto`` gives on CPUs without native bf16).

    .venv/bin/python bench/linear_kernels.py --out bench/results/<hardware>/linear_kernels.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from eagle_ray.config import EngineConfig
from eagle_ray.engine.engine import EagleEngine
from eagle_ray.engine.tuning import verify_seconds
from eagle_ray.model.device import cpu_model
from eagle_ray.model.linears import InputMajorLinear, PackedLinear, packed_available

LAYOUTS = ("native", "input_major", "packed")


def median_us(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def linear_table(shapes, rows, reps: int) -> list[dict]:
    out = []
    for d_in, d_out in shapes:
        w = torch.randn(d_out, d_in)
        impl = {"native": lambda x: F.linear(x, w), "input_major": InputMajorLinear(w, None),
                "packed": PackedLinear(w, None)}
        for m in rows:
            x = torch.randn(m, d_in)
            us = {k: median_us(lambda f=f: f(x), reps) for k, f in impl.items()}
            out.append({"in": d_in, "out": d_out, "rows": m, **{f"{k}_us": round(v, 1) for k, v in us.items()}})
            print(json.dumps(out[-1]), flush=True)
    return out


def engine_with(layout: str, max_batch: int) -> EagleEngine:
    return EagleEngine.from_config(EngineConfig(dtype="float32", max_batch_size=max_batch, threads=2,
                                                cpu_linears=layout))


def verify_table(blocks, reps: int, rounds: int) -> list[dict]:
    engines = {k: engine_with(k, max(b for b, _ in blocks)) for k in LAYOUTS}
    out = []
    for b, t in blocks:
        ms = {k: [] for k in LAYOUTS}
        for _ in range(rounds):                       # interleaved: drift hits every layout alike
            for k, e in engines.items():
                ms[k].append(verify_seconds(e, b, t, repeats=reps) * 1e3)
        row = {"batch": b, "tokens": t, **{f"{k}_ms": round(statistics.median(v), 1) for k, v in ms.items()}}
        row["packed_vs_native"] = round(row["packed_ms"] / row["native_ms"], 3)
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if not packed_available():
        raise SystemExit("this torch build has no oneDNN linear kernel")
    shapes = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]   # SmolLM2-135M's linears
    result = {"cpu": cpu_model(), "threads": a.threads, "dtype": "float32",
              "linears": linear_table(shapes, [1, 2, 4, 8, 16, 32, 64], reps=20),
              "verify": verify_table([(1, 1), (1, 2), (1, 4), (1, 8), (1, 12), (1, 16), (1, 32), (8, 1), (8, 4)],
                                     reps=3, rounds=3)}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
