"""The target's verify forward and a draft level trace into one graph each (``fullgraph=True``: a graph break
fails) and give the eager engine's tokens in fp32, speculative and plain, for an EAGLE-2 and an EAGLE-3 head.
Tracing costs about a minute per engine on two CPU cores, so these run in the slow tier."""
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
def test_inductor_kernels_match_eager(tiny_dir):
    engine, (spec, plain) = compiled_engine(tiny_dir, "random", backend="inductor")
    assert outputs(engine) == spec
    assert outputs(engine, speculative=False) == plain


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
