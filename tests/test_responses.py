"""OpenAI's Responses API over the chat path: a Responses body read as the chat request it amounts to, errors
naming the Responses fields, a chat answer as output items, and a chat stream (the Serve app's own ``_sse`` over a
queue that replays deltas) as the Responses events, whose deltas add up to the completed response. The app over
HTTP with the ``openai`` client: tests/test_serve.py."""
import asyncio
import json
import time

import pytest
from test_reasoning import THOUGHT, ReplayQueue, output, shape_for

from eagle_ray.engine.queue import StreamDelta
from eagle_ray.serve.choices import PromptChoices
from eagle_ray.serve.openai_api import ApiError, parse_body
from eagle_ray.serve.response_store import KeptResponses, ResponseStore, identified, item_page
from eagle_ray.serve.responses import (ResponseEvents, chat_body, checked, parse_data, parse_request, response_base,
                                       response_body)

WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def parsed(body: dict, parser: str | None = "hermes", kept=None):
    """``body`` read as Serve reads it (``kept``: the responses its ``previous_response_id`` may name)."""
    def parse_chat(raw):
        return parse_body(raw, "chat", "m", 100, 16, tool_parser=parser, reasoning_parser="qwen3")
    data = {"model": "m", **body}
    if kept is None:
        return parse_request(json.dumps(data).encode(), parse_chat)
    rid = checked(data, kept.limit)
    return parse_data(data, parse_chat, asyncio.run(kept.conversation(rid)) if rid else [])


