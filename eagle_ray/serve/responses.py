"""OpenAI's Responses API (``POST /v1/responses``), served by the chat path, as vLLM serves it beside chat.

A Responses request is read as the chat request it amounts to (:func:`chat_body`): ``instructions`` a system
message, ``input`` the messages (a string, or items: messages with text parts, earlier ``function_call`` items
joined to the assistant turn before them, ``function_call_output`` items as tool results, earlier ``reasoning``
items left out as chat templates leave out earlier thinking), ``max_output_tokens``, ``tools`` (flat function
tools), ``tool_choice``, ``text.format`` (structured output) and ``reasoning.effort``. The chat's answer comes
back as output items (:func:`response_body`): the thinking as a ``reasoning`` item (with a reasoning parser), the
text as a ``message`` with one ``output_text`` part, each call as a ``function_call``. Streamed, the chat's chunks
become the Responses events (:class:`ResponseEvents`). Errors name the Responses fields (``input[2].content``,
``max_output_tokens``, ``text.format``).

With ``ServeConfig.responses_kept`` the server keeps its newest responses (``serve/response_store.py``): a
request's ``previous_response_id`` continues that one's conversation (its items, then the request's ``input``; its
``instructions`` are not carried over, as OpenAI's are not); one with ``background: true`` is answered at once,
``in_progress``, and made on (:func:`backgrounded`). Otherwise nothing is kept, ``store`` is answered as
false and ``previous_response_id`` and ``background`` are a 400; ``conversation`` is a 400 either way, as are
OpenAI's hosted tools and non-text input.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from eagle_ray.engine.reasoning import CLOSE as THINK_CLOSE
from eagle_ray.serve.openai_api import ApiError, ParsedRequest, changes_nothing, load_object

REFUSED = {"conversation": (None,), "prompt": (None,),
           "truncation": (None, "disabled"), "max_tool_calls": (None,)}   # what this server does not keep or do
LOGPROBS = "message.output_text.logprobs"   # the one ``include`` this server answers
PASSED = ("model", "temperature", "top_p", "stream", "parallel_tool_calls", "user", "seed", "top_k", "min_p",
          "stop", "min_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias",
          "ignore_eos", "chat_template_kwargs", "skip_special_tokens", "bad_words",
          "allowed_token_ids", "stop_token_ids", "truncate_prompt_tokens", "priority")   # as a chat takes them
TEXT_PARTS = ("input_text", "output_text", "text")


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def new_response_id() -> str:
    return _item_id("resp")


def chat_body(data: dict, earlier: list | None = None) -> tuple[dict, "Origins"]:
    """The chat request a Responses request amounts to (``earlier``: the items of the conversation it continues),
    and per chat message the Responses field it came from (to name it in errors); raises :class:`ApiError` naming
    the Responses field."""
    check_fields(data)
    messages, origin = _messages(data, earlier or [])
    chat = {k: data[k] for k in PASSED if data.get(k) is not None} | {"messages": messages}
    if data.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = data["max_output_tokens"]
    if data.get("tools") is not None:
        chat["tools"] = _tools(data["tools"])
    if data.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(data["tool_choice"])
    chat |= _text_format(data.get("text")) | _logprobs(data)
    reasoning = data.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise ApiError(400, "reasoning must be an object ({\"effort\": ...})", param="reasoning")
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
    if data.get("stream") is True:
        chat["stream_options"] = {"include_usage": True}   # the usage of response.completed
    return chat, origin


def shows_reasoning(data: dict) -> bool:
    """vLLM's ``include_reasoning``: false leaves the ``reasoning`` item out. The chat behind the response keeps
    its thinking all the same, so that the answer's logprobs and ``reasoning_tokens`` stay right."""
    return data.get("include_reasoning") is not False


def input_items(data: dict) -> list:
    """The request's ``input`` as items (a string is one user message)."""
    items = data.get("input")
    return [{"role": "user", "content": items}] if isinstance(items, str) else items


