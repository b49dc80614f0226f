"""EagleEngine: load a target + draft pair, run requests with EAGLE-2 speculative decoding (or plain decoding).

``generate()`` takes strings, chat message lists or token id lists, admits up to ``max_batch_size`` of them into
KV-cache slots, and steps the whole running batch together; finished sequences free their slots for waiting ones.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle_ray.config import EngineConfig, SamplingParams, TreeConfig
from eagle_ray.engine.scheduler import Scheduler
from eagle_ray.engine.sequence import Sequence
from eagle_ray.engine.step import StepTimer, decode_step, prefill
from eagle_ray.errors import InvalidRequestError, PromptTooLongError
from eagle_ray.model.draft_head import DraftHead
from eagle_ray.model.loading import resolve_draft, resolve_target
from eagle_ray.model.target import TargetModel
from eagle_ray.spec.tree import static_shape
from eagle_ray.stats import RequestStats

CHAT_ROLES = {"system", "user", "assistant", "tool", "developer"}


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: RequestStats = field(default_factory=RequestStats)


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def cpu_has_fast_bf16() -> bool:
    """bf16 pays off on CPUs with native bf16 dot products (AVX512-BF16 / AMX); elsewhere fp32 is faster."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_model() -> str:
    """The CPU's model name and whether it has native bf16 (recorded with every measurement: the same code
    runs ~2x apart on the machines this project is measured on)."""
    import platform
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}{' (native bf16)' if cpu_has_fast_bf16() else ''}"


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" or cpu_has_fast_bf16() else torch.float32
    return getattr(torch, dtype)


def prefill_chunks(seqs: list[Sequence], max_tokens: int) -> list[list[Sequence]]:
    """Group prompts by length so each padded prefill pass holds at most ``max_tokens`` (rows x longest prompt).

    One pass over prompts of 30 and 600 tokens pads every row to 600; sorted chunks waste little.
    """
    chunks: list[list[Sequence]] = []
    for seq in sorted(seqs, key=lambda s: len(s.prompt_ids)):
        if chunks and (len(chunks[-1]) + 1) * len(seq.prompt_ids) <= max_tokens:
            chunks[-1].append(seq)
        else:
            chunks.append([seq])
    return chunks


