"""The model side of a step: runs the target and the draft head for a finished :class:`StepPlan` and returns tokens.

One step is: prompt chunks (one padded target pass) -> feed the head (the plan's passes over pending pairs) ->
draft (grow the trees of the plan's drafted sequences, one batched head call per level) -> verify (one target pass
over all trees, one over the roots of the rest) -> accept -> keep the accepted path's K/V. A plain step is the
verification of a one-node tree. Phases hand each other typed values (``Tree``, ``Acceptance``, ``SeqResult``); the
sequences' state is updated by the engine, not here, except for the head's pending pairs, which belong to this side.

Everything runs batched over sequences; Python loops run over sequences (to pack ragged inputs and hand out
results), never over tree nodes, and a decode pass reads its results back to the host once.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from eagle_ray.config import TreeConfig
from eagle_ray.engine.scheduler import PrefillChunk, StepPlan, extend_passes
from eagle_ray.engine.sequence import Sequence
from eagle_ray.engine.clock import Clock, resolve_times
from eagle_ray.uploads import uploads_for
from eagle_ray.model.draft_head import DraftHead
from eagle_ray.model.numerics import defaults_for
from eagle_ray.model.target import TargetModel
from eagle_ray.speculative.accept import accept
from eagle_ray.speculative.context_vocab import ContextTokens, context_rows
from eagle_ray.speculative.lookup import TokenHistory, lookup_rows
from eagle_ray.speculative.sampling import SamplingBatch, choose_tokens
from eagle_ray.speculative.tree import (Tree, drop_padding, fit_batch_budget, graft_chain, grow_tree, rows_of,
                                        stack_trees)


@dataclass
class SeqResult:
    """What one sequence got from a step."""
    seq: Sequence
    tokens: list[int]             # emitted: accepted drafts + bonus token, or a prompt's first token
    accepted: int = 0             # accepted draft tokens
    tree_size: int = 0            # verified tree nodes, root included (0: a prefill)


@dataclass
class StepTimes:
    prefill_s: float = 0.0
    draft_s: float = 0.0
    extend_s: float = 0.0         # of draft_s: the head taking pending pairs (speculation's catch-up)
    verify_s: float = 0.0
    total_s: float = 0.0
    forward_s: float = 0.0        # inside model forwards: target verify + logits, head passes + scoring
    verify_width: int = 0         # columns of the drafted trees' verify pass (B x width target tokens)
    tree_nodes: int = 0           # real nodes the speculative sequences verified (a root alone in a plain step)


@dataclass
class StepOutput:
    results: list[SeqResult] = field(default_factory=list)
    times: StepTimes = field(default_factory=StepTimes)
    decoded: dict[bool, int] = field(default_factory=dict)   # sequences per decode pass, by drafted or not
    sampled: bool = False    # StepPlan.sampled: the decode rows ran one mode (a sample for SpeculationChooser)
    steady: bool = False     # StepPlan.steady: a whole decode-only step of one mode


def causal_block(lengths: list[int], width: int, device) -> torch.Tensor:
    """[B, W, W] causal masks for ragged blocks (rows past a sequence's length are padding)."""
    idx = torch.arange(width, device=device)
    return (idx.view(1, -1, 1) >= idx.view(1, 1, -1)).expand(len(lengths), width, width)


def root_only_tree(roots: torch.Tensor) -> Tree:
    """Plain decoding is the verification of a one-node tree."""
    B = roots.shape[0]
    zeros = torch.zeros(B, 1, dtype=torch.long, device=roots.device)
    return Tree(roots.view(B, 1), zeros, zeros, torch.ones(B, 1, dtype=torch.bool, device=roots.device),
                torch.ones(B, 1, 1, dtype=torch.bool, device=roots.device), torch.zeros(B, 1, device=roots.device))


def prompt_block(chunks: list[PrefillChunk], width: int) -> np.ndarray:
    """The prefill's token block ``[R, width]`` (zero padded), read from the chunks' prompts."""
    block = np.zeros((len(chunks), width), dtype=np.int64)
    for r, c in enumerate(chunks):
        block[r, : c.end - c.start] = c.seq.prompt_ids[c.start:c.end]
    return block


def extend_tokens(seqs: list[Sequence], taken: list[tuple[int, int]]) -> np.ndarray:
    """One extend pass's token block ``[G, width]`` (zero padded), read from the sequences' pending tokens."""
    width = max(n for _, n in taken)
    tokens = np.zeros((len(taken), width), dtype=np.int64)
    for row, (i, n) in enumerate(taken):
        tokens[row, :n] = seqs[i].pending.tokens[:n]
    return tokens


class ModelRunner:
    def __init__(self, target: TargetModel, draft: DraftHead | None, extend_budget: int, context_vocab: int = 0):
        self.target, self.draft = target, draft
        self.context_vocab = context_vocab   # context tokens a sequence adds to its draft vocabulary (at most)
        self.device = target.device
        self.extend_budget = extend_budget   # padded tokens per head pass (draft_extend without a plan's passes)
        self.profile = False
        # drafted and plain rows verified in one pass (plain roots padded to the trees' width): one read of the
        # weights where a step is bound by reading them, two narrower passes where compute is dearer
        self.one_verify_pass = defaults_for(self.device).one_verify_pass
        self.clock, self.times = Clock(self.device), StepTimes()   # the running step's (see run)
        self.trace = None  # a TreeTrace recording verified trees (calibration, tuning); off by default
        self.draft_graphs = None   # DraftGraphs (engine/draft_graphs.py) where compile is cuda-graphs

    # ---- slots ---------------------------------------------------------------------------------------------------
    def reset_slot(self, slot: int) -> None:
        self.target.cache.reset(slot)
        if self.draft is not None:
            self.draft.cache.reset(slot)

    def move_slot(self, src: int, dst: int) -> None:
        self.target.cache.move(src, dst)
        if self.draft is not None:
            self.draft.cache.move(src, dst)

    # ---- a step --------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, plan: StepPlan) -> StepOutput:
        """One step, as ``plan`` says (``scheduler.plan_decode``)."""
        clock = self.clock = Clock(self.device, self.profile)
        out = StepOutput(sampled=plan.sampled, steady=plan.steady)
        self.times = out.times
        t0 = clock()
        if plan.prefill:
            out.results += self.prefill(plan.prefill)
        ready, plain, tree_cfg = plan.drafted, plan.plain, plan.tree
        context = self.context_ids(ready) if ready else None
        chains = self.lookup_ids(ready, tree_cfg) if ready and tree_cfg.lookup else None
        self.stage_decode(ready, plain, plan.feed, plan.passes, context, chains)
        if plan.passes:
            t = clock()
            self.draft_extend(plan.feed, plan.passes)
            out.times.extend_s = clock() - t
            out.times.draft_s += out.times.extend_s
        if self.one_verify_pass and ready and plain:   # one read of the weights for both, where it fits
            tree = self.draft_trees(ready, tree_cfg, plan.verify_cap, context, chains)
            W = tree.tokens.shape[1]
            if (len(ready) + len(plain)) * W <= self.extend_budget:   # the step's workspace holds the padded pass
                out.results += self.verify(ready + plain, stack_trees(tree, self.root_trees(plain)),
                                           n_valid=[W] * len(ready) + [1] * len(plain), traced=len(ready))
            else:
                out.results += self.verify(ready, tree) + self.decode_plain(plain)
        else:
            if ready:
                out.results += self.decode_speculative(ready, tree_cfg, plan.verify_cap, context, chains)
            if plain:
                out.results += self.decode_plain(plain)
        out.decoded.update({mode: len(seqs) for mode, seqs in ((True, ready), (False, plain)) if seqs})
        out.times.tree_nodes = sum(r.tree_size for r in out.results if r.seq.speculative)
        out.times.total_s = clock() - t0
        uploads_for(self.device).clear()
        resolve_times(out.times)
        return out

    def stage_prefill(self, chunks: list[PrefillChunk], width: int, done: list[int]):
        """Send the prefill's inputs to the device in one copy (see ``Uploads``): the prompt block, the slots and
        their lengths, and for the prompts that complete, their last rows, positions and sampling rows."""
        upload = uploads_for(self.device)
        slots = [c.seq.slot for c in chunks]
        n = [c.end - c.start for c in chunks]
        seqs = [chunks[r].seq for r in done]
        arrays = [prompt_block(chunks, width), slots, self.target.cache.lengths[slots], n]
        if done:
            arrays += [done, [n[r] - 1 for r in done], [[len(s.prompt_ids)] for s in seqs]]
            if any(not s.params.greedy for s in seqs):
                arrays += [upload.float_bits(SamplingBatch.params_of(seqs)), SamplingBatch.seeds_of(seqs)]
        upload.stage(arrays)
        return upload

    def stage_decode(self, ready: list[Sequence], plain: list[Sequence], feed: list[Sequence], passes,
                     context: np.ndarray | None = None, chains: np.ndarray | None = None) -> None:
        """Send the step's small inputs to the device in one copy (see ``Uploads``): slots, target and head cache
        lengths, roots, the head's first pass, the ready sequences' context tokens (``context_ids``) and lookup
        chains (``lookup_ids``), and the sampling rows."""
        arrays = []
        target_len, upload = self.target.cache.lengths, uploads_for(self.device)
        if passes:
            first = passes[0]
            group = [feed[i].slot for i, _ in first]
            arrays += [group, self.draft.cache.lengths[group], [n for _, n in first], extend_tokens(feed, first)]
        for seqs, drafting in ((ready, True), (plain, False)):
            if not seqs:
                continue
            slots = [s.slot for s in seqs]
            arrays += [slots, target_len[slots], [s.root for s in seqs]]
            if drafting:    # where the tree levels sit once this step's passes have fed every pending pair
                arrays.append(self.draft.cache.lengths[slots] + [len(s.pending) for s in seqs])
                arrays += [a for a in (context, chains) if a is not None]
            sampled_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
            if sampled_rows:
                arrays += [upload.float_bits(SamplingBatch.params_of(seqs)), SamplingBatch.seeds_of(seqs),
                           sampled_rows]
        upload.stage(arrays)

    def target_forward(self, tokens, slots, depth, mask, n_valid=None, graphed=True) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's final hidden states and the features its head reads (the same tensor for an EAGLE-2
        head; the captured layer inputs of the same pass for an EAGLE-3 head). ``graphed``: see
        ``TargetModel.forward`` (prompt chunks run eagerly)."""
        layers = getattr(self.draft, "feature_layers", None)
        if layers:
            return self.target.forward(tokens, slots, depth, mask, n_valid=n_valid, capture=layers, graphed=graphed)
        hidden = self.target.forward(tokens, slots, depth, mask, n_valid=n_valid, graphed=graphed)
        return hidden, hidden

    # ---- prefill -------------------------------------------------------------------------------------------------
    def prefill(self, chunks: list[PrefillChunk]) -> list[SeqResult]:
        """One padded pass over this step's prompt chunks; prompts that complete emit their first token."""
        times, clock = self.times, self.clock
        target, device = self.target, self.device
        n = [c.end - c.start for c in chunks]
        R, W = len(chunks), max(n)
        slots = [c.seq.slot for c in chunks]
        for c in chunks:
            if c.start == 0:
                self.reset_slot(c.seq.slot)
        done = [r for r, c in enumerate(chunks) if c.completes]
        seqs = [chunks[r].seq for r in done]
        upload = self.stage_prefill(chunks, W, done)
        t0 = clock()
        hidden, feats = self.target_forward(upload.ints(prompt_block(chunks, W)), slots,
                                            torch.arange(W, device=device).expand(R, W), causal_block(n, W, device),
                                            n_valid=n, graphed=False)
        first: list[int] = []
        if done:
            rows, last = upload.ints(done), upload.ints([n[r] - 1 for r in done])
            logits = target.logits(hidden[rows, last].unsqueeze(1))
            positions = upload.ints([[len(s.prompt_ids)] for s in seqs])
            first = choose_tokens(logits, SamplingBatch.of(seqs, device), positions)[:, 0].tolist()
        times.prefill_s += clock() - t0
        target.cache.lengths[slots] += n
        results, k = [], 0
        for r, c in enumerate(chunks):
            seq = c.seq
            seq.prefilled = c.end
            nxt = seq.prompt_ids[c.start + 1:c.end]
            if c.completes:
                nxt.append(first[k])
                results.append(SeqResult(seq, [first[k]]))
                k += 1
            else:
                nxt.append(seq.prompt_ids[c.end])
            if seq.speculative and self.draft is not None:
                seq.pending.add(nxt, feats[r, : n[r]])
        return results

    # ---- speculative decoding --------------------------------------------------------------------------------------
    def draft_extend(self, seqs: list[Sequence], passes: list[list[tuple[int, int]]] | None = None) -> None:
        """Feed pending (feature, token) pairs of ``seqs`` to the head, committing them to its cache, in ``passes``
        (default: all of them, in passes of at most ``extend_budget`` padded tokens; see ``extend_passes``). A
        sequence left with no pending pair keeps the head's output at its last one (``draft_hidden``): its next tree
        grows from it."""
        upload = uploads_for(self.device)
        if passes is None:
            passes = extend_passes([len(s.pending) for s in seqs], self.extend_budget)
        for taken in passes:
            group = [seqs[i] for i, _ in taken]
            n = [k for _, k in taken]
            width = max(n)
            tokens = upload.ints(extend_tokens(seqs, taken))
            feats = torch.zeros(len(group), width, self.draft.feature_size, dtype=group[0].pending.chunks[0].dtype,
                                device=self.device)
            for b, s in enumerate(group):
                feats[b, : n[b]] = s.pending.take(n[b])[1]
            slots = [s.slot for s in group]
            t0 = self.clock()
            hidden = self.draft.forward(tokens, feats, slots,
                                        torch.arange(width, device=self.device).expand(len(group), width),
                                        causal_block(n, width, self.device), n_valid=n)
            self.times.forward_s += self.clock() - t0
            self.draft.cache.lengths[slots] += n
            for b, s in enumerate(group):
                if not s.pending:
                    s.draft_hidden = hidden[b, n[b] - 1]

    def context_ids(self, seqs: list[Sequence]) -> np.ndarray | None:
        """The context tokens each sequence adds to its draft vocabulary, ``[B, E]`` (``speculative/context_vocab.py``);
        None where the head has no map (or scores its own vocabulary) or no sequence has such a token."""
        outside = getattr(self.draft, "outside_map", None)
        if outside is None or not self.context_vocab:
            return None
        for s in seqs:
            if s.context is None:
                s.context = ContextTokens(outside, self.context_vocab)
            s.context.update(s.prompt_ids, s.output_ids)
        return context_rows([s.context for s in seqs])

    def lookup_ids(self, seqs: list[Sequence], tree_cfg: TreeConfig) -> np.ndarray:
        """Each sequence's prompt-lookup chain, ``[B, L + 1]`` (``speculative/lookup.py``: tokens, then the length), ``L``
        the longest chain found this step: the host knows the widths, so the verify pass is never wider."""
        for s in seqs:
            if s.history is None:
                s.history = TokenHistory()
            s.history.sync(s.prompt_ids, s.output_ids)
        rows = lookup_rows([s.history for s in seqs], tree_cfg.lookup_ngram, tree_cfg.lookup)
        return np.concatenate([rows[:, : int(rows[:, -1].max())], rows[:, -1:]], axis=1)

    def grow_from(self, seqs: list[Sequence], root_hidden: torch.Tensor, tree_cfg: TreeConfig,
                  context_ids: np.ndarray | None) -> Tree:
        """Grow every sequence's tree from its root (one batched head call per level), drafting over the head's
        map plus ``context_ids`` (``context_ids()``, computed once per step)."""
        draft, device = self.draft, self.device
        slots = [s.slot for s in seqs]
        context = None if context_ids is None else uploads_for(device).ints(context_ids)

        clock, times = self.clock, self.times

        def topk_fn(hidden, k):
            t0 = clock()
            out = draft.topk(hidden, k, context)
            times.forward_s += clock() - t0
            return out

        def draft_fn(tok, feat, level, block_mask, offset):
            depth = torch.full(tok.shape, level, dtype=torch.long, device=device)
            t0 = clock()
            out = draft.forward(tok, feat, slots, depth, block_mask, offset)
            times.forward_s += clock() - t0
            return out

        roots = uploads_for(device).ints([s.root for s in seqs])
        graphs = self.draft_graphs
        if graphs is not None and graphs.draft is draft and graphs.fits(len(seqs), tree_cfg, context):
            t0 = clock()
            tree = graphs.grow(slots, root_hidden, roots, context, tree_cfg)
            times.forward_s += clock() - t0
            return tree
        return grow_tree(draft_fn, topk_fn, root_hidden, roots, tree_cfg)

    def decode_speculative(self, seqs: list[Sequence], tree_cfg: TreeConfig, verify_cap: int | None,
                           context: np.ndarray | None = None, chains: np.ndarray | None = None) -> list[SeqResult]:
        """Grow and verify the trees of sequences the head has caught up with (no pending pair left)."""
        return self.verify(seqs, self.draft_trees(seqs, tree_cfg, verify_cap, context, chains))

    def draft_trees(self, seqs: list[Sequence], tree_cfg: TreeConfig, verify_cap: int | None,
                    context: np.ndarray | None = None, chains: np.ndarray | None = None) -> Tree:
        """The trees of sequences the head has caught up with, drafted over ``context`` (``context_ids``) too,
        with ``chains`` (``lookup_ids``) grafted on and the batch's verify cap applied."""
        times, clock = self.times, self.clock
        t0 = clock()
        tree = self.grow_from(seqs, torch.stack([s.draft_hidden for s in seqs]), tree_cfg, context)
        if chains is not None and chains.shape[1] > 1:
            chains = uploads_for(self.device).ints(chains)
            tree = graft_chain(tree, chains[:, :-1], chains[:, -1])
        if verify_cap:
            tree = fit_batch_budget(tree, verify_cap)
        tree = drop_padding(tree)
        times.draft_s += clock() - t0
        times.verify_width = tree.tokens.shape[1]
        return tree

    def decode_plain(self, seqs: list[Sequence]) -> list[SeqResult]:
        """Verify every sequence's root only (speculative sequences keep collecting the head's pairs)."""
        return self.verify(seqs, self.root_trees(seqs))

    def root_trees(self, seqs: list[Sequence]) -> Tree:
        return root_only_tree(uploads_for(self.device).ints([s.root for s in seqs]))

    def grow_trees(self, seqs: list[Sequence], tree_cfg: TreeConfig) -> Tree:
        """Feed every pending pair, then grow every sequence's tree (what a speculative step does before it
        verifies; the tuner times it)."""
        self.draft_extend(seqs)
        return self.grow_from(seqs, torch.stack([s.draft_hidden for s in seqs]), tree_cfg, self.context_ids(seqs))

    def verify(self, seqs: list[Sequence], tree: Tree, n_valid: list[int] | None = None,
               traced: int | None = None) -> list[SeqResult]:
        """One target pass over every tree, acceptance, and the accepted path's K/V moved next to the prefix;
        speculative sequences queue the accepted tokens' (feature, token) pairs for the head. ``n_valid``: the
        columns each row may write (a plain row stacked beside trees writes its root only); ``traced``: how many
        leading rows are drafted trees a calibration trace records (the stacked plain rows are not)."""
        times, clock = self.times, self.clock
        target, device = self.target, self.device
        slots = [s.slot for s in seqs]
        collect = self.draft is not None and any(s.speculative for s in seqs)
        B, W = tree.tokens.shape
        t0 = clock()
        if collect:
            hidden, feats = self.target_forward(tree.tokens, slots, tree.depth, tree.ancestors, n_valid)
        else:
            hidden = target.forward(tree.tokens, slots, tree.depth, tree.ancestors, n_valid=n_valid)
        logits = target.logits(hidden)
        times.verify_s += clock() - t0
        times.forward_s += clock() - t0
        base = uploads_for(device).ints(target.cache.lengths[slots]).view(-1, 1)
        choice = choose_tokens(logits, SamplingBatch.of(seqs, device), base + tree.depth + 1)
        acc = accept(tree, choice)
        if self.trace is not None and W > 1:
            n = len(seqs) if traced is None else traced
            self.trace.record(rows_of(tree, n), acc.nodes[:n],
                              [(s.request_id, len(s.prompt_ids) + len(s.output_ids)) for s in seqs[:n]])
        A = acc.nodes.shape[1]
        # the one read back to the host: counts, bonus tokens, tree sizes and accepted tokens of every sequence
        packed = torch.cat([acc.count.view(B, 1), acc.bonus.view(B, 1), tree.size.view(B, 1),
                            tree.tokens.gather(1, acc.nodes)], dim=1).tolist()
        if A > 1:
            i = torch.arange(A, device=device).view(1, -1)
            src = acc.nodes + base
            target.cache.keep_accepted(slots, src, torch.where(i < acc.count.view(-1, 1), base + i, src))
        counts = [row[0] for row in packed]
        target.cache.lengths[slots] += counts
        if collect:
            accepted_feats = feats.gather(1, acc.nodes.unsqueeze(-1).expand(B, A, feats.shape[-1]))
        results = []
        for b, s in enumerate(seqs):
            c, bonus, size, path = packed[b][0], packed[b][1], packed[b][2], packed[b][3:]
            new = path[1:c] + [bonus]
            if collect and s.speculative:
                s.pending.add(new, accepted_feats[b, :c])
            results.append(SeqResult(s, new, c - 1, size))
        return results