def failure(message: str) -> dict:
    """A response's fields where it ended in a server error (its replica lost, its engine failed)."""
    return {"status": "failed", "error": {"code": "server_error", "message": message}}


def check_fields(data: dict) -> None:
    """What is refused whatever the rest holds (before a follow-up's conversation is looked up)."""
    for key, harmless in REFUSED.items():
        if key in data and not any(changes_nothing(data[key], h) for h in harmless):
            raise ApiError(400, f"{key} is not supported by this server", param=key)
    for key in ("include_reasoning", "store", "background"):
        if data.get(key) is not None and not isinstance(data[key], bool):
            raise ApiError(400, f"{key} must be a boolean", param=key)


def continued(data: dict, kept: int) -> str | None:
    """The ``previous_response_id`` a request continues, None without one (``kept``: the responses the server
    keeps, ``responses_kept``); raises :class:`ApiError` where nothing is kept."""
    rid = data.get("previous_response_id")
    if rid is None:
        return None
    if not kept:
        raise ApiError(400, "previous_response_id: this server keeps no responses (Serve's responses_kept is 0; a "
                       "batch job keeps none): send the whole conversation as input", param="previous_response_id")
    if not isinstance(rid, str):
        raise ApiError(400, "previous_response_id must be a string", param="previous_response_id")
    return rid


def backgrounded(data: dict, kept: int) -> bool:
    """``background: true``: the response is answered at once (``in_progress``), made on and read back from the
    kept responses (``kept``: ``responses_kept``), as OpenAI's; raises :class:`ApiError` where it cannot be."""
    if not data.get("background"):
        return False
    if not kept:
        raise ApiError(400, "background: this server keeps no responses (Serve's responses_kept is 0; a batch job "
                       "keeps none)", param="background")
    if data.get("store") is False:
        raise ApiError(400, "background requires store: a background response is read back from the kept ones",
                       param="store")
    if data.get("stream"):
        raise ApiError(400, "background with stream is not supported by this server", param="stream")
    return True


def checked(data: dict, kept: int) -> str | None:
    """What is checked before a follow-up's conversation is looked up (``kept``: ``responses_kept``; a batch line's
    0): the fields refused whatever the rest holds, then ``previous_response_id`` and ``background``; the id it
    continues, None without one."""
    check_fields(data)
    rid = continued(data, kept)
    backgrounded(data, kept)
    return rid


def parse_data(data: dict, parse_chat, earlier: list) -> ParsedRequest:
    """A Responses body (JSON read) as the chat request it amounts to (``parse_chat``: the server's chat parser of a
    body's bytes; ``earlier``: the items of the conversation it continues); errors name the Responses fields."""
    chat, origin = chat_body(data, earlier)
    seen = {item.get("id") for item in earlier}
    for i, item in enumerate(input_items(data)):   # a kept item's id names it in a listing of input items
        if isinstance(item.get("id"), str) and item["id"] in seen:
            raise ApiError(400, f"Duplicate item found with id {item['id']!r}", param=f"input[{i}].id")
        seen.add(item.get("id") if isinstance(item.get("id"), str) else None)
    try:
        parsed = parse_chat(json.dumps(chat).encode())
    except ApiError as e:
        raise renamed(e, origin) from None
    parsed.responses = data
    parsed.conversation = input_items(data)
    return parsed


def parse_request(raw: bytes, parse_chat) -> ParsedRequest:
    """A Responses body that continues nothing (a batch file's line: nothing is kept there)."""
    data = load_object(raw)
    checked(data, 0)
    return parse_data(data, parse_chat, [])


