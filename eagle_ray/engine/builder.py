"""Building an engine, every part of it in one place: the pair loaded (``model/pair.py``: read, check, plan, load),
then wired (the tree policy, the scheduler and model runner, the head bound to the target's lm_head, its draft
cache, compiled forwards), then finished (with ``tree_policy: auto`` the tuner's trees, which need a running engine,
and with ``compile: cuda-graphs`` the captured passes). A restart rebuilds the stepping parts here too, so a
restarted engine runs the same options as a new one. ``EagleEngine`` only steps what this module builds.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle_ray.config import EngineConfig
from eagle_ray.engine.budgets import check_prompt_room, draft_room, extend_budget, graph_widths, tree_demand
from eagle_ray.engine.model_runner import ModelRunner
from eagle_ray.engine.scheduler import Feeding, Scheduler
from eagle_ray.engine.text import TextCodec
from eagle_ray.engine.tree_policy import TreePolicy, check_draft_vocab
from eagle_ray.engine.tuning import autotune
from eagle_ray.model.compiled import compile_forwards
from eagle_ray.model.draft_graphs import DraftGraphs
from eagle_ray.model.memory import max_pending_pairs, pending_pair_bytes
from eagle_ray.model.numerics import defaults_for, step_tokens
from eagle_ray.model.pair import LoadedPair, load_pair
from eagle_ray.model.target import TargetModel
from eagle_ray.speculative.grammar import GrammarCache
from eagle_ray.speculative.tree import prepare_trees


@dataclass
class Wiring:
    """What an engine steps with, built around its target and head."""
    policy: TreePolicy
    codec: TextCodec
    scheduler: Scheduler
    runner: ModelRunner
    eos_ids: frozenset
    grammars: GrammarCache


def load(config: EngineConfig, storage_options: dict | None = None) -> LoadedPair:
    """The pair ``config`` names, loaded with a memory plan that holds the largest trees the engine may grow."""
    return load_pair(config, tree_demand(config.speculation), storage_options)


def wire(target: TargetModel, draft, tokenizer, config: EngineConfig) -> Wiring:
    """The parts an engine steps with: its trees checked against the context and the head, the head bound to the
    target's lm_head with its draft cache, the forwards compiled as ``model.compile`` says."""
    policy = TreePolicy(config.speculation, drafting=draft is not None, slots=target.cache.num_slots)
    check_prompt_room(target.max_len, policy.trees())
    scheduler, runner = build_stepping(target, draft, config, policy)
    if draft is not None:
        draft.bind_lm_head(target.lm_head, config.speculation.draft_vocab_size, target.numerics.cpu_linears)
        check_draft_vocab(draft.draft_vocab_size, policy.trees())
        allocate_draft_cache(target, draft, policy, config.cache.max_batch_size, fresh=True)
    compile_forwards(target, draft, config.model.compile)
    if config.model.compile == "cuda-graphs" and draft is not None:
        runner.draft_graphs = DraftGraphs(draft, target.cache.num_slots, config.speculation.context_vocab)
    eos = tokenizer.eos_token_id
    gen_eos = getattr(getattr(target.hf, "generation_config", None), "eos_token_id", None)
    eos_ids = frozenset(x for x in ([eos] + (gen_eos if isinstance(gen_eos, list) else [gen_eos])) if x is not None)
    grammars = GrammarCache(tokenizer, target.vocab_size, eos_ids)   # structured output, compiled once
    codec = TextCodec(tokenizer, target.vocab_size, template_variables=config.model.chat_template_kwargs)
    return Wiring(policy, codec, scheduler, runner, eos_ids, grammars)


