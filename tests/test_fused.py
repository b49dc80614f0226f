"""Fused decoder layers (model/fused.py): a layer in a third of the kernels, the same tokens.

Kernels are counted as the operations a layer dispatches (a ``TorchDispatchMode`` sees each one; views that copy
nothing are not kernels). On a GPU each is a launch, and launches, not work, set the time of a small-batch step."""
import collections

import pytest
import torch
from test_engine import mixed_prompts, reference_greedy
from tiny import make_target, save_target
from torch.utils._python_dispatch import TorchDispatchMode

from eagle_ray.config import SamplingParams, TreeConfig
from eagle_ray.engine.engine import EagleEngine
from eagle_ray.model import target as target_module
from eagle_ray.model.target import TargetModel

VIEWS = {"view", "reshape", "slice", "select", "transpose", "unsqueeze", "expand", "t", "permute", "alias", "detach",
         "as_strided", "_unsafe_view", "squeeze", "split", "chunk", "unbind", "split_with_sizes"}


class KernelCount(TorchDispatchMode):
    """Operations that run a kernel: every dispatched op but views that share their input's memory."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        first = out[0] if isinstance(out, (tuple, list)) else out
        shares = name in VIEWS and torch.is_tensor(first) and torch.is_tensor(args[0]) and \
            first.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr()
        if not shares:
            self.ops[name] += 1
        return out


def kernels_per_layer(monkeypatch, fused: bool, model_type: str = "llama") -> collections.Counter:
    """The kernels of the first layer of a verify pass of 2 sequences x 4 tree tokens, as a GPU runs it (model dtype
    activations, the modules' own linears)."""
    hf = make_target(layers=2, model_type=model_type)
    target = TargetModel(hf, 2, 64, fp32_logits=False, fp32_activations=False, batch_invariant=False,
                         cpu_linears="native", fused_layers=fused)
    owner, name = (target_module, "fused_decoder_layer") if fused else (target, "run_layer")
    layer_fn, counts = getattr(owner, name), []

    def counted(*args, **kwargs):
        with KernelCount() as c:
            out = layer_fn(*args, **kwargs)
        counts.append(c.ops)
        return out

    monkeypatch.setattr(owner, name, counted)
    idx = torch.arange(4)
    mask = (idx.view(-1, 1) >= idx.view(1, -1)).expand(2, 4, 4)
    with torch.inference_mode():
        target.forward(torch.randint(3, 60, (2, 4)), [0, 1], idx.expand(2, 4), mask)
    return counts[0]


def test_a_fused_layer_runs_in_at_most_12_kernels(monkeypatch):
    """A custom operation (model/kernels.py) counts one: on CUDA it is one generated kernel."""
    modules, fused = kernels_per_layer(monkeypatch, False), kernels_per_layer(monkeypatch, True)
    assert sum(modules.values()) >= 44
    assert sum(fused.values()) <= 12 and fused["linear"] + fused["addmm"] == 4   # q/k/v, o, gate/up, down
    assert fused["_fused_rms_norm"] == 2 and fused["scaled_dot_product_attention"] == 1
    assert fused["rotary"] == fused["silu_mul"] == fused["index_put_"] == 1   # keys and values in one scatter


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_biased_and_normed_projections_fuse_too(monkeypatch, model_type):
    assert sum(kernels_per_layer(monkeypatch, True, model_type).values()) <= 12 + 3 * (model_type == "qwen3")


@pytest.mark.parametrize("model_type, tree_attention", [("llama", "sdpa"), ("qwen2", "sdpa"), ("qwen3", "sdpa"),
                                                     ("llama", "flex")])
def test_fused_layers_give_the_targets_greedy_tokens_in_fp32(tmp_path, model_type, tree_attention):
    """Either attention of the fused layers: SDPA over the rows' keys, or flex over the cache as it lies."""
    path = save_target(tmp_path, model_type=model_type)
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = EagleEngine.from_pretrained(str(path), "random", dtype="float32", max_batch_size=3, fused_layers=True,
                                         cpu_linears="native", tree=TreeConfig(total_tokens=10, depth=3, top_k=3),
                                         tree_attention=tree_attention)
    assert engine.target.fused is not None and engine.target.numerics.tree_attention == tree_attention
    prompts = mixed_prompts(4, seed=2)
    for speculative in (True, False):
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True), speculative=speculative)
        assert [o.token_ids for o in outs] == [reference_greedy(hf, p, 24) for p in prompts]


def test_merged_weights_are_shared_with_the_modules_not_copied():
    hf = make_target(layers=2)
    before = sum(p.numel() for p in hf.parameters())
    target = TargetModel(hf, 1, 32, cpu_linears="native", fused_layers=True)
    layer, fused = target.layers[0], target.fused[0]
    assert layer.self_attn.k_proj.weight.data_ptr() == fused.qkv[fused.heads * fused.head_dim:].data_ptr()
    assert layer.mlp.up_proj.weight.untyped_storage().data_ptr() == fused.gate_up.untyped_storage().data_ptr()
    assert sum(p.numel() for p in hf.parameters()) == before


@pytest.mark.parametrize("fused", [False, True])
def test_a_steps_prompt_chunks_trees_and_plain_roots_run_in_one_target_pass(tmp_path, monkeypatch, fused):
    """Each weight is read once a step: prompt chunks, drafted trees and plain roots are blocks of one target pass,
    each attending over its own rows' keys; the tokens are the target's, on either layer path."""
    path = save_target(tmp_path)
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = EagleEngine.from_pretrained(str(path), "random", dtype="float32", max_batch_size=4, max_step_tokens=24,
                                         fused_layers=fused, cpu_linears="native",
                                         tree=TreeConfig(total_tokens=6, depth=3, top_k=2))
    assert engine.scheduler.one_pass
    passes, run_parts = [], engine.target.run_parts
    monkeypatch.setattr(engine.target, "run_parts", lambda blocks, capture=False: passes.append(
        [tuple(t.shape) for t, _, _ in blocks]) or run_parts(blocks, capture))
    prompts = mixed_prompts(3, seed=5) + [list(range(3, 63))]   # the last one's prompt takes several steps
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    seqs = [engine.add_request(p, params, speculative=i != 1) for i, p in enumerate(prompts[:3])]
    per_step = []
    while engine.has_unfinished():
        if engine.counters["decode_passes"] == 4 and len(seqs) == 3:   # mid-stream: a long prompt arrives
            seqs.append(engine.add_request(prompts[3], params))
        before = len(passes)
        engine.step()
        per_step.append(len(passes) - before)
    assert [engine.output(s).token_ids for s in seqs] == [reference_greedy(hf, p, 20) for p in prompts]
    assert set(per_step) == {1}                                      # one target pass a step
    joined = [p for p in passes if len(p) == 3]                      # a chunk, two trees, one plain root
    assert joined and all(p[0][0] == 1 and p[1][0] == 2 and p[2] == (1, 1) for p in joined)
