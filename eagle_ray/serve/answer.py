"""One request's whole answer: its prompts made into sequences, run on a queue, and written as OpenAI's body.

Serve answers an HTTP request with it (or streams the same prepared sequences), and the batch job answers a line
of an OpenAI batch file with it (``batch/openai_batch.py``), so a line gets the answer Serve gives its body.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from eagle_ray.engine.reasoning import markers_of
from eagle_ray.errors import EagleError, EngineDeadError, PromptTooLongError
from eagle_ray.serve import responses
from eagle_ray.serve.choices import ChoiceShape, PromptChoices, merged_stats, prepare, usage
from eagle_ray.serve.logprobs import TokenIds
from eagle_ray.serve.openai_api import ApiError, ParsedRequest, eagle_stats, finish_reason, new_id, now


@dataclass
class Prepared:
    """A request's sequences and how its answer is written."""
    kind: str                    # "chat" or "completion" (a Responses request is answered as a chat)
    rid: str
    prompts: list[PromptChoices]
    shape: ChoiceShape
    base: dict | None            # a Responses request's own response fields (serve/responses.py); None otherwise
    close: str                   # the marker that closes a thinking
    shown: bool = True           # a Responses request's thinking is an output item (include_reasoning)

    @property
    def seqs(self) -> list:
        return [s for p in self.prompts for s in p.seqs]


def api_error(e: EagleError) -> ApiError:
    """An engine's error as the HTTP error Serve answers it with."""
    if isinstance(e, EngineDeadError):
        return ApiError(503, str(e), "server_error", code="engine_failed")
    return ApiError(400, str(e), code="context_length_exceeded" if isinstance(e, PromptTooLongError) else None)


def prepare_request(engine, req: ParsedRequest, kind: str, model: str, speculative: bool, token_text
                    ) -> Prepared:
    """Tokenise ``req`` (call it off the event loop) and check that each prompt leaves room for its output;
    raises :class:`ApiError`, before anything runs."""
    answers = req.responses
    kind = "chat" if answers is not None else kind
    rid = responses.new_response_id() if answers is not None else new_id("chatcmpl" if kind == "chat" else "cmpl")
    try:
        prompts = prepare(engine, req, rid, speculative)
    except EagleError as e:
        raise api_error(e) from None
    limit_name = req.body.limit_field() if answers is None else "max_output_tokens"
    try:
        for p in prompts:
            engine.check_room(len(p.prompt_ids), req.body.limit(), limit_name)
    except PromptTooLongError as e:
        raise ApiError(400, str(e), param=limit_name, code="context_length_exceeded") from None
    prefix = req.body.echoed(req.prompt.value) if kind == "chat" and answers is None else ""
    shape = ChoiceShape(kind, req.body.echo_prompt or bool(prefix), req.body.top(),
                        TokenIds(token_text) if req.body.return_tokens_as_token_ids else token_text, req.tools,
                        req.params.skip_special_tokens, req.reasoning, req.params.guided is not None,
                        getattr(req.body, "include_reasoning", True), req.body.prompt_logprobs,
                        req.body.return_token_ids, prefix)
    base = responses.response_base(answers, rid, now(), model) if answers is not None else None
    return Prepared(kind, rid, prompts, shape, base, markers_of(req.reasoning)[1],
                    answers is None or responses.shows_reasoning(answers))


async def run_all(queue, seqs: list) -> list:
    """Every sequence's output; where one fails, the others are cancelled (of no use now) and its error raised."""
    try:
        return list(await asyncio.gather(*(queue.agenerate(s) for s in seqs)))
    except BaseException:
        for s in seqs:
            queue.cancel(s.request_id)
        raise


async def run_whole(queue, p: Prepared, model: str) -> tuple[dict, list]:
    """Every choice run to its end, and the chat or completion body with the outputs; where one choice fails, the
    others are cancelled and its error raised."""
    outs = await run_all(queue, p.seqs)
    n = len(p.prompts[0].seqs)
    choices = [p.shape.choice(i, p.prompts[i // n], out, finish_reason(out.finish_reason))
               for i, out in enumerate(outs)]
    body = {"id": p.rid, "object": "chat.completion" if p.kind == "chat" else "text_completion", "created": now(),
            "model": model, "choices": choices}
    if p.kind == "chat" and p.shape.prompt_k is not None:   # vLLM's place for a chat's: beside its choices
        body["prompt_logprobs"] = p.shape.prompt_logprobs(p.prompts[0])
    if p.kind == "chat" and p.shape.token_ids:
        body["prompt_token_ids"] = list(p.prompts[0].prompt_ids)
    # in a thread: a long prediction's token count is a second's matching, which must not stall other streams
    body |= {"usage": await asyncio.to_thread(usage, p.prompts, outs), "eagle": eagle_stats(merged_stats(outs))}
    return body, outs


def final_body(p: Prepared, body: dict, count_tokens) -> dict:
    """The body a client gets: the chat's, or for a Responses request the response it amounts to
    (``count_tokens``: a text's token count, for the thinking's)."""
    return body if p.base is None else responses.response_body(body, p.base, count_tokens, p.close, p.shown)


def token_counter(tokenizer):
    """A text's token count, as a response's thinking tokens are counted."""
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])
