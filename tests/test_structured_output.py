"""Structured output on the embedded pair (SmolLM2-135M-Instruct and its head), whose vocabulary writes JSON.

200 sampled objects for three schemas (nested objects, enums, arrays), each valid under ``jsonschema``; greedy
constrained EAGLE equal to greedy constrained plain decoding token for token, with draft nodes pruned; the official
``openai`` client reading a ``json_schema`` response from the Serve app, parsed into its own model and validated,
and calling tools (a named function, ``required``, streamed, a call's result sent back, ``auto``).
"""
import json
import sys
from pathlib import Path

import jsonschema
import pytest

from eagle_ray.config import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from structured import SCHEMAS  # noqa: E402 - the bench's schemas: what is measured is what is tested

pytestmark = pytest.mark.slow   # the embedded 135M model

PROMPTS = {
    "nested objects": [f"Invent a character for a novel set in {place}: give a name, an age and an address, as JSON."
                       for place in ("Lisbon", "Nairobi", "Osaka", "Quebec", "Lima", "Tallinn", "Perth", "Cairo")],
    "enums": [f"Classify this product review as JSON (sentiment, stars, language): \"{review}\""
              for review in ("Great blender, loud but it crushes ice in seconds.", "Arrived broken. Never again.",
                             "Le produit est correct, sans plus.", "Die Schuhe passen perfekt!",
                             "It works. Nothing special about it.", "Best headphones I have owned.",
                             "Muy mala calidad, se rompió en una semana.", "Decent value for the price.")],
    "arrays": [f"Write a shopping list for {meal} as JSON: items with quantities, and a few tags."
               for meal in ("a pancake breakfast", "a picnic for four", "a vegetable curry", "a birthday party",
                            "a week of lunches", "a barbecue", "a pasta dinner", "a camping trip")],
}


@pytest.fixture(scope="module")
def engine():
    from eagle_ray import EagleEngine
    return EagleEngine.from_pretrained(dtype="float32", max_batch_size=32)


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_200_sampled_objects_are_valid_under_three_schemas(engine):
    """67 + 67 + 66 objects at temperature 0.8 (seeded), eight prompts a schema, in mixed batches of 32. A CPU
    step's token budget (48) then leaves most sequences their root alone and some a few draft tokens, verified in
    blocks of their own widths (tests/test_verify_blocks.py); a seeded sample depends on neither its batch nor
    its tree, and hundreds of drafted tokens are still accepted under the grammars (as the job's rows count them:
    plain decoding accepts none)."""
    names = list(SCHEMAS)
    jobs = [(names[i % 3], PROMPTS[names[i % 3]][(i // 3) % 8], i) for i in range(200)]
    outs = engine.generate([chat(p) for _, p, _ in jobs],
                           [SamplingParams(temperature=0.8, seed=i, max_new_tokens=160, guided_json=SCHEMAS[name][0])
                            for name, _, i in jobs])
    for (name, _, _), out in zip(jobs, outs):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMAS[name][0])
    assert len({o.text for o in outs}) > 150   # samples, not one answer repeated
    accepted_drafts = sum(sum(o.stats.accepted_per_depth) for o in outs)
    assert accepted_drafts > 500, accepted_drafts


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_greedy_constrained_eagle_equals_greedy_constrained_plain(engine, name):
    params = SamplingParams(max_new_tokens=160, guided_json=SCHEMAS[name][0])
    prompts = [chat(p) for p in PROMPTS[name]]
    spec = engine.generate(prompts, params)
    plain = engine.generate(prompts, params, speculative=False)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    for out in spec:
        jsonschema.validate(json.loads(out.text), SCHEMAS[name][0])
    tau = sum(o.stats.step_tokens for o in spec) / sum(o.stats.verify_steps for o in spec)
    assert tau > 1.5, tau


@pytest.fixture(scope="module")
def embedded_server(ray_local):
    import socket

    from ray import serve
    from tiny import wait_healthy

    from eagle_ray.serve.app import build_app
    from eagle_ray.serve.config import ServeConfig
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # a named tree (the engine's default): unnamed, the app would first tune its tree to this machine, minutes on
    # a CPU (tests/test_tuning.py covers the tuner)
    # the model's own template, and tools shown hermes-style where a request has them (tests/templates/)
    template = str(Path(__file__).resolve().parent / "templates" / "smollm2_tools.jinja")
    cfg = ServeConfig(engine={"dtype": "float32", "max_batch_size": 4, "max_model_len": 1024, "tree": {},
                              "chat_template": template},
                      model_name="smol", port=port, num_cpus=1, default_max_tokens=128, tool_call_parser="hermes",
                      reasoning_parser="qwen3",   # SmolLM2 does not think: every answer is content
                      responses_kept=8)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(json.loads(cfg.model_dump_json())), name="eagle-structured", route_prefix="/",
              blocking=False)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, 600, 1)
    yield base
    serve.delete("eagle-structured")
    serve.shutdown()


def test_the_openai_client_parses_a_json_schema_response(embedded_server):
    import openai
    from pydantic import BaseModel, Field

    class Address(BaseModel):
        city: str = Field(max_length=30)
        country: str = Field(max_length=30)

    class Character(BaseModel):
        name: str = Field(max_length=30)
        age: int = Field(ge=0, le=120)
        address: Address

    client = openai.OpenAI(base_url=embedded_server + "/v1", api_key="unused", max_retries=0, timeout=300)
    r = client.chat.completions.parse(model="smol", messages=chat(PROMPTS["nested objects"][0]), temperature=0,
                                      max_tokens=128, response_format=Character)
    msg = r.choices[0].message
    assert isinstance(msg.parsed, Character) and r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(msg.content), Character.model_json_schema())
    # the same request as a raw json_schema, and json_object mode, over the completions route too
    schema = SCHEMAS["enums"][0]
    c = client.completions.create(model="smol", prompt="Review: 'Loved it.' As JSON:", temperature=0, max_tokens=64,
                                  extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                      "name": "review", "schema": schema, "strict": True}}})
    jsonschema.validate(json.loads(c.choices[0].text), schema)
    o = client.chat.completions.create(model="smol", messages=chat("Give a city and its country as a JSON object."),
                                       temperature=0, max_tokens=96, response_format={"type": "json_object"})
    assert o.choices[0].finish_reason == "stop" and isinstance(json.loads(o.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError, match="not a valid JSON schema"):
        client.chat.completions.create(model="smol", messages=chat("hi"), response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}})


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}