def _messages(data: dict, earlier: list) -> tuple[list[dict], "Origins"]:
    messages, origin, calls_from = [], [], {}
    instructions = data.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ApiError(400, "instructions must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
        origin.append("instructions")
    items = input_items(data)
    if not isinstance(items, list) or not items:
        raise ApiError(400, "input must be a string or a non-empty list of items", param="input")
    for i, item in enumerate(earlier + items):
        where = f"input[{i - len(earlier)}]" if i >= len(earlier) else "previous_response_id"
        if not isinstance(item, dict):
            raise ApiError(400, f"{where} must be an object (a message, function_call or function_call_output)",
                           param=where)
        kind = item.get("type", "message")
        if kind == "message":
            content = item.get("content")
            if isinstance(content, list):
                content = [_text_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)]
            messages.append({"role": item.get("role"), "content": content})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if messages and messages[-1]["role"] == "assistant":   # the calls of the turn before
                messages[-1].setdefault("tool_calls", []).append(call)
                calls_from.setdefault(len(messages) - 1, []).append(where)
                continue
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            calls_from[len(messages) - 1] = [where]
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": _output_text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            continue   # earlier thinking: chat templates leave it out
        else:
            raise ApiError(400, f"{where}.type {kind!r} is not supported (message, function_call, "
                           "function_call_output, reasoning)", param=f"{where}.type")
        origin.append(where)
    return messages, Origins(origin, calls_from)


@dataclass
class Origins:
    """Where each chat message came from in the Responses request, and each of its calls (an item of its own)."""
    messages: list[str]
    calls: dict[int, list[str]]

    def of(self, path: str) -> str | None:
        """A chat field's path (``messages[3].tool_calls[1].function.arguments``) as the Responses field's."""
        m = re.match(r"messages\[(\d+)\](\.tool_calls\[(\d+)\](\.function)?)?", path)
        if not m or int(m.group(1)) >= len(self.messages):
            return None
        calls = self.calls.get(int(m.group(1)), [])
        if m.group(2) and int(m.group(3)) < len(calls):
            return calls[int(m.group(3))] + path[m.end():]
        return self.messages[int(m.group(1))] + path[m.start(2) if m.group(2) else m.end():]


def _text_part(part, where: str) -> dict:
    if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise ApiError(400, f"{where}: only text parts (input_text, output_text) are supported, got {kind!r}",
                       param=where)
    return {"type": "text", "text": part.get("text")}


def _output_text(output, where: str) -> str:
    """A tool's output: a string, or text parts joined."""
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return "".join(_text_part(p, f"{where}[{j}]")["text"] or "" for j, p in enumerate(output))
    raise ApiError(400, f"{where} must be a string or a list of text parts", param=where)


def _logprobs(data: dict) -> dict:
    """``include: ["message.output_text.logprobs"]`` and ``top_logprobs`` as chat's ``logprobs`` and
    ``top_logprobs``; other inclusions (encrypted reasoning, hosted tools' results) are a 400."""
    include = data.get("include") or []
    if not isinstance(include, list) or any(i != LOGPROBS for i in include):
        raise ApiError(400, f"include: only {LOGPROBS!r} is supported by this server", param="include")
    top = data.get("top_logprobs")
    if not include and not top:
        return {}
    return {"logprobs": True, "top_logprobs": top or 0}


def _tools(tools) -> list:
    """Responses' flat function tools as chat's (``{"type": "function", "function": {...}}``)."""
    if not isinstance(tools, list):
        raise ApiError(400, "tools must be a list of function tools", param="tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise ApiError(400, f"tools[{i}]: only function tools are served (not OpenAI's hosted {kind!r})",
                           param=f"tools[{i}].type")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                     if t.get(k) is not None}})
    return out


def _tool_choice(choice):
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ApiError(400, "tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": "
                           "...}", param="tool_choice")
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _text_format(text) -> dict:
    """``text.format`` as chat's ``response_format``; ``text.verbosity`` only as the default asks."""
    if text is None:
        return {}
    if not isinstance(text, dict):
        raise ApiError(400, "text must be an object ({\"format\": ...})", param="text")
    if text.get("verbosity") not in (None, "medium"):
        raise ApiError(400, "text.verbosity is not supported by this server", param="text.verbosity")
    fmt = text.get("format")
    if fmt is None or isinstance(fmt, dict) and fmt.get("type") == "text":
        return {}
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"response_format": {"type": "json_object"}}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return {"response_format": {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}}
    raise ApiError(400, "text.format.type must be text, json_object or json_schema", param="text.format.type")


