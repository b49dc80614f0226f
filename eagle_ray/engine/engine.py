"""EagleEngine: a target + EAGLE head pair behind ``add_request`` / ``abort`` / ``step`` / ``generate``.

A step is ``scheduler.schedule() -> runner.run(plan) -> postprocess``: the scheduler decides which prompt chunks and
which decode steps run, the model runner runs the forwards and returns tokens, and the sequences take them (stop
tokens, length, stop strings). Requests are tokenised by their caller (``make_sequence``), never on the thread that
steps the engine.
"""
from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from eagle_ray.config import EngineConfig, SamplingParams
from eagle_ray.engine import builder
from eagle_ray.engine.budgets import prompt_room
from eagle_ray.engine.model_runner import StepOutput
from eagle_ray.engine.reasoning import marker_ids, mode_for
from eagle_ray.engine.samples import copy_prefix, samples_of
from eagle_ray.engine.scheduler import StepPlan
from eagle_ray.engine.scoring import Score, score_of, scoring_sequences
from eagle_ray.engine.sequence import Sequence
from eagle_ray.engine.text import Detokenizer, StopStrings
from eagle_ray.engine.tree_policy import check_draft_vocab
from eagle_ray.errors import InvalidRequestError, PromptTooLongError
from eagle_ray.model.draft_head import DraftHead
from eagle_ray.model.target import TargetModel
from eagle_ray.speculative.logprobs import TokenLogprobs
from eagle_ray.stats import RequestStats


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: RequestStats = field(default_factory=RequestStats)
    logprobs: TokenLogprobs | None = None          # per output token, where params.logprobs asked
    prompt_logprobs: TokenLogprobs | None = None   # per scored prompt token (scoring, echo)
    sample_index: int = 0                          # which of the request's n samples
    stop_reason: int | str | None = None           # the stop string or stop_token_ids id that ended it (None: EOS,
                                                   # a grammar's end, the length)


