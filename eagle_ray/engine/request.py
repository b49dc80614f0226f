"""One request parser for every entry point: the engine's API, the batch job's rows and the Serve app's bodies.

Each caller hands over loosely typed values (Python objects, JSON rows, OpenAI bodies) and gets typed ones back, or
an :class:`InvalidRequestError` whose message names the field. ``None`` always means "absent": a Parquet file with
``prompt``, ``messages`` and ``turns`` columns has nulls in the unused ones, and a struct of sampling overrides
has nulls in the fields a row does not set.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from eagle_ray.config import GUIDED_FIELDS, JSON_OBJECT, SamplingParams, engine_arguments_in
from eagle_ray.engine.reasoning import keeps_special_text
from eagle_ray.engine.tools import ToolError, ToolPlan, forced_call_refusal, tool_plan
from eagle_ray.errors import ConfigError, InvalidRequestError

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
PROMPT_KINDS = ("prompt", "messages", "turns")
MAX_NESTING = 64  # deepest JSON a request may carry (real requests need 4-5 levels)


@dataclass(frozen=True)
class Prompt:
    """What the model is asked: raw text (tokenised as is), chat messages (templated, by default with the
    assistant's turn opened) or token ids."""
    kind: str            # "text" | "messages" | "tokens"
    value: object        # str | list[dict] | list[int]
    variables: dict | None = None   # chat-template variables of this request, over the engine's (Serve's
                                    # ``chat_template_kwargs``)
    generation_prompt: bool = True  # a chat ends with the assistant's turn opened (``add_generation_prompt``)
    continue_final: bool = False    # or with its final message left open, to be continued
                                    # (``continue_final_message``: an answer's prefill)
    tools: tuple | None = None      # function tools the template shows the model (Serve's ``tools``)
    documents: tuple | None = None  # documents a retrieval template shows the model (vLLM's ``documents``)
    template: str | None = None     # this request's own chat template (a server that trusts requests' templates)


def check_text(text: str, field: str) -> str:
    """Text must be encodable as UTF-8: JSON can carry lone surrogates (``"\\ud800"``) that no tokenizer, Arrow
    column or HTTP response can hold."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError(f"{field} is not valid Unicode (it holds a lone surrogate)") from None
    return text


def storable(text: str) -> str:
    """``text`` as UTF-8 can carry it (Parquet, HTTP): lone surrogates become backslash escapes."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def nesting_depth(value, limit: int = MAX_NESTING) -> int:
    """Depth of nested lists/dicts, counted without recursion and stopping once past ``limit``."""
    depth, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (list, dict)):
            depth = max(depth, d)
            if depth > limit:
                return depth
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return depth


def parse_messages(value, field: str = "messages") -> list[dict]:
    """Chat messages: a non-empty list of ``{"role", "content"}``; content is a string or OpenAI text parts, empty
    only in an assistant message (an earlier answer may have been empty: a stop string at its start)."""
    if not isinstance(value, list) or not value:
        raise InvalidRequestError(f"{field} must be a non-empty list of {{role, content}} objects")
    out = []
    for i, m in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(m, dict):
            raise InvalidRequestError(f"{where} must be an object with role and content")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequestError(f"{where}.role must be one of {list(CHAT_ROLES)}, got {shown(role)}")
        calls = _tool_calls(m.get("tool_calls"), f"{where}.tool_calls") if role == "assistant" else None
        if m.get("tool_calls") and calls is None:
            raise InvalidRequestError(f"{where}.tool_calls: only an assistant message makes tool calls")
        content = m.get("content")
        if role == "assistant" and (content in ("", None, []) or isinstance(content, list) and all(
                isinstance(p, dict) and p.get("type") == "text" and p.get("text") == "" for p in content)):
            content = ""
        else:
            content = _content_text(content, f"{where}.content")
        message = {"role": role, "content": check_text(content, f"{where}.content")}
        if calls:
            message["tool_calls"] = calls
        if role == "tool" and m.get("tool_call_id") is not None:   # which call a tool's result answers
            if not isinstance(m["tool_call_id"], str):
                raise InvalidRequestError(f"{where}.tool_call_id must be a string")
            message["tool_call_id"] = check_text(m["tool_call_id"], f"{where}.tool_call_id")
        out.append(message)
    return out


