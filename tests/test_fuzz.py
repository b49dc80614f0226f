"""Fuzzing the two front doors: the batch job's row reader/parser (OpenAI batch lines among its rows) and the Serve
app's request parser.

Thousands of generated rows and bodies (random JSON shapes, wrong types, huge and tiny numbers, unicode with lone
surrogates, deep nesting, raw bytes) go through the same code the job and the server run, with the tiny model's
tokenizer behind them. Every row must end as an output row or an error row naming its kind, and be writable to
Parquet; every request must end as a success or an OpenAI-shaped 4xx whose body encodes as UTF-8. Nothing may
raise. Generation is seeded, so a run is the same for the same seed.
"""
import asyncio
import collections
import json

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from tiny import tiny_engine

from eagle_ray.batch.rows import (DUPLICATE_ID, INTERNAL_ERROR, INVALID_JSON, INVALID_REQUEST, INVALID_ROW,
                                 INVALID_UTF8, PROMPT_TOO_LONG, rows_from_lines, to_table)
from eagle_ray.errors import EagleError
from eagle_ray.serve.openai_api import ApiError, parse_body

FUZZ_SEED = 20261123
KINDS = {INVALID_UTF8, INVALID_JSON, INVALID_ROW, DUPLICATE_ID, INVALID_REQUEST, PROMPT_TOO_LONG}
# the fast tier fuzzes 600 cases; the slow tier 3,000 more, drawn from another seed
TIERS = [pytest.param(600, FUZZ_SEED, id="600"),
         pytest.param(3000, FUZZ_SEED + 1, id="3000", marks=pytest.mark.slow)]


def fuzz(cases: int):
    return settings(max_examples=cases, database=None, deadline=None, suppress_health_check=list(HealthCheck))


text = st.text(st.characters(exclude_categories=()), max_size=40)   # surrogates and control characters included
words = st.lists(st.sampled_from(["w1", "w2", "w30", "user", ":", "</s>", "zz"]), min_size=0, max_size=12).map(" ".join)
numbers = st.one_of(st.integers(-2**70, 2**70), st.integers(-3, 300), st.floats(allow_nan=True, allow_infinity=True))
leaf = st.one_of(st.none(), st.booleans(), numbers, text, words)
any_json = st.recursive(leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(text, inner, max_size=4)), max_leaves=12)


def maybe(strategy):
    return st.one_of(strategy, any_json)


message = st.fixed_dictionaries({}, optional={"role": maybe(st.sampled_from(["user", "assistant", "system", "bot"])),
                                              "content": maybe(st.one_of(words, st.lists(st.fixed_dictionaries(
                                                  {"type": maybe(st.just("text")), "text": maybe(words)}),
                                                  max_size=3)))})
sampling = st.fixed_dictionaries({}, optional={
    "temperature": maybe(st.floats(-1, 3)), "top_p": maybe(st.floats(-0.5, 1.5)), "top_k": maybe(st.integers(-2, 2**41)),
    "max_tokens": maybe(st.integers(-1, 10**7)), "max_new_tokens": maybe(st.integers(0, 50)),
    "seed": maybe(st.integers(-2**65, 2**65)), "stop": maybe(st.lists(maybe(words), max_size=5)),
    "ignore_eos": maybe(st.booleans()), "stop_token_ids": maybe(st.lists(st.integers(-5, 100), max_size=3))})
@st.composite
def mutated(draw, base: dict, fields: dict) -> dict:
    """``base`` with 0-3 fields removed, replaced by any JSON value, or set to an out-of-range value."""
    out = dict(base)
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from(sorted(fields)))
        action = draw(st.sampled_from(["drop", "any", "typed"]))
        if action == "drop":
            out.pop(key, None)
        else:
            out[key] = draw(any_json if action == "any" else fields[key])
    return out


chat_line = st.fixed_dictionaries({"custom_id": words.filter(bool), "method": st.just("POST"),
                                   "url": st.just("/v1/chat/completions"),
                                   "body": st.fixed_dictionaries({"model": st.just("m"), "messages": st.lists(
                                       st.fixed_dictionaries({"role": st.just("user"), "content": words.filter(bool)}),
                                       min_size=1, max_size=2), "max_tokens": st.integers(1, 4)})})