def test_a_responses_body_is_the_chat_it_amounts_to():
    body = {"instructions": "Be brief.", "max_output_tokens": 20, "temperature": 0.5, "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"}, "reasoning": {"effort": "low"},
            "text": {"format": {"type": "text"}}, "store": True, "metadata": {"run": "a"},
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "Paris?"}]},
                      {"type": "reasoning", "id": "rs_1", "summary": []},
                      {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Ok."}]},
                      {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "P"}'},
                      {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]}
    chat, origin = chat_body(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Paris?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Ok."}], "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "P"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    assert origin.messages == ["instructions", "input[0]", "input[2]", "input[5]"]
    assert origin.calls == {2: ["input[3]", "input[4]"]}   # the assistant turn's calls, items of their own
    assert origin.of("messages[2].tool_calls[1].function.arguments") == "input[4].arguments"
    assert origin.of("messages[2].content") == "input[2].content"
    assert chat["tools"] == [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description",
                                                                                         "parameters")}}]
    assert (chat["tool_choice"], chat["max_completion_tokens"], chat["temperature"], chat["reasoning_effort"]) == (
        {"type": "function", "function": {"name": "get_weather"}}, 20, 0.5, "low")
    assert "response_format" not in chat
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt, _ = chat_body({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": schema}},
                        "stream": True})
    assert fmt["response_format"] == {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    assert fmt["messages"] == [{"role": "user", "content": "x"}] and fmt["stream_options"] == {"include_usage": True}
    req = parsed({"input": "w1", "max_output_tokens": 7})
    assert (req.params.max_new_tokens, req.responses["max_output_tokens"], req.params.logprobs) == (7, 7, None)
    assert parsed({"input": "w1", "include": ["message.output_text.logprobs"], "top_logprobs": 3}).params.logprobs == 3
    assert parsed({"input": "w1", "include": ["message.output_text.logprobs"]}).params.logprobs == 0


@pytest.mark.parametrize("body, param, message", [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
    ({"background": True}, "background", "keeps no responses"),
    ({"background": 1}, "background", "must be a boolean"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "only 'message.output_text.logprobs'"),
    ({"top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({"truncation": "auto"}, "truncation", "not supported"),
    ({"input": []}, "input", "a non-empty list of items"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]",
     "only text parts"),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type", "'web_search_call' is not supported"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "not OpenAI's hosted 'web_search'"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name", "must be 1-64 letters"),
    ({"text": {"format": {"type": "json_schema", "name": "s"}}}, "text.format", "text.format.schema is required"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type", "text, json_object or json_schema"),
    ({"text": {"verbosity": "low"}}, "text.verbosity", "not supported"),
    ({"max_output_tokens": 500}, "max_output_tokens", "max_output_tokens=500 is above this server's cap"),
    ({"input": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]}, "input[1].role",
     "input[1].role must be one of"),
    ({"instructions": "hi", "input": [{"role": "wizard", "content": "b"}]}, "input[0].role", "input[0].role"),
    ({"model": "other"}, "model", "does not exist"),
    ({"include_reasoning": "no"}, "include_reasoning", "must be a boolean"),
    ({"store": "yes"}, "store", "must be a boolean"),
])
def test_a_bad_responses_body_is_a_400_naming_the_responses_field(body, param, message):
    with pytest.raises(ApiError) as e:
        parsed({"input": "w1", **body})
    assert e.value.param == param and message in e.value.message, (e.value.param, e.value.message)
    assert e.value.status == (404 if param == "model" else 400)


def base(body: dict | None = None) -> dict:
    return response_base({"model": "m", "input": "x", **(body or {})}, "resp_1", 1700000000, "m")


def words(text: str) -> int:
    return len(text.split())


def test_a_chat_answer_is_output_items():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "P"}'}}
    chat = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "Checking.", "reasoning": "one two three", "tool_calls": [call]}}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 12}, "eagle": {"cached_prompt_tokens": 4, "tau": 2.0}}
    got = response_body(chat, base({"instructions": "Be brief."}), words)
    assert (got["id"], got["object"], got["status"], got["instructions"], got["store"]) == (
        "resp_1", "response", "completed", "Be brief.", False)
    assert [i["type"] for i in got["output"]] == ["reasoning", "message", "function_call"]
    assert got["output"][0]["content"] == [{"type": "reasoning_text", "text": "one two three"}]
    assert got["output"][1]["content"][0] | {} == {"type": "output_text", "text": "Checking.", "annotations": [],
                                                   "logprobs": []}
    assert {k: got["output"][2][k] for k in ("call_id", "name", "arguments", "status")} == {
        "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "P"}', "status": "completed"}
    assert got["usage"] == {"input_tokens": 9, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 12,
                            "output_tokens_details": {"reasoning_tokens": 3}, "total_tokens": 21}
    cut = response_body({"choices": [{"finish_reason": "length", "message": {"role": "assistant", "content": "a"}}],
                         "usage": {"prompt_tokens": 1, "completion_tokens": 2}}, base(), words)
    assert (cut["status"], cut["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})


def events(pieces: list[str], tools=None) -> list[dict]:
    """The Responses events of a chat stream of ``pieces`` (the app's ``_sse``, replayed), parsed."""
    from types import SimpleNamespace

    from eagle_ray.serve.app import EagleServer
    text = "".join(pieces)
    deltas = [StreamDelta("r", p, i + 1) for i, p in enumerate(pieces[:-1])]
    deltas.append(StreamDelta("r", pieces[-1], len(pieces), True, output(text)))
    server = SimpleNamespace(cfg=SimpleNamespace(model_name="m"), queue=ReplayQueue(deltas))
    body = SimpleNamespace(stream_options=SimpleNamespace(include_usage=True, continuous_usage_stats=False))
    seqs = [SimpleNamespace(prompt_ids=[1, 2], logprobs=None, output_ids=[], stops=None)]
    sse = EagleServer.func_or_class._sse(server, body, [PromptChoices(seqs, "")], shape_for(tools=tools), "r")

    async def collect():
        return [line async for line in ResponseEvents(base(), words).translate(sse)]
    out = []
    for line in asyncio.run(collect()):
        head, data = line.split("\n", 1)
        payload = json.loads(data.removeprefix("data: "))
        assert head == f"event: {payload['type']}" and line.endswith("\n\n")
        out.append(payload)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def test_a_chat_stream_is_the_responses_events_and_adds_up_to_the_completed_response():
    from test_tools import plan
    got = events([THOUGHT[:10], THOUGHT[10:30], THOUGHT[30:], " Sunny", " today.",
                  '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'],
                 tools=plan("auto", parser="hermes"))
    kinds = [e["type"] for e in got]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    done = got[-1]["response"]
    assert [i["type"] for i in done["output"]] == ["reasoning", "message", "function_call"]
    thought = "".join(e["delta"] for e in got if e["type"] == "response.reasoning_text.delta")
    answer = "".join(e["delta"] for e in got if e["type"] == "response.output_text.delta")
    assert thought == done["output"][0]["content"][0]["text"] == "\nThe user wants Paris' weather.\n"
    assert answer == done["output"][1]["content"][0]["text"] == "\n\nLet me check. Sunny today."
    added = [e["item"]["type"] for e in got if e["type"] == "response.output_item.added"]
    closed = [e["item"]["type"] for e in got if e["type"] == "response.output_item.done"]
    assert added == closed == ["reasoning", "message", "function_call"]
    args = [e for e in got if e["type"] == "response.function_call_arguments.done"]
    assert [(a["name"], json.loads(a["arguments"])) for a in args] == [("get_weather", {"city": "Paris"})]
    assert done["status"] == "completed" and done["usage"]["output_tokens_details"]["reasoning_tokens"] == 5
    assert all(i["status"] == "completed" for i in done["output"])


def replayed(chunks: list[dict], shown: bool = True, on_done=None) -> list[dict]:
    """The Responses events of chat chunks given as they are."""
    async def lines():
        for c in chunks:
            yield f"data: {json.dumps(c)}\n\n"
        yield "data: [DONE]\n\n"

    async def collect():
        return [line async for line in ResponseEvents(base(), words, shown=shown, on_done=on_done).translate(lines())]
    return [json.loads(line.split("\n", 1)[1].removeprefix("data: ")) for line in asyncio.run(collect())]


def tok(text):
    return {"token": text, "logprob": -0.5, "bytes": list(text.encode()), "top_logprobs": []}


ENTRIES = [tok("<think>"), tok("hm"), tok("."), tok("</think>"), tok("Hi"), tok("!")]   # a thinking, an answer
THOUGHT_CHUNKS = [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "reasoning": "hm."},
                  "logprobs": {"content": ENTRIES[:3]}, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {"content": "Hi"}, "logprobs": {"content": ENTRIES[3:5]},
                  "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {"content": "!"}, "logprobs": {"content": ENTRIES[5:]}, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length",
                  "eagle": {"cached_prompt_tokens": 0}}]},
    {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 6}}]