class EagleEngine:
    def __init__(self, target: TargetModel, draft: DraftHead | None, tokenizer, config: EngineConfig):
        """An engine around a loaded pair, wired by ``engine/builder.py`` (``from_config`` loads the pair too)."""
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        self._config = config
        self.device = target.device
        self.target_dir: Path | None = None
        self.draft_dir: Path | None = None
        self._ids = itertools.count()
        self.driving = threading.Lock()   # held by the one caller that steps the engine (generate, a RequestQueue)
        self.driven_by: int | None = None   # that caller's thread, while it steps (see check_driver)
        w = builder.wire(target, draft, tokenizer, config)
        self.policy, self.codec, self.scheduler, self.runner = w.policy, w.codec, w.scheduler, w.runner
        self.eos_ids, self.grammars = w.eos_ids, w.grammars
        # lifetime counters: decode passes, sequences they carried (mean verify batch = sequences / passes)
        self.counters = {"decode_passes": 0, "drafted_passes": 0, "decode_sequences": 0, "verify_tokens": 0,
                         "tree_nodes": 0, "prefill_passes": 0, "prefill_sequences": 0, "decode_step_s": 0.0,
                         "decode_forward_s": 0.0}
        # (seconds, tokens, steps, summed mean context) of whole steady steps (decode only, one mode, the head fed
        # no more than the step's own tokens) by (drafted, sequences): what the tuner's cost table predicts, as run
        self.steady_steps: dict[tuple[bool, int], list] = collections.defaultdict(lambda: [0.0, 0, 0, 0.0])
        self.adapter = None   # online adaptation, where attached (train/online.py adapt): add, after_step, state
        # a reasoning model's parser (engine/reasoning.py; Serve and the job set theirs): structured output then
        # holds a request's answer only, once its thinking has closed
        self.reasoning_parser: str | None = None

    @property
    def config(self) -> EngineConfig:
        """The engine's settings; ``speculation`` is the live one (the tuner's trees once it has run)."""
        return self._config.model_copy(update={"speculation": self.policy.spec})

    @config.setter
    def config(self, config: EngineConfig) -> None:
        self._config, self.policy.spec = config, config.speculation

    # ---- construction -----------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, target: str | None = None, draft: str | None = None, *,
                        storage_options: dict | None = None, **options) -> "EagleEngine":
        """Load a target and its EAGLE head. With neither given: the embedded SmolLM2-135M-Instruct pair.

        ``draft="none"`` loads only the target (plain decoding only); ``draft="random"`` an untrained head.
        ``options`` are any other :class:`EngineConfig` fields (``dtype="float32"``, ``max_batch_size=16``...).
        """
        return cls.from_config(EngineConfig(target=target, draft=draft, **options), storage_options)

    @classmethod
    def from_config(cls, config: EngineConfig, storage_options: dict | None = None) -> "EagleEngine":
        """Build an engine (``engine/builder.py``: read, check, plan, load, wire, then with ``tree_policy: auto``
        measure this device and take the tuner's trees, then capture graphs)."""
        pair = builder.load(config, storage_options)
        engine = cls(pair.target, pair.draft, pair.tokenizer, pair.config)
        builder.finish(engine, pair)
        return engine

    def capture_graphs(self) -> int:
        """The target's and the head's CUDA graphs for the current trees (``builder.capture_graphs``)."""
        return builder.capture_graphs(self.target, self.draft, self.policy, self.runner.draft_graphs)

    def restart(self) -> None:
        """Forget every request and start again from empty caches on the same weights: after a step failed, the
        engine's state (its slots, the head's pending pairs) is in doubt, but a model that raised is not broken.
        (A device that faulted cannot be restarted this way: that needs a new process.)"""
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            self._finalize(seq)
        builder.restart(self)

    def reference_model(self):
        """A pristine transformers model of the target (our runtime rewrites its copy's linears on CPU), for
        comparisons with ``generate()``."""
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(str(self.target_dir), dtype=self.target.dtype).to(self.device).eval()

    # ---- trees ----------------------------------------------------------------------------------------------------
    def set_trees(self, tree=None, trees_by_batch=None) -> None:
        """Change the tree shape(s) between steps (benchmarks, the tuner); grows the draft cache if needed."""
        if self.draft is not None:
            check_draft_vocab(self.draft.draft_vocab_size,
                              [tree or self.policy.spec.tree, *(trees_by_batch or {}).values()])
        self.policy.set_trees(tree, trees_by_batch)
        if self.draft is not None:
            builder.allocate_draft_cache(self.target, self.draft, self.policy, self.config.cache.max_batch_size)

    def close(self) -> None:
        """Stop what the engine started outside its process: a split target's other ranks."""
        self.target.close()

    # ---- requests -------------------------------------------------------------------------------------------------
    def prompt_room(self) -> int:
        """The most prompt tokens a request may bring (see the module-level ``prompt_room``)."""
        return prompt_room(self.target.max_len, self.policy.max_verify_budget())

    def max_new_tokens_for(self, prompt_len: int) -> int:
        """The most tokens a request with a ``prompt_len``-token prompt can generate before its slot ends it with
        ``length`` (the last token is returned, never cached, so one more than the context's free positions)."""
        return self.target.max_len + 1 - prompt_len

    def check_room(self, prompt_len: int, asked: int | None, asked_as: str = "max_tokens") -> None:
        """A request asking more new tokens than fit after its prompt is refused with ``PromptTooLongError`` (Serve's
        400 ``context_length_exceeded``, the job's ``prompt_too_long`` row), as OpenAI and vLLM refuse it: cutting it
        at the context's end would be silent. ``asked_as`` names the request's field in the message."""
        fits = self.max_new_tokens_for(prompt_len)
        if asked is not None and asked > fits:
            raise PromptTooLongError(f"the prompt has {prompt_len} tokens, so at most {fits} more fit in the context "
                                     f"of {self.target.max_len} tokens; {asked_as}={asked} asks for more: lower it "
                                     "or shorten the prompt")

    def encode(self, prompt) -> list[int]:
        """A raw string, a chat message list (templated with a generation prompt) or a list of token ids."""
        return self.codec.encode(prompt, self.prompt_room())

    def make_sequence(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                      speculative: bool = True) -> Sequence:
        """Validate and tokenise a request (on the caller's thread; raises typed errors if it is bad)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if speculative and self.draft is None:
            raise InvalidRequestError("this engine has no draft head; use speculative=False")
        for name, ids in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids),
                          ("stop_token_ids", params.stop_token_ids)):
            if ids and max(ids) >= self.target.vocab_size:
                raise InvalidRequestError(f"{name}: token id {max(ids)} is not in the vocabulary (ids 0 to "
                                          f"{self.target.vocab_size - 1})")
        stopping_eos = frozenset() if params.ignore_eos else frozenset(self.eos_ids)   # as vLLM: its reason none
        stop = set(params.stop_token_ids) | stopping_eos
        # what min_tokens bars: the stop ids and EOS, ignored or not (as vLLM bars it)
        barred = frozenset(stop | set(self.eos_ids)) if params.min_tokens else frozenset()
        bad_words = tuple(map(tuple, self.codec.bad_word_ids(params.bad_words or [])))
        self._check_some_allowed(params, barred, {w[0] for w in bad_words if len(w) == 1})
        ids = self.codec.encode(prompt, self.prompt_room(), keep_last=params.truncate_prompt_tokens)
        guide = self.grammars.guide(params)   # compiled here, on the caller's thread (cached per grammar)
        markers = marker_ids(self.tokenizer, self.reasoning_parser) if guide is not None and self.reasoning_parser \
            else None
        if markers is not None:   # the grammar waits for the answer, as vLLM's waits for its reasoning parser
            guide.gate(mode_for(self.reasoning_parser, self.tokenizer, ids, constrained=True), markers)
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)))
        return Sequence(request_id or str(next(self._ids)), ids, params, frozenset(stop), seed,
                        detok=Detokenizer(self.tokenizer, ids, params.skip_special_tokens), speculative=speculative,
                        stops=StopStrings(params.stop) if params.stop else None, guide=guide, min_barred=barred,
                        logprobs=TokenLogprobs() if params.logprobs is not None else None,
                        prompt_logprobs=TokenLogprobs() if params.prompt_logprobs is not None else None,
                        prompt_logprobs_k=params.prompt_logprobs or 0,
                        bad_words=bad_words, prediction=self._prediction_ids(params.prediction),
                        reason_ids=frozenset(params.stop_token_ids) - stopping_eos)

    def _prediction_ids(self, prediction: str | None) -> np.ndarray | None:
        """A predicted output's token ids (as the output would spell it: no special tokens added)."""
        if not prediction:
            return None
        ids = np.asarray(self.tokenizer(prediction, add_special_tokens=False)["input_ids"], dtype=np.int64)
        if len(ids) > self.target.max_len:   # no output could repeat it: refused, not scanned every step
            raise InvalidRequestError(f"prediction: {len(ids)} tokens, more than the model's context of "
                                      f"{self.target.max_len}")
        return ids

    @staticmethod
    def _check_some_allowed(params: SamplingParams, barred: frozenset, bad: set) -> None:
        """An allowed list that ``min_tokens``' bars and one-token bad words cover between them leaves the first
        step nothing to choose: refused, naming what bars each token."""
        allowed = set(params.allowed_token_ids or ())
        if not allowed or not allowed <= barred | bad:
            return
        why = [w for w, ids in ((f"EOS or a stop token, which min_tokens ({params.min_tokens}) bars", barred),
                                ("a bad word", bad)) if allowed & ids]
        raise InvalidRequestError(f"allowed_token_ids: every allowed token is {' or '.join(why)}: nothing could "
                                  "be chosen")

    def make_samples(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                     speculative: bool = True) -> list[Sequence]:
        """``params.n`` sequences of one prompt (``make_sequence`` for one), tokenised once, sharing the prompt's
        K/V once it is prefilled, each with its own seed (``engine/samples.py``)."""
        params = params or SamplingParams()
        return samples_of(self.make_sequence(prompt, params, request_id, speculative), params.n)

    # ---- the loop -------------------------------------------------------------------------------------------------
    def check_driver(self, what: str) -> None:
        """``add_request``, ``step`` and ``abort`` change the scheduler's lists, which the thread stepping the engine
        (``generate()`` or a RequestQueue) reads without a lock: from any other thread meanwhile they are refused."""
        owner = self.driven_by
        if owner is not None and owner != threading.get_ident():
            raise InvalidRequestError(f"{what}() was called on another thread while generate() or a RequestQueue "
                                      "steps this engine: one thread steps an engine; share it between threads "
                                      "through eagle_ray.engine.queue.RequestQueue (submit, generate, agenerate, "
                                      "stream, cancel)")

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    speculative: bool = True) -> Sequence:
        """Queue one request (a prompt, or a Sequence from ``make_sequence``); ``step()`` runs it."""
        self.check_driver("add_request")
        seq = prompt if isinstance(prompt, Sequence) else self.make_sequence(prompt, params, request_id, speculative)
        if seq.finished or seq.slot >= 0 or any(s is seq for s in self.scheduler.waiting):
            raise InvalidRequestError(f"request {seq.request_id!r} was already added; make a new sequence to run "
                                      "it again")
        self._admit(seq)
        return seq

    def _admit(self, seq: Sequence) -> None:
        if self.adapter is not None and seq.speculative:
            seq.pending.kept = []   # every pair it gives the head, to train on once it finishes
        self.scheduler.add(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, request_id: str) -> Sequence | None:
        """Cancel a waiting or running request and free its slot."""
        self.check_driver("abort")
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            self._finalize(seq)
        return seq

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 speculative: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion (continuously batched); outputs come back in input order, with
        ``n > 1`` the prompt's ``n`` samples in a row (``RequestOutput.sample_index``)."""
        if not isinstance(prompts, (str, list)):
            raise TypeError(f"prompts must be a prompt (a string, chat messages or token ids) or a list of prompts, "
                            f"got {type(prompts).__name__}")
        single = isinstance(prompts, str) or (prompts and (isinstance(prompts[0], dict) or all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompts)))   # one chat, or one prompt's ids
        if single:
            prompts = [prompts]
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidRequestError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        seqs = [s for p, sp in zip(prompts, plist) for s in self.make_samples(p, sp, speculative=speculative)]
        if not self.driving.acquire(blocking=False):
            raise InvalidRequestError("this engine is already running generate() on another thread, or a "
                                      "RequestQueue steps it: one caller steps an engine; share one engine between "
                                      "threads through eagle_ray.engine.queue.RequestQueue (submit, generate, "
                                      "agenerate, stream)")
        self.driven_by = threading.get_ident()
        try:
            for seq in seqs:
                self._admit(seq)
            while self.has_unfinished():
                self.step()
        except BaseException:   # Ctrl-C (KeyboardInterrupt) or a failed step: this call's requests leave with it
            for seq in seqs:
                if not seq.finished:
                    try:
                        self.abort(seq.request_id)
                    except Exception:  # noqa: BLE001 - a step cut short may leave it half-placed; the error goes on
                        pass
            raise
        finally:
            self.driven_by = None
            self.driving.release()
        return [self.output(s) for s in seqs]

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Admit waiting requests, run this step's prompt chunks and one draft-verify step of every running
        sequence, retire finished ones. Returns the sequences that emitted tokens or finished (for streaming)."""
        self.check_driver("step")
        t0 = time.perf_counter()
        for src, dst in self.scheduler.defragment():  # keep running slots contiguous: KV reads stay slices
            self.runner.move_slot(src, dst)
        plan = self.scheduler.schedule(self.target.max_len, self._fork)
        out = None if plan.empty else self.runner.run(plan)
        touched, kept = self._postprocess(plan, out)
        for seq in self.scheduler.retire_finished():
            self._finalize(seq)
        if out is not None and out.steady and len(out.decoded) == 1:
            tally = self.steady_steps[next(iter(out.decoded.items()))]
            tally[0] += time.perf_counter() - t0
            tally[1] += kept
            tally[2] += 1
            tally[3] += sum(len(s.prompt_ids) + len(s.output_ids) for s in plan.decode) / len(plan.decode)
        if self.adapter is not None:   # a training slice within its share of the engine's time
            self.adapter.after_step(time.perf_counter() - t0)
        return touched

    def _fork(self, source: Sequence, seq: Sequence, shared: int) -> None:
        copy_prefix(self.target, self.draft, source, seq, shared)

    def _postprocess(self, plan: StepPlan, out: StepOutput | None) -> tuple[list[Sequence], int]:
        """Sequences take their tokens (stop tokens, length, stop strings) and their share of the step's time.
        Returns the sequences touched and the tokens they kept."""
        touched = {id(s): s for s in self.scheduler.running if s.finished}  # finished by schedule() (length)
        if out is None:
            return list(touched.values()), 0
        t = out.times
        now = time.perf_counter()
        for c in plan.prefill:
            seq = c.seq
            if not seq.start_time:   # its first chunk (a sample that copied its prompt's K/V starts past 0)
                seq.start_time = now - t.total_s
            seq.stats.prefill_s += t.prefill_s
            if c.completes:
                self.scheduler.prefill_done(seq)
                seq.stats.ttft_s = now - seq.start_time
        chooser = self.policy.chooser
        if chooser is not None and plan.speculating:
            chooser.record(plan.speculating, True in out.decoded, t.total_s - t.prefill_s - t.extend_s,
                           sum(len(r.tokens) for r in out.results if r.tree_size), out.sampled, t.extend_s)
        if plan.prefill:
            self.counters["prefill_passes"] += 1
            self.counters["prefill_sequences"] += sum(c.completes for c in plan.prefill)
        for speculative, n in out.decoded.items():
            self.counters["decode_passes"] += 1
            self.counters["drafted_passes"] += speculative
            self.counters["decode_sequences"] += n
            self.counters["verify_tokens"] += t.verify_tokens if speculative else n
        self.counters["tree_nodes"] += t.tree_nodes
        if out.decoded and not plan.prefill:  # decode-only steps: what share of a step is not model forwards
            self.counters["decode_step_s"] += t.total_s
            self.counters["decode_forward_s"] += t.forward_s
        other = t.total_s - t.prefill_s - t.draft_s - t.verify_s
        kept_total = 0
        for r in out.results:
            seq = r.seq
            if seq.finished:
                continue
            kept = seq.append(r.tokens)
            kept_total += kept
            if seq.logprobs is not None and r.logprobs is not None:
                seq.logprobs.extend(r.logprobs, kept, seq.params.logprobs)
            if r.tree_size:
                seq.stats.record_step(r.accepted, r.tree_size, kept)
                seq.stats.draft_s += t.draft_s
                seq.stats.verify_s += t.verify_s
                seq.stats.other_s += other
            seq.update_text()
            if seq.logprobs is not None:   # a stop string cut the output
                seq.logprobs.keep(len(seq.output_ids))
            touched[id(seq)] = seq
        return list(touched.values()), kept_total

    def _finalize(self, seq: Sequence) -> None:
        seq.stats.total_s = time.perf_counter() - seq.start_time if seq.start_time else 0.0
        seq.stats.new_tokens = len(seq.output_ids)
        if self.adapter is not None:
            seq.stats.head_version = self.adapter.state.version
            if seq.finish_reason not in (None, "abort"):
                self.adapter.add(seq)
        seq.pending.clear()     # frees the feature tensors
        seq.draft_hidden = None

    def output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(seq.request_id, seq.prompt_ids, list(seq.output_ids), seq.text,
                             seq.finish_reason or "length", seq.stats, seq.logprobs, seq.prompt_logprobs,
                             seq.sample_index, seq.stop_reason)

    def score(self, requests: list[tuple[str, list[str]]]) -> list[list[Score]]:
        """Each ``(context, continuations)``'s continuations scored after its context, nothing generated: the
        log-likelihood lm-evaluation-harness's ``loglikelihood`` asks for (``engine/scoring.py``). The context runs
        once per request; its continuations share its K/V."""
        groups = [scoring_sequences(self, ctx, conts, str(next(self._ids))) for ctx, conts in requests]
        if not self.driving.acquire(blocking=False):
            raise InvalidRequestError("this engine is already stepped by another caller: score through one caller")
        try:
            for seq in (s for g in groups for s in g):
                self._admit(seq)
            while self.has_unfinished():
                self.step()
        finally:
            self.driving.release()
        return [[score_of(s.prompt_logprobs, s.prompt_ids) for s in g] for g in groups]
