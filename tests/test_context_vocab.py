"""A sequence's context tokens join its draft vocabulary: the tokens kept per sequence, the top-k over the map and
those tokens together, and an engine whose drafts take them while its output stays the target's."""
import copy

import numpy as np
import torch
from test_engine import mixed_prompts, reference_greedy
from tiny import tiny_engine

from eagle_ray.config import SamplingParams, TreeConfig
from eagle_ray.speculative.context_vocab import ContextTokens, context_rows, context_topk


def outside_of(vocab: int, token_map: list[int]) -> np.ndarray:
    outside = np.ones(vocab, dtype=bool)
    outside[token_map] = False
    return outside


def test_a_sequence_keeps_its_newest_context_tokens_that_the_map_lacks():
    """Mapped tokens are skipped; a token seen again moves to the end; past the cap the oldest leaves; each update
    reads only what the sequence gained since the last one."""
    ctx = ContextTokens(outside_of(20, [0, 1, 2, 3]), cap=3)
    ctx.update([1, 5, 2, 6, 5], [])
    assert list(ctx.ids) == [6, 5]
    ctx.update([1, 5, 2, 6, 5], [7, 3])
    assert list(ctx.ids) == [6, 5, 7]
    ctx.update([1, 5, 2, 6, 5], [7, 3, 6, 9])
    assert list(ctx.ids) == [7, 6, 9] and ctx.read == 9
    assert ctx.array().tolist() == [7, 6, 9]
    empty = ContextTokens(outside_of(20, [0, 1, 2, 3]), cap=3)
    empty.update([0, 1], [2])
    assert context_rows([empty]) is None
    assert context_rows([ctx, empty]).tolist() == [[7, 6, 9], [-1, -1, -1]]


def test_topk_runs_over_the_map_and_each_sequences_context_tokens():
    """The same log-probs and ids as a softmax over the full vocabulary restricted to map + that row's context."""
    g = torch.Generator().manual_seed(0)
    V, d, B, R, k = 50, 8, 2, 3, 4
    weight = torch.randn(V, d, generator=g)
    token_map = torch.tensor([4, 9, 1, 30, 22, 7])
    context = torch.tensor([[40, 11, -1], [13, 45, 2]])
    hidden = torch.randn(B, R, d, generator=g)
    logp, ids = context_topk(hidden @ weight[token_map].T, hidden, weight, token_map, context, k)
    assert logp.shape == ids.shape == (B, R, k)
    for b in range(B):
        allowed = torch.zeros(V, dtype=torch.bool)
        allowed[token_map] = True
        allowed[context[b][context[b] >= 0]] = True
        ref = torch.log_softmax((hidden[b] @ weight.T).masked_fill(~allowed, float("-inf")), -1).topk(k, -1)
        assert torch.equal(ids[b], ref.indices)
        assert torch.allclose(logp[b], ref.values, atol=1e-5)
    flat_logp, flat_ids = context_topk(hidden[:, 0] @ weight[token_map].T, hidden[:, 0], weight, token_map,
                                       context, k)          # a tree's first level: one row per sequence
    assert torch.equal(flat_ids, ids[:, 0]) and torch.allclose(flat_logp, logp[:, 0])


def test_drafts_take_context_tokens_outside_the_map_and_output_stays_the_targets(tiny_dir, tiny_hf, tiny_head):
    """With a map of even ids, prompts of odd ids: the head proposes prompt tokens only with the context
    vocabulary on, and greedy output equals the target's either way."""
    from eagle_ray.engine.scheduler import PrefillChunk

    head = copy.deepcopy(tiny_head)
    head.token_map = torch.arange(2, 64, 2)
    prompts = [[(2 * t + 1) % 64 for t in p] for p in mixed_prompts(3, seed=7)]
    proposed = {}
    for cap in (0, 256):
        engine = tiny_engine(tiny_dir, head, TreeConfig(total_tokens=16, depth=3, top_k=4), max_batch_size=3)
        engine.runner.context_vocab = cap
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
        for out, prompt in zip(outs, prompts):
            assert out.token_ids == reference_greedy(tiny_hf, prompt, 24)
        seqs = [engine.make_sequence(p, SamplingParams(max_new_tokens=8)) for p in prompts]
        with torch.inference_mode():
            for slot, s in enumerate(seqs):
                s.slot = slot
            for r in engine.runner.prefill([PrefillChunk(s, 0, len(s.prompt_ids)) for s in seqs]):
                r.seq.append(r.tokens)
            tree = engine.runner.grow_trees(seqs, engine.config.speculation.tree)
        proposed[cap] = [set(tree.tokens[b, 1:].tolist()) for b in range(len(seqs))]
        for b, s in enumerate(seqs):
            assert proposed[cap][b] <= set(range(2, 64, 2)) | (set(s.prompt_ids + s.output_ids) if cap else set())
    assert any(p & {t for t in range(1, 64, 2)} for p in proposed[256])