THOUGHT_WHOLE = {"choices": [{"finish_reason": "length", "logprobs": {"content": ENTRIES},
                              "message": {"role": "assistant", "reasoning": "hm.", "content": "Hi!"}}],
                 "usage": {"prompt_tokens": 3, "completion_tokens": 6}}


def test_an_answers_logprobs_are_its_own_tokens_streamed_or_whole_and_a_cut_item_is_incomplete():
    entries, chunks = ENTRIES, THOUGHT_CHUNKS
    got = replayed(chunks)
    streamed = got[-1]["response"]
    whole = response_body(THOUGHT_WHOLE, base(), words)
    for response in (streamed, whole):
        assert response["status"] == "incomplete" and [i["status"] for i in response["output"]] == [
            "completed", "incomplete"]
        assert [e["token"] for e in response["output"][1]["content"][0]["logprobs"]] == ["Hi", "!"]
    deltas = [e for e in got if e["type"] == "response.output_text.delta"]
    assert [[t["token"] for t in e["logprobs"]] for e in deltas] == [["Hi"], ["!"]]
    assert got[-1]["type"] == "response.incomplete"
    held = [{"choices": [dict(c["choices"][0], logprobs=None)]} for c in chunks[:3]]   # with stop strings, the
    held.append({"choices": [dict(chunks[3]["choices"][0], logprobs={"content": entries})]})   # values come last
    at_end = replayed(held + chunks[4:])[-1]["response"]
    assert [e["token"] for e in at_end["output"][1]["content"][0]["logprobs"]] == ["Hi", "!"]