def _tool_calls(value, where: str) -> list[dict] | None:
    """An assistant message's earlier tool calls as chat templates read them: each function's arguments as an
    object (OpenAI sends them as JSON text; templates render ``arguments | tojson``), as vLLM hands them over."""
    if value in (None, []):
        return None
    if not isinstance(value, list):
        raise InvalidRequestError(f"{where} must be a list of tool calls")
    out = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequestError(f"{where}[{j}] must be {{\"type\": \"function\", \"function\": "
                                      "{\"name\", \"arguments\"}}")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                raise InvalidRequestError(f"{where}[{j}].function.arguments is not valid JSON") from None
        if not isinstance(args, dict):
            raise InvalidRequestError(f"{where}[{j}].function.arguments must be a JSON object")
        out.append({"id": str(call.get("id") or f"call_{j}"), "type": "function",
                    "function": {"name": check_text(fn["name"], f"{where}[{j}].function.name"), "arguments": args}})
    return out


def _content_text(content, where: str) -> str:
    if isinstance(content, str):
        if not content:
            raise InvalidRequestError(f"{where} must be a non-empty string")
        return content
    if isinstance(content, list) and content:
        parts = []
        for j, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise InvalidRequestError(f"{where}[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                          "are supported")
            parts.append(p["text"])
        if any(parts):
            return "\n".join(parts)   # as vLLM joins a message's text parts
    raise InvalidRequestError(f"{where} must be a non-empty string (or a list of text parts)")


def parse_prompt(value, field: str = "prompt") -> Prompt:
    """A raw string, a list of chat messages or a list of token ids (the engine's ``generate``/``add_request``)."""
    if isinstance(value, Prompt):
        return value
    if isinstance(value, str):
        if not value:
            raise InvalidRequestError(f"{field} is empty")
        return Prompt("text", check_text(value, field))
    if isinstance(value, (list, tuple)) and value:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return Prompt("tokens", [int(t) for t in value])
        if all(isinstance(m, dict) for m in value):
            return Prompt("messages", parse_messages(list(value), "messages" if field == "prompt" else field))
    raise InvalidRequestError(f"{field} must be a non-empty string, a list of chat messages ({{role, content}}) or "
                              f"a list of token ids; got {_describe(value)}")


def parse_turns(value, field: str = "turns") -> list[str]:
    """MT-bench style user turns, answered one after another."""
    if not isinstance(value, list) or not value or not all(isinstance(t, str) and t.strip() for t in value):
        raise InvalidRequestError(f"{field} must be a non-empty list of non-empty strings")
    return [check_text(t, f"{field}[{i}]") for i, t in enumerate(value)]


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _whole(v) -> bool:
    return _integer(v) or isinstance(v, float) and v.is_integer()


def _number(v) -> bool:
    return _integer(v) or isinstance(v, float)


def _stops(v) -> bool:
    return isinstance(v, str) or isinstance(v, list) and all(isinstance(s, str) for s in v)


# as strict as the Serve API's, where lax parsing would read ``"max_tokens": true`` as 1 and ``"ignore_eos": "yes"``
# as true; an integer may come as a whole float (pandas stores an integer column with nulls as float64)
_INTEGER = (_whole, "an integer")
_SAMPLING_TYPES = {"max_new_tokens": _INTEGER, "max_tokens": _INTEGER, "max_completion_tokens": _INTEGER,
                   "top_k": _INTEGER, "seed": _INTEGER, "temperature": (_number, "a number"),
                   "top_p": (_number, "a number"), "ignore_eos": (lambda v: isinstance(v, bool), "true or false"),
                   "stop_token_ids": (lambda v: isinstance(v, list) and all(_integer(t) for t in v),
                                      "a list of integers"),
                   "stop": (_stops, "a string or a list of strings"), "logprobs": _INTEGER, "n": _INTEGER,
                   "frequency_penalty": (_number, "a number"), "presence_penalty": (_number, "a number"),
                   "repetition_penalty": (_number, "a number"),
                   "logit_bias": (lambda v: isinstance(v, dict) and all(_number(b) for b in v.values()),
                                  "an object of token ids to numbers"),
                   "min_p": (_number, "a number"), "min_tokens": _INTEGER, "truncate_prompt_tokens": _INTEGER,
                   "priority": _INTEGER,
                   "include_stop_str_in_output": (lambda v: isinstance(v, bool), "true or false"),
                   "skip_special_tokens": (lambda v: isinstance(v, bool), "true or false"),
                   "allowed_token_ids": (lambda v: isinstance(v, list) and all(_integer(t) for t in v),
                                         "a list of integers"),
                   "bad_words": (lambda v: isinstance(v, list) and all(isinstance(w, str) for w in v),
                                 "a list of strings"),
                   "guided_json": (lambda v: isinstance(v, (dict, str)), "a JSON schema (an object or JSON text)"),
                   "guided_regex": (lambda v: isinstance(v, str), "a string"),
                   "prediction": (lambda v: isinstance(v, str), "a string"),
                   "guided_grammar": (lambda v: isinstance(v, str), "a string"),
                   "guided_structural_tag": (lambda v: isinstance(v, dict), "an object"),
                   "guided_choice": (lambda v: isinstance(v, list) and all(isinstance(c, str) for c in v),
                                     "a list of strings")}


def sampling_params(overrides, defaults: SamplingParams | None = None, field: str | None = "sampling_params"
                    ) -> SamplingParams:
    """``defaults`` with ``overrides`` applied (a dict; null values are absent; ``max_tokens`` and
    ``max_completion_tokens`` are aliases of ``max_new_tokens``, a string ``stop`` is one stop string)."""
    defaults = defaults or SamplingParams()
    prefix = f"{field}." if field else ""
    if overrides is None:
        return defaults
    if not isinstance(overrides, dict):
        raise InvalidRequestError(f"{field or 'sampling'} must be an object, got {_describe(overrides)}")
    given = {k: v for k, v in overrides.items() if v is not None}
    for key, value in given.items():
        ok, wanted = _SAMPLING_TYPES.get(key, (None, ""))
        if ok and not ok(value):
            raise InvalidRequestError(f"{prefix}{key}: {wanted} is required, got {_describe(value)}")
    for name in STRUCTURED_OUTPUT_KEYS:   # vLLM's structured_outputs (guided_decoding, its older name)
        if name in given:
            fields = structured_output_fields(given.pop(name), prefix + name)
            twice = [k for k in (*GUIDED_FIELDS, *STRUCTURED_OUTPUT_KEYS) if k in given]
            if fields and twice:
                raise InvalidRequestError(f"{prefix}{name}: {twice[0]} is given too: a request takes one "
                                          "structured output")
            given |= fields
    if any(k in given for k in GUIDED_FIELDS):   # the row's own structured output replaces the defaults'
        given = {k: None for k in GUIDED_FIELDS} | given
    for alias in ("max_completion_tokens", "max_tokens"):   # OpenAI's newer name first, as the Serve API reads them
        if alias in given:
            value = given.pop(alias)
            given.setdefault("max_new_tokens", value)
    unknown = sorted(set(given) - set(SamplingParams.model_fields))
    if unknown:
        raise InvalidRequestError(f"{field or 'sampling'}: unknown field(s) {unknown}; known: "
                                  f"{sorted(SamplingParams.model_fields)}")
    if isinstance(given.get("stop"), str):
        given["stop"] = [given["stop"]]
    if isinstance(given.get("stop"), list):
        for i, s in enumerate(given["stop"]):
            if isinstance(s, str):
                check_text(s, f"{prefix}stop[{i}]")
    try:
        return SamplingParams(**(defaults.model_dump() | given))
    except ConfigError as e:
        raise InvalidRequestError(str(e).replace("invalid SamplingParams: ", prefix)) from None


STRUCTURED_OUTPUTS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                      "grammar": "guided_grammar", "structural_tag": "guided_structural_tag"}   # vLLM's keys
STRUCTURED_OUTPUT_KEYS = ("structured_outputs", "guided_decoding")


