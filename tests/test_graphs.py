"""The target's decode passes through captured graphs (model/graphs.py), held on the CPU by the replay stand-in: the
static buffers, the bucket padding and the output's lifetime work as a CUDA graph's, and the tokens are the
target's own."""
import gc
import weakref

import pytest
import torch
from repo_scripts import load
from test_capture_safety import Uncapturable
from test_engine import mixed_prompts, reference_greedy
from tiny import make_target, save_target, tiny_engine

from eagle_ray.config import SamplingParams, TreeConfig
from eagle_ray.engine.engine import EagleEngine
from eagle_ray.engine.host_reads import count_host_reads
from eagle_ray.model.draft_graphs import DraftGraphs
from eagle_ray.model.graphs import BATCH_BUCKETS, KV_STEP, DecodeGraphs, batch_buckets, bucket, kv_buckets
from eagle_ray.model.target import TargetModel


def with_graphs(engine) -> DecodeGraphs:
    engine.target.graphs = DecodeGraphs(engine.target, engine.target.cache.num_slots, backend="replay")
    return engine.target.graphs


@pytest.mark.parametrize("speculative", [True, False], ids=["eagle", "plain"])
def test_graphed_decoding_gives_the_targets_greedy_tokens(tiny_dir, tiny_hf, tiny_head, speculative):
    engine = tiny_engine(tiny_dir, tiny_head, max_batch_size=3)
    graphs = with_graphs(engine)
    prompts = mixed_prompts(5, seed=3)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True), speculative=speculative)
    assert [o.token_ids for o in outs] == [reference_greedy(tiny_hf, p, 24) for p in prompts]
    assert graphs.replays >= 10
    # a pass over slots below 1, 2, 3 takes the batch bucket 1, 2 or 3 (the last bucket is the slot count: a graph's
    # rows are slots); plain blocks are one token wide, trees with lookup chains up to 24; one key-length bucket
    assert {(b, w, kv) for b, w, kv, _ in graphs.graphs} <= {(b, w, 256) for b in (1, 2, 3) for w in (1, 8, 16, 24)}


def test_graphs_are_captured_at_load_largest_batch_first_and_decoding_replays_them(tiny_dir, tiny_hf, tiny_head):
    """Before the first request every batch bucket has its graphs: the plain root's pass, the tree's verify widths
    (12 drafted tokens and up to 5 lookup tokens: buckets 16 and 24) and its draft loop; decoding short contexts
    then captures nothing more, and the tokens are the target's."""
    engine = tiny_engine(tiny_dir, tiny_head, max_batch_size=3)
    graphs = with_graphs(engine)
    drafts = engine.runner.draft_graphs = DraftGraphs(engine.draft, engine.target.cache.num_slots, backend="replay")
    assert engine.capture_graphs() == len(graphs.graphs) + len(drafts.graphs) == 3 * 3 + 3
    batches = [b for b, *_ in graphs.graphs]   # in the order captured
    assert batches == sorted(batches, reverse=True) and [b for b, *_ in drafts.graphs] == [4, 2, 1]
    assert set(graphs.graphs) == {(b, w, 256, False) for b in (1, 2, 3) for w in (1, 16, 24)}
    assert not engine.target.cache.lengths.any() and not engine.draft.cache.lengths.any()
    prompts = mixed_prompts(5, seed=3)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] == [reference_greedy(tiny_hf, p, 24) for p in prompts]
    assert len(graphs.graphs) == 9 and len(drafts.graphs) == 3 and graphs.replays and drafts.replays


@pytest.mark.parametrize("fused", [False, True], ids=["modules", "fused"])
def test_graphed_fused_and_eagle3_passes_give_the_targets_greedy_tokens(tmp_path, fused):
    """Fused layers (what CUDA runs) and an EAGLE-3 head, whose features come out of the same graph."""
    path = save_target(tmp_path, layers=7)
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = EagleEngine.from_pretrained(str(path), "random-eagle3", dtype="float32", max_batch_size=4,
                                         fused_layers=fused, cpu_linears="native",
                                         tree=TreeConfig(total_tokens=10, depth=3, top_k=3))
    graphs = with_graphs(engine)
    prompts = mixed_prompts(4, seed=8)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert [o.token_ids for o in outs] == [reference_greedy(hf, p, 20) for p in prompts]
    assert any(capture for *_, capture in graphs.graphs)


