"""A request's choices: ``n`` samples of each of its prompts, answered together or streamed interleaved.

Choice ``i * n + j`` is sample ``j`` of prompt ``i`` (OpenAI's order). Each choice is one engine sequence; a prompt's
samples share its prefill (``engine/samples.py``). Echo puts the prompt's text (and, with ``logprobs``, its
per-token log-probabilities, the first ``null``) before the output; the prompt's values are the same for each of its
samples and are read from whichever sample ran all of the prompt.
"""
from __future__ import annotations

import asyncio
import difflib
import time
from dataclasses import dataclass, field

from eagle_ray.engine.reasoning import ReasoningStream, markers_of, mode_for, split_reasoning
from eagle_ray.engine.sequence import Sequence
from eagle_ray.engine.tools import CallReader, ToolPlan
from eagle_ray.serve.logprobs import (TokenText, chat_logprobs, completion_logprobs, echoed, merge_completion,
                                     prompt_logprob_entries)
from eagle_ray.speculative.logprobs import TokenLogprobs
from eagle_ray.stats import RequestStats


@dataclass
class PromptChoices:
    """One prompt's samples and what echo shows of it."""
    seqs: list[Sequence]
    text: str            # the prompt's text (echo)

    @property
    def prompt_ids(self) -> list[int]:
        return self.seqs[0].prompt_ids

    def prompt_logprobs(self) -> TokenLogprobs | None:
        """The prompt's values, from the sample that computed the most of them (one that copied the prompt's K/V
        from another computed only its last token's)."""
        got = [s.prompt_logprobs for s in self.seqs if s.prompt_logprobs is not None]
        return max(got, key=len) if got else None


def prepare(engine, parsed, request_id: str, speculative: bool) -> list[PromptChoices]:
    """Every prompt's samples as sequences (tokenising: call it off the event loop), with echo's prompt scoring."""
    body, k = parsed.body, parsed.body.top()
    out = []
    for i, prompt in enumerate(parsed.prompts):
        rid = request_id if len(parsed.prompts) == 1 else f"{request_id}-{i}"
        seqs = engine.make_samples(prompt, parsed.params, rid, speculative)
        text = ""
        if body.echo_prompt:
            whole = prompt.kind == "text" and parsed.params.truncate_prompt_tokens is None   # else: what ran
            text = prompt.value if whole else engine.tokenizer.decode(seqs[0].prompt_ids)
            for s in seqs:
                s.prompt_only = parsed.prompt_only
                if k is not None:   # with prompt_logprobs too: the more alternatives of the two
                    s.prompt_logprobs = s.prompt_logprobs or TokenLogprobs()
                    s.prompt_logprobs_k = max(k, s.prompt_logprobs_k)
        out.append(PromptChoices(seqs, text))
    return out


