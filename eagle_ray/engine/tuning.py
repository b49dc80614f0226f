"""Automatic tree shape for the device at hand.

A tree's speed is ``tau(tree) / step_time(tree, batch)``. EAGLE-2's reference times one thing (the verify cost of
its token budget, ``total_token=-1``); here both sides are estimated per batch size:

- cost: on this device, the time of a target verify pass of ``B x n`` tokens for every ``n`` of the grid (the mean
  over a short and a long context, :data:`CONTEXTS`), of growing a draft tree of ``(depth, top_k)`` for ``B``
  sequences (the rerank to ``total_tokens`` is free), and the host's share of a whole engine step at ``B`` (a few
  real plain steps less their target pass: scheduling, sampling, appending tokens and text);
- acceptance: one traced run with a large tree (``TRACE_TREE``) on bundled prompts; every smaller shape's tau is
  read off those trees (:meth:`TreeTrace.simulated_tau`);
- prompt lookups (``TreeConfig.lookup``): each candidate is also tried with the configured chain grafted on. The
  trace says how deep each step's chain would have been accepted and how often a pass of ``B`` sequences has one,
  which widens that pass by the chain (the costs, interpolated between measured widths). Where a chain pays at one
  batch size it can cost more than it brings at another: on a CPU a verify pass costs about its width.

The shape with the highest expected tokens/s per batch size wins. The result is cached on disk per (models, dtype,
device, threads); a cached result that covers the batch sizes asked for serves them (each batch size's costs are
measured on their own), so a job or a Serve replica pays for the measurement once per machine type.
"""
from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from eagle_ray.config import PLAIN, SamplingParams, TreeConfig
from eagle_ray.engine.budgets import GRID_DEPTH, GRID_TOPK, GRID_TOTAL, TRACE_TREE
from eagle_ray.engine.chooser import MIN_GAIN
from eagle_ray.speculative.trace import TreeTrace

CONTEXTS = (128, 384)  # prefix lengths a verify pass is timed at, its cost the mean: a decode's context grows from its
                      # prompt to prompt + answer, and a pass's cost need not grow smoothly with it (on a CPU it can
                      # jump where a batch's keys outgrow a cache)
CONTEXT = 256         # the head's trees are timed at one (its one layer's attention is a small share of a step)


@dataclass
class BatchChoice:
    tree: dict                 # TreeConfig fields
    expected_tau: float
    step_s: float
    expected_tok_s: float      # batch * tau / step_s
    plain_tok_s: float         # batch / (one-token verify pass): plain decoding on the same runtime
    verify_cap: int | None = None   # the most tree nodes a verify pass takes (most probable kept), None: no cap
    best_tree: dict | None = None          # the best speculative tree and its best cap, chosen or not: the report
    best_tree_tok_s: float | None = None   # shows why plain or a cap was or was not taken
    best_cap: int | None = None
    best_cap_tok_s: float | None = None


