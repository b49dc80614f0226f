"""OpenAI batch files: a line ``{"custom_id", "method", "url", "body"}`` is a job row answered as Serve answers its
body, and the job can write OpenAI's batch output file from its output.

A line's body is read by Serve's own parser (``serve/openai_api.py``) and answered by its own code
(``serve/answer.py``), so its answer is Serve's: OpenAI's defaults (``temperature`` 1), its ``n`` choices, logprobs,
tools, structured output, reasoning. The job's ``sampling`` defaults do not apply, except ``max_new_tokens`` for a
body without a limit of its own (where Serve has ``default_max_tokens``). The row keeps the whole answer in its
``response`` column, as the output file's ``response`` object (``status_code``, ``request_id``, ``body``), and the
first choice in the usual columns, so analytics read these rows like any other.

The output file holds a line per row: ``response`` where the line was answered or refused with an HTTP status,
``error`` (``code``: the row's ``error_kind``) where there is none, as for a line that is not JSON. Lines come in the
order the output's parts hold them, not the input's (OpenAI's file is not in order either: match by ``custom_id``).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
import uuid

from eagle_ray.batch.rows import (ENGINE_FAILED, INTERNAL_ERROR, INVALID_REQUEST, PROMPT_TOO_LONG, error_kind,
                                  stop_text)
from eagle_ray.batch.store import put_file_atomic
from eagle_ray.engine.request import shown, without_nulls
from eagle_ray.errors import EagleError
from eagle_ray.serve import responses
from eagle_ray.serve.answer import api_error
from eagle_ray.serve.openai_api import ApiError, ParsedRequest, parse_body

URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completion", "/v1/responses": "responses"}
MAX_CHOICES = 1024            # a line's choices per prompt (a job row's ``n`` has the same cap)
NO_CAP = 2**31 - 1            # max_tokens: the room after the prompt is the limit (SamplingParams' own bound)


def parse_line(rec: dict, default_max_tokens: int, tool_parser: str | None, reasoning_parser: str | None
               ) -> tuple[str, ParsedRequest]:
    """A batch line's kind ("chat", "completion" or "responses") and its body read as Serve reads it; raises
    :class:`ApiError` naming the field. The line's ``model`` is taken as it is: the job runs one model. No cap on
    ``max_tokens`` but the context's (a line that asks for more than fits is ``prompt_too_long``)."""
    custom_id = rec.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise ApiError(400, "custom_id: a non-empty string is required on a batch request line", param="custom_id")
    method = rec.get("method", "POST")
    if method != "POST":
        raise ApiError(400, f"method: only POST is supported, got {shown(method, 60)}", param="method")
    url = rec.get("url")
    if not isinstance(url, str) or url not in URLS:
        raise ApiError(400, f"url: {shown(url, 60)} is not answered by this job; it answers {', '.join(URLS)}",
                       param="url")
    body = rec.get("body")
    if not isinstance(body, dict):
        raise ApiError(400, "body: the request's JSON object is required", param="body")
    body = without_nulls(body)   # a null means absent: Arrow fills the keys one line's body lacks with nulls
    if body.get("stream"):
        raise ApiError(400, "stream: a batch line's answer is written whole, not streamed", param="stream")
    model = body.get("model")
    parse = functools.partial(parse_body, model_name=model, max_tokens_cap=NO_CAP,
                              default_max_tokens=default_max_tokens, max_n=MAX_CHOICES, tool_parser=tool_parser,
                              reasoning_parser=reasoning_parser)
    raw = json.dumps(body).encode()
    kind = URLS[url]
    if kind == "responses":
        return kind, responses.parse_request(raw, functools.partial(parse, kind="chat"))
    return kind, parse(raw, kind)


def batch_response(status: int, body: dict) -> str:
    """A row's ``response`` column: the output line's ``response`` object, as JSON text."""
    return json.dumps({"status_code": status, "request_id": f"req_{uuid.uuid4().hex}", "body": body},
                      ensure_ascii=False)


def refusal(e: ApiError | EagleError) -> tuple[str, ApiError]:
    """A refused or failed line's ``error_kind`` (what the job calls the same failure of any row) and the HTTP
    error Serve would answer (a bug: 500, and the row runs again on resume)."""
    if isinstance(e, EagleError):
        kind = error_kind(e)
        return kind, ApiError(500, f"{type(e).__name__}: {e}", "server_error") if kind == INTERNAL_ERROR else \
            api_error(e)
    if e.code == "context_length_exceeded":
        return PROMPT_TOO_LONG, e
    if e.status == 503:
        return ENGINE_FAILED, e
    return INVALID_REQUEST if e.status < 500 else INTERNAL_ERROR, e


def answer_columns(kind: str, body: dict, outs: list) -> dict:
    """The usual output columns of a line's answer: its first choice's text, thinking, calls and finish, the
    first choice's tokens, and the whole answer's usage."""
    first = body["choices"][0]
    if kind == "chat":
        message = first["message"]
        text, thought, calls = message.get("content"), message.get("reasoning"), message.get("tool_calls")
    else:
        text, thought, calls = first["text"], None, None
    return {"output": text or "", "reasoning": thought, "turn_outputs": [text or ""],
            "tool_calls": json.dumps(calls, ensure_ascii=False) if calls else None,
            "finish_reason": first["finish_reason"], "stop_reason": stop_text(first["stop_reason"]),
            "output_token_ids": outs[0].token_ids, "sample_index": 0,
            "prompt_tokens": body["usage"]["prompt_tokens"], "output_tokens": body["usage"]["completion_tokens"]}


NOT_A_LINE = "not_a_batch_request"


def output_line(rid: str, response: str | None, error: str | None, kind: str | None) -> dict:
    """One line of OpenAI's batch output file for an output row (its id is the line's ``custom_id``)."""
    line_id = "batch_req_" + hashlib.sha1(rid.encode("utf-8", "surrogatepass")).hexdigest()[:24]
    if response is not None:
        return {"id": line_id, "custom_id": rid, "response": json.loads(response), "error": None}
    if not error:
        kind, error = NOT_A_LINE, "this row is not an OpenAI batch request line (custom_id, method, url, body)"
    return {"id": line_id, "custom_id": rid, "response": None, "error": {"code": kind, "message": error}}


def write_output_file(tables, dest_fs, dest: str) -> dict:
    """Write OpenAI's batch output file at ``dest`` (whole or not at all) from the output's ``tables`` (its parts'
    ``id``, ``sample_index``, ``response``, ``error`` and ``error_kind``), a part at a time; returns how many
    lines it holds and how many of them were answered (status 200)."""
    counts = {"lines": 0, "answered": 0}
    fd, tmp = tempfile.mkstemp(prefix="eagle-ray-batch-", suffix=".jsonl")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", errors="surrogatepass") as f:
            for table in tables:
                cols = [table.column(c).to_pylist() for c in ("id", "sample_index", "response", "error",
                                                             "error_kind")]
                for rid, sample, response, error, kind in zip(*cols):
                    if sample:   # a plain row's further samples: one line per row
                        continue
                    line = output_line(rid, response, error, kind)
                    counts["lines"] += 1
                    counts["answered"] += (line["response"] or {}).get("status_code") == 200
                    f.write(json.dumps(line, ensure_ascii=False) + "\n")
        put_file_atomic(dest_fs, dest, tmp)
    finally:
        os.remove(tmp)
    return counts