@dataclass
class ChoiceShape:
    """How one choice is written: chat or completion, echo, and ``k`` (None: no logprobs)."""
    kind: str
    echo: bool                      # a completion's: its prompt first; a chat's: ``prefix`` first
    k: int | None
    text: TokenText
    tools: ToolPlan | None = None   # a chat's tools: its answers are read for calls unless tool_choice is none
    skip_special: bool = True       # the request's skip_special_tokens: what a completions token's text holds
    reasoning: str | None = None    # the reasoning parser that splits a chat's thinking from its answer
    constrained: bool = False       # structured output holds the answer from its first token: nothing to split
    include_reasoning: bool = True  # vLLM's include_reasoning: false leaves the thinking out
    prompt_k: int | None = None     # vLLM's prompt_logprobs: alternatives per prompt token (None: not asked)
    token_ids: bool = False         # vLLM's return_token_ids: the prompt's and the output's ids beside the text
    prefix: str = ""                # a chat's echo: the last message's text (ChatRequest.echoed)

    def thinking(self, prompt: PromptChoices) -> str:
        """This prompt's thinking mode (``engine/reasoning.py``: read from the end of its templated prompt)."""
        return mode_for(self.reasoning, self.text.tokenizer, prompt.prompt_ids, self.constrained)

    def answer(self, text: str, prompt: PromptChoices) -> tuple[str | None, str | None]:
        """A whole chat output's (thinking, answer); without a reasoning parser, the output is the answer."""
        if self.reasoning is None:
            return None, text
        return split_reasoning(text, self.thinking(prompt), markers_of(self.reasoning))

    def stream_split(self, prompt: PromptChoices) -> ReasoningStream | None:
        """A streamed choice's splitter of thinking from answer (None without a reasoning parser)."""
        return ReasoningStream(self.thinking(prompt), markers_of(self.reasoning)) if self.reasoning else None

    def reasoning_fields(self, thought: str | None) -> dict:
        """The message's (or delta's) thinking under both names clients read: vLLM's older ``reasoning_content``
        (DeepSeek's API too) and its newer ``reasoning``."""
        if self.reasoning is None:
            return {}
        thought = thought if self.include_reasoning else None
        return {"reasoning_content": thought, "reasoning": thought}

    @property
    def reads_calls(self) -> bool:
        return self.tools is not None and self.tools.calls

    def prompt_logprobs(self, prompt: PromptChoices) -> list | None:
        """vLLM's ``prompt_logprobs`` of a prompt (a completions choice's; a chat response's, beside its choices)."""
        if self.prompt_k is None:
            return None
        return prompt_logprob_entries(echoed(prompt.prompt_logprobs(), prompt.prompt_ids, 1), prompt.prompt_ids,
                                      self.prompt_k, self.text)

    def echo_part(self, prompt: PromptChoices) -> tuple[str, dict | None]:
        """The echoed prompt's text and completions logprobs."""
        if self.k is None:
            return prompt.text, None
        lp = echoed(prompt.prompt_logprobs(), prompt.prompt_ids, 1)
        return prompt.text, completion_logprobs(lp, prompt.prompt_ids, self.k, self.text)

    def output_logprobs(self, lp: TokenLogprobs | None, ids: list[int], offset: int, prompt_ids: list[int],
                        before: list[int] = ()) -> dict | None:
        """``before`` and ``prompt_ids``: the output's tokens ahead of ``ids`` (a streamed chunk's) and its
        prompt's, which decide the completions texts of ``ids``."""
        if self.k is None or lp is None:
            return None
        if self.kind == "chat":
            return chat_logprobs(lp, ids, self.k, self.text)
        return completion_logprobs(lp, ids, self.k, self.text, offset, before, prompt_ids, self.skip_special)

    def choice(self, index: int, prompt: PromptChoices, out, reason: str | None) -> dict:
        """A whole choice of a response that is not streamed."""
        if self.kind == "chat":
            thought, text = self.answer(out.text, prompt)
            message = {"role": "assistant", "content": text}
            if self.reads_calls and text is not None:
                message, reason = self.tools.message(text, reason)
            if self.echo:
                message["content"] = self.prefix + (message["content"] or "")
            message |= self.reasoning_fields(thought)
            return {"index": index, "message": message, "finish_reason": reason, "stop_reason": out.stop_reason,
                    "logprobs": self.output_logprobs(out.logprobs, out.token_ids, 0, prompt.prompt_ids),
                    **({"token_ids": list(out.token_ids)} if self.token_ids else {})}
        text, lp = self.echo_part(prompt) if self.echo else ("", None)
        own = self.output_logprobs(out.logprobs, out.token_ids, len(text), prompt.prompt_ids)
        if self.k is not None:
            lp = merge_completion(lp, own or completion_logprobs(TokenLogprobs(), [], 0, self.text))
        choice = {"index": index, "text": text + out.text, "finish_reason": reason, "stop_reason": out.stop_reason,
                  "logprobs": lp}
        if self.token_ids:   # vLLM's place for a completion's: in each choice
            choice |= {"token_ids": list(out.token_ids), "prompt_token_ids": list(prompt.prompt_ids)}
        return choice if self.prompt_k is None else choice | {"prompt_logprobs": self.prompt_logprobs(prompt)}


@dataclass
class StreamState:
    """What a streamed choice has sent so far."""
    first: bool = True
    echoed: bool = False
    tokens: int = 0          # output tokens whose logprobs went out
    offset: int = 0          # completions text_offset of the next token
    split: ReasoningStream | None = None   # its thinking apart from its answer, where a reasoning parser is set
    reader: CallReader | None = None       # its answer read for tool calls, where they are read


