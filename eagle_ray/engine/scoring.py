"""Log-probabilities of prompts: scoring continuations without generating (lm-evaluation-harness's
``loglikelihood``), and the prompt's own log-probabilities (OpenAI's ``echo``).

A prompt chunk's pass already computes every prompt position's final hidden state; the rows whose next token is a
scored prompt token go through the lm_head (in slices, so a long chunk never holds ``rows x vocab`` logits at once)
and come back with the chunk's other results in one read. A row's continuations are scored as sequences that share
the context's K/V (``engine/samples.py``): the context is prefilled once, each continuation runs after it, and
nothing is generated.

Tokenisation is lm-evaluation-harness's (``HFLM._encode_pair``): trailing whitespace of the context moves to the
front of the continuation, context and context + continuation are encoded separately, and the continuation's tokens
are those of the whole past the context's length; the scored sequence is the context's tokens followed by them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle_ray.engine.sequence import Sequence
from eagle_ray.errors import InvalidRequestError
from eagle_ray.speculative.logprobs import TokenLogprobs, packed, unpack, width
from eagle_ray.uploads import uploads_for

SLICE_ROWS = 256   # prompt rows a scoring lm_head call takes at once


def logprob_k(seqs: list[Sequence]) -> int | None:
    """The most alternatives any of ``seqs`` asks per output token (None: none asks for log-probabilities)."""
    ks = [s.params.logprobs for s in seqs if s.logprobs is not None]
    return max(ks) if ks else None


@dataclass
class PromptRows:
    """The rows of a prefill block whose next token is a scored prompt token: block row, column and that token,
    and per scoring chunk its sequence and how many rows it has (in row order)."""
    rows: list[int]
    cols: list[int]
    tokens: list[int]
    spans: list[tuple[Sequence, int]]
    k: int

    def arrays(self) -> list:
        return [self.rows, self.cols, self.tokens]

    def packed(self, target, hidden: torch.Tensor) -> torch.Tensor:
        """``[rows, width(k)]`` packed log-probabilities of the rows' next tokens (``speculative/logprobs.py``)."""
        upload = uploads_for(hidden.device)
        rows, cols, tokens = (upload.ints(a) for a in self.arrays())
        out = []
        for i in range(0, len(self.rows), SLICE_ROWS):
            part = slice(i, i + SLICE_ROWS)
            logits = target.logits(hidden[rows[part], cols[part]].unsqueeze(0))[0]
            out.append(packed(logits, tokens[part], self.k, ranked=True))   # ranks: vLLM's prompt_logprobs
        return torch.cat(out)

    def attach(self, values: list[int]) -> None:
        """Hand each sequence its rows' host values (``values``: the flat read of :meth:`packed`)."""
        w, at = width(self.k, ranked=True), 0
        for seq, n in self.spans:
            seq.prompt_logprobs.extend(unpack([values[at: at + n * w]], self.k, ranked=True)[0],
                                       k=seq.prompt_logprobs_k)
            at += n * w


def prompt_rows(chunks) -> PromptRows | None:
    """Which rows of a prefill block's chunks (``scheduler.PrefillChunk``) score a prompt token: position ``p``'s
    row gives token ``p + 1``, scored from ``prompt_logprobs_from``."""
    rows, cols, tokens, spans, ks = [], [], [], [], []
    for r, c in enumerate(chunks):
        s = c.seq
        if s.prompt_logprobs is None:
            continue
        lo, hi = max(c.start, s.prompt_logprobs_from - 1), min(c.end, len(s.prompt_ids) - 1)
        if lo >= hi:
            continue
        rows += [r] * (hi - lo)
        cols += range(lo - c.start, hi - c.start)
        tokens += s.prompt_ids[lo + 1: hi + 1]
        spans.append((s, hi - lo))
        ks.append(s.prompt_logprobs_k)
    return PromptRows(rows, cols, tokens, spans, max(ks)) if spans else None


@dataclass
class Score:
    """A continuation's log-likelihood after its context: what lm-evaluation-harness's ``loglikelihood`` returns,
    with its token count and each token's log-probability."""
    logprob: float          # summed over the continuation's tokens
    tokens: int
    greedy: bool            # every token is the target's most probable one
    token_logprobs: list[float]


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-evaluation-harness encodes a loglikelihood request."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = list(tokenizer(context + continuation)["input_ids"])
    ctx = list(tokenizer(context)["input_ids"])
    return ctx, whole[len(ctx):]


def scoring_sequences(engine, context: str, continuations: list[str], request_id: str, priority: int = 0
                      ) -> list[Sequence]:
    """One sequence per continuation, ``<id>/<i>``: the context's ids and the continuation's, run as a prompt with
    nothing generated, scored from the continuation's first token with the top alternative (the greedy test); all
    share the context's K/V (``engine/samples.py``)."""
    from eagle_ray.config import SamplingParams
    from eagle_ray.engine.samples import group

    if not continuations:
        raise InvalidRequestError("continuations must hold at least one continuation")
    pairs = [encode_pair(engine.tokenizer, context, c) for c in continuations]
    ctx = pairs[0][0]
    if not ctx:
        raise InvalidRequestError("prompt encodes to no tokens: a continuation needs a context to follow")
    seqs, params = [], SamplingParams(max_new_tokens=1, priority=priority)
    for i, (c, cont) in enumerate(pairs):
        if not cont:
            raise InvalidRequestError(f"continuation {i} encodes to no tokens after the prompt")
        seq = engine.make_sequence(ctx + cont, params, f"{request_id}/{i}", speculative=False)
        seq.prompt_only, seq.prompt_logprobs_k, seq.prompt_logprobs_from = True, 1, len(ctx)
        seq.prompt_logprobs = TokenLogprobs()
        seqs.append(seq)
    return group(seqs, len(ctx) - 1)


def score_of(prompt_logprobs: TokenLogprobs, prompt_ids: list[int]) -> Score:
    """A scored continuation's :class:`Score` from its sequence's prompt log-probabilities (one per continuation
    token, each with its top alternative)."""
    n = len(prompt_logprobs)
    tokens = prompt_ids[len(prompt_ids) - n:]
    greedy = all(top and top[0][0] == t for top, t in zip(prompt_logprobs.top, tokens))
    values = [float(v) for v in prompt_logprobs.values]
    return Score(sum(values), n, greedy, values)
