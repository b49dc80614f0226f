"""Tool calling on chat completions, as OpenAI's API and vLLM's server take it.

The request's ``tools`` reach the model through the chat template (``apply_chat_template(tools=...)``; a template
that does not render them is refused, since the model would never see them). ``tool_choice`` decides how the answer
is read:

- a named function: the output is that function's arguments, constrained to its ``parameters`` schema by the
  grammar engine (structured output), so it always parses;
- ``required``: the output is a JSON array of ``{"name", "parameters"}`` calls (at least one; one with
  ``parallel_tool_calls: false``), each constrained to its tool's schema, as vLLM constrains it;
- ``auto``: the model decides; its output is read by the deployment's ``tool_call_parser``, the format its chat
  template teaches: ``hermes`` (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``: Qwen2.5, Qwen3,
  Hermes), ``llama3_json`` (``{"name": ..., "parameters": ...}``, ``;``-separated: Llama 3.1-3.3), ``mistral``
  (``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}``, or ``name{arguments}`` after each marker, with or
  without ``[ARGS]``: Mistral 7B v0.3, Nemo, Small), ``pythonic`` (a Python list of calls with keyword arguments,
  ``[get_weather(city="Oslo")]``, in ``<|python_start|>`` / ``<|python_end|>`` or not: Llama 3.2, Llama 4) or
  ``qwen3_coder`` (``<tool_call><function=name><parameter=city>Oslo</parameter></function></tool_call>``, each value
  read as its tool's schema types it: Qwen3-Coder); the first call alone with ``parallel_tool_calls: false``.
  Without a parser ``auto`` is refused, as vLLM refuses it without ``--tool-call-parser``;
- ``none``: the tools are shown, the answer is text.

Constrained decoding is exact with speculation on (``speculative/grammar.py``), so a call's tokens are the target's
own under the schema.
"""
from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass

from eagle_ray.config import checked_schema

TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder")
CALL_OPEN, CALL_CLOSE, PYTHON_TAG = "<tool_call>", "</tool_call>", "<|python_tag|>"
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"


class ToolError(ValueError):
    """A request's tools or tool choice that cannot be served: ``param`` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    """A chat request's tools, as the template gets them, and how its answer is read."""
    tools: tuple[dict, ...]     # [{"type": "function", "function": {"name", "description", "parameters"}}]
    choice: str                 # "none" | "auto" | "required" | "named"
    name: str | None = None     # the function ``tool_choice`` names
    parser: str | None = None   # how an ``auto`` answer is read
    parallel: bool = True       # ``parallel_tool_calls``: more than one call in an answer

    @property
    def calls(self) -> bool:
        """Whether answers are read for tool calls (every choice but ``none``)."""
        return self.choice != "none"

    def schema(self, name: str) -> dict:
        fn = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return fn.get("parameters") or {"type": "object"}

    def guided_json(self) -> dict | None:
        """The JSON schema the answer is held to: the named function's arguments, or ``required``'s call list."""
        if self.choice == "named":
            return self.schema(self.name)
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                                   "parameters": self.schema(t["function"]["name"])},
                  "required": ["name", "parameters"]} for t in self.tools]
        return {"type": "array", "minItems": 1, **({} if self.parallel else {"maxItems": 1}),
                "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}

    @property
    def keeps_special_text(self) -> bool:
        """Whether answers keep special tokens' text: hermes' ``<tool_call>`` and mistral's ``[TOOL_CALLS]`` are
        special tokens of some tokenizers, which decoding would drop with the calls' markers (vLLM's parsers keep
        them too); llama3_json and pythonic answers read the same without theirs."""
        return self.choice == "auto" and self.parser in ("hermes", "mistral", "qwen3_coder")

    def message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        """The assistant message an answer makes, and its finish reason: ``tool_calls`` where the model chose to
        call (``auto``, ``required``); a call it was made to make (a named function) ends with ``stop``, as
        OpenAI's and vLLM's do."""
        content, calls = text, []
        if self.choice == "named":
            content, calls = None, [(self.name, text)]
        elif self.choice == "required":
            calls = _listed_calls(text)
            content = None if calls else text
        elif self.choice == "auto":   # the answer read as a stream read in one delta reads it
            content, calls = AutoCalls(self.parser, self.parallel, self.tools).feed(text, final=True)
            content = (content or None) if calls else content
        if not calls:
            return {"role": "assistant", "content": content}, reason
        message = {"role": "assistant", "content": content,
                   "tool_calls": [{"id": _call_id(), "type": "function",
                                   "function": {"name": name, "arguments": args}} for name, args in calls]}
        return message, "tool_calls" if reason == "stop" and self.choice != "named" else reason


def forced_call_refusal(given: str) -> str:
    """Why a forced call (a named function, ``required``) refuses a request's own constraints on its answer."""
    return f"tool_choice forces a tool call, whose arguments are structured output already: leave out {given}"


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


JSON = json.JSONDecoder(parse_constant=_no_constant)   # NaN and Infinity are not JSON: an answer holding them is text


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _arguments(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, allow_nan=False)


def _call(obj, key: str) -> tuple[str, str] | None:
    if isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get(key, {}), (dict, str)):
        return obj["name"], _arguments(obj.get(key, {}))
    return None


