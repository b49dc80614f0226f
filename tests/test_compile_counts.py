"""How often the engine's compiled functions compile over the GPU script's shapes, counted on the CPU.

A function compiled by torch.compile compiles again for every dtype and static shape it meets, up to
``recompile_limit`` graphs, and past that runs uncompiled without a word. Here the very call sites the CUDA path
compiles (``model/kernels.py``'s RoPE and SwiGLU, flex tree attention through the target's forward) run with a
backend that counts each graph and computes nothing (a graph runs on fake tensors and returns zeros of its outputs'
shapes: what torch compiles depends on shapes and dtypes, never on values), over what bench/gpu_step.py runs: its
model shapes, batches 1, 8, 32 and 64, plain decoding (width 1) and the verify widths of the engine's default tree
and of the script's tree, bf16 for the timed sections and fp32 at the 1B shape for fidelity (whose prompt chunks
of 16-48 tokens also run flex). Every compile is guarded: a failed one is reported, per key, as a fallback.
"""
import warnings

import pytest
import torch
from repo_scripts import load
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.utils import _pytree
from transformers import LlamaConfig, LlamaForCausalLM

from eagle_ray.config import TreeConfig
from eagle_ray.engine.budgets import draft_budget, verify_budget
from eagle_ray.model.attention import make_block_meta
from eagle_ray.model import kernels
from eagle_ray.model.guarded_compile import RECOMPILE_LIMIT, GuardedCompile, compile_report
from eagle_ray.model.target import TargetModel
from eagle_ray.model.tree_attention import compiled_flex

gpu_step = load("bench/gpu_step.py")
BATCHES = (1, 8, 32, 64)
SLOTS = 64              # the script's engines hold max(batches) slots (fidelity's: 8)
TORCH_DEFAULT_LIMIT = 8


def decode_widths() -> list[int]:
    """Plain decoding, then every width the default tree and the script's tree verify."""
    trees = [TreeConfig(), TreeConfig(**gpu_step.EAGLE_TREE)]
    return [1] + sorted({w for t in trees for w in range(draft_budget(t), verify_budget(t) + 1)})


