"""EagleEngine: a target + EAGLE head pair behind ``add_request`` / ``abort`` / ``step`` / ``generate``.

A step is ``scheduler.schedule() -> runner.run(plan) -> postprocess``: the scheduler decides which prompt chunks and
which decode steps run, the model runner runs the forwards and returns tokens, and the sequences take them (stop
tokens, length, stop strings). Requests are tokenised by their caller (``make_sequence``), never on the thread that
steps the engine.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle_ray.config import PLAIN, EngineConfig, SamplingParams, TreeConfig, is_plain
from eagle_ray.engine.chooser import SpeculationChooser
from eagle_ray.engine.model_runner import ModelRunner, StepOutput
from eagle_ray.engine.scheduler import Scheduler, StepPlan
from eagle_ray.engine.sequence import Sequence
from eagle_ray.engine.text import Detokenizer, StopStrings, TextCodec
from eagle_ray.errors import ConfigError, InvalidRequestError
from eagle_ray.model.compiled import compile_forwards
from eagle_ray.model.device import pick_device, pick_dtype
from eagle_ray.model.draft_head import DraftHead, check_head, load_head
from eagle_ray.model.eagle3_head import Eagle3Head
from eagle_ray.model.loading import resolve_draft, resolve_target, target_config_and_tokenizer
from eagle_ray.model.memory import max_pending_pairs, pending_pair_bytes
from eagle_ray.model.target import TargetModel
from eagle_ray.spec.tree import children_per_node, static_shape
from eagle_ray.stats import RequestStats


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: RequestStats = field(default_factory=RequestStats)


RANDOM_HEADS = ("random", "random-eagle3")  # untrained heads (EAGLE-2, EAGLE-3): lossless-test fixtures


def by_batch(table: dict, batch: int, below_all):
    """``table``'s entry for the largest batch size <= ``batch``; the entry for ``below_all`` (None: None) if every
    key is larger."""
    fits = [b for b in table if b <= batch]
    key = max(fits) if fits else below_all
    return None if key is None else table[key]


def draft_budget(tree: TreeConfig) -> int:
    """Tree tokens per sequence (root included) the head drafts."""
    return tree.total_tokens if tree.mode == "dynamic" else len(static_shape(tree)) + 1


def tree_budget(tree: TreeConfig) -> int:
    """Verify tokens per sequence (root included) a tree may take: the head's drafts and the lookup chain."""
    return draft_budget(tree) + (0 if is_plain(tree) else tree.lookup)


def prompt_room(max_len: int, verify_budget: int) -> int:
    """The most prompt tokens a context of ``max_len`` takes: one verify budget stays free, so a request's first
    step can speculate (near the end of its slot a sequence decodes plainly)."""
    return max_len - verify_budget - 1


def check_prompt_room(max_len: int, trees: list[TreeConfig]) -> None:
    """Fail unless a context of ``max_len`` leaves room for a prompt next to the largest verify budget (see
    ``EagleEngine.prompt_room``): else every request would be refused as too long. Callers check before loading."""
    budget = max(tree_budget(t) for t in trees)
    if prompt_room(max_len, budget) < 1:
        raise ConfigError(f"cache.max_model_len {max_len} leaves no room for a prompt next to the largest tree's "
                          f"verify budget ({budget} tokens): raise max_model_len or use a smaller tree")


def check_draft_vocab(draft, trees: list[TreeConfig]) -> None:
    """Refuse trees whose nodes take more children than the head has draft tokens: top-k would pick padding."""
    n, k = draft.draft_vocab_size, max(children_per_node(t) for t in trees)
    if n < k:
        raise ConfigError(f"the draft head proposes from {n} tokens, fewer than the {k} children a tree node takes "
                          "(top_k, or a static tree's widest rank): use a narrower tree or a head with a larger draft "
                          "vocabulary")


def draft_room(tree: TreeConfig) -> int:
    """Tree tokens a cycle stacks on a slot's draft cache (lookup tokens are never drafted)."""
    return tree.depth * tree.top_k if tree.mode == "dynamic" else draft_budget(tree)


