"""Reasoning models' thinking apart from their answer, as vLLM's ``--reasoning-parser`` returns it.

A model that thinks first (Qwen3, DeepSeek-R1 and its distills) writes ``<think> ... </think>`` and then its answer;
the deployment's ``reasoning_parser`` puts the thinking in the message's ``reasoning_content`` and the rest in
``content``:

- ``qwen3``: thinking where the output opens with ``<think>``, up to ``</think>``; an output that does not open
  it (``enable_thinking: false``) is all answer;
- ``deepseek_r1``: its chat template opens ``<think>`` in the prompt, so everything before ``</think>`` is thinking.

An output cut (``max_tokens``) before it closes its thinking is all thinking, whole or streamed.
Streamed, each delta goes to one side or the other, a marker split across deltas held back until it is whole.
Structured output and forced tool calls constrain the answer from its first token, so their outputs are not split.
"""
from __future__ import annotations

PARSERS = ("deepseek_r1", "qwen3")
OPEN, CLOSE = "<think>", "</think>"


def split_reasoning(text: str, parser: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output; None for a side it does not have."""
    body = text
    if text.lstrip().startswith(OPEN):
        body = text.lstrip()[len(OPEN):]
    elif parser == "qwen3":
        return None, text
    if CLOSE not in body:
        return body or None, None
    thought, _, answer = body.partition(CLOSE)
    return thought or None, answer.lstrip("\n") or None


class ReasoningStream:
    """Splits a streamed output as :func:`split_reasoning` splits it whole: :meth:`feed` returns each delta's
    (reasoning, content) parts; text that may be the start of a marker is held back until a later delta (or the
    end, ``final``) shows what it is."""

    def __init__(self, parser: str):
        self.parser = parser
        self.thinking = True      # before the closing marker
        self.opened = False       # the output's start is past (and its opening marker, where it writes one)
        self.held = ""            # text that may begin a marker
        self.started = False      # the answer's first text is out (the newlines after the thinking are not)

    def answer(self, text: str) -> str | None:
        if not self.started:
            text = text.lstrip("\n")
            self.started = bool(text)
        return text or None

    def feed(self, delta: str, final: bool = False) -> tuple[str | None, str | None]:
        text, self.held = self.held + delta, ""
        if not self.thinking:
            return None, self.answer(text)
        if not self.opened:
            stripped = text.lstrip()
            if OPEN.startswith(stripped) and stripped != OPEN and not final:   # "<thi" may become "<think>"
                self.held = text
                return None, None
            self.opened = True
            if stripped.startswith(OPEN):
                text = stripped[len(OPEN):]
            elif self.parser == "qwen3":   # no thinking opened: all answer
                self.thinking, self.started = False, True
                return None, text or None
        if CLOSE in text:
            thought, _, answer = text.partition(CLOSE)
            self.thinking = False
            return thought or None, self.answer(answer)
        keep = next((n for n in range(min(len(CLOSE) - 1, len(text)), 0, -1) if CLOSE.startswith(text[-n:])), 0)
        if keep and not final:
            text, self.held = text[:-keep], text[-keep:]
        return text or None, None