class ShapesOnly:
    """A torch.compile backend that counts graphs and computes nothing: a graph runs once per input signature on
    fake tensors, and each call returns empty tensors of its outputs' shapes. ``graphs``: each graph's tensor
    inputs' sizes (ints where static)."""

    def __init__(self):
        self.graphs: list[list[tuple]] = []

    def __call__(self, gm, example_inputs):
        self.graphs.append([tuple(int(d) if is_concrete_int(d) else d for d in n.meta["example_value"].shape)
                            for n in gm.graph.nodes
                            if n.op == "placeholder" and isinstance(n.meta.get("example_value"), torch.Tensor)])
        outputs = {}

        def run(*args):
            signature = tuple((a.shape, a.dtype) if isinstance(a, torch.Tensor) else a for a in args)
            if signature not in outputs:
                with FakeTensorMode() as mode:
                    out = gm(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
                outputs[signature] = _pytree.tree_map_only(torch.Tensor, lambda t: (t.shape, t.dtype), out)
            return _pytree.tree_map_only(tuple, lambda s: torch.empty(s[0], dtype=s[1]), outputs[signature],
                                         is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2
                                         and isinstance(x[1], torch.dtype))
        return run


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()   # no graph of another test counts against a limit here, none of ours stays
    yield
    torch._dynamo.reset()


def shape_of(name: str) -> dict:
    cfg = gpu_step.SHAPES[name]
    return {"heads": cfg["num_attention_heads"], "kv_heads": cfg["num_key_value_heads"],
            "head_dim": cfg["hidden_size"] // cfg["num_attention_heads"], "intermediate": cfg["intermediate_size"]}


# what the script compiles, in its order: step times per shape (8B first), then fidelity at 1B in fp32
RUNS = [("llama-3.1-8b", torch.bfloat16, SLOTS), ("llama-3.2-1b", torch.bfloat16, SLOTS),
        ("llama-3.2-1b", torch.float32, 8)]


def test_rope_and_swiglu_compile_a_few_graphs_per_dtype_over_the_gpu_scripts_shapes():
    counter = ShapesOnly()
    ops = kernels.compiled_ops(counter)
    for name, dtype, _ in RUNS:
        s = shape_of(name)
        H, Hkv, D = s["heads"], s["kv_heads"], s["head_dim"]
        for B in BATCHES:
            for T in decode_widths():
                qkv = torch.empty(B, T, H + 2 * Hkv, D, dtype=dtype)
                cos = torch.empty(B, T, 1, D, dtype=dtype)
                assert ops["rotary"](dtype, qkv, cos, cos, H, Hkv).shape == (B, H, T, D)
                assert ops["silu_mul"](dtype, torch.empty(B * T, 2 * s["intermediate"], dtype=dtype)).shape == (
                    B * T, s["intermediate"])
    # rows and widths of 1 are torch's own static cases (B = 1, T = 1, both, neither); the model's sizes are dynamic
    assert {name: dict(op.compiles) for name, op in ops.items()} == {
        "rotary": {"bfloat16": 4, "float32": 4}, "silu_mul": {"bfloat16": 2, "float32": 2}}
    assert all(op.status == {"bfloat16": "compiled", "float32": "compiled"} for op in ops.values())
    assert all(sum(op.compiles.values()) <= TORCH_DEFAULT_LIMIT < RECOMPILE_LIMIT for op in ops.values())
    assert torch._dynamo.config.recompile_limit >= RECOMPILE_LIMIT   # raised where the engine compiles


def target_for(name: str, dtype: torch.dtype, slots: int, attend) -> TargetModel:
    """A one-layer target with the shape's attention (heads, grouped kv heads, head dim) and a small rest."""
    s = shape_of(name)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                                      head_dim=s["head_dim"], max_position_embeddings=1024)).eval().to(dtype)
    target = TargetModel(hf, slots, 256, fp32_logits=False, fp32_activations=False, batch_invariant=False,
                         cpu_linears="native", fused_layers=True, tree_attention="flex")
    target.flex_attend = attend
    return target


def attend(target: TargetModel, B: int, T: int, gen: torch.Generator) -> None:
    """A layer's attention in a forward of ``B`` rows (slots 0..B-1, ragged lengths) ``T`` tokens wide, called where
    the target's forward calls it (its projections, which compile nothing, left out)."""
    target.cache.lengths[:] = 0
    target.cache.lengths[:B] = torch.randint(0, 200, (B,), generator=gen).numpy()
    idx = torch.arange(T)
    meta = make_block_meta(target.cache, list(range(B)), (idx.view(-1, 1) >= idx.view(1, -1)).expand(B, T, T))
    H, D = target.config.num_attention_heads, target.config.head_dim
    out = target.attention_of(meta, D ** -0.5)(torch.randn(B, H, T, D, generator=gen).to(target.dtype), 0)
    assert out.shape == (B, H, T, D)


