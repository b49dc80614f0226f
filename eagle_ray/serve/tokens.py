"""vLLM's ``/tokenize`` and ``/detokenize``: a prompt's token ids as the engine would run them, and ids' text.

Clients count a prompt's tokens before they send it (to fit a context, to bill) with the server's own tokenizer and
chat template; the answer is what a completion or chat request with the same prompt would run, special-token
handling (``split_special_tokens``) included.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt

from eagle_ray.engine.request import Prompt, parse_prompt
from eagle_ray.errors import InvalidRequestError
from eagle_ray.serve.openai_api import ApiError, ChatFields, checked_tools, read_body


class TokenizeRequest(ChatFields):
    """vLLM's body: ``prompt`` (text or ids) or ``messages`` (with its chat fields), and the model."""
    model: str | None = None   # optional, as vLLM's
    prompt: str | list[StrictInt] | None = None
    messages: list | None = None
    add_special_tokens: StrictBool | None = None
    return_token_strs: StrictBool = False

    def to_prompt(self) -> Prompt | None:
        """The prompt as the engine takes it (None: an empty one, which holds no tokens)."""
        if (self.prompt is None) == (self.messages is None):
            raise ApiError(400, "give one of prompt and messages", param="prompt")
        if self.prompt is not None:
            if self.add_special_tokens is False:   # the engine runs a text prompt with them
                raise ApiError(400, "add_special_tokens: false is not supported for a prompt (a completion "
                               "runs it with them)", param="add_special_tokens")
            return parse_prompt(self.prompt, "prompt") if self.prompt not in ("", []) else None
        if self.add_special_tokens:   # a chat template writes them itself
            raise ApiError(400, "add_special_tokens: true is not supported with messages (the chat template "
                           "writes them)", param="add_special_tokens")
        self.check_ending()
        plan = checked_tools(self.tools, "none", True, None)
        return self.chat_prompt(self.messages, self.chat_template_kwargs, plan.tools if plan else None)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[StrictInt]


def parse_tokens_body(raw: bytes, kind: str, model_name: str, trust_template: bool = False
                      ) -> TokenizeRequest | DetokenizeRequest:
    """``kind``: "tokenize" or "detokenize"; raises :class:`ApiError` naming the field (a request's own
    ``chat_template`` as chat completions does)."""
    req = read_body(raw, TokenizeRequest if kind == "tokenize" else DetokenizeRequest)
    if kind == "tokenize":
        req.check_template(trust_template)
    if req.model is not None and req.model != model_name:
        raise ApiError(404, f"model {req.model!r} does not exist; this server serves {model_name!r}",
                       param="model", code="model_not_found")
    return req


def answer(engine, req: TokenizeRequest | DetokenizeRequest) -> dict:
    """The response body (tokenising: call it off the event loop); a prompt the engine refuses is an
    :class:`InvalidRequestError` (a 400)."""
    tokenizer = engine.tokenizer
    if isinstance(req, DetokenizeRequest):
        bad = [t for t in req.tokens if not 0 <= t < engine.target.vocab_size]
        if bad:
            raise InvalidRequestError(f"tokens: ids {bad[:5]} are outside the vocabulary [0, "
                                      f"{engine.target.vocab_size})")
        return {"prompt": tokenizer.decode(req.tokens)}
    prompt = req.to_prompt()
    ids = [] if prompt is None else engine.codec.encode(prompt)
    return {"count": len(ids), "max_model_len": engine.target.max_len, "tokens": ids,
            "token_strs": tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None}
