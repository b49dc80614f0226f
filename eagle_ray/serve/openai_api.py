"""OpenAI request/response shapes for completions and chat completions (the subset eagle-ray serves).

:func:`parse_body` turns the raw bytes of a request into a typed :class:`ParsedRequest` or raises
:class:`ApiError` (a 4xx with OpenAI's error body naming the field). It is pure and cheap (no tokenisation), so it
runs on the event loop and is fuzzed directly by the tests. Prompt and sampling values go through the engine's
request parser, the same one the batch job uses. Unknown fields are ignored (clients send many), and so is an
explicit ``null`` (OpenAI's fields are nullable: clients send unset options as ``null``); unsupported ones that
would change what is generated or returned (``n`` above the server's cap, ``echo`` on chat, ``best_of``,
``suffix``, the legacy ``functions``, vLLM's beam search and ``length_penalty``, ``prompt_logprobs`` on a stream,
and a chat's own ``chat_template`` where the server does not trust requests' templates) are refused, unless they
hold the value that changes nothing; vLLM's ``chat_template_kwargs``, ``add_generation_prompt``,
``continue_final_message`` and ``documents``, and ``tools`` with ``tool_choice`` (``engine/tools.py``), are taken
on chat. Types are strict where lax parsing would change the request: ``"stream": "yes"`` or ``"max_tokens": true``
are refused, not read as true and 1.
"""
from __future__ import annotations

import hmac
import json
import time
import uuid
from dataclasses import dataclass
from typing import Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError,
                      field_validator, model_validator)

from eagle_ray.config import GUIDED_FIELDS, JSON_OBJECT, SamplingParams, checked_schema, engine_arguments_in
from eagle_ray.engine.request import (MAX_NESTING, Prompt, changes_nothing, documents_of_strings, nesting_depth,
                                     parse_messages, parse_prompt, sampling_params, storable)
from eagle_ray.engine.reasoning import keeps_special_text
from eagle_ray.engine.request import structured_output_fields as request_structured_outputs
from eagle_ray.engine.tools import ToolError, ToolPlan, forced_call_refusal, tool_plan
from eagle_ray.errors import InvalidRequestError
from eagle_ray.speculative.logprobs import MAX_TOP
from eagle_ray.stats import RequestStats