def _check_text(text: str, field: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError(f"{field} is not valid Unicode (lone surrogate)") from None


class EagleEngine:
    def __init__(self, target: TargetModel, draft: DraftHead | None, tokenizer, config: EngineConfig):
        self.target, self.draft, self.tokenizer, self.config = target, draft, tokenizer, config
        self.device = target.device
        self.target_dir: Path | None = None
        self.draft_dir: Path | None = None
        self.tuning = None  # the TuningResult when tree_policy is "auto"
        self._ids = itertools.count()
        self.scheduler = Scheduler(config.max_batch_size)
        # lifetime counters: decode passes, sequences they carried (mean verify batch = sequences / passes)
        self.counters = {"decode_passes": 0, "decode_sequences": 0, "verify_tokens": 0, "tree_nodes": 0,
                         "prefill_passes": 0, "prefill_sequences": 0}
        eos = tokenizer.eos_token_id
        gen_eos = getattr(getattr(target.hf, "generation_config", None), "eos_token_id", None)
        self.eos_ids = frozenset(x for x in ([eos] + (gen_eos if isinstance(gen_eos, list) else [gen_eos]))
                                 if x is not None)
        if draft is not None:
            draft.bind_lm_head(target.lm_head_weight, config.draft_vocab_size)
            self._allocate_draft_cache(fresh=True)
        self.trace = None  # a TreeTrace to record verified trees (calibration, tuning); off by default

    # ---- construction -----------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, target: str | None = None, draft: str | None = None, dtype: str = "auto",
                        device: str = "auto", tree: TreeConfig | None = None, max_batch_size: int = 8,
                        max_model_len: int = 2048, threads: int | None = None, draft_vocab_size: int | None = None,
                        max_verify_tokens: int | None = None, storage_options: dict | None = None,
                        **options) -> "EagleEngine":
        """Load a target and its EAGLE head. With neither given: the embedded SmolLM2-135M-Instruct pair.

        ``draft="none"`` loads only the target (plain decoding only); ``draft="random"`` an untrained head.
        ``options`` are any other :class:`EngineConfig` fields (``fp32_activations=False``...).
        """
        config = EngineConfig(target=target, draft=draft, dtype=dtype, device=device, tree=tree or TreeConfig(),
                              max_batch_size=max_batch_size, max_model_len=max_model_len, threads=threads,
                              draft_vocab_size=draft_vocab_size, max_verify_tokens=max_verify_tokens, **options)
        return cls.from_config(config, storage_options)

    @classmethod
    def from_config(cls, config: EngineConfig, storage_options: dict | None = None) -> "EagleEngine":
        from transformers import AutoTokenizer

        if config.threads:
            torch.set_num_threads(config.threads)
        dev = pick_device(config.device)
        dt = pick_dtype(config.dtype, dev)
        target_dir = resolve_target(config.target, storage_options)
        draft_dir = None if config.draft in ("none", "random") else resolve_draft(config.draft, storage_options)
        if draft_dir is not None:  # validate the head's config before spending time on the target's weights
            from transformers import AutoConfig
            DraftHead.check_config(draft_dir, AutoConfig.from_pretrained(str(target_dir)))
        target = TargetModel.load(target_dir, dt, dev, config.max_batch_size, config.max_model_len,
                                  config.fp32_logits, config.fp32_activations, config.batch_invariant)
        draft = None
        if draft_dir is not None:
            draft = DraftHead.load(draft_dir, target.config, target.model.embed_tokens.weight, dt, dev)
        elif config.draft == "random":  # an untrained head: useless for speed, a strong test of losslessness
            torch.manual_seed(0)
            draft = DraftHead.for_target(target.config)
            draft.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight)
            draft = draft.to(device=dev, dtype=dt).eval()
        tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
        engine = cls(target, draft, tokenizer, config)
        engine.target_dir, engine.draft_dir = target_dir, draft_dir
        if config.tree_policy == "auto" and draft is not None:
            from eagle_ray.tuning import autotune
            engine.tuning = autotune(engine)
            engine.set_trees(trees_by_batch=engine.tuning.trees_by_batch())
        return engine

    def reference_model(self):
        """A pristine transformers model of the target (our runtime rewrites its copy's linears on CPU), for
        comparisons with ``generate()``."""
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(str(self.target_dir), dtype=self.target.dtype).to(self.device).eval()

    @staticmethod
    def tree_budget(tree: TreeConfig) -> int:
        return tree.total_tokens if tree.mode == "dynamic" else len(static_shape(tree)) + 1

    def max_tree_budget(self) -> int:
        return max(self.tree_budget(t) for t in self.config.trees())

    def tree_for(self, batch: int) -> TreeConfig:
        """The tree a step with ``batch`` sequences grows: ``trees_by_batch``'s entry for the largest batch size
        <= ``batch`` (the smallest entry below that), else ``tree``."""
        table = self.config.trees_by_batch
        if not table:
            return self.config.tree
        fits = [b for b in table if b <= batch]
        return table[max(fits) if fits else min(table)]

    def tree_summary(self) -> dict:
        """What trees this engine grows (recorded in job outputs and Serve stats)."""
        c = self.config
        if not c.trees_by_batch:
            return c.tree.model_dump(exclude_none=True)
        return {"policy": c.tree_policy, "trees_by_batch": {str(b): t.model_dump(exclude_none=True)
                                                            for b, t in sorted(c.trees_by_batch.items())}}

    def set_trees(self, tree: TreeConfig | None = None, trees_by_batch: dict[int, TreeConfig] | None = None) -> None:
        """Change the tree shape(s) between steps (benchmarks, the tuner); grows the draft cache if needed."""
        self.config = self.config.model_copy(update={"tree": tree or self.config.tree,
                                                     "trees_by_batch": trees_by_batch})
        if self.draft is not None:
            self._allocate_draft_cache()

    def _allocate_draft_cache(self, fresh: bool = False) -> None:
        # stable pairs never outnumber the target's tokens; a cycle's tree tokens stack on top of them
        room = max(t.depth * t.top_k if t.mode == "dynamic" else self.tree_budget(t) for t in self.config.trees())
        cache = None if fresh else getattr(self.draft, "cache", None)
        slots = self.config.max_batch_size
        if cache is None or cache.num_slots != slots or cache.max_len < self.target.max_len + room + 1:
            self.draft.allocate_cache(slots, self.target.max_len + room + 1)
            if cache is not None and cache.num_slots == slots:  # running sequences keep their draft context
                self.draft.cache.k[..., : cache.max_len, :] = cache.k
                self.draft.cache.v[..., : cache.max_len, :] = cache.v
                self.draft.cache.lengths.copy_(cache.lengths)

    # ---- requests -----------------------------------------------------------------------------------------------
    def encode(self, prompt) -> list[int]:
        """A raw string, a chat message list (templated with a generation prompt) or a list of token ids."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            _check_text(prompt, "prompt")
            return self._tokenize(lambda: self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.target.vocab_size]
            if bad:
                raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.target.vocab_size})")
            return list(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            for i, m in enumerate(prompt):
                if m.get("role") not in CHAT_ROLES:
                    raise InvalidRequestError(f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, "
                                              f"got {m.get('role')!r}")
                if not isinstance(m.get("content"), str):
                    raise InvalidRequestError(f"messages[{i}].content must be a string")
                _check_text(m["content"], f"messages[{i}].content")
            return self._tokenize(lambda: self.tokenizer.apply_chat_template(
                prompt, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
        raise InvalidRequestError("a prompt must be a non-empty string, a list of chat messages "
                                  "({'role', 'content'}) or a list of token ids; got " + type(prompt).__name__)

    @staticmethod
    def _tokenize(fn) -> list[int]:
        """Tokenizer and chat-template failures (e.g. a template that requires alternating roles) are the
        request's fault: report them as such instead of failing the batch."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001
            raise InvalidRequestError(f"cannot tokenize the prompt: {type(e).__name__}: {e}") from None

    def make_sequence(self, prompt, params: SamplingParams, request_id: str | None = None) -> Sequence:
        ids = self.encode(prompt)
        room = self.target.max_len - self.max_tree_budget() - 1
        if len(ids) > room:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens but the engine fits at most {room} (max_model_len="
                f"{self.target.max_len} minus the verify budget); shorten the prompt or raise max_model_len")
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_ids))
        gen = None
        if not params.greedy:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,))))
        return Sequence(request_id or str(next(self._ids)), ids, params, frozenset(stop), gen)

    # ---- the loop -------------------------------------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    speculative: bool = True) -> Sequence:
        """Validate and queue one request (raises a typed error if it is bad); ``step()`` runs it."""
        if speculative and self.draft is None:
            raise InvalidRequestError("this engine has no draft head; use speculative=False")
        seq = self.make_sequence(prompt, params or SamplingParams(), request_id)
        seq.speculative = speculative
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
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], dict))
        if single:
            prompts = [prompts]
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidRequestError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        if speculative and self.draft is None:
            raise InvalidRequestError("this engine has no draft head; use speculative=False")
        seqs = [self.make_sequence(p, sp) for p, sp in zip(prompts, plist)]
        self.run(seqs, speculative)
        return [self.output(s) for s in seqs]

    def run(self, seqs: list[Sequence], speculative: bool = True) -> None:
        """Queue ``seqs`` (already validated) and step until the engine is idle."""
        for seq in seqs:
            seq.speculative = speculative
            self.scheduler.add(seq)
        while self.has_unfinished():
            self.step()

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Admit waiting requests into free slots (one batched prefill), advance every running sequence by one
        draft-verify step (speculative and plain ones in separate passes), retire finished ones.

        Returns the sequences that emitted tokens or finished this step, for streaming.
        """
        admitted = self.scheduler.admit()
        if admitted:
            self._prefill(admitted)
        for src, dst in self.scheduler.pack():  # keep running slots contiguous: KV reads stay slices
            self.target.cache.move(src, dst)
            if self.draft is not None:
                self.draft.cache.move(src, dst)
        running = [s for s in self.scheduler.running if not s.finished]
        for speculative in (True, False):
            group = [s for s in running if s.speculative == speculative]
            if group:
                self._decode(group, speculative)
        touched = list(self.scheduler.running)
        for seq in self.scheduler.retire_finished():
            self._finalize(seq)
        return touched

    def _prefill(self, seqs: list[Sequence]) -> None:
        """Prefill newly admitted sequences together (their slots are already assigned)."""
        start = time.perf_counter()
        for seq in seqs:
            seq.start_time = start
            self.target.cache.reset(seq.slot)
            if self.draft is not None:
                self.draft.cache.reset(seq.slot)
        for chunk in prefill_chunks(seqs, self.config.max_prefill_tokens):
            timer = StepTimer(self.device)
            prefill(self.target, chunk, timer)
            self.counters["prefill_passes"] += 1
            self.counters["prefill_sequences"] += len(chunk)
            for seq in chunk:
                seq.stats.prefill_s = timer.verify_s
                seq.stats.ttft_s = time.perf_counter() - start
        for seq in seqs:
            if not seq.speculative:
                seq.draft_tokens, seq.draft_features = [], None
            if seq.params.stop:
                self._check_stop_strings(seq)

    def _finalize(self, seq: Sequence) -> None:
        seq.stats.total_s = time.perf_counter() - seq.start_time if seq.start_time else 0.0
        seq.stats.new_tokens = len(seq.output_ids)
        seq.draft_features = None  # frees the feature tensor

    def _decode(self, running: list[Sequence], speculative: bool) -> None:
        budget = self.max_tree_budget() if speculative else 1
        active = []
        for s in running:
            if int(self.target.cache.lengths[s.slot]) + budget > self.target.max_len:
                s.finish_reason = "length"
            else:
                active.append(s)
        if not active:
            return
        timer = StepTimer(self.device)
        t0 = timer.now()
        decode_step(self.target, self.draft if speculative else None, active,
                    self.tree_for(len(active)) if speculative else None, timer, self.config.max_verify_tokens,
                    self.trace)
        total = timer.now() - t0
        self.counters["decode_passes"] += 1
        self.counters["decode_sequences"] += len(active)
        self.counters["verify_tokens"] += len(active) * timer.verify_width
        self.counters["tree_nodes"] += timer.tree_nodes
        for s in active:
            s.stats.draft_s += timer.draft_s
            s.stats.verify_s += timer.verify_s
            s.stats.other_s += total - timer.draft_s - timer.verify_s
        for s in active:
            if s.params.stop and s.stop_text is None:
                self._check_stop_strings(s)

    def _check_stop_strings(self, seq: Sequence) -> None:
        text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        hits = [(text.find(x), x) for x in seq.params.stop if x and x in text]
        if not hits:
            return
        pos = min(hits)[0]
        # keep the fewest tokens whose text reaches the stop string; the text itself ends before it
        for n in range(1, len(seq.output_ids) + 1):
            if len(self.tokenizer.decode(seq.output_ids[:n], skip_special_tokens=True)) > pos:
                seq.output_ids = seq.output_ids[:n]
                break
        seq.stop_text = text[:pos]
        seq.finish_reason = "stop"

    def output_text(self, seq: Sequence) -> str:
        return seq.stop_text if seq.stop_text is not None else \
            self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)

    def output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(seq.request_id, seq.prompt_ids, list(seq.output_ids), self.output_text(seq),
                             seq.finish_reason or "length", seq.stats)