def test_include_reasoning_false_leaves_the_reasoning_item_out_and_keeps_the_answers_logprobs_its_own():
    got = replayed(THOUGHT_CHUNKS, shown=False)
    assert not [e for e in got if "reasoning" in e["type"] or e.get("item", {}).get("type") == "reasoning"]
    for response in (got[-1]["response"], response_body(THOUGHT_WHOLE, base(), words, shown=False)):
        assert [i["type"] for i in response["output"]] == ["message"]
        assert [e["token"] for e in response["output"][0]["content"][0]["logprobs"]] == ["Hi", "!"]
        assert response["usage"]["output_tokens_details"] == {"reasoning_tokens": 1}   # "hm." is one word
    req = parsed({"input": "w1", "include_reasoning": False})
    assert req.body.include_reasoning is True   # the chat behind it keeps the thinking; the response leaves it out


def test_a_follow_up_continues_the_kept_conversation_and_the_newest_responses_are_kept():
    """``previous_response_id``: the kept chain's items (each response's input, then its output), then the new
    input; its instructions are not carried over (OpenAI's rule). The store keeps the newest ``responses_kept``; a
    conversation whose earlier response was dropped is a 404, as OpenAI's."""
    kept = KeptResponses(2, "test")   # outside Ray: this process's own
    first = parsed({"instructions": "Be brief.", "input": "Paris?", "tools": [WEATHER]}, kept=kept)
    assert first.conversation == [{"role": "user", "content": "Paris?"}]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "P"}'}}
    answer = response_body({"choices": [{"finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "Checking.", "tool_calls": [call]}}], "usage": {"prompt_tokens": 9,
                                                                                     "completion_tokens": 12}},
                           base(), words)
    asyncio.run(kept.put(answer, first.conversation + answer["output"], None))
    result = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
    follow = parsed({"previous_response_id": "resp_1", "input": [result], "tools": [WEATHER]}, kept=kept)
    whole = parsed({"input": [{"role": "user", "content": "Paris?"}, *answer["output"], result], "tools": [WEATHER]})
    assert follow.prompt == whole.prompt and follow.conversation == [result]
    asyncio.run(kept.put(answer | {"id": "resp_2"}, follow.conversation, "resp_1"))
    third = parsed({"previous_response_id": "resp_2", "input": "And Rome?"}, kept=kept)
    rome = {"role": "user", "content": "And Rome?"}
    assert third.prompt == parsed({"input": [*whole.responses["input"], rome]}).prompt
    asyncio.run(kept.put(answer | {"id": "resp_3"}, [], None))   # a third kept: the first is dropped
    for gone in ("resp_1", "resp_2"):   # resp_2 is kept, but its conversation began with resp_1
        with pytest.raises(ApiError) as e:
            parsed({"previous_response_id": gone, "input": "more"}, kept=kept)
        assert (e.value.status, e.value.code, e.value.param) == (404, "previous_response_not_found",
                                                                 "previous_response_id")
    with pytest.raises(ApiError, match="responses_kept is 0") as e:
        parsed({"previous_response_id": "resp_3", "input": "more"}, kept=KeptResponses(0, "none"))
    with pytest.raises(ApiError, match="conversation is not supported"):   # refused before any look-up
        parsed({"previous_response_id": "resp_9", "input": "more", "conversation": "conv_1"}, kept=kept)
    assert asyncio.run(kept.response("resp_3"))["id"] == "resp_3"
    assert (asyncio.run(kept.delete("resp_3")), asyncio.run(kept.delete("resp_3"))) == (True, False)


def test_a_kept_responses_input_items_are_its_conversations_then_its_own_listed_a_page_at_a_time():
    """``GET /v1/responses/{id}/input_items``: what the response was made from (the chain's inputs and outputs,
    then its own input), each with an id (a client's own kept), messages typed with text parts; newest first by
    default, ``limit`` items a page, ``after`` / ``before`` an item id."""
    kept = KeptResponses(3, "test")
    first = identified([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris?"}])
    said = {"role": "assistant", "content": "Yes."}
    answer = response_body({"choices": [{"finish_reason": "stop", "message": said}],
                            "usage": {"prompt_tokens": 9, "completion_tokens": 2}}, base(), words)
    asyncio.run(kept.put(answer, first + answer["output"], None))
    own = identified([{"id": "msg_mine", "type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "And Rome?"}]}, {"role": "assistant", "content": "Say it."}])
    asyncio.run(kept.put(answer | {"id": "resp_2", "output": []}, own, "resp_1"))
    items = asyncio.run(kept.input_items("resp_2"))
    assert [i["id"] for i in items] == [first[0]["id"], first[1]["id"], answer["output"][0]["id"], "msg_mine",
                                        own[1]["id"]]
    assert [i["id"][:4] for i in first] == ["msg_", "msg_"] and len({i["id"] for i in items}) == 5
    assert asyncio.run(kept.input_items("resp_1")) == first

    page = item_page(items, {})
    assert (page["object"], page["has_more"]) == ("list", False) and page["data"][-1]["content"] == [
        {"type": "input_text", "text": "Be brief."}] and page["data"][0]["content"] == [
        {"type": "output_text", "text": "Say it."}]
    assert all(i["type"] == "message" for i in page["data"]) and page["data"][1] == own[0]
    ids = [i["id"] for i in items]
    two = item_page(items, {"order": "asc", "limit": "2"})
    assert ([i["id"] for i in two["data"]], two["first_id"], two["last_id"], two["has_more"]) == (
        ids[:2], ids[0], ids[1], True)
    assert [i["id"] for i in item_page(items, {"order": "asc", "after": ids[1]})["data"]] == ids[2:]
    assert [i["id"] for i in item_page(items, {"order": "asc", "before": ids[3], "limit": "2"})["data"]] == ids[1:3]
    assert [i["id"] for i in item_page(items, {"after": ids[3]})["data"]] == ids[2::-1]   # newest first
    for query, param in (({"order": "up"}, "order"), ({"limit": "0"}, "limit"), ({"limit": "x"}, "limit"),
                         ({"after": "msg_none"}, "after")):
        with pytest.raises(ApiError) as e:
            item_page(items, query)
        assert (e.value.status, e.value.param) == (400, param)
    for n in (3, 4):   # two more kept: resp_1 is dropped
        asyncio.run(kept.put(answer | {"id": f"resp_{n}"}, [], None))
    assert asyncio.run(kept.input_items("resp_9")) is None   # never kept
    assert asyncio.run(kept.response("resp_2")) and asyncio.run(kept.input_items("resp_2")) is None   # its link gone


def test_a_background_response_is_kept_in_progress_until_it_ends_is_cancelled_or_its_replica_is_lost():
    """``background: true`` (only where responses are kept, never with ``store: false`` or a stream): kept
    ``in_progress`` at once, its replica beating; its end replaces it only while it is still in progress (not
    after a cancel, a delete or its replica's loss); a cancel of an ended one answers it as it is; a follow-up
    waits for its end."""
    kept = KeptResponses(4, "test")
    request = parsed({"input": "Paris?", "background": True}, kept=kept)
    started = base({"background": True})
    assert (started["status"], started["background"], base()["background"]) == ("in_progress", True, False)
    for body, param in (({"store": False}, "store"), ({"stream": True}, "stream")):
        with pytest.raises(ApiError) as e:
            parsed({"input": "w1", "background": True, **body}, kept=kept)
        assert (e.value.status, e.value.param) == (400, param)

    store = ResponseStore(4, lost_s=0.2)
    items = identified(request.conversation)
    store.put("resp_1", started, items, None)
    assert store.beat("resp_1") == "in_progress" and store.input_items("resp_1") == items
    assert store.conversation("resp_1") == {"in_progress": "resp_1"}   # a follow-up's: refused (below)
    said = {"role": "assistant", "content": "Yes."}
    done = response_body({"choices": [{"finish_reason": "stop", "message": said}],
                          "usage": {"prompt_tokens": 9, "completion_tokens": 2}}, started, words)
    assert store.finish("resp_1", done, items + done["output"])
    assert store.response("resp_1")["status"] == "completed" and store.cancel("resp_1") == done
    assert store.conversation("resp_1") == items + done["output"]

    store.put("resp_2", started | {"id": "resp_2"}, items, None)
    assert store.cancel("resp_2")["status"] == store.beat("resp_2") == "cancelled"
    assert not store.finish("resp_2", done | {"id": "resp_2"}, items + done["output"])   # its end comes late
    assert store.response("resp_2")["status"] == "cancelled"
    store.put("resp_4", started | {"id": "resp_4"}, items, None)
    assert store.delete("resp_4") and not store.finish("resp_4", done, []) and store.response("resp_4") is None

    store.put("resp_3", started | {"id": "resp_3"}, items, None)
    time.sleep(0.3)   # past lost_s without a beat
    lost = store.response("resp_3")
    assert lost["status"] == "failed" and "replica making it was lost" in lost["error"]["message"]
    assert store.beat("resp_3") == "failed" and store.beat("resp_9") is None
    assert not store.finish("resp_3", done | {"id": "resp_3"}, items)

    asyncio.run(kept.start(started, items, None))   # a replica that shuts down fails its own at once
    with pytest.raises(ApiError, match="still in progress") as e:
        parsed({"previous_response_id": "resp_1", "input": "more"}, kept=kept)
    assert (e.value.status, e.value.param) == (400, "previous_response_id")
    kept.abandon(["resp_1"], "its replica shut down before it ended")
    assert asyncio.run(kept.response("resp_1"))["error"]["message"] == "its replica shut down before it ended"


def test_an_item_id_twice_in_a_conversation_is_a_400():
    """An item's id names it in the listing of input items: the same id again (an earlier output sent back with
    ``previous_response_id``) is refused, as OpenAI's."""
    kept = KeptResponses(2, "test")
    answer = response_body({"choices": [{"finish_reason": "stop", "message": {"role": "assistant", "content": "A"}}],
                           "usage": {"prompt_tokens": 9, "completion_tokens": 1}}, base(), words)
    asyncio.run(kept.put(answer, identified([{"role": "user", "content": "Q"}]) + answer["output"], None))
    with pytest.raises(ApiError, match="Duplicate item found") as e:
        parsed({"previous_response_id": "resp_1", "input": [*answer["output"], {"role": "user", "content": "B"}]},
               kept=kept)
    assert (e.value.status, e.value.param) == (400, "input[0].id")
    twice = {"id": "msg_1", "role": "user", "content": "B"}
    with pytest.raises(ApiError, match="Duplicate item found") as e:
        parsed({"input": [twice, twice]})
    assert e.value.param == "input[1].id"
    assert parsed({"previous_response_id": "resp_1", "input": "B"}, kept=kept).conversation == [
        {"role": "user", "content": "B"}]


def test_a_streamed_response_is_kept_whole_before_its_last_event():
    done = []

    async def keep(response):
        done.append(response)
    last = replayed(THOUGHT_CHUNKS, on_done=keep)[-1]
    assert done == [last["response"]] and [i["type"] for i in done[0]["output"]] == ["reasoning", "message"]


def test_an_error_mid_stream_fails_the_response_with_what_was_sent():
    got = replayed([{"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]},
                    {"error": {"message": "the engine failed", "type": "server_error", "param": None, "code": None}}])
    assert [e["type"] for e in got[-2:]] == ["error", "response.failed"]
    failed = got[-1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {"code": "server_error",
                                                                "message": "the engine failed"}
    assert failed["output"][0]["content"][0]["text"] == "Hi"


def test_errors_name_the_responses_items_a_call_came_from():
    body = {"input": [{"role": "user", "content": "w1"},
                      {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                      {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "[1]"}]}
    with pytest.raises(ApiError) as e:
        parsed(body)
    assert e.value.param.startswith("input[2].arguments"), (e.value.param, e.value.message)
    with pytest.raises(ApiError, match="tool_choice must be") as e:
        parsed({"input": "w1", "tools": [WEATHER], "tool_choice": {"type": "function"}})
    with pytest.raises(ApiError, match="leave out text.format") as e:   # the field as the request named it
        parsed({"input": "w1", "tools": [WEATHER], "tool_choice": "required", "text": {"format": {
            "type": "json_object"}}})