text_line = st.fixed_dictionaries({"custom_id": words.filter(bool), "url": st.sampled_from(
    ["/v1/completions", "/v1/responses", "/v1/embeddings"]), "body": st.fixed_dictionaries(
    {"model": st.just("m"), "prompt": words.filter(str.strip), "input": words.filter(str.strip),
     "n": st.integers(1, 2), "max_tokens": st.integers(1, 4), "max_output_tokens": st.integers(16, 20)})})
valid_row = st.one_of(st.fixed_dictionaries({"id": words, "prompt": words.filter(str.strip)}), chat_line, text_line,
                      st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
                          {"role": st.sampled_from(["user", "system"]), "content": words.filter(bool)}), min_size=1,
                          max_size=2)}),
                      st.fixed_dictionaries({"turns": st.lists(words.filter(str.strip), min_size=1, max_size=2),
                                             "sampling_params": st.fixed_dictionaries({"max_tokens": st.integers(1, 4)})}))
ROW_FIELDS = {"id": st.one_of(st.integers(), words), "prompt": words, "messages": st.lists(message, max_size=3),
              "turns": st.lists(maybe(words), max_size=3), "sampling_params": sampling, "sampling": sampling,
              "tools": st.lists(st.sampled_from([{"type": "function", "function": {"name": "w5"}}, {"type": "x"}, "w1",
                                                 {"type": "function", "function": {"name": "w6", "parameters": None}}]),
                                max_size=2),
              "tool_choice": st.sampled_from(["none", "auto", "required", 3, {"type": "function",
                                                                              "function": {"name": "w5"}}]),
              "parallel_tool_calls": st.one_of(st.booleans(), words),
              "custom_id": st.one_of(st.integers(), words), "method": st.sampled_from(["POST", "GET"]),
              "url": st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/x", "https://w1"]),
              "body": st.fixed_dictionaries({}, optional={"model": maybe(st.just("m")), "messages": st.lists(message),
                                                          "prompt": maybe(words), "stream": maybe(st.booleans()),
                                                          "n": maybe(st.integers(-1, 3)), "input": maybe(words),
                                                          "max_tokens": maybe(st.integers(-1, 10**7))})}


@st.composite
def row_lines(draw) -> bytes:
    """One JSONL line: a plausible row, any JSON value, raw bytes, or a deeply nested value."""
    kind = draw(st.sampled_from(["row", "row", "row", "json", "bytes", "deep", "mangled"]))
    if kind == "bytes":
        return draw(st.binary(min_size=1, max_size=60)).replace(b"\n", b" ")
    if kind == "deep":
        n = draw(st.integers(30, 200_000))
        return b'{"prompt": "w1", "x": ' + b"[" * n + b"]" * n + b"}"
    value = draw(mutated(draw(valid_row), ROW_FIELDS) if kind in ("row", "mangled") else any_json)
    line = json.dumps(value, ensure_ascii=draw(st.booleans()), allow_nan=True).encode("utf-8", "surrogatepass")
    if kind == "mangled" and len(line) > 2:
        cut = draw(st.integers(1, len(line) - 1))
        line = line[:cut] + draw(st.binary(max_size=3)).replace(b"\n", b" ") + line[cut + 1:]
    return line


class ValidatingQueue:
    """The stage's queue, minus generation: requests are validated and tokenised by the real engine (what the
    job's actor does before a request reaches the engine thread) and answered with one token."""

    def __init__(self, engine):
        self.engine, self.healthy = engine, True

    async def aprepare(self, prompt, params=None, request_id=None, speculative=True):
        return self.engine.make_sequence(prompt, params, request_id, speculative)

    async def agenerate(self, seq):
        from eagle_ray.engine.engine import RequestOutput
        return RequestOutput(seq.request_id, seq.prompt_ids, [5], "w2", "length")


@pytest.fixture(scope="module")
def stage(tiny_dir, tiny_head):
    from eagle_ray.batch.config import JobConfig
    from eagle_ray.batch.stage import GenerateStage
    st_ = GenerateStage.__new__(GenerateStage)
    st_.cfg = JobConfig(input={"uri": "x"}, output={"uri": "y"}, sampling={"max_new_tokens": 4})
    st_.engine = tiny_engine(tiny_dir, tiny_head, max_model_len=64)
    st_.queue = ValidatingQueue(st_.engine)
    st_.target_name, st_.draft_name, st_.worker_id = "t", "d", "w"
    return st_