def finish(engine, pair: LoadedPair) -> None:
    """What needs a built engine: where its pair came from, with ``tree_policy: auto`` the tuner's trees (measured
    on this device, the draft cache grown to them), then the captured graphs."""
    engine.target_dir = pair.checkpoints.target_dir
    engine.draft_dir = pair.checkpoints.head.path if pair.checkpoints.head else None
    if pair.config.speculation.tree_policy == "auto" and pair.draft is not None:
        engine.policy.adopt(autotune(engine))
        allocate_draft_cache(engine.target, engine.draft, engine.policy, pair.config.cache.max_batch_size)
    capture_graphs(engine.target, engine.draft, engine.policy, engine.runner.draft_graphs)


def build_stepping(target: TargetModel, draft, config: EngineConfig, policy: TreePolicy,
                   draft_graphs=None) -> tuple[Scheduler, ModelRunner]:
    """An engine's scheduler and model runner, as ``config`` and the device say (the step's token budget, the head's
    feeding, one target pass a step), both empty; ``draft_graphs``: the runner's captured draft loops, if any."""
    budget = step_tokens(config.cache.max_step_tokens, target.device, config.cache.step_goal)
    extend = extend_budget(budget)
    runner = ModelRunner(target, draft, extend, context_vocab=config.speculation.context_vocab)
    runner.draft_graphs = draft_graphs
    feeding = None
    if draft is not None:
        pair = pending_pair_bytes(draft.feature_size, target.dtype, target.numerics.fp32_activations)
        feeding = Feeding(extend, max_pending_pairs(pair, target.max_len))
    scheduler = Scheduler(config.cache.max_batch_size, budget, policy, feeding,
                          one_pass=defaults_for(target.device).one_target_pass,
                          prefix_sharing=config.cache.prefix_sharing)
    return scheduler, runner


def restart(engine) -> None:
    """Empty caches and fresh stepping parts on the same weights (a split target's other ranks start again)."""
    engine.target.restart()
    engine.scheduler, engine.runner = build_stepping(engine.target, engine.draft, engine.config, engine.policy,
                                                     engine.runner.draft_graphs)
    if engine.draft is not None:
        allocate_draft_cache(engine.target, engine.draft, engine.policy, engine.config.cache.max_batch_size,
                             fresh=True)


def allocate_draft_cache(target: TargetModel, draft, policy: TreePolicy, slots: int, fresh: bool = False) -> None:
    """The head's cache, large enough for the policy's trees: consumed pairs never outnumber the target's cached
    tokens, and a cycle's tree tokens stack on top of them. Grown in place, running sequences keep their draft
    context; ``fresh``: a new, empty one."""
    prepare_trees(policy.trees(), target.device)
    room = max(draft_room(t) for t in policy.trees())
    cache = None if fresh else getattr(draft, "cache", None)
    if cache is None or cache.num_slots != slots or cache.max_len < target.max_len + room + 1:
        draft.allocate_cache(slots, target.max_len + room + 1)
        draft.cache.kv_bucket = target.cache.kv_bucket
        draft.cache.slice_reads = target.cache.slice_reads
        if cache is not None and cache.num_slots == slots:  # running sequences keep their draft context
            draft.cache.k[..., : cache.max_len, :] = cache.k[..., : cache.max_len, :]
            draft.cache.v[..., : cache.max_len, :] = cache.v[..., : cache.max_len, :]
            draft.cache.lengths[:] = cache.lengths


@torch.inference_mode()
def capture_graphs(target: TargetModel, draft, policy: TreePolicy, draft_graphs) -> int:
    """With ``compile: cuda-graphs``, before the first request and after the tuner has chosen the trees: the
    target's decode passes for every batch bucket (plain roots, and each tree's verify widths) and the head's
    draft loops, largest batch first, at the first key-length bucket (``DecodeGraphs.capture_at_load``); longer
    contexts' graphs are captured when a step first needs them. Returns the number of graphs captured."""
    if target.graphs is None:
        return 0
    widths = graph_widths(policy.trees() if draft is not None else [])
    n = target.graphs.capture_at_load(widths, capture=bool(getattr(draft, "feature_layers", None)))
    if draft_graphs is not None:
        n += draft_graphs.capture_at_load(policy.speculative_tree_for)
    return n
