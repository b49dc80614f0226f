"""Per-request state: prompt, output, where its prefill stands, the head's pending inputs, sampling, stop rules,
output text and stats. The scheduler owns sequences; the model runner reads them and returns tokens."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from eagle_ray.config import SamplingParams
from eagle_ray.engine.text import Detokenizer, StopStrings
from eagle_ray.speculative.context_vocab import ContextTokens
from eagle_ray.speculative.grammar import Guide
from eagle_ray.speculative.logprobs import TokenLogprobs
from eagle_ray.speculative.lookup import TokenHistory
from eagle_ray.stats import RequestStats


class PendingPairs:
    """(target feature f_i, next token x_{i+1}) pairs the head has not consumed yet, oldest first.

    The head is fed lazily (see ``ModelRunner``): a sequence that runs plain steps collects pairs for as long as
    its memory bound allows, so the features are kept as the chunks they arrived in (one copy each, detached from
    the forward's output they came from) and are concatenated only when a pass takes them."""

    def __init__(self):
        self.tokens: list[int] = []
        self.chunks: list[torch.Tensor] = []
        self.kept: list[tuple[list[int], torch.Tensor]] | None = None   # every pair ever added (online adaptation)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, tokens: list[int], features: torch.Tensor) -> None:
        if tokens:
            self.tokens += tokens
            self.chunks.append(features.clone())
            if self.kept is not None:
                self.kept.append((list(tokens), self.chunks[-1]))

    def take(self, n: int) -> tuple[list[int], torch.Tensor]:
        """Remove and return the first ``n`` pairs (tokens, features ``[n, d]``)."""
        feats = self.chunks[0] if len(self.chunks) == 1 else torch.cat(self.chunks)
        tokens, self.tokens = self.tokens[:n], self.tokens[n:]
        self.chunks = [feats[n:]] if self.tokens else []
        return tokens, feats[:n]

    def kept_first(self, n: int) -> list[tuple[list[int], torch.Tensor]]:
        """The first ``n`` pairs ever added, as kept (a sequence that copies another's first positions keeps
        its pairs from position 0 too)."""
        out = []
        for tokens, feats in self.kept or []:
            if n <= 0:
                break
            out.append((tokens[:n], feats[:n]))
            n -= len(tokens)
        return out

    def features(self) -> torch.Tensor | None:
        """Every pending feature ``[len, d]`` (a copy; None when empty)."""
        return torch.cat(self.chunks) if self.chunks else None

    def clear(self) -> None:
        self.tokens, self.chunks = [], []


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    seed: int                                   # sampling noise is keyed by (seed, position): see speculative/sampling.py
    detok: Detokenizer | None = None
    slot: int = -1
    speculative: bool = True
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None        # vLLM's: the stop string or stop_token_ids id that ended it
    reason_ids: frozenset[int] = frozenset()    # the stop ids a stop_reason names (EOS that stops it names none)
    prefilled: int = 0                          # prompt tokens whose K/V are in the target cache
    pending: PendingPairs = field(default_factory=PendingPairs)   # the head's unconsumed inputs
    draft_hidden: torch.Tensor | None = None    # the head's output at the last pair it consumed: the tree's root
    context: ContextTokens | None = None        # its context tokens outside the head's map (the runner's)
    history: TokenHistory | None = None         # its prompt and output ids for prompt lookups (the runner's)
    prediction: np.ndarray | None = None        # its predicted output's ids (params.prediction), a lookup source
    stats: RequestStats = field(default_factory=RequestStats)
    start_time: float = 0.0
    stops: StopStrings | None = None
    guide: Guide | None = None                  # its grammar's matcher, for structured output (speculative/grammar.py)
    # what it returns besides tokens, and the samples it shares its prompt with (engine/samples.py)
    sample_index: int = 0                       # which of its request's n samples
    logprobs: TokenLogprobs | None = None       # per output token, where its params ask (params.logprobs)
    prompt_only: bool = False                   # ends once its prompt has run: nothing generated (scoring, echo)
    prompt_logprobs: TokenLogprobs | None = None   # per prompt token from prompt_logprobs_from, where asked
    prompt_logprobs_k: int = 0                  # ... with this many alternatives each
    prompt_logprobs_from: int = 1               # the first prompt position scored (the first token has no logits)
    fork: object | None = None                  # its ForkGroup: sequences sharing its prompt's first tokens
    fork_ready: bool = True                     # False while it waits for a member of its group to hold them
    stop_floor: int | None = None               # characters of text no stop string may end in (``min_tokens``'s)
    min_barred: frozenset[int] = frozenset()    # ids ``min_tokens`` bars: its stop ids and EOS, ignored or not
    bad_words: tuple[tuple[int, ...], ...] = ()  # its bad words' token ids (speculative/token_masks.py)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def in_prefill(self) -> bool:
        return self.prefilled < len(self.prompt_ids)

    @property
    def root(self) -> int:
        """The last emitted token: the target has not run it yet, it roots the next draft tree."""
        return self.output_ids[-1]

    @property
    def cached_len(self) -> int:
        """Positions of this sequence in the target's KV cache (prompt + output minus the root)."""
        return self.prefilled + max(0, len(self.output_ids) - 1)

    @property
    def text(self) -> str:
        return self.detok.text if self.detok is not None else ""

    def append(self, tokens: list[int]) -> int:
        """Append emitted tokens up to the first stop token or ``max_new_tokens``; returns how many were kept."""
        if self.prompt_only:
            self.finish_reason = "length"
            return 0
        for n, tok in enumerate(tokens, 1):
            if self.guide is not None and not self.guide.accept(tok):   # a grammar's dead end: nothing fits
                self.finish_reason = "stop"
                return n - 1
            self.output_ids.append(tok)
            if tok in self.stop_ids or (self.guide is not None and self.guide.finished()):
                self.finish_reason = "stop"    # a stop token, or a grammar that can take nothing more
                self.stop_reason = tok if tok in self.reason_ids else None
                return n
            if len(self.output_ids) >= self.params.max_new_tokens:
                self.finish_reason = "length"
                return n
        return len(tokens)

    def update_text(self) -> None:
        """Detokenise the new tokens; a stop string ends the sequence there (its text and tokens are cut before it,
        or after it with ``include_stop_str_in_output``). A stop token ends it too: its id is the last output id,
        its text is not in the output (as vLLM's) unless ``include_stop_str_in_output``. A stop string ending in
        the text of the first ``min_tokens`` tokens does not count (as vLLM's)."""
        if self.detok is None:
            return
        ids, keep_stop = self.output_ids, self.params.include_stop_str_in_output
        end = len(ids) - 1 if (self.finish_reason == "stop" and ids and ids[-1] in self.stop_ids
                               and not keep_stop) else len(ids)
        new = self.detok.add(ids[len(self.detok.ids):end])
        if self.stops is None or len(self.detok.ids) <= self.params.min_tokens:
            return
        if self.stop_floor is None:   # once: the text the first min_tokens tokens hold
            m = self.params.min_tokens   # a character its last token only begins is text past the floor
            self.stop_floor = len(self.detok.text_of(m).rstrip("\ufffd")) if m else 0
        hit = self.stops.find(self.detok.text, len(new), self.stop_floor)
        if hit is None:
            return
        self.stop_reason = self.detok.text[hit[0]:hit[1]]
        cut = hit[1] if keep_stop else hit[0]
        keep = self.detok.tokens_reaching(hit[1] - 1 if keep_stop else hit[0])   # the stop's last / first character
        del self.output_ids[keep:]
        self.detok.truncate(keep, cut)
        self.finish_reason = "stop"