@dataclass
class TuningResult:
    device: str
    dtype: str
    threads: int
    batches: dict[int, BatchChoice]
    trace_steps: int
    trace_tau: float
    seconds: float
    # {"verify": {B: {n: s}}: a step's target pass, mean over CONTEXTS, plus the host's share; "verify_at":
    #  {B: {context: {n: s}}}: the passes alone; "host": {B: s}; "draft": {B: {"depth,top_k": s}}} (str keys)
    costs: dict = field(default_factory=dict)

    def trees_by_batch(self) -> dict[int, TreeConfig]:
        return {b: TreeConfig(**c.tree) for b, c in self.batches.items()}

    def speculative_trees(self) -> dict[int, TreeConfig]:
        """Per batch size the tree to draft when speculating there: the chosen one, or the best speculative tree
        where plain was chosen (what a measured choice tries against plain)."""
        return {b: TreeConfig(**(c.best_tree if c.best_tree and c.tree["total_tokens"] == 1 else c.tree))
                for b, c in self.batches.items()}

    def verify_cap_by_batch(self) -> dict[int, int] | None:
        caps = {b: c.verify_cap for b, c in self.batches.items() if c.verify_cap}
        return caps or None

    def to_dict(self) -> dict:
        return asdict(self)

    def predicted_tok_s(self, batch: int, context: float) -> dict[str, float]:
        """Tokens/s of full ``batch``-sequence decode steps at a ``context``-token prefix: of the chosen mode
        (``"choice"``) and of plain decoding, each step's target pass interpolated between the measured contexts
        (the choice itself is made at their mean). What steady steps of a run with that mean context should show."""
        c = self.batches[batch]
        at = {int(x): {int(n): t for n, t in by_n.items()} for x, by_n in self.costs["verify_at"][str(batch)].items()}
        mean = {int(n): t for n, t in self.costs["verify"][str(batch)].items()}

        def shift(width: int) -> float:   # the pass at ``context`` less the pass at the mean context
            here = pass_seconds({x: pass_seconds(by_n, width) for x, by_n in at.items()}, context)
            return here - statistics.fmean(pass_seconds(by_n, width) for by_n in at.values())
        plain = batch / (pass_seconds(mean, 1) + shift(1))
        return {"choice": batch * c.expected_tau / (c.step_s + shift(c.tree["total_tokens"])), "plain": plain}

    def covering(self, batch_sizes: list[int]) -> "TuningResult | None":
        """This result restricted to ``batch_sizes``, or None if it lacks one of them."""
        if not set(batch_sizes) <= set(self.batches):
            return None
        costs = {kind: {b: c for b, c in by_b.items() if int(b) in batch_sizes} for kind, by_b in self.costs.items()}
        return TuningResult(self.device, self.dtype, self.threads, {b: self.batches[b] for b in batch_sizes},
                            self.trace_steps, self.trace_tau, self.seconds, costs)

    @classmethod
    def from_dict(cls, d: dict) -> "TuningResult":
        d = dict(d)
        d["batches"] = {int(b): BatchChoice(**c) for b, c in d["batches"].items()}
        return cls(**d)


def _median_time(fn, device: torch.device, repeats: int, warm_up: bool = True) -> float:
    if warm_up:
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def verify_seconds(engine, batch: int, width: int, context: int | None = None, repeats: int | None = None) -> float:
    """One target pass of ``batch x width`` tree tokens over a ``context``-token prefix, logits included; without
    ``context``, the mean over :data:`CONTEXTS`."""
    if context is None:
        return statistics.fmean(verify_seconds_at(engine, batch, width, repeats).values())
    return _verify_seconds(engine, batch, width, context, repeats)


def verify_seconds_at(engine, batch: int, width: int, repeats: int | None = None) -> dict[int, float]:
    """:func:`verify_seconds` at each of :data:`CONTEXTS` (one warm-up)."""
    return {c: _verify_seconds(engine, batch, width, c, repeats, warm_up=i == 0) for i, c in enumerate(CONTEXTS)}


def _verify_seconds(engine, batch: int, width: int, context: int, repeats: int | None, warm_up: bool = True) -> float:
    from eagle_ray.engine.model_runner import causal_block
    target, dev = engine.target, engine.device
    slots = list(range(batch))
    context = max(0, min(context, target.max_len - width))
    saved = target.cache.lengths.copy()
    target.cache.lengths[slots] = context
    tokens = torch.randint(0, target.vocab_size, (batch, width), device=dev)
    depth = torch.arange(width, device=dev).expand(batch, width)
    mask = causal_block([width] * batch, width, dev)
    repeats = repeats or (3 if batch * width <= 64 else 1)  # big passes vary little and cost much
    try:
        return _median_time(lambda: target.logits(target.forward(tokens, slots, depth, mask)), dev, repeats, warm_up)
    finally:
        target.cache.lengths[:] = saved


