"""Reasoning models' thinking apart from their answer, as vLLM's ``--reasoning-parser`` returns it.

A model that thinks first (Qwen3, DeepSeek-R1 and its distills) writes ``<think> ... </think>`` and then its answer
(Magistral: ``[THINK] ... [/THINK]``, read as Qwen3's are; ``MARKERS``).
Where the thinking starts depends on the chat template, so each request's mode is read from the end of its own
prompt (:func:`thinking_mode`):

- the prompt opens a thinking (its last marker is ``<think>``: DeepSeek-R1's template, Qwen3's thinking-only
  models, an assistant prefill that stops inside one): everything before ``</think>`` is thinking (``until_close``);
- the prompt closes one (``<think></think>``: thinking turned off): the output is all answer (``answer``), but for
  ``qwen3``, whose output may still open its own;
- no marker: ``qwen3`` thinks where the output opens ``<think>`` (``if_opened``; ``enable_thinking: false`` writes
  none), ``deepseek_r1`` until ``</think>``.

An output cut (``max_tokens``) before it closes its thinking is all thinking. As vLLM's parsers, the markers are
dropped and the text around them kept as it is. Streamed, each delta goes to one side or the other, a marker split
across deltas held back until it is whole. Structured output and forced tool calls constrain the answer from its
first token, so their outputs are all answer, unless each marker is one token of the model's vocabulary (Qwen3's,
DeepSeek-R1's): then the grammar waits for the thinking to close (``speculative/grammar.py``, ``Guide.gate``).
"""
from __future__ import annotations

import functools

OPEN, CLOSE = "<think>", "</think>"
MARKERS = {"deepseek_r1": (OPEN, CLOSE), "qwen3": (OPEN, CLOSE),
           "mistral": ("[THINK]", "[/THINK]")}   # Magistral's
PARSERS = tuple(MARKERS)
MODES = ("until_close", "if_opened", "answer")


def markers_of(parser: str | None) -> tuple[str, str]:
    """A parser's (opening, closing) markers."""
    return MARKERS.get(parser or "qwen3", (OPEN, CLOSE))


def keeps_special_text(parser: str | None) -> bool:
    """Whether answers keep special tokens' text: Magistral's markers are control tokens, which decoding would drop
    with them (Qwen3's and DeepSeek-R1's are not special)."""
    return parser == "mistral"


def thinking_mode(parser: str, prompt_tail: str, constrained: bool = False, gated: bool = False) -> str:
    """How a request's output is split: from the parser, the end of its templated prompt (text holding at least
    its last marker, if any) and whether structured output constrains it from its first token (``constrained``)
    or once its thinking has closed (``gated``: a prompt that closed it leaves the output all answer)."""
    if constrained:
        return "answer"
    opening, closing = markers_of(parser)
    if parser == "mistral":   # Magistral's system prompt shows the markers: only the assistant's turn counts
        prompt_tail = prompt_tail.rpartition("[/INST]")[2]
    opened, closed = prompt_tail.rfind(opening), prompt_tail.rfind(closing)
    if gated and closed > opened:
        return "answer"
    if opened > closed:
        return "until_close"
    if parser in ("qwen3", "mistral"):
        return "if_opened"
    return "answer" if closed >= 0 else "until_close"


def split_reasoning(text: str, mode: str, markers: tuple[str, str] = (OPEN, CLOSE)
                    ) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output; None for a side it does not have (or that is empty)."""
    if mode == "answer":
        return None, text or None
    opening, closing = markers
    body = text
    if text.lstrip().startswith(opening):
        body = text.lstrip()[len(opening):]
    elif mode == "if_opened":
        return None, text or None
    if closing not in body:
        return body or None, None
    thought, _, answer = body.partition(closing)
    return thought or None, answer or None


class ReasoningStream:
    """Splits a streamed output as :func:`split_reasoning` splits it whole: :meth:`feed` returns each delta's
    (reasoning, content) parts; text that may be the start of a marker is held back until a later delta (or the
    end, ``final``) shows what it is."""

    def __init__(self, mode: str, markers: tuple[str, str] = (OPEN, CLOSE)):
        self.thinking = mode != "answer"    # before the closing marker
        self.mode = mode
        self.opening, self.closing = markers
        self.opened = False                 # the output's start is past (and its opening marker, where it writes one)
        self.held = ""                      # text that may begin a marker

    def feed(self, delta: str, final: bool = False) -> tuple[str | None, str | None]:
        text, self.held = self.held + delta, ""
        if not self.thinking:
            return None, text or None
        if not self.opened:
            stripped = text.lstrip()
            if self.opening.startswith(stripped) and stripped != self.opening and not final:   # "<thi": "<think>"?
                self.held = text
                return None, None
            self.opened = True
            if stripped.startswith(self.opening):
                text = stripped[len(self.opening):]
            elif self.mode == "if_opened":   # no thinking opened: all answer
                self.thinking = False
                return None, text or None
        if self.closing in text:
            thought, _, answer = text.partition(self.closing)
            self.thinking = False
            return thought or None, answer or None
        keep = next((n for n in range(min(len(self.closing) - 1, len(text)), 0, -1)
                     if self.closing.startswith(text[-n:])), 0)
        if keep and not final:
            text, self.held = text[:-keep], text[-keep:]
        return text or None, None


def mode_for(parser: str, tokenizer, prompt_ids: list[int], constrained: bool = False) -> str:
    """:func:`thinking_mode` of a request from its prompt's token ids (the last few hold any marker it ends with).
    A constrained request thinks first where the markers are one token each (:func:`marker_ids`), unless its
    prompt closed the thinking (thinking turned off): then, as vLLM reads the prompt, it is all answer."""
    tail = tokenizer.decode(list(prompt_ids[-TAIL_TOKENS:]), skip_special_tokens=False)
    gated = constrained and marker_ids(tokenizer, parser) is not None
    return thinking_mode(parser, tail, constrained and not gated, gated)


@functools.lru_cache(maxsize=8)
def marker_ids(tokenizer, parser: str = "qwen3") -> tuple[int, int] | None:
    """The ids of the parser's markers (``<think>``, ``</think>``) where each is one token of ``tokenizer``, as a
    grammar must see where the thinking closes; None where either is spelled in pieces."""
    markers = markers_of(parser)
    ids = [tokenizer.encode(marker, add_special_tokens=False) for marker in markers]
    whole = all(len(i) == 1 and tokenizer.decode(i) == marker for i, marker in zip(ids, markers))
    return (ids[0][0], ids[1][0]) if whole else None   # (an unknown word is one token too: its text tells)


TAIL_TOKENS = 16   # prompt tokens read for a marker: a template ends with at most a marker and a few newlines