def structured_output_fields(so, where: str) -> dict:
    """vLLM's ``structured_outputs`` (``StructuredOutputsParams``: one of ``json``, ``regex``, ``choice``,
    ``grammar``, ``json_object``; its ``backend`` changes nothing here) as the engine's guided fields."""
    if not isinstance(so, dict):
        raise InvalidRequestError(f"{where} must be an object (json, regex, choice, grammar, structural_tag or "
                                  f"json_object), got {_describe(so)}")
    if isinstance(so.get("structural_tag"), str):   # vLLM's StructuredOutputsParams holds it as JSON text
        try:
            tag = json.loads(so["structural_tag"])
        except (ValueError, RecursionError):
            raise InvalidRequestError(f"{where}.structural_tag: not valid JSON") from None
        if not isinstance(tag, dict) or nesting_depth(tag) > MAX_NESTING:
            raise InvalidRequestError(f"{where}.structural_tag: a JSON object nested at most {MAX_NESTING} deep "
                                      "is required")
        so = so | {"structural_tag": tag}
    if so.get("json_object") is not None and not isinstance(so["json_object"], bool):
        raise InvalidRequestError(f"{where}.json_object: true or false is required, got {_describe(so['json_object'])}")
    given = {k: v for k, v in so.items() if v is not None and v is not False and k != "backend"}
    unknown = sorted(set(given) - set(STRUCTURED_OUTPUTS) - {"json_object"})
    if unknown:
        raise InvalidRequestError(f"{where}: {unknown} not supported (json, regex, choice, grammar, structural_tag, "
                                  "json_object)")
    if len(given) > 1:
        raise InvalidRequestError(f"{where}: {sorted(given)} are given: one of them")
    if given.get("json_object") is True:
        return {"guided_json": dict(JSON_OBJECT)}
    return {STRUCTURED_OUTPUTS[k]: v for k, v in given.items() if k in STRUCTURED_OUTPUTS}