class ApiError(Exception):
    """An HTTP error with OpenAI's body: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


# fields that would change what is generated or returned, with the values that change nothing (OpenAI's, then
# vLLM's extra sampling and output fields, which its clients send in the same body)
UNSUPPORTED = {"best_of": (None, 1), "suffix": (None, ""),
               "functions": (None, []), "function_call": (None, "none", "auto"),
               "audio": (None,), "web_search_options": (None,),
               "length_penalty": (None, 1.0), "use_beam_search": (None, False),
               "logits_processors": (None, []),
               }
# chat fields that mean nothing to a completion's prompt (it is not templated), with the values that change nothing
CHAT_ONLY = {"chat_template_kwargs": (None, {}), "add_generation_prompt": (None, True),
             "continue_final_message": (None, False), "tools": (None, []), "tool_choice": (None, "none", "auto"),
             "parallel_tool_calls": (None, True, False), "include_reasoning": (None, True),
             "reasoning_effort": (None,), "documents": (None, []), "chat_template": (None,)}
NUMBERS = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n", "seed",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens",
           "truncate_prompt_tokens", "top_logprobs", "prompt_logprobs", "priority")   # JSON true or false is none
MAX_PROMPTS = 64    # prompts one completions request may batch


def template_variables(v: dict | None) -> dict | None:
    """A request's ``chat_template_kwargs``: the server's own apply_chat_template arguments are refused."""
    taken = engine_arguments_in(v)
    if taken:
        raise ValueError(f"{', '.join(taken)}: not a template variable (the server sets it, or a field of the "
                         "request does)")
    return v or None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None   # vLLM's: every chunk carries its choice's usage so far


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: StrictInt | None = Field(None, ge=0, description="0: completions with echo only")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(0, ge=-1, description="-1 or 0: off")
    n: StrictInt = Field(1, ge=1, description="choices per prompt; the server's cap is max_n")
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    # vLLM's extra sampling and output fields (checked by the engine's parser)
    min_p: float = 0.0
    min_tokens: StrictInt = 0
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    truncate_prompt_tokens: StrictInt | None = None
    prompt_logprobs: StrictInt | None = None   # vLLM's: the prompt's own, with k alternatives (not streamed)
    priority: StrictInt = 0                    # vLLM's: a waiting request of lower priority is admitted first
    return_token_ids: StrictBool = False       # vLLM's: the prompt's and each choice's token ids beside the text
    return_tokens_as_token_ids: StrictBool = False   # vLLM's: logprobs name tokens "token_id:<id>"
    prediction: dict | None = None   # OpenAI's predicted output: {"type": "content", "content": text or parts}
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # penalties, logit bias and structured output: checked by the engine's parser (eagle_ray/config.py)
    repetition_penalty: float = 1.0
    logit_bias: dict | None = None
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list | None = None
    guided_grammar: str | None = None
    guided_structural_tag: dict | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls_and_unsupported(cls, data):
        """A null means unset (a required field keeps it, to be named invalid); unsupported fields are refused."""
        if not isinstance(data, dict):
            return data
        for key, harmless in UNSUPPORTED.items():
            if key in data and not any(changes_nothing(data[key], h) for h in harmless):
                raise ApiError(400, f"{key} is not supported by this server", param=key)
        for key in NUMBERS:
            if isinstance(data.get(key), bool):
                raise ApiError(400, f"{key}: a number is required, not {str(data[key]).lower()}", param=key)
        if data.get("prompt_logprobs") is not None and data.get("stream"):   # as vLLM refuses it
            raise ApiError(400, "prompt_logprobs is not available when stream is true", param="prompt_logprobs")
        if data.get("stream_options") and not data.get("stream"):   # as OpenAI: options of a stream need one
            raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
        required = {k for k, f in cls.model_fields.items() if f.is_required()}
        return {k: v for k, v in data.items() if v is not None or k in required}

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop must be up to 4 non-empty strings")
        return stops

    def limit(self) -> int | None:
        return self.max_tokens

    def limit_field(self) -> str:
        """The field the client set the output limit with, to name in errors."""
        return "max_tokens"

    def top(self) -> int | None:
        """Alternatives per output token (None: no logprobs asked)."""
        return None

    @property
    def echo_prompt(self) -> bool:
        return False

    def sampling(self, default_max_tokens: int, tool_schema: dict | None = None) -> SamplingParams:
        """The request's sampling, validated by the engine's parser (a bad seed or top_k is a 400 naming it). A
        request that echoes its prompt and generates nothing (``max_tokens: 0``) runs its prompt alone.
        ``tool_schema``: the JSON schema a forced tool call holds its answer to (``engine/tools.py``)."""
        limit = self.limit()
        guided, sources = guided_fields(self)
        if tool_schema is not None:
            taken = sources + [f for f in ("min_tokens", "allowed_token_ids") if getattr(self, f)]
            if taken:
                raise ApiError(400, forced_call_refusal(", ".join(taken)), param="tool_choice")
            guided = {"guided_json": tool_schema}
        return sampling_params({"temperature": self.temperature, "top_p": self.top_p, "top_k": max(self.top_k, 0),
                                "max_new_tokens": default_max_tokens if limit is None else max(limit, 1),
                                "stop": self.stop or [], "seed": self.seed, "ignore_eos": self.ignore_eos,
                                "stop_token_ids": self.stop_token_ids or [], "logprobs": self.top(), "n": self.n,
                               "frequency_penalty": self.frequency_penalty, "presence_penalty": self.presence_penalty,
                               "repetition_penalty": self.repetition_penalty, "logit_bias": self.logit_bias,
                               "min_p": self.min_p, "min_tokens": self.min_tokens,
                               "allowed_token_ids": self.allowed_token_ids, "bad_words": self.bad_words or None,
                               "include_stop_str_in_output": self.include_stop_str_in_output,
                               "skip_special_tokens": self.skip_special_tokens,
                               "truncate_prompt_tokens": self.truncate_prompt_tokens,
                               "prompt_logprobs": self.prompt_logprobs,
                               "prediction": predicted_text(self.prediction), "priority": self.priority,
                               **guided}, field=None)


def predicted_text(prediction: dict | None) -> str | None:
    """OpenAI's ``prediction`` (``{"type": "content", "content": text or text parts}``) as its text."""
    if prediction is None:
        return None
    content = prediction.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                         isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if prediction.get("type") != "content" or not isinstance(content, str):
        raise ApiError(400, "prediction must be {\"type\": \"content\", \"content\": text or text parts}",
                       param="prediction")
    return content or None