CHAT_NAMES = [(re.compile(r"\bmax_completion_tokens\b"), "max_output_tokens"),
              (re.compile(r"\bresponse_format(\.json_schema)?\b"), "text.format"),
              (re.compile(r"\breasoning_effort\b"), "reasoning.effort"),
              (re.compile(r"\btools\[(\d+)\]\.function\b"), r"tools[\1]")]   # chat's fields, as Responses names them


def renamed(e: ApiError, origin: Origins) -> ApiError:
    """A chat request's error naming the Responses fields it came from (``messages[3]`` -> ``input[2]``,
    ``response_format`` -> ``text.format``), in its param and its message."""
    def chat_names(text: str) -> str:
        for pattern, new in CHAT_NAMES:
            text = pattern.sub(new, text)
        return text

    def name(text: str) -> str:
        own = origin.of(text)
        if own is not None:
            return own
        return "input" + text[len("messages"):] if text.startswith("messages") else chat_names(text)
    param = name(e.param) if e.param else e.param
    message = name(e.message) if e.param and e.message.startswith(e.param) else e.message
    return ApiError(e.status, chat_names(message), e.type, param, e.code)


def response_base(data: dict, rid: str, created: int, model: str) -> dict:
    """The fields a response repeats from its request, as OpenAI's does."""
    text = data.get("text") if isinstance(data.get("text"), dict) else {}
    return {"id": rid, "object": "response", "created_at": created, "model": model, "status": "in_progress",
            "error": None, "incomplete_details": None, "instructions": data.get("instructions"),
            "max_output_tokens": data.get("max_output_tokens"), "temperature": data.get("temperature", 1.0),
            "top_p": data.get("top_p", 1.0), "tools": data.get("tools") or [],
            "tool_choice": data.get("tool_choice") or "auto",
            "parallel_tool_calls": data.get("parallel_tool_calls", True),
            "text": {"format": text.get("format") or {"type": "text"}},
            "reasoning": data.get("reasoning") or {"effort": None, "summary": None}, "store": False,
            "background": data.get("background") is True,
            "previous_response_id": data.get("previous_response_id"), "metadata": data.get("metadata") or {},
            "user": data.get("user"), "output": [], "usage": None}