def test_flex_compiles_twice_per_dtype_and_cache_shape_with_static_slots_and_heads():
    """The slots (flex's batch), heads, head dim and key length are static in every graph; only the width varies,
    and one graph serves every width above 1: two graphs per dtype and cache shape, whatever the batch."""
    counter = ShapesOnly()
    flex = compiled_flex(counter)
    gen = torch.Generator().manual_seed(0)
    for name, dtype, slots in RUNS:
        target = target_for(name, dtype, slots, flex)
        widths = decode_widths() + ([16, 24, 32, 40, 48] if dtype == torch.float32 else [])   # fidelity's prompts
        for B in (b for b in BATCHES if b <= slots):
            for T in widths:
                attend(target, B, T, gen)
    assert dict(flex.compiles) == {
        "bfloat16 slots=64 heads=32 kv_heads=8 head_dim=128 keys=257": 2,
        "bfloat16 slots=64 heads=32 kv_heads=8 head_dim=64 keys=257": 2,
        "float32 slots=8 heads=32 kv_heads=8 head_dim=64 keys=257": 2}
    assert set(flex.status.values()) == {"compiled"}
    assert sum(flex.compiles.values()) <= TORCH_DEFAULT_LIMIT < RECOMPILE_LIMIT
    for graph, (slots, D) in zip(counter.graphs, [(64, 128)] * 2 + [(64, 64)] * 2 + [(8, 64)] * 2):
        queries = [s for s in graph if len(s) == 4 and s[0] == slots and s[1] == 32 and s[3] == D]
        assert queries, graph   # the query [slots, heads, T, head_dim], its slots and heads static
        assert all(isinstance(s[0], int) for s in graph if s)   # every input's leading size (slots) static
    widths = [[q[2] for q in graph if len(q) == 4 and q[1] == 32][0] for graph in counter.graphs]
    assert [isinstance(w, int) for w in widths] == [True, False] * 3 and widths[::2] == [1, 1, 1]


def test_a_failed_compile_falls_back_for_its_key_only_and_says_so():
    """A first compile for a dtype that raises, and a later recompile (a new static shape) that raises, turn that
    dtype eager with a warning; the results are the eager function's and the other dtype stays compiled."""
    fail = {"dtype": torch.float32, "rows": None}

    def backend(gm, example_inputs):
        tensor = next(t for t in example_inputs if isinstance(t, torch.Tensor))
        if tensor.dtype == fail["dtype"] or tensor.shape[0] == fail["rows"]:
            raise RuntimeError("no kernel for this")
        return gm.forward

    double = GuardedCompile("double", lambda x: x * 2, backend, dynamic=False, fullgraph=True)
    x = torch.arange(6.0).view(3, 2)
    assert torch.equal(double(torch.bfloat16, x.bfloat16()), (x * 2).bfloat16())
    with pytest.warns(UserWarning, match=r"double \(float32\) runs eagerly: torch.compile failed"):
        assert torch.equal(double(torch.float32, x), x * 2)
    assert double.status == {"bfloat16": "compiled", "float32": "eager: torch.compile failed (RuntimeError: "
                                                                 "no kernel for this)"}
    fail["rows"] = 5   # dynamic=False: 5 rows are a new static shape, a recompile
    with pytest.warns(UserWarning, match=r"double \(bfloat16\) runs eagerly"):
        assert torch.equal(double(torch.bfloat16, torch.ones(5, 2, dtype=torch.bfloat16)),
                           torch.full((5, 2), 2.0, dtype=torch.bfloat16))
    assert double.status["bfloat16"].startswith("eager: torch.compile failed")
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a key that fell back warns once, and compiles no more
        assert torch.equal(double(torch.bfloat16, x.bfloat16()), (x * 2).bfloat16())
        assert torch.equal(double(torch.float32, x), x * 2)
    assert dict(double.compiles) == {"bfloat16": 2, "float32": 1}


def test_a_call_that_torch_leaves_uncompiled_at_the_recompile_limit_is_reported():
    double = GuardedCompile("double", lambda x: x * 2, "eager", dynamic=False, fullgraph=True)
    assert torch.equal(double(torch.float32, torch.ones(3)), torch.full((3,), 2.0))
    with torch._dynamo.config.patch(recompile_limit=1), pytest.warns(UserWarning, match="float64"):
        assert torch.equal(double(torch.float64, torch.ones(4, dtype=torch.float64)),
                           torch.full((4,), 2.0, dtype=torch.float64))
    assert double.status["float32"] == "compiled"
    assert double.status["float64"] in ("eager: torch.compile failed (FailOnRecompileLimitHit: Hard failure due to "
                                        "fullgraph=True)",   # fullgraph: torch raises
                                        "eager: torch.compile left it uncompiled (recompile limit reached?)")


def test_the_compile_report_lists_the_engines_compiled_functions():
    assert set(compile_report()) == {"rotary", "silu_mul", "flex_attention"}
