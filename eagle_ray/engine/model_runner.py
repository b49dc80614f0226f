"""The model side of a step: runs the target and the draft head for a finished :class:`StepPlan` and returns tokens.

One step is: feed the head (the plan's passes over pending pairs) -> draft (grow the trees of the plan's drafted
sequences, one batched head call per level) -> one target pass over the prompt chunks, the trees and the roots of
the rest (``target_pass``: each weight read once, each block attending over its own rows) -> accept -> keep the
accepted path's K/V. A plain step is the verification of a one-node tree. Where the plan keeps them apart
(``StepPlan.one_pass`` off), prompt chunks run first in a pass of their own and the head takes their pairs in the
same step. Phases hand each other typed values (``Tree``, ``Acceptance``, ``SeqResult``); the
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
from eagle_ray.engine.scoring import logprob_k, prompt_rows
from eagle_ray.engine.sequence import Sequence
from eagle_ray.engine.clock import Clock, resolve_times
from eagle_ray.uploads import Uploads, uploads_for
from eagle_ray.model.draft_head import DraftHead
from eagle_ray.model.numerics import defaults_for
from eagle_ray.model.target import TargetModel
from eagle_ray.speculative.accept import accept
from eagle_ray.speculative.context_vocab import ContextTokens, context_rows
from eagle_ray.speculative.grammar import mask_logits, prune_tree
from eagle_ray.speculative.logprobs import TokenLogprobs, packed, unpack, width
from eagle_ray.speculative.lookup import TokenHistory, lookup_rows
from eagle_ray.speculative.penalties import PenaltyBatch, apply_penalties
from eagle_ray.speculative.sampling import SamplingBatch, choose_tokens
from eagle_ray.speculative.token_masks import TokenMaskBatch, apply_token_masks
from eagle_ray.speculative.tree import (Tree, drop_padding, fit_batch_budget, graft_chain, grow_tree, rows_of,
                                        select_rows, size_order, split_by_size, stack_trees)


@dataclass
class SeqResult:
    """What one sequence got from a step."""
    seq: Sequence
    tokens: list[int]             # emitted: accepted drafts + bonus token, or a prompt's first token
    accepted: int = 0             # accepted draft tokens
    tree_size: int = 0            # verified tree nodes, root included (0: a prefill)
    logprobs: TokenLogprobs | None = None   # of ``tokens``, where the sequence asks for them


@dataclass
class StepTimes:
    prefill_s: float = 0.0
    draft_s: float = 0.0
    extend_s: float = 0.0         # of draft_s: the head taking pending pairs (speculation's catch-up)
    verify_s: float = 0.0
    total_s: float = 0.0
    forward_s: float = 0.0        # inside model forwards: target verify + logits, head passes + scoring
    verify_tokens: int = 0        # target tokens the drafted trees' verify blocks hold, padding included
    tree_nodes: int = 0           # real nodes the speculative sequences verified (a root alone in a plain step)


@dataclass
class StepOutput:
    results: list[SeqResult] = field(default_factory=list)
    times: StepTimes = field(default_factory=StepTimes)
    decoded: dict[bool, int] = field(default_factory=dict)   # sequences per decode pass, by drafted or not
    sampled: bool = False    # StepPlan.sampled: the decode rows ran one mode (a sample for SpeculationChooser)
    steady: bool = False     # StepPlan.steady: a whole decode-only step of one mode


@dataclass
class VerifyBlock:
    """Sequences whose trees one block of a target pass verifies (a plain sequence's tree is its root)."""
    seqs: list[Sequence]
    tree: Tree
    n_valid: list[int] | None = None   # columns each row may write (plain roots stacked beside trees: 1)
    traced: int | None = None          # leading rows that are drafted trees (what a calibration trace records)


@dataclass
class PrefillBlock:
    """A step's prompt chunks as one block of a target pass: ``R`` rows padded to the longest chunk."""
    chunks: list[PrefillChunk]
    n: list[int]                        # tokens of each chunk
    done: list[int]                     # rows whose prompt completes (they emit a first token)

    @property
    def width(self) -> int:
        return max(self.n)

    @property
    def slots(self) -> list[int]:
        return [c.seq.slot for c in self.chunks]


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
        self.clock, self.times = Clock(self.device), StepTimes()   # the running step's (see run)
        self.trace = None  # a TreeTrace recording verified trees (calibration, tuning); off by default
        self.draft_graphs = None   # DraftGraphs (model/draft_graphs.py) where compile is cuda-graphs

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
        ready, plain, tree_cfg = plan.drafted, plan.plain, plan.tree
        if plan.prefill and not plan.joined:
            out.results += self.prefill(plan.prefill)
        prefill = self.prefill_block(plan.prefill) if plan.joined else None
        context = self.context_ids(ready) if ready else None
        chains = self.lookup_ids(ready, tree_cfg) if ready and tree_cfg.lookup else None
        self.stage_decode(ready, plain, plan.feed, plan.passes, context, chains,
                          self.prefill_arrays(prefill) if prefill else ())
        if plan.passes:
            t = clock()
            self.draft_extend(plan.feed, plan.passes)
            out.times.extend_s = clock() - t
            out.times.draft_s += out.times.extend_s
        tree = self.draft_trees(ready, tree_cfg, plan.verify_cap, context, chains) if ready else None
        if tree is not None and any(s.guide is not None for s in ready):   # structured output: forbidden nodes go
            tree = prune_tree(tree, ready)
        if ready and plain and self.stacks_for_graph(prefill, len(ready) + len(plain), tree.tokens.shape[1]):
            W = tree.tokens.shape[1]
            blocks = [VerifyBlock(ready + plain, stack_trees(tree, self.root_trees(plain)),
                                  [W] * len(ready) + [1] * len(plain), len(ready))]
            out.times.verify_tokens = len(ready) * W
        else:
            blocks = self.verify_blocks(ready, tree, plan.one_pass) if ready else []
            out.times.verify_tokens = sum(len(b.seqs) * b.tree.tokens.shape[1] for b in blocks)
            blocks += [VerifyBlock(plain, self.root_trees(plain))] if plain else []
        if plan.one_pass and (prefill or blocks):
            out.results += self.target_pass(prefill, blocks)
        else:
            for block in blocks:
                out.results += self.target_pass(None, [block])
        out.decoded.update({mode: len(seqs) for mode, seqs in ((True, ready), (False, plain)) if seqs})
        out.times.tree_nodes = sum(r.tree_size for r in out.results if r.seq.speculative)
        out.times.total_s = clock() - t0
        uploads_for(self.device).clear()
        resolve_times(out.times)
        return out

    def verify_blocks(self, seqs: list[Sequence], tree: Tree, one_pass: bool) -> list[VerifyBlock]:
        """The drafted trees' verify blocks: one; or, on a device whose table says so (``verify_block_tokens``: a
        padding row costs a verified token's compute there) and in a step whose blocks share one pass, blocks of
        their own widths where the trees' sizes differ enough (``split_by_size``). Not while a trace records the
        step's trees as one block, nor with captured graphs (they replay one width)."""
        block_tokens = defaults_for(self.device).verify_block_tokens
        if not (one_pass and tree.padded and len(seqs) > 1 and self.trace is None and self.target.graphs is None
                and block_tokens is not None):
            return [VerifyBlock(seqs, tree)]
        sizes = tree.size.tolist()
        groups = split_by_size(sizes, block_tokens)
        if len(groups) == 1:
            return [VerifyBlock(seqs, tree)]
        rows, order = sorted(range(len(seqs)), key=lambda i: -sizes[i]), size_order(tree)   # the same order
        blocks, start = [], 0
        for n, width in groups:
            blocks.append(VerifyBlock([seqs[i] for i in rows[start:start + n]],
                                      select_rows(tree, order[start:start + n], width)))
            start += n
        return blocks

    def stacks_for_graph(self, prefill: PrefillBlock | None, rows: int, width: int) -> bool:
        """Whether a decode-only step's drafted and plain rows go in one block, the plain roots padded to the trees'
        width: so that one captured graph replays it (``model/graphs.py``), where the padded block fits the step's
        workspace. Without graphs they are two blocks of one pass."""
        return prefill is None and self.target.graphs is not None and rows * width <= self.extend_budget

    def target_pass(self, prefill: PrefillBlock | None, blocks: list[VerifyBlock]) -> list[SeqResult]:
        """One target pass over a step's prompt chunks (``prefill``, if any) and verify ``blocks``, each weight read
        once; then each block's acceptance, and the prompts' first tokens. The pass's seconds are split between
        prefill and verify by their tokens (the measured choice times decode rows without the prompt chunks)."""
        times, clock = self.times, self.clock
        seqs = [s for b in blocks for s in b.seqs] + ([c.seq for c in prefill.chunks] if prefill else [])
        collect = self.draft is not None and any(s.speculative for s in seqs)
        forwards = [] if prefill is None else [self.prefill_inputs(prefill)]
        forwards += [(b.tree.tokens, [s.slot for s in b.seqs], b.tree.depth, b.tree.ancestors, b.n_valid)
                     for b in blocks]
        t0 = clock()
        outs = self.target_forward_parts(forwards, collect, graphed=prefill is None)
        seconds = clock() - t0
        share = forwards[0][0].numel() / sum(f[0].numel() for f in forwards) if prefill else 0.0
        times.prefill_s += seconds * share
        times.verify_s += seconds * (1 - share)
        times.forward_s += seconds * (1 - share)
        results = self.finish_prefill(prefill, *outs.pop(0)) if prefill else []
        for block, (hidden, feats) in zip(blocks, outs):   # features gathered where a block's sequences feed a head
            fed = collect and any(s.speculative for s in block.seqs)
            results += self.accept(block, hidden, feats if fed else None)
        return results

    def target_forward_parts(self, forwards, collect: bool, graphed: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``TargetModel.forward_parts`` of ``forwards``: per block, the final hidden states and the features the head
        reads (the same tensor for an EAGLE-2 head; an EAGLE-3 head's captured layer inputs where ``collect``)."""
        layers = getattr(self.draft, "feature_layers", None) if collect else None
        outs = self.target.forward_parts(forwards, capture=layers or None, graphed=graphed)
        return outs if layers else [(hidden, hidden) for hidden in outs]

    def prefill_block(self, chunks: list[PrefillChunk]) -> PrefillBlock:
        """The step's prompt chunks as a block; prompts that start here get their slots emptied first."""
        for c in chunks:
            if c.start == 0:
                self.reset_slot(c.seq.slot)
        return PrefillBlock(chunks, [c.end - c.start for c in chunks], [r for r, c in enumerate(chunks) if c.completes])

    def prefill_arrays(self, block: PrefillBlock) -> list:
        """The prefill's small inputs, staged with the step's others (see ``Uploads``): the prompt block, the slots
        and their lengths, and for the prompts that complete, their last rows, positions and sampling rows."""
        slots, n, done = block.slots, block.n, block.done
        seqs = [block.chunks[r].seq for r in done]
        arrays = [prompt_block(block.chunks, block.width), slots, self.target.cache.lengths[slots], n]
        if done:
            arrays += [done, [n[r] - 1 for r in done], [[len(s.prompt_ids)] for s in seqs]]
            if any(not s.params.greedy for s in seqs):
                arrays += [Uploads.float_bits(SamplingBatch.params_of(seqs)), SamplingBatch.seeds_of(seqs)]
            arrays += self.logit_arrays(seqs)
        scored = prompt_rows(block.chunks)
        return arrays + (scored.arrays() if scored else [])

    def prefill_inputs(self, block: PrefillBlock) -> tuple:
        """The prefill block as ``TargetModel.forward`` takes it: causal rows, padding past each chunk."""
        R, W, device = len(block.chunks), block.width, self.device
        return (uploads_for(device).ints(prompt_block(block.chunks, W)), block.slots,
                torch.arange(W, device=device).expand(R, W), causal_block(block.n, W, device), block.n)

    def stage_decode(self, ready: list[Sequence], plain: list[Sequence], feed: list[Sequence], passes,
                     context: np.ndarray | None = None, chains: np.ndarray | None = None, prefill=()) -> None:
        """Send the step's small inputs to the device in one copy (see ``Uploads``): slots, target and head cache
        lengths, roots, the head's first pass, the ready sequences' context tokens (``context_ids``) and lookup
        chains (``lookup_ids``), the sampling rows, and ``prefill`` (``prefill_arrays``) where the prompt chunks
        join the decode rows' pass."""
        arrays = list(prefill)
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
            arrays += self.logit_arrays(seqs)
        upload.stage(arrays)

    def logit_arrays(self, seqs: list[Sequence]) -> list:
        """The host arrays ``processed_logits`` reads for ``seqs``: their token masks and penalties."""
        vocab = self.target.vocab_size
        return TokenMaskBatch.arrays_of(seqs, vocab) + PenaltyBatch.arrays_of(seqs, vocab)

    # ---- prefill -------------------------------------------------------------------------------------------------
    def prefill(self, chunks: list[PrefillChunk]) -> list[SeqResult]:
        """One padded pass over this step's prompt chunks alone; prompts that complete emit their first token."""
        block = self.prefill_block(chunks)
        uploads_for(self.device).stage(self.prefill_arrays(block))
        t0 = self.clock()
        hidden, feats = self.target_forward_parts([self.prefill_inputs(block)], self.draft is not None,
                                                  graphed=False)[0]
        self.times.prefill_s += self.clock() - t0
        return self.finish_prefill(block, hidden, feats)

    def finish_prefill(self, block: PrefillBlock, hidden: torch.Tensor, feats: torch.Tensor) -> list[SeqResult]:
        """After the prefill block's pass: the completed prompts' first tokens (with their log-probabilities where
        asked), the scored prompt tokens' log-probabilities (``engine/scoring.py``), all in one read; the chunks
        committed, and the speculative sequences' (feature, token) pairs queued for the head."""
        chunks, n, done, slots = block.chunks, block.n, block.done, block.slots
        t0 = self.clock()
        reads, k, scored = [], None, prompt_rows(chunks)
        if done:
            seqs = [chunks[r].seq for r in done]
            upload = uploads_for(self.device)
            rows, last = upload.ints(done), upload.ints([n[r] - 1 for r in done])
            raw = self.target.logits(hidden[rows, last].unsqueeze(1))
            logits = self.processed_logits(raw, seqs)   # a new tensor: log-probabilities read the raw ones
            positions = upload.ints([[len(s.prompt_ids)] for s in seqs])
            chosen = choose_tokens(logits, SamplingBatch.of(seqs, self.device), positions)
            k = logprob_k(seqs)
            reads.append(chosen if k is None else torch.cat([chosen, packed(raw[:, 0], chosen[:, 0], k)], 1))
        if scored is not None:
            reads.append(scored.packed(self.target, hidden))
        values = torch.cat([r.reshape(-1) for r in reads]).tolist() if reads else []
        w = 1 + (0 if k is None else width(k))
        first = values[: len(done) * w]
        if scored is not None:
            scored.attach(values[len(done) * w:])
        self.times.prefill_s += self.clock() - t0
        self.target.cache.lengths[slots] += n
        results, j = [], 0
        for r, c in enumerate(chunks):
            seq = c.seq
            seq.prefilled = c.end
            nxt = seq.prompt_ids[c.start + 1:c.end]
            if c.completes:
                token = first[j * w]
                nxt.append(token)
                logprobs = unpack([first[j * w + 1: (j + 1) * w]], k)[0] if k is not None and seq.logprobs is not None \
                    else None
                results.append(SeqResult(seq, [token], logprobs=logprobs))
                j += 1
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
                s.history = TokenHistory(s.prediction)
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
        return tree

    def root_trees(self, seqs: list[Sequence]) -> Tree:
        return root_only_tree(uploads_for(self.device).ints([s.root for s in seqs]))

    def grow_trees(self, seqs: list[Sequence], tree_cfg: TreeConfig) -> Tree:
        """Feed every pending pair, then grow every sequence's tree (what a speculative step does before it
        verifies; the tuner times it)."""
        self.draft_extend(seqs)
        return self.grow_from(seqs, torch.stack([s.draft_hidden for s in seqs]), tree_cfg, self.context_ids(seqs))

    def processed_logits(self, logits: torch.Tensor, seqs: list[Sequence], tree: Tree | None = None) -> torch.Tensor:
        """The logits the target's choice is taken from: each constrained sequence's grammar masks, its allowed
        tokens and the stop tokens ``min_tokens`` bars at each node, then logit bias and penalties with each node's
        path counted (``speculative/grammar.py``, ``token_masks.py``, ``penalties.py``). A new tensor where any
        applies; the raw logits are left as they were."""
        logits = mask_logits(logits, seqs)
        masks = TokenMaskBatch.of(seqs, self.target.vocab_size, self.device)
        if masks is not None:
            logits = apply_token_masks(logits, masks, tree)
        penalties = PenaltyBatch.of(seqs, self.target.vocab_size, self.device)
        if penalties is not None:
            logits = apply_penalties(logits, penalties, *((tree.tokens, tree.ancestors) if tree is not None else ()))
        return logits

    def accept(self, block: VerifyBlock, hidden: torch.Tensor, feats: torch.Tensor | None) -> list[SeqResult]:
        """A verify block's acceptance from its rows' final hidden states, and the accepted path's K/V moved next
        to the prefix; speculative sequences queue the accepted tokens' (feature, token) pairs (``feats``) for the
        head."""
        times, clock = self.times, self.clock
        target, device = self.target, self.device
        seqs, tree, traced = block.seqs, block.tree, block.traced
        slots = [s.slot for s in seqs]
        collect = feats is not None
        B, W = tree.tokens.shape
        t0 = clock()
        raw = target.logits(hidden)
        times.verify_s += clock() - t0
        times.forward_s += clock() - t0
        base = uploads_for(device).ints(target.cache.lengths[slots]).view(-1, 1)
        logits = self.processed_logits(raw, seqs, tree)   # a new tensor: log-probabilities read the raw ones
        choice = choose_tokens(logits, SamplingBatch.of(seqs, device), base + tree.depth + 1)
        acc = accept(tree, choice)
        if self.trace is not None and W > 1:
            n = len(seqs) if traced is None else traced
            self.trace.record(rows_of(tree, n), acc.nodes[:n],
                              [(s.request_id, len(s.prompt_ids) + len(s.output_ids)) for s in seqs[:n]])
        A = acc.nodes.shape[1]
        # the one read back to the host: counts, bonus tokens, tree sizes and accepted tokens of every sequence,
        # and where asked, each emitted token's raw log-probabilities from its parent's row (speculative/logprobs.py)
        parts = [acc.count.view(B, 1), acc.bonus.view(B, 1), tree.size.view(B, 1), tree.tokens.gather(1, acc.nodes)]
        k = logprob_k(seqs)
        if k is not None:
            rows = raw.gather(1, acc.nodes.unsqueeze(-1).expand(B, A, raw.shape[-1]))
            parts.append(packed(rows, choice.gather(1, acc.nodes), k).view(B, -1))
        read = torch.cat(parts, dim=1).tolist()
        if A > 1:
            i = torch.arange(A, device=device).view(1, -1)
            src = acc.nodes + base
            target.cache.keep_accepted(slots, src, torch.where(i < acc.count.view(-1, 1), base + i, src))
        counts = [row[0] for row in read]
        target.cache.lengths[slots] += counts
        if collect:
            accepted_feats = feats.gather(1, acc.nodes.unsqueeze(-1).expand(B, A, feats.shape[-1]))
        results = []
        for b, s in enumerate(seqs):
            c, bonus, size, path = read[b][0], read[b][1], read[b][2], read[b][3:3 + A]
            new = path[1:c] + [bonus]
            if collect and s.speculative:
                s.pending.add(new, accepted_feats[b, :c])
            logprobs = unpack([read[b][3 + A: 3 + A + c * width(k)]], k)[0] if k is not None and s.logprobs is not None \
                else None
            results.append(SeqResult(s, new, c - 1, size, logprobs))
        return results
