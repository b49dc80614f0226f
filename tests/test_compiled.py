"""The target's and the head's decoder layers trace into one graph each (``fullgraph=True``: a graph break fails),
one graph serving every layer of a shape, and give the eager engine's tokens in fp32, speculative and plain, for an
EAGLE-2 and an EAGLE-3 head. Tracing costs 20-70 s per engine on two CPU cores, so these run in the slow tier.
Inductor's own kernels are checked on the golden pair (tests/test_golden.py), whose compiled traces built them."""
import pytest
import torch

from eagle_ray.config import SamplingParams, TreeConfig
from eagle_ray.engine.engine import EagleEngine
from eagle_ray.model.compiled import compile_forwards
from tiny import save_target

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17], [20, 21]]
PARAMS = SamplingParams(max_new_tokens=24, ignore_eos=True)
TREE = TreeConfig(total_tokens=10, depth=3, top_k=3)


def outputs(engine, speculative=True):
    return [o.token_ids for o in engine.generate(PROMPTS, PARAMS, speculative=speculative)]


def compiled_engine(target_dir, head, backend):
    torch._dynamo.reset()
    engine = EagleEngine.from_pretrained(str(target_dir), head, dtype="float32", max_batch_size=4, tree=TREE,
                                         cpu_linears="input_major")   # what model.compile chooses on CPU
    eager = (outputs(engine), outputs(engine, speculative=False))
    compile_forwards(engine.target, engine.draft, "inductor", backend=backend)
    return engine, eager


@pytest.mark.slow
@pytest.mark.parametrize("head", ["random", "random-eagle3"])
def test_traced_forwards_have_no_graph_break_and_match_eager(tiny_dir, tmp_path, head):
    target = tiny_dir if head == "random" else save_target(tmp_path, layers=8, seed=3)  # EAGLE-3 reads 3 layers
    engine, (spec, plain) = compiled_engine(target, head, backend="aot_eager")
    assert outputs(engine) == spec
    assert outputs(engine, speculative=False) == plain


@pytest.mark.slow
def test_one_graph_serves_every_layer_so_a_deeper_target_compiles_no_more(tmp_path):
    """Graphs traced (Dynamo's, run eagerly by a counting backend) for the same plain decoding (its pass shapes do
    not depend on the tokens) on a 2- and an 8-layer target: as many, of as many operations, since each layer runs
    on its own LayerCache and the graph holds no layer index (a graph of the whole forward grows with the depth)."""
    from torch._dynamo.testing import CompileCounter
    graphs = []
    for layers in (2, 8):
        torch._dynamo.reset()
        engine = EagleEngine.from_pretrained(str(save_target(tmp_path / f"l{layers}", layers=layers)), "random",
                                             dtype="float32", max_batch_size=4, tree=TREE, cpu_linears="input_major")
        counter = CompileCounter()
        compile_forwards(engine.target, engine.draft, "inductor", backend=counter)
        outputs(engine, speculative=False)
        graphs.append((counter.frame_count, counter.op_count))
    assert graphs[0] == graphs[1] and graphs[0][0] > 0, graphs


def test_compiling_refuses_packed_weights_and_the_engine_avoids_them(tiny_dir):
    engine = EagleEngine.from_pretrained(str(tiny_dir), "random", dtype="float32", max_batch_size=2, tree=TREE)
    assert engine.target.numerics.cpu_linears == "packed"   # fp32 on CPU
    with pytest.raises(ValueError, match="cpu_linears"):
        compile_forwards(engine.target, engine.draft, "inductor")
    compiled = EagleEngine.from_pretrained(str(tiny_dir), "random", dtype="float32", max_batch_size=2, tree=TREE,
                                           compile="inductor")   # traced lazily: nothing compiles here
    assert compiled.target.numerics.cpu_linears == "input_major"


def test_cuda_graph_mode_buckets_key_lengths_without_changing_tokens(tiny_dir):
    engine = EagleEngine.from_pretrained(str(tiny_dir), "random", dtype="float32", max_batch_size=4, tree=TREE)
    spec = outputs(engine)
    engine.target.cache.kv_bucket = engine.draft.cache.kv_bucket = 256   # what cuda-graphs sets, eager here
    assert outputs(engine) == spec
