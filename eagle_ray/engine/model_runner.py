"""The model side of a step: runs the target and the draft head for a :class:`StepPlan` and returns tokens.

One step is: prompt chunks (one padded target pass) -> draft extend (the head consumes its pending pairs, in passes
bounded like prefill) -> draft (grow every sequence's tree, one batched head call per level) -> verify (one target
pass over all trees) -> accept -> keep the accepted path's K/V. Speculative and plain sequences verify in separate
passes (a plain step is the verification of a one-node tree). Phases hand each other typed values (``Tree``,
``Acceptance``, ``DecodeResult``); the sequences' state is updated by the scheduler side, not here, except for the
head's pending pairs, which belong to this side.

Everything runs batched over sequences; Python loops run over sequences (to pack ragged inputs and hand out
results), never over tree nodes, and a decode pass reads its results back to the host once.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from eagle_ray.config import TreeConfig, is_plain
from eagle_ray.engine.scheduler import PrefillChunk, StepPlan
from eagle_ray.engine.sequence import Sequence
from eagle_ray.model.device import Clock, resolve_times, uploads_for
from eagle_ray.model.draft_head import DraftHead
from eagle_ray.model.target import TargetModel
from eagle_ray.spec.accept import accept
from eagle_ray.spec.sampling import SamplingBatch, choose_tokens
from eagle_ray.spec.tree import Tree, drop_padding, fit_batch_budget, grow_tree


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
    verify_s: float = 0.0
    total_s: float = 0.0
    forward_s: float = 0.0        # inside model forwards: target verify + logits, head passes + scoring
    verify_width: int = 0         # columns of the speculative verify pass (B x width target tokens)
    tree_nodes: int = 0           # real tree nodes in it


@dataclass
class StepOutput:
    results: list[SeqResult] = field(default_factory=list)
    times: StepTimes = field(default_factory=StepTimes)
    decoded: dict[bool, int] = field(default_factory=dict)   # sequences per decode pass, by speculative


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


FEED_EVERY = 32  # pending pairs a sequence collects in plain steps before the head consumes them


def extend_passes(pending: list[int], budget: int) -> list[list[tuple[int, int]]]:
    """How the head consumes pending pairs in passes of at most ``budget`` padded tokens: per pass, (index into
    ``pending``, pairs taken). Shortest first, so a decode step's few pairs share one pass and a new prompt's
    thousands take the following ones."""
    left = {i: n for i, n in enumerate(pending) if n}
    todo, passes = list(left), []
    while todo:
        todo.sort(key=lambda i: left[i])
        group, width = [], 0
        for i in todo:
            w = max(width, min(left[i], budget))
            if group and (len(group) + 1) * w > budget:
                break
            group.append(i)
            width = w
        taken = [(i, min(left[i], width)) for i in group]
        for i, n in taken:
            left[i] -= n
        passes.append(taken)
        todo = [i for i in todo if left[i]]
    return passes


def extend_tokens(seqs: list[Sequence], taken: list[tuple[int, int]]) -> np.ndarray:
    """One extend pass's token block ``[G, width]`` (zero padded), read from the sequences' pending tokens."""
    width = max(n for _, n in taken)
    tokens = np.zeros((len(taken), width), dtype=np.int64)
    for row, (i, n) in enumerate(taken):
        tokens[row, :n] = seqs[i].draft_tokens[:n]
    return tokens


class ModelRunner:
    def __init__(self, target: TargetModel, draft: DraftHead | None, extend_budget: int):
        self.target, self.draft = target, draft
        self.device = target.device
        self.extend_budget = extend_budget
        self.profile = False
        self.clock, self.times = Clock(self.device), StepTimes()   # the running step's (see run)
        self.trace = None  # a TreeTrace recording verified trees (calibration, tuning); off by default

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
    def run(self, plan: StepPlan, tree_for, budget_for=lambda batch: None) -> StepOutput:
        """One step: ``tree_for(n)`` / ``budget_for(n)`` give the tree and the verify cap of a step with ``n``
        speculative sequences."""
        clock = self.clock = Clock(self.device, self.profile)
        out = StepOutput()
        self.times = out.times
        t0 = clock()
        if plan.prefill:
            out.results += self.prefill(plan.prefill)
        spec = [s for s in plan.decode if s.speculative and self.draft is not None]
        plain = [s for s in plan.decode if not (s.speculative and self.draft is not None)]
        self.stage_decode(spec, plain)
        if spec:
            out.results += self.decode_speculative(spec, tree_for(len(spec)), budget_for(len(spec)))
            out.decoded[True] = len(spec)
        if plain:
            out.results += self.decode_plain(plain)
            out.decoded[False] = len(plain)
        if self.draft is not None:  # prompts in progress: the head catches up on their chunks in bounded passes
            catching_up = [c.seq for c in plan.prefill if c.seq.speculative and c.seq.draft_tokens]
            if catching_up:
                t = clock()
                self.draft_extend(catching_up)
                out.times.draft_s += clock() - t
        out.times.total_s = clock() - t0
        uploads_for(self.device).clear()
        resolve_times(out.times)
        return out

    def stage_decode(self, spec: list[Sequence], plain: list[Sequence]) -> None:
        """Send the decode passes' small inputs to the device in one copy (see ``Uploads``): slots, target and head
        cache lengths, roots, the head's first extend pass, and the sampling rows."""
        arrays = []
        target_len, upload = self.target.cache.lengths, uploads_for(self.device)
        for seqs, speculative in ((spec, True), (plain, False)):
            if not seqs:
                continue
            slots = [s.slot for s in seqs]
            arrays += [slots, target_len[slots], [s.root for s in seqs]]
            if speculative:
                pending = [len(s.draft_tokens) for s in seqs]
                draft_len = self.draft.cache.lengths
                arrays.append(draft_len[slots] + pending)                  # where the tree levels sit
                passes = extend_passes(pending, self.extend_budget)
                if passes:
                    first = passes[0]
                    group = [seqs[i].slot for i, _ in first]
                    arrays += [group, draft_len[group], [n for _, n in first], extend_tokens(seqs, first)]
            sampled_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
            if sampled_rows:
                arrays += [upload.float_bits(SamplingBatch.params_of(seqs)), SamplingBatch.seeds_of(seqs),
                           sampled_rows]
        upload.stage(arrays)

    def target_forward(self, tokens, slots, depth, mask, n_valid=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's final hidden states and the features its head reads (the same tensor for an EAGLE-2
        head; the captured layer inputs of the same pass for an EAGLE-3 head)."""
        layers = getattr(self.draft, "feature_layers", None)
        if layers:
            return self.target.forward(tokens, slots, depth, mask, n_valid=n_valid, capture=layers)
        hidden = self.target.forward(tokens, slots, depth, mask, n_valid=n_valid)
        return hidden, hidden

    # ---- prefill -------------------------------------------------------------------------------------------------
    def prefill(self, chunks: list[PrefillChunk]) -> list[SeqResult]:
        """One padded pass over this step's prompt chunks; prompts that complete emit their first token."""
        times, clock = self.times, self.clock
        target, device = self.target, self.device
        n = [c.end - c.start for c in chunks]
        R, W = len(chunks), max(n)
        ids = torch.zeros(R, W, dtype=torch.long)
        for r, c in enumerate(chunks):
            ids[r, : n[r]] = torch.tensor(c.seq.prompt_ids[c.start:c.end])
        slots = [c.seq.slot for c in chunks]
        for c in chunks:
            if c.start == 0:
                self.reset_slot(c.seq.slot)
        t0 = clock()
        hidden, feats = self.target_forward(ids.to(device, non_blocking=True), slots,
                                            torch.arange(W, device=device).expand(R, W), causal_block(n, W, device),
                                            n_valid=n)
        done = [r for r, c in enumerate(chunks) if c.completes]
        first: list[int] = []
        if done:
            rows = torch.tensor(done, device=device)
            last = torch.tensor([n[r] - 1 for r in done], device=device)
            logits = target.logits(hidden[rows, last].unsqueeze(1))
            seqs = [chunks[r].seq for r in done]
            positions = torch.tensor([[len(s.prompt_ids)] for s in seqs], device=device)
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
                seq.add_pending(nxt, feats[r, : n[r]])
        return results

    # ---- speculative decoding --------------------------------------------------------------------------------------
    def draft_extend(self, seqs: list[Sequence]) -> None:
        """Feed every pending (feature, token) pair of ``seqs`` to the head, committing them to its cache, in passes
        of at most ``extend_budget`` padded tokens (a new prompt brings thousands of pairs, a decode step a few).
        Each sequence keeps the head's output at its last pair (``draft_hidden``): its next tree grows from it."""
        upload = uploads_for(self.device)
        for taken in extend_passes([len(s.draft_tokens) for s in seqs], self.extend_budget):
            group = [seqs[i] for i, _ in taken]
            n = [k for _, k in taken]
            width = max(n)
            tokens = upload.ints(extend_tokens(seqs, taken))
            feats = torch.zeros(len(group), width, self.draft.feature_size, dtype=group[0].draft_features.dtype,
                                device=self.device)
            for b, s in enumerate(group):
                feats[b, : n[b]] = s.take_pending(n[b])[1]
            slots = [s.slot for s in group]
            t0 = self.clock()
            hidden = self.draft.forward(tokens, feats, slots,
                                        torch.arange(width, device=self.device).expand(len(group), width),
                                        causal_block(n, width, self.device), n_valid=n)
            self.times.forward_s += self.clock() - t0
            self.draft.cache.lengths[slots] += n
            for b, s in enumerate(group):
                if not s.draft_tokens:
                    s.draft_hidden = hidden[b, n[b] - 1]

    def grow_from(self, seqs: list[Sequence], root_hidden: torch.Tensor, tree_cfg: TreeConfig) -> Tree:
        """Grow every sequence's tree from its root (one batched head call per level)."""
        draft, device = self.draft, self.device
        slots = [s.slot for s in seqs]

        clock, times = self.clock, self.times

        def topk_fn(hidden, k):
            t0 = clock()
            out = draft.topk(hidden, k)
            times.forward_s += clock() - t0
            return out

        def draft_fn(tok, feat, level, block_mask, offset):
            depth = torch.full(tok.shape, level, dtype=torch.long, device=device)
            t0 = clock()
            out = draft.forward(tok, feat, slots, depth, block_mask, offset)
            times.forward_s += clock() - t0
            return out

        roots = uploads_for(device).ints([s.root for s in seqs])
        return grow_tree(draft_fn, topk_fn, root_hidden, roots, tree_cfg)

    def grow_trees(self, seqs: list[Sequence], tree_cfg: TreeConfig) -> Tree:
        """Draft extend, then every sequence's tree (what a speculative step does before it verifies)."""
        self.draft_extend(seqs)
        return self.grow_from(seqs, torch.stack([s.draft_hidden for s in seqs]), tree_cfg)

    def decode_speculative(self, seqs: list[Sequence], tree_cfg: TreeConfig,
                           max_verify_tokens: int | None) -> list[SeqResult]:
        times, clock = self.times, self.clock
        if is_plain(tree_cfg) or (max_verify_tokens is not None and max_verify_tokens < 2 * len(seqs)):
            return self.decode_plain(seqs, keep_pairs=True)   # no room for a draft token: skip the drafting
        t0 = clock()
        tree = self.grow_trees(seqs, tree_cfg)
        if max_verify_tokens:
            tree = fit_batch_budget(tree, max_verify_tokens)
        tree = drop_padding(tree)
        times.draft_s += clock() - t0
        return self.verify(seqs, tree, speculative=True)

    def decode_plain(self, seqs: list[Sequence], keep_pairs: bool = False) -> list[SeqResult]:
        """Verify every sequence's root only. ``keep_pairs``: speculative sequences in a step whose tree is plain
        keep the head's (feature, token) pairs, fed to the head once a sequence holds ``FEED_EVERY`` (one bounded
        pass then serves many steps, and the pending features stay small)."""
        roots = uploads_for(self.device).ints([s.root for s in seqs])
        results = self.verify(seqs, root_only_tree(roots), speculative=keep_pairs)
        times, clock = self.times, self.clock
        full = [s for s in seqs if keep_pairs and len(s.draft_tokens) >= FEED_EVERY]
        if full:
            t = clock()
            self.draft_extend(full)
            times.draft_s += clock() - t
        return results

    def verify(self, seqs: list[Sequence], tree: Tree, speculative: bool) -> list[SeqResult]:
        """One target pass over every tree, acceptance, and the accepted path's K/V moved next to the prefix."""
        times, clock = self.times, self.clock
        target, device = self.target, self.device
        slots = [s.slot for s in seqs]
        B, W = tree.tokens.shape
        t0 = clock()
        if speculative:
            hidden, feats = self.target_forward(tree.tokens, slots, tree.depth, tree.ancestors)
        else:
            hidden = target.forward(tree.tokens, slots, tree.depth, tree.ancestors)
        logits = target.logits(hidden)
        times.verify_s += clock() - t0
        times.forward_s += clock() - t0
        base = uploads_for(device).ints(target.cache.lengths[slots]).view(-1, 1)
        choice = choose_tokens(logits, SamplingBatch.of(seqs, device), base + tree.depth + 1)
        acc = accept(tree, choice)
        if self.trace is not None and speculative:
            self.trace.record(tree, acc.nodes)
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
        if speculative:
            times.verify_width = W
            times.tree_nodes = sum(row[2] for row in packed)
            accepted_feats = feats.gather(1, acc.nodes.unsqueeze(-1).expand(B, A, feats.shape[-1]))
        results = []
        for b, s in enumerate(seqs):
            c, bonus, size, path = packed[b][0], packed[b][1], packed[b][2], packed[b][3:]
            new = path[1:c] + [bonus]
            if speculative:
                s.add_pending(new, accepted_feats[b, :c])
            results.append(SeqResult(s, new, c - 1, size))
        return results