@dataclass(frozen=True)
class RowRequest:
    """One batch-job row: a prompt, a chat, or MT-bench style turns, with its sampling."""
    kind: str                 # "prompt" | "messages" | "turns"
    prompt: Prompt | None     # None for turns
    turns: list[str] | None
    params: SamplingParams
    asked_tokens: int | None = None   # the row's own max_new_tokens (None: the defaults' limit, cut at the context)
    continuations: list[str] | None = None   # scored after the prompt, nothing generated (engine/scoring.py)
    tools: ToolPlan | None = None             # a chat's tools and how its answer is read (engine/tools.py)
    variables: dict | None = None             # its chat-template variables (each turn's too), over the engine's


SAMPLING_KEYS = ("sampling_params", "sampling")
CONTINUATION_KEYS = ("continuation", "continuations")
MAX_CONTINUATIONS = 256   # choices one scoring row may hold


def parse_continuations(rec: dict, kind: str, params: SamplingParams) -> list[str] | None:
    """A scoring row's continuations: ``continuation`` (one string) or ``continuations`` (a list of them), after a
    ``prompt``; None for a row that generates."""
    given = [k for k in CONTINUATION_KEYS if rec.get(k) is not None]
    if not given:
        return None
    if len(given) == 2:
        raise InvalidRequestError("a row holds continuation or continuations, not both")
    value = rec[given[0]]
    if given[0] == "continuation":
        if not isinstance(value, str) or not value:
            raise InvalidRequestError(f"continuation must be a non-empty string, got {_describe(value)}")
        value = [value]
    elif not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise InvalidRequestError("continuations must be a non-empty list of non-empty strings")
    if len(value) > MAX_CONTINUATIONS:
        raise InvalidRequestError(f"continuations: at most {MAX_CONTINUATIONS}, got {len(value)}")
    if kind != "prompt":
        raise InvalidRequestError(f"{given[0]} is scored after a prompt (text), not after {kind}")
    if params.n != 1:
        raise InvalidRequestError("sampling_params.n: a scoring row generates nothing, so it takes no samples")
    if params.truncate_prompt_tokens is not None:
        raise InvalidRequestError("sampling_params.truncate_prompt_tokens: a scoring row's context is scored as "
                                  "it stands")
    if params.prompt_logprobs is not None:
        raise InvalidRequestError("sampling_params.prompt_logprobs: a scoring row scores its continuations (its "
                                  "prompt's own values: a prompt row with prompt_logprobs)")
    return [check_text(c, f"{given[0]}[{i}]") for i, c in enumerate(value)]


