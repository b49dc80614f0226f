"""Log-probabilities in OpenAI's response shapes.

Chat: ``choices[i].logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}, ...]}, ...]}``. Completions: ``choices[i].logprobs = {"tokens", "token_logprobs", "top_logprobs",
"text_offset"}``, where each ``top_logprobs`` entry maps token text to its logprob and holds the chosen token and the
``k`` most probable ones (vLLM's shape: lm-evaluation-harness reads a greedy continuation off it), and a prompt's
first token (``echo``) has ``null`` for both. A chat token's text is the tokenizer's decoding of it alone; a
completions token's text is the text it adds after the tokens before it (as vLLM detokenizes), so that the tokens
joined are the choice's text and ``text_offset`` indexes it. A token's ``bytes`` are its own bytes (a byte-level BPE
token that holds part of a UTF-8 character gives those bytes, not U+FFFD).
"""
from __future__ import annotations

import functools

from eagle_ray.engine.text import Detokenizer
from eagle_ray.speculative.logprobs import TokenLogprobs

FLOOR = -9999.0   # a logprob of -inf (a token the target rules out) as JSON can carry it, as vLLM sends it


def _finite(x: float) -> float:
    return max(x, FLOOR)


class TokenText:
    """Each token id's text and bytes, decoded once per tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        from transformers.convert_slow_tokenizer import bytes_to_unicode   # byte-level BPE's byte -> character
        self._byte_of = {c: b for b, c in bytes_to_unicode().items()}
        self.text = functools.lru_cache(maxsize=65536)(self._text)
        self.bytes = functools.lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def pieces(self, token_ids: list[int], before: list[int] = (), prompt_ids: list[int] = (),
               skip_special: bool = True) -> list[str]:
        """The text each token adds to the text before it, as the engine's detokenizer gives an output's text
        (``prompt_ids``: the prompt it follows; ``before``: the output's tokens ahead of ``token_ids``;
        ``skip_special``: the request's ``skip_special_tokens``). A token that ends inside a character adds nothing;
        the one that completes it adds the character."""
        d = Detokenizer(self.tokenizer, prompt_ids, skip_special)
        if before:
            d.add(list(before))
        return [d.add([t]) for t in token_ids]

    def _bytes(self, token_id: int) -> list[int]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and piece and all(c in self._byte_of for c in piece):
            return [self._byte_of[c] for c in piece]        # byte-level BPE: the token's own bytes
        return list(self.text(token_id).encode("utf-8"))


class TokenIds:
    """Token texts as vLLM's ``return_tokens_as_token_ids`` names them, ``token_id:<id>`` (a token whose text is
    part of a character stays identifiable); bytes as the token's own."""

    def __init__(self, text: TokenText):
        self.tokenizer, self.bytes = text.tokenizer, text.bytes

    @staticmethod
    def text(token_id: int) -> str:
        return f"token_id:{token_id}"

    def pieces(self, token_ids: list[int], before: list[int] = (), prompt_ids: list[int] = (),
               skip_special: bool = True) -> list[str]:
        return [self.text(t) for t in token_ids]


def chat_logprobs(lp: TokenLogprobs, token_ids: list[int], k: int, text: TokenText) -> dict:
    """OpenAI's chat ``logprobs`` object for ``token_ids`` (``k``: ``top_logprobs``)."""
    def entry(t: int, v: float) -> dict:
        return {"token": text.text(t), "logprob": _finite(v), "bytes": text.bytes(t)}
    return {"content": [entry(t, v) | {"top_logprobs": [entry(i, x) for i, x in (top or [])[:k]]}
                        for t, v, top in zip(token_ids, lp.values, lp.top)]}


def completion_logprobs(lp: TokenLogprobs, token_ids: list[int], k: int, text: TokenText, offset: int = 0,
                        before: list[int] = (), prompt_ids: list[int] = (), skip_special: bool = True) -> dict:
    """OpenAI's completions ``logprobs`` object for ``token_ids``; ``offset``: the first token's ``text_offset``;
    ``before`` and ``prompt_ids``: the output's tokens ahead of them (a streamed chunk's) and its prompt's, which
    decide their texts (an echoed prompt has neither)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, v, top, piece in zip(token_ids, lp.values, lp.top, text.pieces(token_ids, before, prompt_ids,
                                                                                         skip_special)):
        out["tokens"].append(piece)
        out["text_offset"].append(offset)
        offset += len(piece)
        if v is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_finite(v))
        alts = {text.text(i): _finite(x) for i, x in (top or [])[:k]}
        out["top_logprobs"].append({piece: _finite(v)} | alts if piece not in alts else alts)
    return out


def prompt_logprob_entries(lp: TokenLogprobs, prompt_ids: list[int], k: int, text: TokenText) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` (``lp`` from the prompt's first token, :func:`echoed`): per prompt token, the
    token and its ``k`` most probable alternatives by id, each ``{logprob, rank, decoded_token}`` (an alternative's
    rank its place; the token's its rank in the vocabulary, or its place where it is among them, as vLLM's); null
    for the first token, which has none."""
    def entry(t: int, v: float, rank: int | None) -> dict:
        return {"logprob": _finite(v), "rank": rank, "decoded_token": text.text(t)}
    out = []
    for t, v, top, rank in zip(prompt_ids, lp.values, lp.top, lp.ranks):
        if v is None:
            out.append(None)
            continue
        at = {str(t): entry(t, v, rank)}
        for place, (i, x) in enumerate((top or [])[:k], 1):
            at[str(i)] = entry(i, x, place)
        out.append(at)
    return out


def merge_completion(a: dict | None, b: dict) -> dict:
    """Two completions ``logprobs`` objects as one (an echoed prompt's, then the output's)."""
    return b if a is None else {key: a[key] + b[key] for key in a}


def echoed(prompt: TokenLogprobs | None, prompt_ids: list[int], start: int) -> TokenLogprobs:
    """A prompt's log-probabilities from its first token: ``None`` where none was computed (before ``start``)."""
    lp = TokenLogprobs([None] * start, [None] * start)
    if prompt is not None:
        lp.extend(prompt)
    missing = len(prompt_ids) - len(lp)
    if missing > 0:
        lp.extend(TokenLogprobs([None] * missing, [None] * missing))
    return lp