def target_with_graphs(slots=4, max_len=300):
    target = TargetModel(make_target(layers=2), slots, max_len, fp32_logits=False, fp32_activations=False,
                         batch_invariant=False, cpu_linears="native", fused_layers=True)
    target.graphs = DecodeGraphs(target, slots, backend="replay")
    return target


def tree_block(B, T):
    idx = torch.arange(T)
    return (idx.view(-1, 1) >= idx.view(1, -1)).expand(B, T, T), idx.expand(B, T)


def test_a_smaller_batch_in_a_graph_leaves_the_other_slots_alone():
    """Rows past the batch are padding: whatever a wider batch left in the buffers, they write nowhere real."""
    target = target_with_graphs()
    target.cache.lengths[:] = [5, 9, 7, 11]
    torch.manual_seed(0)
    target.cache.k.normal_()
    target.cache.v.normal_()
    mask, depth = tree_block(4, 3)
    target.forward(torch.randint(3, 60, (4, 3)), [0, 1, 2, 3], depth, mask)     # bucket 4, all rows real
    before = target.cache.kv[:, :, 3, :, : target.cache.max_len].clone()
    mask, depth = tree_block(3, 3)
    target.forward(torch.randint(3, 60, (3, 3)), [0, 1, 2], depth, mask)        # the same graph, row 3 padding
    assert torch.equal(target.cache.kv[:, :, 3, :, : target.cache.max_len], before)
    assert len(target.graphs.graphs) == 1


def test_graphed_outputs_equal_eager_and_the_replay_reads_nothing_back():
    eager, graphed = target_with_graphs(), target_with_graphs()
    eager.graphs = None
    for t in (eager, graphed):
        t.cache.lengths[:] = [5, 0, 7, 12]
    tokens = torch.randint(3, 60, (3, 5))
    mask, depth = tree_block(3, 5)
    want = eager.forward(tokens, [3, 0, 2], depth, mask, n_valid=[5, 2, 4])
    got = graphed.forward(tokens, [3, 0, 2], depth, mask, n_valid=[5, 2, 4])   # captured at (4, 8, 256)
    for row, n in enumerate([5, 2, 4]):
        torch.testing.assert_close(got[row, :n], want[row, :n], rtol=1e-5, atol=1e-5)
    entry = next(iter(graphed.graphs.graphs.values()))
    with torch.inference_mode(), count_host_reads() as reads, Uncapturable() as mode:
        entry.graph.replay()
    assert (reads.count, mode.seen) == (0, [])


def test_buckets():
    assert [bucket(n, BATCH_BUCKETS) for n in (1, 3, 5, 17, 33, 65, 257)] == [1, 4, 8, 24, 48, 96, None]
    assert batch_buckets(3) == (1, 2, 3) and batch_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert kv_buckets(2048) == [256, 512, 768, 1024, 1280, 1536, 1792, 2048, 2049]   # eager's grid on CUDA
    assert kv_buckets(100) == [101]


def test_cuda_graphs_refuse_a_cpu_target_and_flex_attention():
    target = TargetModel(make_target(layers=2), 2, 64, cpu_linears="native", fused_layers=True)
    with pytest.raises(ValueError, match="needs a CUDA target"):
        DecodeGraphs(target, 2)
    target.numerics = target.numerics.__class__(**{**target.numerics.__dict__, "tree_attention": "flex"})
    with pytest.raises(ValueError, match="tree_attention: sdpa"):
        DecodeGraphs(target, 2, backend="replay")


def with_draft_graphs(engine) -> DraftGraphs:
    engine.runner.draft_graphs = DraftGraphs(engine.draft, engine.target.cache.num_slots,
                                             engine.runner.context_vocab, backend="replay")
    return engine.runner.draft_graphs