def parse_row(rec, defaults: SamplingParams, tool_parser: str | None = None,
              reasoning_parser: str | None = None) -> RowRequest:
    """Validate one job row (an already decoded JSON object or Parquet record); ``tool_parser``: how a chat's
    answer is read for tool calls where the model chooses; ``reasoning_parser``: the job's, whose markers may be
    special tokens an answer must keep."""
    if not isinstance(rec, dict):
        raise InvalidRequestError(f"a row must be a JSON object, got {_describe(rec)}")
    kinds = [k for k in PROMPT_KINDS if rec.get(k) is not None]
    if len(kinds) != 1:
        raise InvalidRequestError(f"a row needs exactly one of prompt / messages / turns, got "
                                  f"{kinds or sorted(str(k) for k in rec)}")
    kind = kinds[0]
    value = rec[kind]
    overrides = next((rec[k] for k in SAMPLING_KEYS if rec.get(k) is not None), None)
    params = sampling_params(overrides, defaults)
    if keeps_special_text(reasoning_parser):   # its thinking markers are special tokens
        params = params.model_copy(update={"skip_special_tokens": False})
    if params.prompt_logprobs is not None and not (isinstance(overrides, dict) and
                                                   overrides.get("prompt_logprobs") is not None):
        if kind == "turns" or any(rec.get(k) is not None for k in CONTINUATION_KEYS):   # a job's default: not theirs
            params = params.model_copy(update={"prompt_logprobs": None})
    limits = ("max_new_tokens", "max_tokens", "max_completion_tokens")
    asked = params.max_new_tokens if isinstance(overrides, dict) and any(overrides.get(k) is not None
                                                                         for k in limits) else None
    continuations = parse_continuations(rec, kind, params)
    template = row_template(rec, kind)
    if kind == "turns":
        if params.n != 1:
            raise InvalidRequestError("sampling_params.n: samples of a conversation answered turn by turn are not "
                                      "supported; give the chat as messages")
        if params.prompt_logprobs is not None:
            raise InvalidRequestError("sampling_params.prompt_logprobs: a conversation answered turn by turn has a "
                                      "prompt per turn; give the chat as messages")
        if any(rec.get(k) is not None for k in TOOL_KEYS):
            raise InvalidRequestError("tools: a conversation answered turn by turn calls none; give the chat as "
                                      "messages")
        return RowRequest(kind, None, parse_turns(value), params, asked, variables=template.get("variables"))
    if kind == "prompt":
        if not isinstance(value, str):
            raise InvalidRequestError(f"prompt must be a string, got {_describe(value)}")
        if not value.strip():
            raise InvalidRequestError("prompt is empty")
        if any(rec.get(k) is not None for k in TOOL_KEYS):
            raise InvalidRequestError("tools: a chat's template shows them; give the row as messages")
        return RowRequest(kind, Prompt("text", check_text(value, "prompt")), None, params, asked, continuations)
    plan, params = row_tools(rec, params, overrides, tool_parser)
    return RowRequest(kind, Prompt("messages", parse_messages(value), tools=plan.tools if plan else None, **template),
                      None, params, asked, tools=plan, variables=template.get("variables"))


TOOL_KEYS = ("tools", "tool_choice")
TEMPLATE_KEYS = ("chat_template_kwargs", "add_generation_prompt", "continue_final_message", "documents")   # vLLM's
TEMPLATE_DEFAULTS = {"chat_template_kwargs": {}, "add_generation_prompt": True, "continue_final_message": False,
                     "documents": []}


def changes_nothing(value, harmless) -> bool:
    """``value`` is ``harmless``: equal, and a bool only where a bool is meant (``true == 1`` in Python)."""
    return value == harmless and isinstance(value, bool) == isinstance(harmless, bool)


def documents_of_strings(value) -> bool:
    """vLLM's ``documents``: a list of non-empty objects of strings (``{"title": ..., "text": ...}``)."""
    return isinstance(value, list) and all(isinstance(d, dict) and d and all(
        isinstance(k, str) and isinstance(x, str) for k, x in d.items()) for d in value)