def reasoning_item(text: str, item_id: str | None = None, status: str = "completed") -> dict:
    return {"id": item_id or _item_id("rs"), "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(text: str, item_id: str | None = None, status: str = "completed", logprobs=None) -> dict:
    return {"id": item_id or _item_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def call_item(call: dict, item_id: str | None = None, status: str = "completed") -> dict:
    fn = call.get("function") or {}
    return {"id": item_id or _item_id("fc"), "type": "function_call", "call_id": call.get("id"),
            "name": fn.get("name"), "arguments": fn.get("arguments") or "", "status": status}


def finished(base: dict, output: list, finish: str | None, usage: dict | None, eagle: dict | None,
             reasoning_tokens: int) -> dict:
    """A whole response: ``incomplete`` where the output was cut at ``max_output_tokens``."""
    cut = finish == "length"
    if cut and output:   # the item the cut fell in
        output[-1]["status"] = "incomplete"
    usage = usage or {"prompt_tokens": 0, "completion_tokens": 0}
    out = base | {"status": "incomplete" if cut else "completed", "output": output,
                  "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
                  "usage": {"input_tokens": usage["prompt_tokens"],
                            "input_tokens_details": {"cached_tokens": (eagle or {}).get("cached_prompt_tokens", 0)},
                            "output_tokens": usage["completion_tokens"],
                            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                            "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]}}
    return out | ({"eagle": eagle} if eagle is not None else {})


def response_body(chat: dict, base: dict, count_tokens, close: str = THINK_CLOSE, shown: bool = True) -> dict:
    """A chat completion's answer as a response (``count_tokens``: a text's token count, for the thinking's;
    ``close``: the marker that closes a thinking; ``shown``: the thinking is an output item)."""
    choice = chat["choices"][0]
    message = choice["message"]
    output = []
    if message.get("reasoning") and shown:
        output.append(reasoning_item(message["reasoning"]))
    if message.get("content") is not None:
        entries = (choice.get("logprobs") or {}).get("content")
        output.append(message_item(message["content"], logprobs=AnswerLogprobs(close).add(
            entries, bool(message.get("reasoning")), True)))
    output += [call_item(c) for c in message.get("tool_calls") or []]
    return finished(base, output, choice["finish_reason"], chat.get("usage"), chat.get("eagle"),
                    count_tokens(message["reasoning"]) if message.get("reasoning") else 0)


class AnswerLogprobs:
    """The answer's tokens among a chat's per-token ``logprobs`` entries, however they arrive: entries are held
    until the answer has begun (by then any thinking before it has shown); after a thinking, those up to the token
    that closes it (``</think>``, found in the tokens' text) are its, not the answer's."""

    def __init__(self, close: str = THINK_CLOSE):
        self.close = close     # the reasoning parser's closing marker
        self.held: list = []
        self.thought = False   # a thinking came first
        self.closed = False    # ... and its closing token has passed
        self.seen = ""

    def add(self, entries: list | None, thought: bool, answering: bool) -> list:
        """The entries of the answer among those held and ``entries`` (``answering``: its text has begun)."""
        self.held += entries or []
        self.thought |= thought
        if not answering:
            return []
        out = []
        for e in self.held:
            if self.thought and not self.closed:
                self.seen += e["token"]
                self.closed = self.close in self.seen
            else:
                out.append(e)
        self.held = []
        return out


class ResponseEvents:
    """A chat completion's stream (its SSE lines) as the Responses events: ``response.created``, then per output
    item ``output_item.added``, its text's deltas (``reasoning_text`` / ``output_text``) or a call's argument
    deltas, their ``done`` events and ``output_item.done``, and last ``response.completed`` (``incomplete`` where
    cut) carrying the whole response; an error in the stream ends it with ``error`` and ``response.failed``."""

    def __init__(self, base: dict, count_tokens, close: str = THINK_CLOSE, shown: bool = True, on_done=None):
        self.base, self.count_tokens = base, count_tokens
        self.on_done = on_done             # awaited with the whole response before its last event (to keep it)
        self.shown = shown                 # the thinking is an output item (include_reasoning)
        self.hidden = ""                   # ... or, where it is not, its text (for reasoning_tokens)
        self.seq = 0
        self.output: list[dict] = []       # items, in order
        self.open: dict | None = None      # the text item being written (reasoning or message)
        self.calls: dict[int, dict] = {}   # chat's call index -> its item
        self.finish, self.usage, self.eagle = None, None, None
        self.logprobs = AnswerLogprobs(close)   # which logprobs are the answer's
        self.cut: dict | None = None       # the item a cut at max_output_tokens fell in

    def event(self, kind: str, **fields) -> str:
        self.seq += 1
        payload = {"type": kind, "sequence_number": self.seq - 1} | fields
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    async def translate(self, chat_lines):
        start = self.base | {"status": "in_progress"}
        yield self.event("response.created", response=start)
        yield self.event("response.in_progress", response=start)
        async for line in chat_lines:
            payload = line[len("data: "):].strip()
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                error = {"code": chunk["error"].get("code") or "server_error", "message": chunk["error"]["message"]}
                yield self.event("error", param=chunk["error"].get("param"), **error)
                yield self.event("response.failed", response=self.base | {"status": "failed", "error": error,
                                                                            "output": self.output})
                return
            if chunk.get("usage") and not chunk["choices"]:
                self.usage = chunk["usage"]
            for choice in chunk["choices"]:
                for text in self.choice(choice):
                    yield text
        self.cut = self.output[-1] if self.finish == "length" and self.output else None
        for text in self.close_all():
            yield text
        whole = finished(self.base, self.output, self.finish, self.usage, self.eagle, self.reasoning_tokens())
        if self.on_done is not None:
            await self.on_done(whole)
        yield self.event("response.incomplete" if whole["status"] == "incomplete" else "response.completed",
                         response=whole)

    def choice(self, choice: dict):
        delta = choice.get("delta") or {}
        if delta.get("reasoning") and self.shown:
            yield from self.text("reasoning", delta["reasoning"])
        elif delta.get("reasoning"):
            self.hidden += delta["reasoning"]
        answering = bool(delta.get("content")) or any(i["type"] == "message" for i in self.output)
        logprobs = self.logprobs.add((choice.get("logprobs") or {}).get("content"), bool(delta.get("reasoning")),
                                     answering)
        if delta.get("content"):
            yield from self.text("message", delta["content"], logprobs)
        elif logprobs and self.open is not None and self.open["type"] == "message":   # held to the end (stops)
            self.open["content"][0]["logprobs"] += logprobs
        for call in delta.get("tool_calls") or []:
            yield from self.call(call)
        if choice.get("finish_reason") is not None:
            self.finish, self.eagle = choice["finish_reason"], choice.get("eagle")

    def text(self, kind: str, delta: str, logprobs: list | None = None):
        if self.open is None or self.open["type"] != kind:
            yield from self.close_text()
            item = (reasoning_item if kind == "reasoning" else message_item)("", status="in_progress")
            self.open = item
            self.output.append(item)
            index = len(self.output) - 1
            yield self.event("response.output_item.added", output_index=index, item=item | {"content": []})
            yield self.event("response.content_part.added", item_id=item["id"], output_index=index,
                             content_index=0, part=item["content"][0])
        item = self.open
        item["content"][0]["text"] += delta
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {}
        if kind == "message":
            item["content"][0]["logprobs"] += logprobs or []
            extra = {"logprobs": logprobs or []}
        yield self.event(name, item_id=item["id"], output_index=self.output.index(item), content_index=0,
                         delta=delta, **extra)

    def close_text(self):
        item, self.open = self.open, None
        if item is None:
            return
        index, part = self.output.index(item), item["content"][0]
        kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
        yield self.event(f"response.{kind}.done", item_id=item["id"], output_index=index, content_index=0,
                         text=part["text"], **({} if kind == "reasoning_text" else {"logprobs": part["logprobs"]}))
        yield self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                         part=part)
        item["status"] = "incomplete" if item is self.cut else "completed"
        yield self.event("response.output_item.done", output_index=index, item=item)

    def call(self, call: dict):
        index = call.get("index", 0)
        if index not in self.calls:
            yield from self.close_text()
            item = call_item(call, status="in_progress") | {"arguments": ""}
            self.calls[index] = item
            self.output.append(item)
            yield self.event("response.output_item.added", output_index=len(self.output) - 1, item=item)
        item = self.calls[index]
        delta = (call.get("function") or {}).get("arguments") or ""
        if delta:
            item["arguments"] += delta
            yield self.event("response.function_call_arguments.delta", item_id=item["id"],
                             output_index=self.output.index(item), delta=delta)

    def close_all(self):
        yield from self.close_text()
        for item in self.calls.values():
            index = self.output.index(item)
            yield self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                             name=item["name"], arguments=item["arguments"])
            item["status"] = "incomplete" if item is self.cut else "completed"
            yield self.event("response.output_item.done", output_index=index, item=item)

    def reasoning_tokens(self) -> int:
        thought = self.hidden + "".join(i["content"][0]["text"] for i in self.output if i["type"] == "reasoning")
        return self.count_tokens(thought) if thought else 0