@pytest.mark.parametrize("cases, fuzz_seed", TIERS)
def test_fuzzed_rows_become_output_rows_or_error_rows_of_a_known_kind(stage, cases, fuzz_seed):
    outcomes = collections.Counter()

    @fuzz(cases)
    @seed(fuzz_seed)
    @given(row_lines())
    def one(line):
        rows = list(rows_from_lines([line], "fuzz.jsonl"))
        if not rows:   # a blank line is no row at all
            outcomes["blank line"] += 1
            return
        (row_in,) = rows
        row = asyncio.run(stage.process(row_in.as_item()))
        table = to_table([row])                       # the write a whole batch depends on
        assert table.num_rows == 1
        if row["error"] is None:
            assert row["output"] is not None and row["finish_reason"] == "length"
            outcomes["output row"] += 1
        else:
            assert row["error_kind"] in KINDS, (row["error_kind"], row["error"])
            assert row["output"] is None
            outcomes[row["error_kind"]] += 1

    one()
    print("\nfuzzed rows:", dict(outcomes))
    assert sum(outcomes.values()) >= cases and INTERNAL_ERROR not in outcomes
    assert outcomes["output row"] > cases // 20 and len(outcomes) >= 5


REQUEST_FIELDS = {
    "model": st.sampled_from(["m", "other"]), "prompt": st.one_of(words, st.lists(words, max_size=2),
                                                                 st.lists(st.integers(-3, 99))),
    "messages": st.lists(message, max_size=3), "max_tokens": st.integers(-1, 5000),
    "max_completion_tokens": st.integers(-1, 5000), "temperature": st.floats(-1, 3), "top_p": st.floats(-1, 2),
    "top_k": st.integers(-2**41, 2**41), "seed": st.integers(-2**65, 2**65), "n": st.integers(-1, 3),
    "stop": st.one_of(words, st.lists(words, max_size=6)), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": maybe(st.booleans())}), "logprobs": st.booleans(),
    "presence_penalty": st.floats(-2, 2), "ignore_eos": st.booleans(), "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-1, 3), "logit_bias": st.dictionaries(st.text(max_size=3), st.floats(-200, 200),
                                                                           max_size=3),
    "chat_template_kwargs": st.dictionaries(st.text(max_size=8), st.one_of(st.booleans(), words, st.integers()),
                                            max_size=3),
    "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(),
    "min_p": st.floats(-1, 2), "min_tokens": st.integers(-1, 20), "allowed_token_ids": st.lists(st.integers(-2, 99)),
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
    "truncate_prompt_tokens": st.integers(-2, 5000), "bad_words": st.lists(words, max_size=3),
    "tools": st.lists(st.sampled_from([{"type": "function", "function": {"name": "w5", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}, {"type": "function"}, "w1",
        {"type": "function", "function": {"name": "w6", "parameters": {"type": 3}}}]), max_size=2),
    "tool_choice": st.sampled_from(["none", "auto", "required", 5, {"type": "x"},
                                    {"type": "function", "function": {"name": "w5"}}]),
    "parallel_tool_calls": st.booleans(), "prompt_logprobs": st.integers(-2, 25),
    "priority": st.integers(-2**33, 2**33), "return_token_ids": st.booleans(),
    "return_tokens_as_token_ids": st.booleans(), "documents": st.lists(maybe(st.dictionaries(
        st.sampled_from(["title", "text"]), maybe(words), max_size=2)), max_size=2),
    "prediction": st.one_of(st.fixed_dictionaries({"type": st.just("content"), "content": words}),
                            st.fixed_dictionaries({"type": words, "content": any_json})),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "json_schema"},
                                        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}},
                                        {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
                                        {"type": "structural_tag"}, {"type": "structural_tag", "format": 3}])}


@st.composite
def request_bodies(draw) -> tuple[str, bytes]:
    kind = draw(st.sampled_from(["completion", "chat"]))
    shape = draw(st.sampled_from(["body", "body", "body", "json", "bytes", "deep"]))
    if shape == "bytes":
        return kind, draw(st.binary(max_size=80))
    if shape == "deep":
        n = draw(st.integers(30, 200_000))
        return kind, b'{"model": "m", "prompt": ' + b"[" * n + b"]" * n + b"}"
    if shape == "json":
        return kind, json.dumps(draw(any_json), allow_nan=True).encode("utf-8", "surrogatepass")
    base = {"model": draw(st.sampled_from(["m"] * 19 + ["other"])),   # 1 in 20: a model the server does not serve
            "max_tokens": draw(st.integers(1, 8)), "temperature": draw(st.sampled_from([0, 0.7, 1]))}
    if kind == "chat":
        base["messages"] = [{"role": "user", "content": draw(words.filter(bool))}]
    else:
        base["prompt"] = draw(words.filter(bool))
    body = draw(mutated(base, REQUEST_FIELDS))
    return kind, json.dumps(body, ensure_ascii=draw(st.booleans()), allow_nan=True).encode("utf-8", "surrogatepass")