def test_the_openai_client_calls_tools(embedded_server):
    """Forced calls always parse and hold to their tool's schema (structured output); a stream carries the same
    call; the call and its result sent back are answered in text; ``auto`` answers either way, well formed."""
    import openai
    client = openai.OpenAI(base_url=embedded_server + "/v1", api_key="unused", max_retries=0, timeout=300)
    ask = chat("What is the weather in Paris right now?")
    common = dict(model="smol", messages=ask, tools=[WEATHER, CLOCK], temperature=0, max_tokens=64)
    named = client.chat.completions.create(**common, tool_choice={"type": "function",
                                                                  "function": {"name": "get_weather"}})
    choice = named.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "stop" and choice.message.content is None   # made to call: OpenAI's reason
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    required = client.chat.completions.create(**common, tool_choice="required", parallel_tool_calls=False)
    (any_call,) = required.choices[0].message.tool_calls
    assert required.choices[0].finish_reason == "tool_calls"
    tool = {"get_weather": WEATHER, "get_time": CLOCK}[any_call.function.name]
    jsonschema.validate(json.loads(any_call.function.arguments), tool["function"]["parameters"])

    chunks = list(client.chat.completions.create(**common, stream=True, tool_choice={
        "type": "function", "function": {"name": "get_weather"}}))
    deltas = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(deltas) > 3 and all(d.index == 0 for d in deltas)   # the arguments stream as they come
    assert (deltas[0].function.name, deltas[0].type) == ("get_weather", "function") and deltas[0].id
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "stop"
    required_streamed = list(client.chat.completions.create(**common, stream=True, tool_choice="required",
                                                            parallel_tool_calls=False))
    parts = [d for c in required_streamed if c.choices and c.choices[0].delta.tool_calls
             for d in c.choices[0].delta.tool_calls]
    assert len(parts) > 3 and {d.index for d in parts} == {0}   # the call's parameters as they come
    assert (parts[0].function.name, "".join(d.function.arguments for d in parts)) == \
        (any_call.function.name, any_call.function.arguments)

    result = {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}
    answer = client.chat.completions.create(**common | {"messages": ask + [choice.message.model_dump(
        exclude_none=True), result]}, tool_choice="none")
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    assert answer.choices[0].message.model_extra == {"reasoning_content": None, "reasoning": None}   # none found
    assert answer.usage.prompt_tokens > named.usage.prompt_tokens + 20   # the call and its result were shown

    auto = client.chat.completions.create(**common).choices[0]   # tool_choice auto: the hermes parser reads it
    assert auto.message.content or auto.message.tool_calls
    assert auto.finish_reason == ("tool_calls" if auto.message.tool_calls else "stop") or \
        auto.finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(**common, tool_choice={"type": "function", "function": {"name": "f"}})