def guided_fields(req: _Request) -> tuple[dict, list[str]]:
    """The request's structured output as the engine's guided fields, and the request's field that gave it:
    OpenAI's ``response_format`` (``json_object``: any JSON object; ``json_schema``: its ``schema``, always
    enforced, ``strict`` or not), vLLM's ``structured_outputs`` or its older ``guided_*`` fields. More than one of
    them is a 400 naming them."""
    given = {f: getattr(req, f) for f in GUIDED_FIELDS if getattr(req, f) is not None}
    sources = list(given)
    if req.response_format is not None:
        guided = response_format_fields(req.response_format)
        sources += ["response_format"] if guided else []
        given |= guided
    if req.structured_outputs is not None:
        fields = structured_output_fields(req.structured_outputs)
        sources += ["structured_outputs"] if fields else []
        given |= fields
    if len(sources) > 1:
        raise ApiError(400, f"{' and '.join(sources)} are given: a request takes one structured output",
                       param=sources[1])
    return given, sources


def response_format_fields(rf: dict) -> dict:
    kind = rf.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"guided_json": dict(JSON_OBJECT)}
    if kind == "structural_tag":   # vLLM's: xgrammar's structural tag, the whole object
        return {"guided_structural_tag": dict(rf)}
    if kind != "json_schema":
        raise ApiError(400, f"response_format.type must be text, json_object, json_schema or structural_tag, got "
                       f"{kind!r}", param="response_format.type")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
        raise ApiError(400, "response_format.json_schema must be an object with a name and a schema",
                       param="response_format.json_schema")
    if spec.get("schema") is None:
        raise ApiError(400, "response_format.json_schema.schema is required", param="response_format.json_schema")
    try:
        return {"guided_json": checked_schema(spec["schema"])}
    except ValueError as e:
        raise ApiError(400, f"response_format.json_schema.schema: {e}",
                       param="response_format.json_schema.schema") from None


def structured_output_fields(so) -> dict:
    """vLLM's ``structured_outputs`` body field, read as the batch job reads a row's (``engine/request.py``)."""
    try:
        return request_structured_outputs(so, "structured_outputs")
    except InvalidRequestError as e:
        raise ApiError(400, str(e), param="structured_outputs") from None