def _listed_calls(text: str) -> list[tuple[str, str]]:
    """``required``'s answer, a JSON array of ``{"name", "parameters"}``: each call's name and its parameters as
    written (as a named call's arguments are); cut (``length``), the calls as far as they were written, as the
    stream sent them (:class:`ListedCalls`, fed the whole answer)."""
    listed = ListedCalls()
    listed.feed(text)
    return listed.named()


class ListedCalls:
    """``required``'s JSON array of ``{"name", "parameters"}`` objects read as it streams, each character once:
    per call its name (None until its string has ended) and its parameters' text so far, as written (``{}`` for an
    object closed without any). A call's first ``name`` and ``parameters`` count; reading stops at what is not
    such an array (a name that is not a string ends the calls there)."""

    def __init__(self):
        self.text, self.at, self.state = "", 0, "open"
        self.calls: list[list] = []     # [name | None, parameters' text so far]
        self.key, self.start = None, 0  # the member being read and where its key or value starts
        self.depth, self.in_string, self.escaped = 0, False, False
        self.partial: str | None = None   # the parameters being written, while they are

    def named(self) -> list[tuple[str, str]]:
        """The calls up to the first without a name."""
        out = []
        for i, (name, _) in enumerate(self.calls):
            if not isinstance(name, str):
                break
            out.append((name, self.parameters(i)))
        return out

    def feed(self, delta: str) -> None:
        self.text += delta
        text = self.text
        while self.at < len(text) and self.state != "stop":
            c = text[self.at]
            if self.state in ("keystr", "value"):
                self._scan(c)
            elif c.isspace() or (c == "," and self.state in ("items", "key")):
                self.at += 1
            elif self.state == "open":
                self.state = "items" if c == "[" else "stop"
                self.at += c == "["
            elif self.state == "items":
                if c == "{":
                    self.calls.append([None, None])
                self.state = "key" if c == "{" else "stop"
                self.at += c == "{"
            elif self.state == "key":
                self._key(c)
            elif self.state == "colon":
                self.state = "before_value" if c == ":" else "stop"
                self.at += c == ":"
            else:   # a value's first character
                self.state, self.start = "value", self.at
                self.depth, self.in_string, self.escaped = 0, False, False
        reading = self.state == "value" and self.key == "parameters" and self.calls[-1][1] is None
        self.partial = text[self.start:self.at] if reading else None

    def _key(self, c: str) -> None:
        if c == "}":
            call = self.calls[-1]
            call[1] = "{}" if call[1] is None else call[1]
            self.state, self.at = "items", self.at + 1
        elif c == '"':
            self.state, self.start, self.at = "keystr", self.at, self.at + 1
            self.in_string, self.escaped, self.depth = True, False, 0
        else:
            self.state = "stop"

    def _scan(self, c: str) -> None:
        """One character of a key string or a value."""
        end = None
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
                end = self.at + 1 if self.depth == 0 else None
        elif c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            end = self.at + 1 if self.depth == 0 else (self.at if self.depth < 0 else None)
        elif self.depth == 0 and (c in ",:" or c.isspace()):
            end = self.at   # a number or literal ends at what follows it
        if end is None:
            self.at += 1
            return
        self._member(self.text[self.start:end])
        self.at = end

    def _member(self, written: str) -> None:
        if self.state == "keystr":
            try:
                self.key = JSON.decode(written)
            except ValueError:
                self.key = None
            self.state = "colon"
            return
        call, self.state = self.calls[-1], "key"
        self.depth = 0
        if self.key == "name" and call[0] is None:
            try:
                call[0] = JSON.decode(written) if written.startswith('"') else False
            except ValueError:
                call[0] = False   # not a name: the calls end here
        elif self.key == "parameters" and call[1] is None:
            call[1] = written

    def parameters(self, i: int) -> str:
        """Call ``i``'s parameters' text so far (its value still being written included)."""
        args = self.calls[i][1]
        if args is not None:
            return args
        return (self.partial or "") if i == len(self.calls) - 1 else ""