@pytest.mark.parametrize("head", ["trained", "eagle3"])
def test_a_graphed_draft_loop_and_verify_give_the_targets_greedy_tokens(tiny_dir, tiny_hf, tiny_head, tmp_path, head):
    if head == "trained":
        engine, hf = tiny_engine(tiny_dir, tiny_head, max_batch_size=3), tiny_hf
    else:
        path = save_target(tmp_path, layers=7)
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        engine = EagleEngine.from_pretrained(str(path), "random-eagle3", dtype="float32", max_batch_size=3,
                                             tree=TreeConfig(total_tokens=10, depth=3, top_k=3))
    with_graphs(engine)
    drafts = with_draft_graphs(engine)
    prompts = mixed_prompts(5, seed=4)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] == [reference_greedy(hf, p, 24) for p in prompts]
    assert drafts.replays >= 5 and {b for b, *_ in drafts.graphs} <= {1, 2, 4}


def test_a_graphed_draft_loop_grows_the_eager_trees(tiny_dir, tiny_head):
    """At a batch that is its own bucket (no padding rows), the captured loop grows exactly the eager trees, eager
    reading key lengths on the graphs' grid (as on CUDA: a softmax over other key columns rounds other last bits)."""
    engine = tiny_engine(tiny_dir, tiny_head, max_batch_size=2)
    engine.draft.cache.kv_bucket = KV_STEP
    seqs = [engine.add_request(p, SamplingParams(max_new_tokens=40, ignore_eos=True)) for p in mixed_prompts(2, 6)]
    for _ in range(3):
        engine.step()
    runner, cfg = engine.runner, TreeConfig(total_tokens=12, depth=3, top_k=3)
    with torch.inference_mode():
        runner.draft_extend(seqs)   # the head takes every pending pair: both trees grow from here
    ready = seqs
    with torch.inference_mode():
        eager = runner.grow_from(ready, torch.stack([s.draft_hidden for s in ready]), cfg, None)
    with_draft_graphs(engine)
    for _ in range(2):   # the capture, then a replay
        with torch.inference_mode():
            graphed = runner.grow_from(ready, torch.stack([s.draft_hidden for s in ready]), cfg, None)
        for name in ("tokens", "parents", "depth", "valid", "ancestors", "scores"):
            assert torch.equal(getattr(graphed, name), getattr(eager, name)), name


@pytest.mark.parametrize("width", [1, 8], ids=["plain", "tree"])
def test_a_replayed_decode_pass_reads_the_keys_eager_attention_reads(width):
    """Rows in slots 0..B-1 with ragged lengths (bench/graph_reads.py): at batches 1, 8 and 32 a replayed pass reads
    as many bytes of the cache as eager attention (slices of it, key lengths on the same 256-column grid) and gathers
    none; a pass over scattered slots 0, 2, 5 reads the 8 slots of its bucket as one slice, where eager gathers."""
    rows = load("bench/graph_reads.py").measure(batches=(1, 8, 32), widths=(width,))
    assert [(r["case"], r["graph_bytes"] == r["eager_bytes"], r["graph_gathered"]) for r in rows] == [
        ("batch 1", True, 0), ("batch 8", True, 0), ("batch 32", True, 0), ("scattered 0,2,5", False, 0)]
    scattered = rows[-1]
    assert scattered["graph_key"][0] == 8 and scattered["eager_gathered"] > 0
    assert scattered["graph_bytes"] == 8 * scattered["eager_bytes"] // 3 // 2   # eager: 3 rows read twice


def test_deleting_an_engine_frees_its_kv_caches_without_a_garbage_collection(tiny_dir):
    """The target holds its graphs and nothing holds the target back (nor the head its draft graphs): with the
    collector off, ``del engine`` frees the target's and the head's KV caches at once."""
    engine = tiny_engine(tiny_dir, max_batch_size=2)
    with_graphs(engine)
    with_draft_graphs(engine)
    engine.generate(mixed_prompts(2, seed=2), SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert engine.target.graphs.replays and engine.runner.draft_graphs.replays
    caches = [weakref.ref(engine.target.cache.kv), weakref.ref(engine.draft.cache.kv)]
    gc.collect()
    gc.disable()
    try:
        del engine
        assert [cache() is None for cache in caches] == [True, True]
    finally:
        gc.enable()
