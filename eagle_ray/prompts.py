"""Prompt files: EAGLE/MT-bench question files (``{"turns": [...]}``), ``{"prompt": ...}`` and ``{"messages": ...}``
JSONL. Raw ``prompt`` strings are used as they are; ``turns`` and ``messages`` go through the chat template."""
from __future__ import annotations

import json
from pathlib import Path


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def first_turn_prompt(record: dict):
    """What one generation request of ``record`` is: a chat message list or a raw string."""
    if "turns" in record:
        return [{"role": "user", "content": record["turns"][0]}]
    if "messages" in record:
        return record["messages"]
    if "prompt" in record:
        return record["prompt"]
    raise ValueError(f"record has none of turns/messages/prompt: {sorted(record)}")


def demo_prompts_path() -> Path:
    return Path(__file__).resolve().parent / "assets" / "prompts" / "demo.jsonl"


EAGLE_TASKS = ("mt_bench", "humaneval", "gsm8k", "alpaca", "sum", "qa")  # EAGLE-2's Table 1 columns


def benchmark_path(task: str) -> Path:
    """One of EAGLE-2's six bundled question files."""
    if task not in EAGLE_TASKS:
        raise ValueError(f"unknown benchmark task {task!r}; bundled: {', '.join(EAGLE_TASKS)}")
    return Path(__file__).resolve().parent / "assets" / "benchmarks" / f"{task}.jsonl"