@torch.inference_mode()
def draft_seconds(engine, batch: int, depth: int, top_k: int, context: int = CONTEXT, repeats: int = 3) -> float:
    """Feeding two accepted tokens to the head and growing a ``(depth, top_k)`` tree for ``batch`` sequences."""
    from eagle_ray.engine.sequence import Sequence

    draft, dev = engine.draft, engine.device
    d = draft.feature_size
    cfg = TreeConfig(total_tokens=min(512, 1 + top_k * (depth + 1)), depth=depth, top_k=top_k)
    saved = draft.cache.lengths.copy()
    context = max(0, min(context, draft.cache.max_len - 2 - top_k * (depth + 1)))
    seqs = [Sequence(str(b), [1], SamplingParams(), frozenset(), 0, slot=b, output_ids=[3]) for b in range(batch)]

    def run():
        draft.cache.lengths[: batch] = context
        for s in seqs:
            s.pending.add([1, 2], torch.randn(2, d, device=dev, dtype=engine.target.dtype))
        engine.runner.grow_trees(seqs, cfg)
    try:
        return _median_time(run, dev, repeats)
    finally:
        draft.cache.lengths[:] = saved


@torch.inference_mode()
def host_seconds(engine, batch: int, context: int = CONTEXTS[0], steps: int = 6) -> float:
    """The host's share of a whole engine step at ``batch`` sequences: a few real plain decode steps (their steady
    steps, ``EagleEngine.steady_steps``) less a bare target pass of the same shape."""
    context = max(1, min(context, engine.prompt_room(), engine.target.max_len - steps - 2))
    vocab = engine.target.vocab_size
    prompts = [[(101 + 7 * i + 13 * j) % vocab for j in range(context)] for i in range(batch)]
    before = engine.steady_steps.get((False, batch), (0.0, 0))
    engine.generate(prompts, SamplingParams(max_new_tokens=steps + 1, ignore_eos=True), speculative=False)
    after = engine.steady_steps.get((False, batch), (0.0, 0))
    seconds, tokens = after[0] - before[0], after[1] - before[1]
    if not tokens:
        return 0.0
    return max(0.0, seconds / (tokens / batch) - _verify_seconds(engine, batch, 1, context + steps // 2, 3))


def trace_prompts(n: int) -> list:
    """Calibration prompts: alternating first turns of the bundled MT-bench and HumanEval files."""
    from eagle_ray.prompts import benchmark_path, first_turn_prompt, read_jsonl
    mt, he = read_jsonl(benchmark_path("mt_bench")), read_jsonl(benchmark_path("humaneval"))
    out = []
    for i in range(n):
        out.append(first_turn_prompt((mt if i % 2 == 0 else he)[i // 2]))
    return out


def collect_trace(engine, prompts: list, max_new_tokens: int, tree: TreeConfig = TRACE_TREE) -> TreeTrace:
    """Greedy-generate ``prompts`` with ``tree`` and record every verified tree, with the engine's configured
    prompt-lookup chains matched against the outputs (:meth:`TreeTrace.match_chains`)."""
    saved = (engine.config.speculation.tree, engine.config.speculation.trees_by_batch)
    chooser, engine.policy.chooser = engine.policy.chooser, None      # every step drafts the trace's tree
    engine.set_trees(tree)
    trace = engine.runner.trace = TreeTrace()
    try:
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens))
        configured = saved[0]
        trace.match_chains({o.request_id: list(o.prompt_token_ids) + list(o.token_ids) for o in outs},
                           configured.lookup_ngram, configured.lookup)
        return trace
    finally:
        engine.runner.trace = None
        engine.set_trees(*saved)
        engine.policy.chooser = chooser


def shapes_for(total_tokens: int):
    """(depth, top_k) of the grid that can fill ``total_tokens`` (the pool has ``k + d * k^2`` nodes) without a
    level the budget cannot reach."""
    for k in GRID_TOPK:
        for d in GRID_DEPTH:
            if total_tokens - 1 <= k + d * k * k and d + 1 <= total_tokens - 1:
                yield d, k


def candidate_trees(max_total: int = TRACE_TREE.total_tokens):
    for t in GRID_TOTAL:
        if t <= max_total:
            for d, k in shapes_for(t):
                yield t, d, k


def pass_seconds(costs: dict[int, float], width: float) -> float:
    """A verify pass ``width`` tokens wide per sequence: linear between the measured widths, along the last
    segment beyond the widest."""
    if width in costs:
        return costs[width]
    widths = sorted(costs)
    if len(widths) == 1:
        return costs[widths[0]]
    above = [w for w in widths if w > width]
    below = [w for w in widths if w < width]
    if not below:
        return costs[above[0]]
    lo, hi = (below[-1], above[0]) if above else (widths[-2], widths[-1])
    return costs[lo] + (costs[hi] - costs[lo]) * (width - lo) / (hi - lo)


def choose_trees(trace: TreeTrace, verify_s: dict[int, dict[int, float]], draft_s: dict[int, dict[str, float]],
                 lookup: int = 0, lookup_ngram: int = TreeConfig().lookup_ngram,
                 ) -> tuple[dict[int, BatchChoice], list[dict]]:
    """Per batch size the candidate with the highest expected tokens/s, plain decoding (one token per step at the
    cost of a one-token verify pass) included, which a tree must beat by :data:`MIN_GAIN`; also every candidate's
    estimate. Each tree is tried without prompt lookups and, if ``lookup``, with ``lookup``-token chains."""
    lookups = (0, lookup) if lookup else (0,)
    taus = {(t, d, k, n): trace.simulated_tau(t, d, k, n) for t, d, k in candidate_trees() for n in lookups}
    choices, table = {}, []
    for b in verify_s:
        plain_s = verify_s[b][1]
        plain = BatchChoice(PLAIN.model_dump(), 1.0, plain_s, b / plain_s, b / plain_s)
        table.append({"batch": b, "total_tokens": 1, "depth": 0, "top_k": 1, "tau": 1.0, "step_s": plain_s,
                      "tok_s": b / plain_s})
        tree = None   # the best speculative tree
        chained = trace.chain_rate(b)   # passes a chain widens
        for (t, d, k, n), tau in taus.items():
            verify = verify_s[b][t] if not n else \
                (1 - chained) * verify_s[b][t] + chained * pass_seconds(verify_s[b], t + n)
            step = draft_s[b][f"{d},{k}"] + verify
            tok_s = b * tau / step
            table.append({"batch": b, "total_tokens": t, "depth": d, "top_k": k, "lookup": n, "tau": tau,
                          "step_s": step, "tok_s": tok_s})
            if tree is None or tok_s > tree.expected_tok_s:
                shape = TreeConfig(total_tokens=t, depth=d, top_k=k, lookup=n, lookup_ngram=lookup_ngram)
                tree = BatchChoice(shape.model_dump(), tau, step, tok_s, b / plain_s)
        capped = None
        shape = TreeConfig(**tree.tree).model_copy(update={"lookup": 0})   # caps are simulated without chains
        if b > 1 and shape.total_tokens > 2:  # a cap over the batch: confident sequences keep big trees
            t, d, k = shape.total_tokens, shape.depth, shape.top_k
            for per_seq in range(2, t):
                cap = b * per_seq
                tau, width = trace.simulated_budget(t, d, k, b, cap)
                w = next((n for n in sorted(verify_s[b]) if n >= width), max(verify_s[b]))
                step = draft_s[b][f"{d},{k}"] + verify_s[b][w]
                table.append({"batch": b, "total_tokens": t, "depth": d, "top_k": k, "lookup": 0,
                              "verify_cap": cap, "tau": tau, "step_s": step, "tok_s": b * tau / step})
                if capped is None or b * tau / step > capped.expected_tok_s:
                    capped = BatchChoice(shape.model_dump(), tau, step, b * tau / step, b / plain_s, cap)
        best = max([tree] + ([capped] if capped else []), key=lambda c: c.expected_tok_s)
        if best.expected_tok_s < MIN_GAIN * plain.expected_tok_s:
            best = plain
        best.best_tree, best.best_tree_tok_s = tree.tree, tree.expected_tok_s
        if capped is not None:
            best.best_cap, best.best_cap_tok_s = capped.verify_cap, capped.expected_tok_s
        choices[b] = best
    return choices, table


def fingerprint(path) -> str:
    """What a checkpoint is, not where it lies: its config and weight files by name, size and content (files over
    64 MiB by their first and last MiB), so a copy of the same model in another directory, or the same files with a
    new mtime (``ray job submit --working-dir`` unpacks the repository anew), hits the same tuning cache."""
    if path is None:
        return "none"
    p = Path(path)
    files = [p] if p.is_file() else sorted(f for f in p.iterdir() if f.suffix in (".json", ".safetensors", ".bin")
                                           and f.is_file() and not f.name.startswith("."))
    h = hashlib.sha1()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            if size <= 64 * 2**20:
                h.update(fh.read())
            else:
                h.update(fh.read(2**20))
                fh.seek(size - 2**20)
                h.update(fh.read())
    return h.hexdigest()


def cache_key(engine) -> str:
    dev = engine.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu{os.cpu_count()}"
    blob = json.dumps([fingerprint(engine.target_dir), fingerprint(getattr(engine, "draft_dir", None)),
                       str(engine.target.dtype), name, torch.get_num_threads(), engine.target.numerics.cpu_linears,
                       engine.config.speculation.draft_vocab_size, engine.runner.context_vocab,
                       engine.config.speculation.tree.lookup, engine.config.speculation.tree.lookup_ngram, 10],
                      sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get("EAGLE_RAY_CACHE", Path.home() / ".cache" / "eagle_ray")) / "tuning"


def autotune(engine, batch_sizes: list[int] | None = None, num_prompts: int = 4, max_new_tokens: int = 48,
             use_cache: bool = True, prompts: list | None = None, log=None) -> TuningResult:
    """Measure this device and choose a tree per batch size (see the module doc). ``batch_sizes`` defaults to the
    powers of two up to the engine's max batch size; ``prompts`` to bundled MT-bench/HumanEval first turns."""
    if engine.draft is None:
        raise ValueError("tree tuning needs a draft head")
    if batch_sizes is None:
        batch_sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= engine.config.cache.max_batch_size]
    requested = list(batch_sizes)
    path = cache_dir() / f"{cache_key(engine)}.json"
    if use_cache and path.exists():
        cached = TuningResult.from_dict(json.loads(path.read_text()))
        hit = cached.covering(batch_sizes)
        if hit is not None:
            return hit
        batch_sizes = sorted(set(batch_sizes) | set(cached.batches))  # measure the union once; serve both
    t0 = time.perf_counter()
    say = log or (lambda m: None)
    trace = collect_trace(engine, prompts or trace_prompts(num_prompts), max_new_tokens)
    say(f"traced {len(trace)} trees (tau {trace.simulated_tau(*_shape(TRACE_TREE)):.2f})")
    widths = sorted({t for t, _, _ in candidate_trees()} | {1})
    verify_at = {b: {n: verify_seconds_at(engine, b, n) for n in widths} for b in batch_sizes}
    host = {b: host_seconds(engine, b) for b in batch_sizes}
    verify = {b: {n: statistics.fmean(by_ctx.values()) + host[b] for n, by_ctx in by_n.items()}
              for b, by_n in verify_at.items()}
    say(f"verify costs: {verify}")
    draft = {b: {f"{d},{k}": draft_seconds(engine, b, d, k) for d in GRID_DEPTH for k in GRID_TOPK}
             for b in batch_sizes}
    configured = engine.config.speculation.tree
    choices, _ = choose_trees(trace, verify, draft, configured.lookup, configured.lookup_ngram)
    result = TuningResult(str(engine.device), str(engine.target.dtype).replace("torch.", ""), torch.get_num_threads(),
                          choices, len(trace), trace.simulated_tau(*_shape(TRACE_TREE)), time.perf_counter() - t0,
                          json.loads(json.dumps({"verify": verify, "draft": draft, "host": host,   # str keys,
                                                 "verify_at": {b: {c: {n: by_ctx[c] for n, by_ctx in by_n.items()}
                                                                   for c in CONTEXTS}
                                                               for b, by_n in verify_at.items()}})))   # as cached
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(result.to_dict(), indent=1))
        os.replace(tmp, path)
    return result.covering(requested)


def _shape(tree: TreeConfig) -> tuple[int, int, int]:
    return tree.total_tokens, tree.depth, tree.top_k
