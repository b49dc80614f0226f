"""What the GPU step needs from the engine, checked on the CPU: shapes that stop growing, and the device script that
measures a GPU step running end to end at a tiny shape.

A kernel specialised to a shape (cuDNN attention builds a graph per key length; a captured CUDA graph replays one
shape) pays its build at every new shape. Key lengths are rounded up to ``kv_bucket`` columns (masked) on CUDA, so
over a long run the target's forwards take as many shapes as buckets, not as many as steps."""
import json
import math

import pytest
from repo_scripts import load

from eagle_ray.config import SamplingParams, TreeConfig
from eagle_ray.engine.engine import EagleEngine
from eagle_ray.model.numerics import DEVICE_DEFAULTS

TREE = TreeConfig(total_tokens=8, depth=2, top_k=3, lookup=0)   # a fixed width: 8 verify tokens every step


def target_shapes(tiny_dir, kv_bucket: int, speculative: bool, steps: int = 500, prompt: int = 20) -> set:
    """(batch, tokens, key length) of every target forward after the prompt, over ``steps`` tokens."""
    engine = EagleEngine.from_pretrained(str(tiny_dir), "random", dtype="float32", max_batch_size=1,
                                         max_model_len=1024, tree=TREE)
    engine.target.cache.kv_bucket = engine.draft.cache.kv_bucket = kv_bucket
    with load("bench/gpu_step.py").decode_shapes(engine) as shapes:
        engine.generate([list(range(3, 3 + prompt))], SamplingParams(max_new_tokens=steps, ignore_eos=True),
                        speculative=speculative)
    return shapes


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "eagle"])
def test_over_500_steps_the_target_takes_one_shape_per_key_length_bucket(tiny_dir, speculative):
    bucket = DEVICE_DEFAULTS["cuda"].kv_bucket
    shapes = target_shapes(tiny_dir, bucket, speculative)
    widths = {t for _, t, _ in shapes}
    assert widths == ({8} if speculative else {1})
    buckets = {kv for _, _, kv in shapes}
    assert all(kv % bucket == 0 for kv in buckets) and len(shapes) == len(buckets) <= math.ceil((20 + 500 + 8) / bucket)


def test_without_buckets_every_step_is_a_new_shape(tiny_dir):
    assert len(target_shapes(tiny_dir, 1, False, steps=100)) >= 99


def test_the_gpu_step_script_runs_every_section_at_a_tiny_shape_on_the_cpu(tmp_path):
    gpu_step = load("bench/gpu_step.py")
    out = tmp_path / "gpu_step.jsonl"
    gpu_step.main(["--device", "cpu", "--shapes", "tiny", "--dtype", "float32", "--batches", "1,4", "--steps", "6",
                   "--context", "64", "--prompts", "4", "--tokens", "12", "--out", str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    sections = [line["section"] for line in lines]
    assert sections[0] == "versions" and sections[-1] == "verdicts"
    for wanted in ("sdpa_choice", "joined_step", "shapes", "step_times", "launches", "host_reads", "memory",
                   "fidelity"):
        assert wanted in sections
    joined = next(line for line in lines if line["section"] == "joined_step")
    assert {(r["batch"], r["one_pass"]) for r in joined["rows"]} == {(b, o) for b in (1, 4) for o in (True, False)}
    assert all(r["step_with_chunk_ms"] > 0 and r["decode_step_ms"] > 0 for r in joined["rows"])
    step = next(line for line in lines if line["section"] == "step_times")
    modes = ("eager-modules", "eager-fused", "eager-fused-flex", "graphs")   # graphs: the CPU's replay stand-in
    assert {(r["mode"], r["decode"], r["batch"]) for r in step["rows"]} == {
        (m, d, b) for m in modes for d in ("plain", "eagle") for b in (1, 4)}
    assert all(r["median_ms"] > 0 and r["tokens_per_s"] > 0 for r in step["rows"])
    fidelity = next(line for line in lines if line["section"] == "fidelity")
    assert fidelity["eagle_equals_plain"] == fidelity["flex_equals_modules"] == fidelity["prompts"] == 4
    assert fidelity["graphs_equal_eager"] == 4 and fidelity["graph_replays"] > 0
    memory = next(line for line in lines if line["section"] == "memory")
    graphs = next(r for r in memory["rows"] if r["mode"] == "graphs")
    assert graphs["graphs"] > 0 and graphs["eager_decode_passes"] == 0 and graphs["draft_replays"] > 0