class CompletionRequest(_Request):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP, description="alternatives per token")

    @model_validator(mode="before")
    @classmethod
    def _logprobs_as_false(cls, data):
        """``logprobs: false`` asks for nothing (some clients send it); ``true`` is not a count. Completions count
        alternatives in ``logprobs``: chat's ``top_logprobs`` would be ignored here, so it is refused."""
        if isinstance(data, dict) and data.get("top_logprobs") not in (None, 0):
            raise ApiError(400, "top_logprobs is a chat field: on completions, logprobs is the number of "
                           "alternatives per token", param="top_logprobs")
        for key, harmless in CHAT_ONLY.items():
            if isinstance(data, dict) and key in data and not any(changes_nothing(data[key], h) for h in harmless):
                raise ApiError(400, f"{key} is a chat field: a completion's prompt is not templated", param=key)
        if isinstance(data, dict) and data.get("logprobs") is False:
            data = {k: v for k, v in data.items() if k != "logprobs"}
        elif isinstance(data, dict) and data.get("logprobs") is True:
            raise ApiError(400, f"logprobs: on completions an integer 0-{MAX_TOP} is required (the alternatives per "
                           "token), not true", param="logprobs")
        return data

    @model_validator(mode="after")
    def _nothing_only_with_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(400, "max_tokens: 0 generates nothing: it is allowed only with echo (to score the prompt)",
                           param="max_tokens")
        return self

    def top(self) -> int | None:
        return self.logprobs

    @property
    def echo_prompt(self) -> bool:
        return self.echo

    def to_prompts(self) -> list[Prompt]:
        """A string or token ids, or a batch of either (OpenAI's list forms)."""
        v = self.prompt
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) > MAX_PROMPTS:
                raise InvalidRequestError(f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(v)}")
            return [parse_prompt(p, f"prompt[{i}]") for i, p in enumerate(v)]
        return [parse_prompt(v, "prompt")]