@pytest.mark.parametrize("cases, fuzz_seed", TIERS)
def test_fuzzed_requests_end_as_success_or_an_openai_shaped_4xx(stage, cases, fuzz_seed):
    engine = stage.engine
    outcomes = collections.Counter()

    @fuzz(cases)
    @seed(fuzz_seed)
    @given(request_bodies())
    def one(case):
        kind, raw = case
        try:
            req = parse_body(raw, kind, "m", max_tokens_cap=1000, default_max_tokens=16)
            engine.make_sequence(req.prompt, req.params, "r", True)   # what the handler's worker thread does
            outcomes["2xx"] += 1
        except ApiError as e:
            assert 400 <= e.status < 500
            body = json.dumps(e.body(), ensure_ascii=False).encode("utf-8")   # what JSONResponse sends
            assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
            outcomes[str(e.status)] += 1
        except EagleError as e:   # the handler answers these with a 400
            json.dumps({"error": {"message": str(e)}}, ensure_ascii=False).encode("utf-8")
            outcomes["400 (" + type(e).__name__ + ")"] += 1

    one()
    print("\nfuzzed requests:", dict(outcomes))
    assert sum(outcomes.values()) >= cases
    assert outcomes["2xx"] > cases // 20 and outcomes["400"] > cases // 20
    assert outcomes["404"] > 0   # an unknown model in an otherwise valid body


item = st.one_of(message, st.fixed_dictionaries({"type": st.sampled_from(["message", "function_call",
                                                                          "function_call_output", "reasoning", "x"])},
                                                optional={"role": maybe(st.sampled_from(["user", "developer"])),
                                                          "content": maybe(st.lists(st.fixed_dictionaries(
                                                              {"type": maybe(st.sampled_from(["input_text",
                                                                                              "input_image"])),
                                                               "text": maybe(words)}), max_size=2)),
                                                          "call_id": maybe(words), "name": maybe(words),
                                                          "arguments": maybe(words), "output": maybe(words)}))
RESPONSES_FIELDS = {
    "model": st.sampled_from(["m", "other"]), "input": st.one_of(words, st.lists(item, max_size=4)),
    "instructions": maybe(words), "max_output_tokens": st.integers(-1, 5000), "temperature": st.floats(-1, 3),
    "stream": st.booleans(), "store": st.booleans(), "previous_response_id": words,
    "tools": st.lists(st.sampled_from([{"type": "function", "name": "w5", "parameters": {"type": "object"}},
                                       {"type": "web_search"}, {"type": "function"}]), max_size=2),
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "name": "w5"}, {"type": "x"}]),
    "text": st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}}, {"format": None},
                             {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
                             {"format": {"type": "json_schema"}}, {"verbosity": "low"}, "x"]),
    "reasoning": st.sampled_from([{"effort": "low"}, {"effort": 3}, "high", None])}


@pytest.mark.parametrize("cases, fuzz_seed", TIERS)
def test_fuzzed_responses_bodies_end_as_success_or_an_openai_shaped_4xx(stage, cases, fuzz_seed):
    from eagle_ray.serve.responses import parse_request
    engine = stage.engine
    outcomes = collections.Counter()

    def parse_chat(raw):
        return parse_body(raw, "chat", "m", max_tokens_cap=1000, default_max_tokens=16, tool_parser="hermes")

    @fuzz(cases)
    @seed(fuzz_seed)
    @given(st.one_of(mutated({"model": "m", "input": "w1 w2"}, RESPONSES_FIELDS), any_json))
    def one(body):
        try:
            req = parse_request(json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass"), parse_chat)
            engine.make_sequence(req.prompt, req.params, "r", True)
            outcomes["2xx"] += 1
        except ApiError as e:
            assert 400 <= e.status < 500 and set(e.body()["error"]) == {"message", "type", "param", "code"}
            json.dumps(e.body(), ensure_ascii=False).encode("utf-8")
            outcomes[str(e.status)] += 1
        except EagleError:
            outcomes["400 (engine)"] += 1

    one()
    print("\nfuzzed responses bodies:", dict(outcomes))
    assert outcomes["2xx"] > cases // 20 and outcomes["400"] > cases // 20