class EagleEngine:
    def __init__(self, target: TargetModel, draft: DraftHead | None, tokenizer, config: EngineConfig):
        self.target, self.draft, self.tokenizer, self.config = target, draft, tokenizer, config
        self.device = target.device
        self.target_dir: Path | None = None
        self.draft_dir: Path | None = None
        self.tuning = None  # the TuningResult when tree_policy is "auto"
        self.chooser: SpeculationChooser | None = None   # speculate or not per batch size, measured (measured_choice)
        self.codec = TextCodec(tokenizer, target.vocab_size)
        check_prompt_room(target.max_len, config.speculation.trees())
        self._ids = itertools.count()
        budget = config.cache.step_budget(target.device)
        self.scheduler = Scheduler(config.cache.max_batch_size, budget)
        self.runner = ModelRunner(target, draft, max(budget, 512), context_vocab=config.speculation.context_vocab)
        if draft is not None:
            pair = pending_pair_bytes(draft.feature_size, target.dtype, target.numerics.fp32_activations)
            self.runner.max_pending = max_pending_pairs(pair, target.max_len)
        # lifetime counters: decode passes, sequences they carried (mean verify batch = sequences / passes)
        self.counters = {"decode_passes": 0, "decode_sequences": 0, "verify_tokens": 0, "tree_nodes": 0,
                         "prefill_passes": 0, "prefill_sequences": 0, "decode_step_s": 0.0, "decode_forward_s": 0.0}
        eos = tokenizer.eos_token_id
        gen_eos = getattr(getattr(target.hf, "generation_config", None), "eos_token_id", None)
        self.eos_ids = frozenset(x for x in ([eos] + (gen_eos if isinstance(gen_eos, list) else [gen_eos]))
                                 if x is not None)
        if draft is not None:
            draft.bind_lm_head(target.lm_head, config.speculation.draft_vocab_size, target.numerics.cpu_linears)
            check_draft_vocab(draft, config.speculation.trees())
            self._allocate_draft_cache(fresh=True)
        compile_forwards(target, draft, config.model.compile)

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
        from eagle_ray.engine.sizing import size_engine

        m = config.model
        if m.threads:
            torch.set_num_threads(m.threads)
        dev = pick_device(m.device)
        dt = pick_dtype(m.dtype, dev)
        target_dir = resolve_target(m.target, storage_options)
        draft_dir = None if m.draft in ("none",) + RANDOM_HEADS else resolve_draft(m.draft, storage_options)
        target_config, tokenizer = target_config_and_tokenizer(target_dir)
        if draft_dir is not None:  # validate the head's config before spending time on the target's weights
            check_head(draft_dir, target_config)
        if m.compile != "off" and config.precision.cpu_linears == "auto":
            config = config.replace(cpu_linears="input_major")   # Inductor lowers dense weights, not packed ones
        # plan the memory before allocating any: max_batch_size "auto" becomes an int, one that does not fit fails
        config = size_engine(config, target_config, draft_dir, dev, dt)
        target = TargetModel.load(target_dir, dt, dev, config.cache.max_batch_size, config.cache.max_model_len,
                                  **config.precision.model_dump())
        draft = None
        if draft_dir is not None:
            draft = load_head(draft_dir, target.config, target.model.embed_tokens.weight, dt, dev)
        elif m.draft in RANDOM_HEADS:  # an untrained head: useless for speed, a strong test of losslessness
            torch.manual_seed(0)
            draft = (Eagle3Head if m.draft == "random-eagle3" else DraftHead).for_target(target.config)
            draft.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight)
            draft = draft.to(device=dev, dtype=dt).eval()
        engine = cls(target, draft, tokenizer, config)
        engine.target_dir, engine.draft_dir = target_dir, draft_dir
        spec = config.speculation
        measured = spec.measured_choice if spec.measured_choice is not None else spec.tree_policy == "auto"
        if spec.tree_policy == "auto" and draft is not None:
            from eagle_ray.engine.tuning import autotune
            engine.tuning = t = autotune(engine)
            engine.set_trees(trees_by_batch=t.speculative_trees() if measured else t.trees_by_batch())
            engine.config = engine.config.replace(verify_budget_by_batch=t.verify_budget_by_batch())
            if measured:   # the tuner's choices are where the measured ones start
                engine.chooser = SpeculationChooser.for_trees(t.trees_by_batch())
        elif measured and draft is not None:
            engine.chooser = SpeculationChooser.for_trees(spec.trees_by_batch or {1: spec.tree})
        return engine

    def reference_model(self):
        """A pristine transformers model of the target (our runtime rewrites its copy's linears on CPU), for
        comparisons with ``generate()``."""
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(str(self.target_dir), dtype=self.target.dtype).to(self.device).eval()

    # ---- trees ----------------------------------------------------------------------------------------------------
    tree_budget = staticmethod(tree_budget)

    def max_tree_budget(self) -> int:
        return max(tree_budget(t) for t in self.config.speculation.trees())

    def tree_for(self, batch: int) -> TreeConfig:
        """The tree a step with ``batch`` sequences grows: ``trees_by_batch``'s entry for the largest batch size
        <= ``batch`` (the smallest entry below that), else ``tree``."""
        table = self.config.speculation.trees_by_batch
        return by_batch(table, batch, min(table)) if table else self.config.speculation.tree

    def speculative_tree_for(self, batch: int) -> TreeConfig:
        """The tree a step drafts where the measured choice speculates: ``tree_for``'s, or where that is plain the
        configured ``tree`` (the default tree if that is plain too)."""
        tree = self.tree_for(batch)
        if is_plain(tree):
            tree = self.config.speculation.tree
        return TreeConfig() if is_plain(tree) else tree

    def verify_budget_for(self, batch: int) -> int | None:
        """The verify cap of a step with ``batch`` speculative sequences: ``verify_budget_by_batch``'s entry for the
        largest batch size <= ``batch``, else ``max_verify_tokens``."""
        c = self.config.speculation
        return by_batch(c.verify_budget_by_batch or {}, batch, None) or c.max_verify_tokens

    def step_verify_cap(self, batch: int, room: int | None) -> int | None:
        """The verify cap of a step with ``batch`` speculative sequences: the tuned or configured cap, lowered to the
        ``room`` that the step's prompt chunks leave (see ``Scheduler``); None where nothing limits the trees."""
        cap = self.verify_budget_for(batch)
        if room is None or room >= batch * tree_budget(self.tree_for(batch)):
            return cap
        return min(cap, room) if cap else room

    def tree_summary(self) -> dict:
        """What trees this engine grows (recorded in job outputs and Serve stats); with a measured choice, per batch
        size what steps run now ("plain" where speculation is off) and the tokens/s measured for both modes."""
        c = self.config.speculation
        if not c.trees_by_batch and self.chooser is None:
            return c.tree.model_dump(exclude_none=True)
        table = c.trees_by_batch or {1: c.tree}
        out = {"policy": c.tree_policy, "trees_by_batch": {
            str(b): "plain" if is_plain(t) or (self.chooser and not self.chooser.bucket(b).speculate) else
            t.model_dump(exclude_none=True) for b, t in sorted(table.items())}}
        if c.verify_budget_by_batch:
            out["verify_budget_by_batch"] = {str(b): n for b, n in sorted(c.verify_budget_by_batch.items())}
        if self.chooser is not None:
            out["measured"] = self.chooser.summary()
        return out

    def set_trees(self, tree: TreeConfig | None = None, trees_by_batch: dict[int, TreeConfig] | None = None) -> None:
        """Change the tree shape(s) between steps (benchmarks, the tuner); grows the draft cache if needed."""
        if self.draft is not None:
            check_draft_vocab(self.draft, [tree or self.config.speculation.tree, *(trees_by_batch or {}).values()])
        self.config = self.config.replace(tree=tree or self.config.speculation.tree, trees_by_batch=trees_by_batch)
        if self.chooser is not None:   # a new table: the measured choice starts again from it
            self.chooser = SpeculationChooser.for_trees(trees_by_batch or {1: self.config.speculation.tree})
        if self.draft is not None:
            self._allocate_draft_cache()

    def _allocate_draft_cache(self, fresh: bool = False) -> None:
        # consumed pairs never outnumber the target's cached tokens; a cycle's tree tokens stack on top of them
        room = max(draft_room(t) for t in self.config.speculation.trees())
        cache = None if fresh else getattr(self.draft, "cache", None)
        slots = self.config.cache.max_batch_size
        if cache is None or cache.num_slots != slots or cache.max_len < self.target.max_len + room + 1:
            self.draft.allocate_cache(slots, self.target.max_len + room + 1)
            self.draft.cache.kv_bucket = self.target.cache.kv_bucket
            self.draft.cache.slice_reads = self.target.cache.slice_reads
            if cache is not None and cache.num_slots == slots:  # running sequences keep their draft context
                self.draft.cache.k[..., : cache.max_len, :] = cache.k[..., : cache.max_len, :]
                self.draft.cache.v[..., : cache.max_len, :] = cache.v[..., : cache.max_len, :]
                self.draft.cache.lengths[:] = cache.lengths

    # ---- requests -------------------------------------------------------------------------------------------------
    def prompt_room(self) -> int:
        """The most prompt tokens a request may bring (see the module-level ``prompt_room``)."""
        return prompt_room(self.target.max_len, self.max_tree_budget())

    def max_new_tokens_for(self, prompt_len: int) -> int:
        """The most tokens a request with a ``prompt_len``-token prompt can generate before its slot ends it with
        ``length`` (the last token is returned, never cached, so one more than the context's free positions)."""
        return self.target.max_len + 1 - prompt_len

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
        ids = self.encode(prompt)
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_ids))
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)))
        return Sequence(request_id or str(next(self._ids)), ids, params, frozenset(stop), seed,
                        detok=Detokenizer(self.tokenizer, ids), speculative=speculative,
                        stops=StopStrings(params.stop) if params.stop else None)

    # ---- the loop -------------------------------------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    speculative: bool = True) -> Sequence:
        """Queue one request (a prompt, or a Sequence from ``make_sequence``); ``step()`` runs it."""
        seq = prompt if isinstance(prompt, Sequence) else self.make_sequence(prompt, params, request_id, speculative)
        if seq.finished or seq.slot >= 0 or any(s is seq for s in self.scheduler.waiting):
            raise InvalidRequestError(f"request {seq.request_id!r} was already added; make a new sequence to run "
                                      "it again")
        self.scheduler.add(seq)
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, request_id: str) -> Sequence | None:
        """Cancel a waiting or running request and free its slot."""
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            self._finalize(seq)
        return seq

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 speculative: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion (continuously batched); outputs come back in input order."""
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
        seqs = [self.make_sequence(p, sp, speculative=speculative) for p, sp in zip(prompts, plist)]
        for seq in seqs:
            self.scheduler.add(seq)
        while self.has_unfinished():
            self.step()
        return [self.output(s) for s in seqs]

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Admit waiting requests, run this step's prompt chunks and one draft-verify step of every running
        sequence, retire finished ones. Returns the sequences that emitted tokens or finished (for streaming)."""
        for src, dst in self.scheduler.defragment():  # keep running slots contiguous: KV reads stay slices
            self.runner.move_slot(src, dst)
        plan = self.scheduler.schedule({True: self.max_tree_budget(), False: 1}, self.target.max_len)
        out = None if plan.empty else self.runner.run(plan, self.trees_this_step(plan),
                                                      lambda n: self.step_verify_cap(n, plan.verify_room))
        touched = self._postprocess(plan, out)
        for seq in self.scheduler.retire_finished():
            self._finalize(seq)
        return touched

    def speculative_batch(self, plan: StepPlan) -> int:
        """Sequences of the step that may speculate: what picks its tree and its measured choice."""
        return sum(s.speculative for s in plan.decode) if self.draft is not None else 0

    def trees_this_step(self, plan: StepPlan):
        """``tree_for``, or with a measured choice the tree or plain decoding, as it says for the step's batch."""
        n = self.speculative_batch(plan)
        if self.chooser is None or not n:
            return self.tree_for
        return self.speculative_tree_for if self.chooser.speculate(n) else lambda batch: PLAIN

    def _postprocess(self, plan: StepPlan, out: StepOutput | None) -> list[Sequence]:
        """Sequences take their tokens (stop tokens, length, stop strings) and their share of the step's time."""
        touched = {id(s): s for s in self.scheduler.running if s.finished}  # finished by schedule() (length)
        if out is None:
            return list(touched.values())
        t = out.times
        now = time.perf_counter()
        for c in plan.prefill:
            seq = c.seq
            if c.start == 0:
                seq.start_time = now - t.total_s
            seq.stats.prefill_s += t.prefill_s
            if c.completes:
                self.scheduler.prefill_done(seq)
                seq.stats.ttft_s = now - seq.start_time
        if self.chooser is not None and self.speculative_batch(plan):
            self.chooser.record(self.speculative_batch(plan), True in out.decoded, t.total_s,
                                sum(len(r.tokens) for r in out.results if r.tree_size), out.steady, t.extend_s)
        if plan.prefill:
            self.counters["prefill_passes"] += 1
            self.counters["prefill_sequences"] += sum(c.completes for c in plan.prefill)
        for speculative, n in out.decoded.items():
            self.counters["decode_passes"] += 1
            self.counters["decode_sequences"] += n
            self.counters["verify_tokens"] += n * (t.verify_width if speculative else 1)
        self.counters["tree_nodes"] += t.tree_nodes
        if out.decoded and not plan.prefill:  # decode-only steps: what share of a step is not model forwards
            self.counters["decode_step_s"] += t.total_s
            self.counters["decode_forward_s"] += t.forward_s
        other = t.total_s - t.prefill_s - t.draft_s - t.verify_s
        for r in out.results:
            seq = r.seq
            if seq.finished:
                continue
            kept = seq.append(r.tokens)
            if r.tree_size:
                seq.stats.record_step(r.accepted, r.tree_size, kept)
                seq.stats.draft_s += t.draft_s
                seq.stats.verify_s += t.verify_s
                seq.stats.other_s += other
            seq.update_text()
            touched[id(seq)] = seq
        return list(touched.values())

    def _finalize(self, seq: Sequence) -> None:
        seq.stats.total_s = time.perf_counter() - seq.start_time if seq.start_time else 0.0
        seq.stats.new_tokens = len(seq.output_ids)
        seq.pending.clear()     # frees the feature tensors
        seq.draft_hidden = None

    def output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(seq.request_id, seq.prompt_ids, list(seq.output_ids), seq.text,
                             seq.finish_reason or "length", seq.stats)