class ChatFields(BaseModel):
    """How a chat is templated, as vLLM's chat completions and ``/tokenize`` take it."""
    model_config = ConfigDict(extra="ignore")
    chat_template_kwargs: dict | None = Field(None, description="vLLM's: variables the chat template sees, over "
                                              "the deployment's (engine.model.chat_template_kwargs)")
    add_generation_prompt: StrictBool = Field(True, description="vLLM's: end the chat with the assistant's turn "
                                              "opened")
    continue_final_message: StrictBool = Field(False, description="vLLM's: leave the final message open, for the "
                                               "model to continue (an answer's prefill)")
    tools: list | None = Field(None, description="function tools the template shows the model (engine/tools.py)")
    documents: list | None = Field(None, description="vLLM's: documents a retrieval template shows the model, each "
                                   "an object of strings (`{\"title\": ..., \"text\": ...}`)")
    chat_template: StrictStr | None = Field(None, description="vLLM's: the request's own chat template, taken where "
                                            "the server trusts requests' templates (trust_request_chat_template)")

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, v):
        return template_variables(v)

    @field_validator("documents")
    @classmethod
    def _documents_of_strings(cls, v):
        if v and not documents_of_strings(v):
            raise ValueError("each document is an object of strings ({\"title\": ..., \"text\": ...})")
        return v or None

    def check_template(self, trusted: bool) -> None:
        if self.chat_template is not None and not trusted:   # as vLLM without --trust-request-chat-template
            raise ApiError(400, "chat_template: this server does not take a request's own template "
                           "(trust_request_chat_template: false); it renders chats with engine.model.chat_template",
                           param="chat_template")

    def check_ending(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise ApiError(400, "continue_final_message: add_generation_prompt must be false to continue the final "
                           "message instead of opening the assistant's turn", param="continue_final_message")

    def chat_prompt(self, messages, variables: dict | None, tools: tuple | None) -> Prompt:
        return Prompt("messages", parse_messages(messages, "messages"), variables, self.add_generation_prompt,
                      self.continue_final_message, tools, tuple(self.documents) if self.documents else None,
                      self.chat_template or None)


def checked_tools(tools, tool_choice, parallel: bool, parser: str | None) -> ToolPlan | None:
    """:func:`tool_plan`, its refusal a 400 naming the field."""
    try:
        return tool_plan(tools, tool_choice, parallel, parser)
    except ToolError as e:
        raise ApiError(400, str(e), param=e.param) from None


class ChatRequest(_Request, ChatFields):
    messages: list = Field(..., min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP)
    echo: StrictBool = False
    include_reasoning: StrictBool = Field(True, description="vLLM's: false leaves a reasoning model's thinking out")
    reasoning_effort: Literal["low", "medium", "high"] | None = Field(
        None, description="handed to the chat template as a variable, as vLLM hands it (templates that read it)")
    tool_choice: str | dict | None = None
    parallel_tool_calls: StrictBool = True

    @field_validator("max_tokens")
    @classmethod
    def _something(cls, v):
        if v == 0:
            raise ValueError("a chat completion generates at least 1 token (max_tokens: 0 is for completions with "
                             "echo)")
        return v

    def echoed(self, messages: list[dict]) -> str:
        """vLLM's chat ``echo``: the last message's text, which each answer then starts with, where that message
        has the role the answer is written in (the assistant's; without ``add_generation_prompt``, its own).
        ``messages``: the request's as its prompt holds them (``parse_messages``: content one string)."""
        last = messages[-1]
        return last["content"] if self.echo and last["role"] == (
            "assistant" if self.add_generation_prompt else last["role"]) else ""

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs: logprobs must be true when top_logprobs is set", param="top_logprobs")
        return self

    @model_validator(mode="after")
    def _one_ending(self):
        self.check_ending()
        return self

    def top(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def limit(self) -> int | None:
        """OpenAI's ``max_completion_tokens`` replaces the deprecated ``max_tokens``: it wins where both are set."""
        return self.max_completion_tokens or self.max_tokens

    def limit_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    def tool_plan(self, parser: str | None) -> ToolPlan | None:
        return checked_tools(self.tools, self.tool_choice, self.parallel_tool_calls, parser)

    def to_prompts(self, tools: tuple | None = None) -> list[Prompt]:
        variables = self.chat_template_kwargs
        if self.reasoning_effort is not None:
            variables = {**(variables or {}), "reasoning_effort": self.reasoning_effort}
        return [self.chat_prompt(self.messages, variables, tools)]


@dataclass
class ParsedRequest:
    body: CompletionRequest | ChatRequest
    prompts: list[Prompt]
    params: SamplingParams
    tools: ToolPlan | None = None   # a chat's tools and how its answers are read
    reasoning: str | None = None    # the parser that splits a chat's thinking from its answer (engine/reasoning.py)
    responses: dict | None = None   # a Responses request as sent, answered as this chat (serve/responses.py)
    conversation: list | None = None   # ... and its own input items (kept after those of the one it continues)

    @property
    def prompt(self) -> Prompt:
        return self.prompts[0]

    @property
    def stream(self) -> bool:
        return self.body.stream

    @property
    def prompt_only(self) -> bool:
        """Echo with ``max_tokens: 0``: the prompt is scored, nothing generated."""
        return self.body.limit() == 0


def parse_body(raw: bytes, kind: str, model_name: str, max_tokens_cap: int, default_max_tokens: int,
               max_n: int = 16, tool_parser: str | None = None, reasoning_parser: str | None = None,
               trust_template: bool = False) -> ParsedRequest:
    """Validate one request body (``kind``: "completion" or "chat"); raises :class:`ApiError`. ``tool_parser``:
    how a chat's answers are read for tool calls where the model chooses (``tool_choice: auto``);
    ``reasoning_parser``: how a chat's thinking is told from its answer (``engine/reasoning.py``)."""
    req = read_body(raw, ChatRequest if kind == "chat" else CompletionRequest)
    if req.model != model_name:
        raise ApiError(404, f"model {req.model!r} does not exist; this server serves {model_name!r}",
                       param="model", code="model_not_found")
    limit = req.limit()
    if limit is not None and limit > max_tokens_cap:
        field = req.limit_field()
        raise ApiError(400, f"{field}={limit} is above this server's cap of {max_tokens_cap}", param=field)
    if req.n > max_n:
        raise ApiError(400, f"n={req.n} is above this server's cap of {max_n} choices per prompt", param="n")
    try:
        if kind != "chat":
            return ParsedRequest(req, req.to_prompts(), req.sampling(default_max_tokens))
        req.check_template(trust_template)
        plan = req.tool_plan(tool_parser)
        params = req.sampling(default_max_tokens, plan.guided_json() if plan else None)
        if plan is not None and plan.keeps_special_text or keeps_special_text(reasoning_parser):
            params = params.model_copy(update={"skip_special_tokens": False})
        return ParsedRequest(req, req.to_prompts(plan.tools if plan else None), params, plan, reasoning_parser)
    except InvalidRequestError as e:
        raise ApiError(400, str(e), param=str(e).split(":", 1)[0].split(" ", 1)[0] or None) from None


def load_object(raw: bytes) -> dict:
    """``raw`` as a JSON object nested at most ``MAX_NESTING`` deep; raises :class:`ApiError`."""
    try:
        data = json.loads(raw)
    except ValueError as e:   # JSONDecodeError, UnicodeDecodeError, an integer of more digits than Python converts
        raise ApiError(400, f"request body is not valid JSON: {str(e).split(';')[0]}") from None
    except RecursionError:
        raise ApiError(400, f"request body is nested deeper than {MAX_NESTING} levels") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    if nesting_depth(data) > MAX_NESTING:
        raise ApiError(400, f"request body is nested deeper than {MAX_NESTING} levels")
    return data


def read_body(raw: bytes, model: type[BaseModel]):
    """``raw`` as a ``model`` (a JSON object nested at most ``MAX_NESTING`` deep); raises :class:`ApiError`."""
    data = load_object(raw)
    try:
        return model(**data)
    except ValidationError as e:
        msg, param = validation_message(e)
        raise ApiError(400, msg, param=param) from None
    except (TypeError, RecursionError) as e:  # e.g. keys that are not strings cannot be keyword arguments
        raise ApiError(400, f"malformed request: {e}") from None


def authorized(header: str | None, api_key: str | None) -> bool:
    """``Authorization: Bearer <key>``; the scheme is case-insensitive (RFC 7235)."""
    if api_key is None:
        return True
    scheme, _, token = (header or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}   # pydantic's names for a union's branches


def validation_message(e: ValidationError) -> tuple[str, str | None]:
    """One line naming each bad field as the client wrote it: ``stop`` or ``stop_token_ids.1``, not the branch of
    a union pydantic tried (``stop.str``, ``stop.list[str]``). A union's branches that fail alike say so once."""
    def where(loc) -> str:
        return ".".join(str(p) for i, p in enumerate(loc)
                        if i == 0 or isinstance(p, int) or (p.isidentifier() and p not in TYPE_TAGS))

    errors = e.errors()
    msgs = list(dict.fromkeys(f"{where(x['loc']) or 'body'}: {x['msg']}" for x in errors))
    return "; ".join(msgs), where(errors[0]["loc"]) or None


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object; text that quotes the request is made UTF-8-safe (it may hold lone surrogates)."""
    return {"error": {"message": storable(message), "type": type_, "param": None if param is None else storable(param),
                      "code": code}}


def finish_reason(reason: str | None) -> str | None:
    return {"abort": "abort", "stop": "stop", "length": "length"}.get(reason or "", reason)


def eagle_stats(stats: RequestStats) -> dict:
    """Speculative-decoding stats returned with every response (``eagle`` field)."""
    return {"tau": round(stats.tau, 4), "verify_steps": stats.verify_steps,
            "accepted_draft_tokens": sum(stats.accepted_per_depth), "mean_tree_size": round(stats.mean_tree_size, 3),
            "accept_hist": stats.accept_hist, "ttft_s": round(stats.ttft_s, 4),
            "cached_prompt_tokens": stats.cached_prompt_tokens}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