@dataclass
class Chunks:
    """A stream's chunk objects: one choice's delta in OpenAI's shape, with the usage where asked (with vLLM's
    ``continuous_usage_stats``, the usage so far: ``made``, each choice's output tokens until then). A choice's
    finishing chunk (``out``: its output) names its ``stop_reason``; with ``return_token_ids`` a choice's first
    chunk carries its prompt's ids and its finishing chunk the output's (all of them: vLLM sends them as deltas,
    which add up to the same list)."""
    rid: str
    shape: ChoiceShape
    model: str
    prompts: list[PromptChoices]
    include_usage: bool
    continuous: bool
    made: list[int]
    created: int = field(default_factory=lambda: int(time.time()))
    opened: set = field(default_factory=set)   # the choices a chunk went out for

    def __call__(self, index: int, text: str | None, reason: str | None, first: bool = False, logprobs=None,
                 calls: list | None = None, reasoning: str | None = None, out=None) -> dict:
        if self.shape.kind == "chat":
            delta = {} if text is None else {"content": text}
            if first:
                delta["role"] = "assistant"
            if reasoning is not None:
                delta |= self.shape.reasoning_fields(reasoning)
            if calls:   # each call's index among the choice's calls: its own where it has one (a stream's later calls)
                delta["tool_calls"] = [c if "index" in c else {"index": i, **c} for i, c in enumerate(calls)]
            c = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
        else:
            c = {"index": index, "text": text or "", "finish_reason": reason, "logprobs": logprobs}
        body = {"id": self.rid, "object": "chat.completion.chunk" if self.shape.kind == "chat" else "text_completion",
                "created": self.created, "model": self.model, "choices": [c],
                **({"usage": self.usage_of(index) if self.continuous else None} if self.include_usage else {})}
        if out is not None:
            c["stop_reason"] = out.stop_reason
        if self.shape.token_ids:
            if index not in self.opened:   # chat: beside the choices, as a whole response has it
                ids = {"prompt_token_ids": list(self.prompts[index // len(self.prompts[0].seqs)].prompt_ids)}
                (body if self.shape.kind == "chat" else c).update(ids)
            if out is not None:
                c["token_ids"] = list(out.token_ids)
        self.opened.add(index)
        return body

    def usage_of(self, index: int) -> dict:
        """vLLM's continuous usage: the chunk's own choice, its prompt and its tokens so far."""
        prompt = self.prompts[index // len(self.prompts[0].seqs)]
        return usage([prompt], [self.made[index]])


def usage(prompts: list[PromptChoices], outs: list) -> dict:
    """OpenAI's usage: each prompt counted once, every choice's output (``outs``: outputs, in the order of the
    prompts' sequences, or their token counts so far); with a prediction, its tokens accepted and rejected."""
    p = sum(len(c.prompt_ids) for c in prompts)
    c = sum(o if isinstance(o, int) else len(o.token_ids) for o in outs)
    out = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
    seqs = [s for prompt in prompts for s in prompt.seqs]
    counts = [prediction_tokens(s.prediction, o.token_ids) for s, o in zip(seqs, outs)
              if not isinstance(o, int) and getattr(s, "prediction", None) is not None]
    if counts:
        out["completion_tokens_details"] = {"accepted_prediction_tokens": sum(a for a, _ in counts),
                                            "rejected_prediction_tokens": sum(r for _, r in counts)}
    return out


def prediction_tokens(predicted, output_ids: list[int]) -> tuple[int, int]:
    """OpenAI's accepted and rejected prediction tokens of one choice: the predicted tokens its output holds, in
    order (the blocks ``difflib`` matches between the two), and the rest of the prediction."""
    predicted = [int(t) for t in predicted]
    blocks = difflib.SequenceMatcher(None, predicted, list(output_ids), autojunk=False).get_matching_blocks()
    accepted = sum(b.size for b in blocks)
    return accepted, len(predicted) - accepted


def merged_stats(outs: list) -> RequestStats:
    stats = RequestStats()
    for o in outs:
        stats.merge(o.stats)
    return stats


@dataclass
class Interleaved:
    """Several sequences' streams as one: ``(choice index, delta)`` in the order they come, ``(index, None)`` once a
    choice's stream has ended; an error of any ends the whole."""
    queue: object
    items: list[tuple[int, Sequence]]
    tasks: list = field(default_factory=list)

    async def __aiter__(self):
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, seq: Sequence):
            try:
                async for d in self.queue.astream(seq):
                    await merged.put((index, d, None))
                await merged.put((index, None, None))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, which ends the stream with it
                await merged.put((index, None, e))

        self.tasks = [asyncio.create_task(pump(i, s)) for i, s in self.items]
        left = len(self.tasks)
        try:
            while left:
                index, d, err = await merged.get()
                if err is not None:
                    raise err
                if d is None:
                    left -= 1
                yield index, d
        finally:
            for t in self.tasks:   # a client gone, or an error: the other choices' requests are cancelled
                t.cancel()