def _xml_calls(block: str, tools: dict) -> list[tuple[str, str]] | None:
    """Qwen3-Coder's ``<function=name>`` blocks in one ``<tool_call>``: each ``<parameter=key>`` value (one newline
    each side trimmed) typed by its tool's schema (:func:`_typed`); None where the block is anything else. One
    forward pass with ``str.find``: linear however the text repeats itself."""
    calls, at = [], 0
    while True:
        at = _skip(block, at)
        if at == len(block):
            return calls or None
        if not block.startswith("<function=", at):
            return None
        head_end = block.find(">", at)
        name = block[at + len("<function="):head_end].strip() if head_end >= 0 else ""
        if not name or "\n" in name or "<" in name:
            return None
        props = ((tools.get(name) or {}).get("parameters") or {}).get("properties") or {}
        args, at = {}, head_end + 1
        while True:
            at = _skip(block, at)
            if block.startswith("</function>", at):
                at += len("</function>")
                break
            if not block.startswith("<parameter=", at):
                return None
            key_end = block.find(">", at)
            value_end = block.find("</parameter>", key_end) if key_end >= 0 else -1
            key = block[at + len("<parameter="):key_end].strip() if key_end >= 0 else ""
            if value_end < 0 or not key or "\n" in key or "<" in key:
                return None
            value = block[key_end + 1:value_end]
            value = value[1:] if value.startswith("\n") else value
            args[key] = _typed(value[:-1] if value.endswith("\n") else value, props.get(key) or {})
            at = value_end + len("</parameter>")
        calls.append((name, json.dumps(args, ensure_ascii=False, allow_nan=False)))


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _typed(value: str, schema: dict):
    """A parameter's text as its schema types it, as vLLM's qwen3_coder parser reads it: ``null`` is None; text for
    a string (or where no type is given); otherwise JSON (``True`` as ``true``; a whole number as an integer), text
    where it does not parse or parses as another type than the schema's."""
    text = value.strip()
    if text.lower() == "null":
        return None
    types = schema.get("type") or [b.get("type") for b in schema.get("anyOf", []) if isinstance(b, dict)]
    types = {t for t in (types if isinstance(types, list) else [types]) if isinstance(t, str)} - {"null"}
    if not types or "string" in types:
        return value
    if "boolean" in types and text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        parsed = JSON.decode(text)
    except (ValueError, RecursionError):
        return value
    if isinstance(parsed, float) and parsed.is_integer() and types & {"integer", "number"}:
        return int(parsed)
    kinds = {"integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}
    ok = any(isinstance(parsed, kinds[t]) and not (t in ("integer", "number") and isinstance(parsed, bool))
             for t in types if t in kinds)
    return parsed if ok else value


def _hermes_call(block: str) -> tuple[str, str] | None:
    try:
        return _call(JSON.decode(block), "arguments")
    except ValueError:
        return None


def _held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` may begin ``marker``."""
    return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-n:])), 0)


class AutoCalls:
    """An ``auto`` answer read as it streams: its text outside calls goes out as it comes, each call once it is
    whole; read whole, the answer is this stream fed in one delta, so both read alike.

    ``hermes``: ``<tool_call>{json}</tool_call>`` blocks (the last may be left open), text that may begin a marker
    held back until the next delta shows what it is; a block that does not parse stays text. ``mistral``: the text
    before ``[TOOL_CALLS]`` as it comes, the calls after it read once the answer has ended (text where they do not
    parse). ``llama3_json`` and ``pythonic``: an answer that starts as calls do (``{`` or ``<|python_tag|>``; ``[``
    or ``<|python_start|>``) is calls, read once it has ended (text where it does not parse); any other answer is
    text, sent as it comes. Without parallel calls, the first alone is kept.
    Whitespace is sent once other text follows it: an answer with calls drops the whitespace around them (its
    content is null where nothing else is left), one without keeps its text as it is."""

    def __init__(self, parser: str, parallel: bool = True, tools: tuple = ()):
        self.parser, self.parallel = parser, parallel
        self.tools = {t["function"]["name"]: t["function"] for t in tools}   # qwen3_coder: the values' types
        self.buf = ""
        self.in_call = False        # hermes: inside a block
        self.calls_mode = None      # llama3_json: None while the answer's start is unknown, then True or False
        self.count = 0              # calls read so far
        self.spaces = ""            # whitespace not sent yet: sent once other text follows it
        self.scanned = 0            # hermes: where in an open block the search for its end goes on

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[tuple[str, str]]]:
        """(text, calls) this delta completes."""
        self.buf += delta
        if self.parser in ("hermes", "mistral", "qwen3_coder"):
            content, calls = self._mistral(final) if self.parser == "mistral" else self._hermes(final)
        else:
            content, calls = self._whole(final)
        calls = calls if self.parallel else calls[: max(0, 1 - self.count)]
        self.count += len(calls)
        text = self.spaces + content
        if final:
            self.spaces = ""
            return (text.rstrip() if self.count else text), calls
        sent = text.rstrip()
        self.spaces = text[len(sent):]
        return sent, calls

    def _hermes(self, final: bool) -> tuple[str, list[tuple[str, str]]]:
        content, calls = "", []
        while True:
            if not self.in_call:
                at = self.buf.find(CALL_OPEN)
                if at < 0:
                    cut = len(self.buf) - (0 if final else _held(self.buf, CALL_OPEN))
                    content, self.buf = content + self.buf[:cut], self.buf[cut:]
                    return content, calls
                content, self.buf, self.in_call = content + self.buf[:at], self.buf[at + len(CALL_OPEN):], True
            end = self.buf.find(CALL_CLOSE, self.scanned)
            if end < 0 and not final:
                self.scanned = max(0, len(self.buf) - len(CALL_CLOSE) + 1)
                return content, calls
            block, rest = (self.buf, "") if end < 0 else (self.buf[:end], self.buf[end + len(CALL_CLOSE):])
            self.buf, self.in_call, self.scanned = rest, False, 0
            found = ([_hermes_call(block.strip())] if self.parser == "hermes" else
                     _xml_calls(block, self.tools) or [None])
            if None in found:
                content += CALL_OPEN + block + ("" if end < 0 else CALL_CLOSE)
            else:
                calls += found
            if end < 0:
                return content, calls

    def _mistral(self, final: bool) -> tuple[str, list[tuple[str, str]]]:
        if not self.in_call:
            at = self.buf.find(MISTRAL_CALLS)
            if at < 0:
                cut = len(self.buf) - (0 if final else _held(self.buf, MISTRAL_CALLS))
                content, self.buf = self.buf[:cut], self.buf[cut:]
                return content, []
            content, self.buf, self.in_call = self.buf[:at], self.buf[at:], True
        else:
            content = ""
        if not final:
            return content, []
        calls = _mistral_calls(self.buf)
        return (content, calls) if calls else (content + self.buf, [])

    def _whole(self, final: bool) -> tuple[str, list[tuple[str, str]]]:
        starts, read = WHOLE_ANSWERS[self.parser]
        if self.calls_mode is None:
            head = self.buf.lstrip()
            if (not head or any(s.startswith(head) and s != head for s in starts)) and not final:
                return "", []   # not yet known
            self.calls_mode = head.startswith(starts)
        if not self.calls_mode:
            content, self.buf = self.buf, ""
            return content, []
        if not final:
            return "", []
        content, calls = read(self.buf)
        return content or "", calls


class CallReader:
    """One streamed choice's answer read for calls (``plan.choice`` not ``none``): a named call's arguments go out
    as they come (the first delta of the answer opens the call: id, type, name; a thinking before it opens
    nothing, so an output cut while thinking has no call, as read whole), as OpenAI streams them; an ``auto``
    answer's text as it comes and each call once it is whole (:class:`AutoCalls`); a ``required`` answer, a JSON
    array, call by call: each opens once its name is whole and its parameters go out as they come, as vLLM
    streams them."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.auto = AutoCalls(plan.parser, plan.parallel, plan.tools) if plan.choice == "auto" else None
        self.sent = 0   # calls sent
        self.listed = ListedCalls()      # required: the answer so far, read
        self.args_sent: list[int] = []   # required: per call opened, the length of its parameters sent

    def part(self, delta: str, whole: str | None, answering: bool, reason: str | None, finished: bool
             ) -> tuple[str | None, list[dict] | None, str | None]:
        """(content, calls, finish reason) of one delta of the answer (``answering``: the answer has begun, no
        thinking is left before it; ``whole``: the whole answer once it has ended; None: it has none, cut while
        thinking)."""
        plan = self.plan
        if plan.choice == "named":
            if not self.sent:
                if not answering:
                    return None, None, reason
                self.sent = 1
                return None, [{"id": _call_id(), "type": "function",
                               "function": {"name": plan.name, "arguments": delta}}], reason
            return None, [{"function": {"arguments": delta}}] if delta else None, reason
        if self.auto is not None:
            content, found = self.auto.feed(delta, final=finished)
            calls = [{"index": self.sent + i, "id": _call_id(), "type": "function",
                      "function": {"name": name, "arguments": args}} for i, (name, args) in enumerate(found)]
            self.sent += len(found)
            return content or None, calls or None, "tool_calls" if finished and self.sent and reason == "stop" \
                else reason
        self.listed.feed(delta)
        calls = []
        for i, (name, _) in enumerate(self.listed.calls):
            if not isinstance(name, str):
                break
            if i == len(self.args_sent):
                self.args_sent.append(0)
                calls.append({"index": i, "id": _call_id(), "type": "function",
                              "function": {"name": name, "arguments": ""}})
            args = self.listed.parameters(i)
            new, self.args_sent[i] = args[self.args_sent[i]:], len(args)
            if new and calls and calls[-1]["index"] == i:
                calls[-1]["function"]["arguments"] += new
            elif new:
                calls.append({"index": i, "function": {"arguments": new}})
        self.sent = len(self.args_sent)
        if finished and not self.sent:   # no call at all (cut before a name): the text, as read whole
            return self.listed.text or None, None, reason
        if finished and self.sent and reason == "stop":
            reason = "tool_calls"
        return None, calls or None, reason


def _llama3_calls(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """An answer that is ``{"name", "parameters"}`` objects (``;``-separated, after an optional
    ``<|python_tag|>``); anything else is text."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, i = JSON, [], 0
    try:
        while i < len(body):
            obj, i = decoder.raw_decode(body, i)
            calls.append(_call(obj, "arguments" if isinstance(obj, dict) and "arguments" in obj else "parameters"))
            i = len(body) - len(body[i:].lstrip().removeprefix(";").lstrip())
    except ValueError:
        return text, []
    return (None, calls) if calls and all(calls) else (text, [])


def _mistral_calls(text: str) -> list[tuple[str, str]]:
    """The calls after ``[TOOL_CALLS]``: a JSON list (or object) of ``{"name", "arguments"}``, or ``name`` and its
    JSON arguments (``[ARGS]`` between them or not) after each marker; none where any part does not parse."""
    calls, decoder = [], JSON
    for part in text.split(MISTRAL_CALLS)[1:]:
        part = part.strip()
        try:
            if part.startswith(("[", "{")):
                obj, end = decoder.raw_decode(part)
                found = [_call(o, "arguments") for o in (obj if isinstance(obj, list) else [obj])]
            else:
                name, _, rest = part.partition("{")
                name = name.strip().removesuffix(MISTRAL_ARGS).strip()
                obj, end = decoder.raw_decode("{" + rest)
                end += len(part) - len(rest) - 1
                found = [(name, _arguments(obj))] if TOOL_NAME.fullmatch(name) and isinstance(obj, dict) else [None]
        except ValueError:
            return []
        if not found or not all(found) or part[end:].strip():
            return []
        calls += found
    return calls


class _JsonNames(ast.NodeTransformer):
    """``true``, ``false`` and ``null`` (a model writing JSON inside Python) as Python's constants."""
    NAMES = {"true": True, "false": False, "null": None}

    def visit_Name(self, node):
        return ast.Constant(self.NAMES[node.id]) if node.id in self.NAMES else node


def _pythonic_calls(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """An answer that is a Python list of calls with keyword arguments of literal values (in Llama 4's
    ``<|python_start|>`` / ``<|python_end|>`` or not), parsed, never run; anything else is text."""
    body = text.strip().removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip()
    try:
        tree = _JsonNames().visit(ast.parse(body, mode="eval")).body
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for call in tree.elts:
            if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
                return text, []
            names = [k.arg for k in call.keywords]
            if None in names or len(set(names)) < len(names):
                return text, []   # positional, ** or repeated arguments: not a call of keyword arguments
            args = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
            calls.append((call.func.id, json.dumps(args, ensure_ascii=False, allow_nan=False)))
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return text, []
    return None, calls


WHOLE_ANSWERS = {   # parsers whose calls are the whole answer: how such an answer starts, and its reader
    "llama3_json": (("{", PYTHON_TAG), _llama3_calls),
    "pythonic": (("[", PYTHON_START), _pythonic_calls),
}


def tool_plan(tools, tool_choice, parallel: bool, parser: str | None) -> ToolPlan | None:
    """A chat request's ``tools`` and ``tool_choice`` checked (``ToolError`` names the field), or None where it
    has no tools and no choice that needs them."""
    if tool_choice is not None and not isinstance(tool_choice, (str, dict)):
        raise ToolError("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                        "{\"name\": ...}}", "tool_choice")
    if not tools:
        if tool_choice in (None, "none"):
            return None
        raise ToolError("tool_choice needs tools", "tool_choice")
    if not isinstance(tools, list):
        raise ToolError("tools must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    try:
        json.dumps(tools, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ToolError("tools are not valid Unicode (they hold a lone surrogate)", "tools") from None
    checked = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(tools))
    names = [t["function"]["name"] for t in checked]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ToolError(f"tools: the name {twice[0]!r} is given twice", "tools")
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise ToolError("tool_choice must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                            "tool_choice")
        if name not in names:
            raise ToolError(f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})",
                            "tool_choice")
        return ToolPlan(checked, "named", name, parser, parallel)
    choice = tool_choice or "auto"
    if choice not in ("none", "auto", "required"):
        raise ToolError(f"tool_choice must be none, auto, required or a named function, got {choice!r}",
                        "tool_choice")
    if choice == "auto" and parser is None:
        raise ToolError("tool_choice auto (the default with tools) needs a tool_call_parser in the config ("
                        + ", ".join(PARSERS) + "); send tool_choice required or a named function, or none",
                        "tool_choice")
    return ToolPlan(checked, choice, None, parser, parallel)


def _tool(t, where: str) -> dict:
    """One tool as the template gets it: ``{"type": "function", "function": {"name", "description"?,
    "parameters"?}}``, its parameters a valid JSON schema."""
    fn = t.get("function") if isinstance(t, dict) else None
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
        raise ToolError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}", where)
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise ToolError(f"{where}.function.name must be 1-64 letters, digits, _, . or -, got {name!r}",
                        f"{where}.function.name")
    out = {"name": name}
    if fn.get("description") is not None:
        if not isinstance(fn["description"], str):
            raise ToolError(f"{where}.function.description must be a string", f"{where}.function.description")
        out["description"] = fn["description"]
    if fn.get("parameters") is not None:
        try:
            out["parameters"] = checked_schema(fn["parameters"])
        except ValueError as e:
            raise ToolError(f"{where}.function.parameters: {e}", f"{where}.function.parameters") from None
    return {"type": "function", "function": out}