def test_the_responses_api_calls_a_tool_and_reads_its_output(embedded_server):
    """The Responses API's flat function tools: a forced call is a ``function_call`` item whose arguments hold to
    the schema; sent back with its ``function_call_output``, the answer is a message; text.format holds JSON."""
    import openai
    client = openai.OpenAI(base_url=embedded_server + "/v1", api_key="unused", max_retries=0, timeout=300)
    flat = {"type": "function", **WEATHER["function"]}
    ask = "What is the weather in Paris right now?"
    r = client.responses.create(model="smol", input=ask, tools=[flat], temperature=0, max_output_tokens=64,
                                tool_choice={"type": "function", "name": "get_weather"})
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and r.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    answer = client.responses.create(model="smol", tools=[flat], temperature=0, max_output_tokens=48,
                                     tool_choice="none", input=[
                                         {"role": "user", "content": ask}, call.model_dump(exclude_none=True),
                                         {"type": "function_call_output", "call_id": call.call_id,
                                          "output": '{"temperature": 21, "sky": "clear"}'}])
    assert [i.type for i in answer.output] == ["message"] and answer.output_text
    assert answer.usage.input_tokens > r.usage.input_tokens + 20   # the call and its output were shown
    # the same turn as a follow-up of the kept response, streamed: the same answer; then kept in its turn
    events = list(client.responses.create(model="smol", tools=[flat], temperature=0, max_output_tokens=48,
                                          tool_choice="none", previous_response_id=r.id, stream=True, input=[
                                              {"type": "function_call_output", "call_id": call.call_id,
                                               "output": '{"temperature": 21, "sky": "clear"}'}]))
    follow = events[-1].response
    assert events[-1].type == "response.completed" and follow.output_text == answer.output_text
    assert (follow.previous_response_id, follow.store, r.store) == (r.id, True, True)
    assert client.responses.retrieve(follow.id).output_text == answer.output_text
    listed = list(client.responses.input_items.list(follow.id, order="asc", limit=2))   # two pages of two
    assert [i.type for i in listed] == ["message", "function_call", "function_call_output"]
    assert (listed[0].content[0].text, listed[1].id, listed[2].output) == (ask, call.id,
                                                                           '{"temperature": 21, "sky": "clear"}')
    client.responses.delete(follow.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.retrieve(follow.id)
    schema = SCHEMAS["enums"][0]
    typed = client.responses.create(model="smol", input=PROMPTS["enums"][0], temperature=0, max_output_tokens=160,
                                    text={"format": {"type": "json_schema", "name": "review", "schema": schema}})
    jsonschema.validate(json.loads(typed.output_text), schema)


def test_a_background_response_is_made_on_read_back_and_stopped_by_a_cancel(embedded_server):
    """``background: true``: answered at once ``in_progress``, then read back as the same request made in the
    foreground answers; a cancel ends one in progress (its request counted as aborted, not run to its length)."""
    import time

    import httpx
    import openai
    from test_metrics import samples
    client = openai.OpenAI(base_url=embedded_server + "/v1", api_key="unused", max_retries=0, timeout=300)
    ask = {"model": "smol", "input": "Name three colors.", "temperature": 0, "max_output_tokens": 24}
    r = client.responses.create(**ask, background=True)
    assert (r.status, r.background, r.output) == ("in_progress", True, [])
    deadline = time.time() + 300
    while r.status == "in_progress" and time.time() < deadline:
        time.sleep(0.5)
        r = client.responses.retrieve(r.id)
    now = client.responses.create(**ask)
    assert (r.status, r.output_text, r.usage.output_tokens) == (now.status, now.output_text, now.usage.output_tokens)
    with pytest.raises(openai.BadRequestError, match="only those can be cancelled"):
        client.responses.cancel(now.id)

    aborted = ("vllm:request_success_total", (("finished_reason", "abort"),))
    before = samples(httpx.get(embedded_server + "/metrics", timeout=60).content).get(aborted, 0)
    long = client.responses.create(**ask | {"max_output_tokens": 960}, background=True,
                                   extra_body={"ignore_eos": True})
    assert client.responses.cancel(long.id).status == "cancelled"
    deadline = time.time() + 120
    while samples(httpx.get(embedded_server + "/metrics", timeout=60).content).get(aborted, 0) == before:
        assert time.time() < deadline, "the cancelled response's request was not aborted"
        time.sleep(0.5)
    assert client.responses.retrieve(long.id).status == "cancelled"


def test_a_jobs_chat_rows_call_tools_as_serve_does(tmp_path):
    """The job's rows with tools, on the embedded model with a template that shows them: a named call and a
    required one land in ``tool_calls`` (OpenAI's list, each call's arguments valid under its tool's schema)."""
    from test_job_output import run_rows

    from eagle_ray.batch.config import JobConfig
    from eagle_ray.batch.stage import GenerateStage
    template = str(Path(__file__).resolve().parent / "templates" / "smollm2_tools.jinja")
    cfg = JobConfig(engine={"dtype": "float32", "max_batch_size": 2, "max_model_len": 1024, "tree": {},
                            "chat_template": template},
                    sampling={"max_new_tokens": 64}, tool_call_parser="hermes",
                    input={"uri": str(tmp_path / "in.jsonl")}, output={"uri": str(tmp_path / "out")})
    ask = chat("What is the weather in Paris right now?")
    named, required = run_rows(GenerateStage(cfg.model_dump_json()), [
        {"messages": ask, "tools": [WEATHER, CLOCK], "tool_choice": {"type": "function",
                                                                     "function": {"name": "get_weather"}}},
        {"messages": ask, "tools": [WEATHER, CLOCK], "tool_choice": "required", "parallel_tool_calls": False}])
    for row, reason in ((named, "stop"), (required, "tool_calls")):
        assert row["error"] is None and row["finish_reason"] == reason and row["output"] == ""
        (call,) = json.loads(row["tool_calls"])
        tool = {"get_weather": WEATHER, "get_time": CLOCK}[call["function"]["name"]]
        jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])
    assert json.loads(named["tool_calls"])[0]["function"]["name"] == "get_weather"