def row_template(rec: dict, kind: str) -> dict:
    """A chat row's own ``chat_template_kwargs`` (over the engine's), ``add_generation_prompt``,
    ``continue_final_message`` and ``documents``, as Serve takes them per request, as :class:`Prompt` fields; a
    ``turns`` row takes the variables alone (each turn ends with the assistant's turn opened), a ``prompt`` row
    none."""
    given = {k: without_nulls(rec[k]) for k in TEMPLATE_KEYS if rec.get(k) is not None}
    given = {k: v for k, v in given.items() if not changes_nothing(v, TEMPLATE_DEFAULTS[k])}   # a filled column's
    if not given:
        return {}
    if kind == "prompt":
        raise InvalidRequestError(f"{next(iter(given))}: a chat template's field; give the row as messages")
    variables = given.get("chat_template_kwargs")
    if variables is not None and not isinstance(variables, dict):
        raise InvalidRequestError(f"chat_template_kwargs must be an object, got {_describe(variables)}")
    taken = engine_arguments_in(variables)
    if taken:
        raise InvalidRequestError(f"chat_template_kwargs: {', '.join(taken)} is not a template variable (the job "
                                  "sets it, or a field of the row does)")
    documents = given.get("documents")
    if documents is not None and not documents_of_strings(documents):
        raise InvalidRequestError("documents: each document is an object of strings ({\"title\": ..., "
                                  "\"text\": ...})")
    if documents and kind == "turns":
        raise InvalidRequestError("documents: a turns row's chat is made turn by turn; give the chat as messages")
    ending = {k: given[k] for k in ("add_generation_prompt", "continue_final_message") if k in given}
    for key, value in ending.items():
        if not isinstance(value, bool):
            raise InvalidRequestError(f"{key} must be true or false, got {_describe(value)}")
    if ending and kind == "turns":
        raise InvalidRequestError(f"{next(iter(ending))}: each turn of a turns row ends with the assistant's turn "
                                  "opened; give the chat as messages")
    generation, cont = ending.get("add_generation_prompt", True), ending.get("continue_final_message", False)
    if generation and cont:
        raise InvalidRequestError("continue_final_message: add_generation_prompt must be false to continue the "
                                  "final message instead of opening the assistant's turn")
    return {"variables": variables or None, "generation_prompt": generation, "continue_final": cont,
            "documents": tuple(documents) if documents else None}


FORCED_CALL_CONFLICTS = (*GUIDED_FIELDS, "min_tokens", "allowed_token_ids")   # what a forced call's schema replaces


def without_nulls(value):
    """``value`` with null object members dropped at every depth: a null means absent, and Arrow fills the keys one
    struct of a column lacks with nulls (two tools with different parameters, in Parquet or a Ray dataset)."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


def row_tools(rec: dict, params: SamplingParams, overrides, parser: str | None
              ) -> tuple[ToolPlan | None, SamplingParams]:
    """A chat row's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, read as Serve reads them, and its
    sampling with a forced call's schema (and, where hermes reads the answer, special tokens' text kept). A forced
    call's schema replaces the job's own guided field, ``min_tokens`` or ``allowed_token_ids``; the row's own are
    refused."""
    parallel = rec.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError(f"parallel_tool_calls must be true or false, got {_describe(parallel)}")
    try:
        plan = tool_plan(without_nulls(rec.get("tools")), without_nulls(rec.get("tool_choice")),
                         parallel is not False, parser)
    except ToolError as e:
        raise InvalidRequestError(str(e)) from None
    if plan is None:
        return None, params
    update = {"skip_special_tokens": False} if plan.keeps_special_text else {}
    schema = plan.guided_json()
    if schema is not None:
        own = [k for k in FORCED_CALL_CONFLICTS if isinstance(overrides, dict) and overrides.get(k) not in (None, 0)]
        if own:
            raise InvalidRequestError(forced_call_refusal("the row's " + ", ".join(own)))
        update |= {k: None for k in GUIDED_FIELDS} | {"guided_json": schema, "min_tokens": 0,
                                                      "allowed_token_ids": None}
    return plan, params.model_copy(update=update) if update else params


def _describe(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)}" if value else "an empty list"
    return type(value).__name__


def shown(value, width: int = 40) -> str:
    """``value`` as an error message quotes it: its repr, cut to ``width`` characters."""
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."
