"""What the GPU step needs from the engine, checked on the CPU: shapes that stop growing, and the device script that
measures a GPU step: it runs end to end at a tiny shape as the device runs it (from the repository root, nothing
installed, only the device image's packages and the carried wheels importable), inside its budget, and its verdicts
read the rows they name.

A kernel specialised to a shape (cuDNN attention builds a graph per key length; a captured CUDA graph replays one
shape) pays its build at every new shape. Key lengths are rounded up to ``kv_bucket`` columns (masked) on CUDA, so
over a long run the target's forwards take as many shapes as buckets, not as many as steps."""
import dataclasses
import json
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from repo_scripts import ROOT, load

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


SMOKE = ["--device", "cpu", "--shapes", "tiny", "--dtype", "float32", "--batches", "1,2", "--steps", "2",
         "--context", "32", "--prompts", "3", "--tokens", "8", "--probe-steps", "2"]
SECTIONS = ["versions", "bandwidth", "key_steps", "fidelity", "probe", "rest", "flex"]


def as_on_device(*args, timeout=900) -> subprocess.CompletedProcess:
    """``python -I bench/device/as_on_device.py ARGS`` from the repository root: no PYTHONPATH, no current folder on
    the path, the editable install taken away, only the device's distributions importable."""
    return subprocess.run([sys.executable, "-I", "bench/device/as_on_device.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> list[dict]:
    """The GPU script's CPU smoke run, once for the tests below, as the device runs it."""
    out = tmp_path_factory.mktemp("gpu-step") / "gpu_step.jsonl"
    done = as_on_device("bench/gpu_step.py", *SMOKE, "--out", str(out))
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_the_gpu_step_script_runs_every_section_at_a_tiny_shape_with_only_the_devices_packages(smoke):
    assert [line for line in smoke if "error" in line] == []
    assert [line["after"] for line in smoke if line["section"] == "verdicts"] == SECTIONS   # one after each section
    assert smoke[0]["section"] == "versions" and smoke[-1]["section"] == "done"
    for wanted in ("bandwidth", "sdpa_choice", "probe", "joined_step", "shapes", "step", "engine", "launches",
                   "host_reads", "fidelity", "fidelity_flex", "compiles"):
        assert wanted in {line["section"] for line in smoke}, wanted
    assert not [line for line in smoke if "skipped" in line]
    steps = [line for line in smoke if line["section"] == "step"]
    modes = ("eager-modules", "eager-fused", "eager-fused-flex", "graphs")   # graphs: the CPU's replay stand-in
    assert sorted((r["mode"], r["decode"], r["batch"]) for r in steps) == sorted(
        (m, d, b) for m in modes for d in ("plain", "eagle") for b in (1, 2))
    assert all(r["median_ms"] > 0 and r["tokens_per_s"] > 0 for r in steps)
    key = [(r["mode"], r["decode"], r["batch"]) for r in steps if r["part"] == "key_steps"]   # the targets' rows first
    assert key == [("graphs", d, b) for b in (1, 2) for d in ("plain", "eagle")] + [
        ("eager-fused", d, b) for b in (1, 2) for d in ("plain", "eagle")] + [
        ("eager-modules", "plain", 1), ("eager-modules", "eagle", 1)]
    joined = next(line for line in smoke if line["section"] == "joined_step")
    assert {(r["batch"], r["one_pass"]) for r in joined["rows"]} == {(b, o) for b in (1, 2) for o in (True, False)}
    assert all(r["step_with_chunk_ms"] > 0 and r["decode_step_ms"] > 0 for r in joined["rows"])
    fidelity = next(line for line in smoke if line["section"] == "fidelity")
    assert [fidelity[k] for k in ("prompts", "eagle_equals_plain", "fused_equals_modules", "graphs_eagle_equal_eager",
                                  "graphs_plain_equal_eager")] == [3, 3, 3, 3, 3]
    assert next(line for line in smoke if line["section"] == "fidelity_flex")["flex_equals_modules"] == 3
    graphs = [line for line in smoke if line["section"] == "engine" and line["mode"] == "graphs"]
    assert all(g["graphs"] > 0 and g["eager_decode_passes"] == 0 and g["draft_replays"] > 0 for g in graphs)
    launches = [line for line in smoke if line["section"] == "launches"]
    assert {line["mode"] for line in launches} == {"graphs", "eager-fused", "eager-modules"}
    assert all(line["unit"].startswith("top-level aten operators") and line["plain"] > 0 for line in launches)
    final = smoke[-2]
    assert [c["status"] for c in final["checks"]] == ["INFO"] * 5 + ["PASS", "PASS", "INFO"]   # no GPU targets here


def test_the_smoke_finds_the_package_only_through_the_repository_root(tmp_path):
    """The isolation the smoke test relies on: without the root on the path eagle_ray is not found (the editable
    install is gone), and distributions the device lacks are not found either, while its own ones are."""
    script = tmp_path / "probe_imports.py"
    script.write_text(
        "import importlib.util, json, sys\n"
        "found = {m: importlib.util.find_spec(m) is not None for m in ('eagle_ray', 'ray', 's3fs', 'gguf', 'boto3', "
        "'pydantic', 'yaml', 'numpy')}\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "found['root'] = importlib.util.find_spec('eagle_ray').origin.startswith(sys.argv[1])\n"
        "print(json.dumps(found))\n")
    done = as_on_device(str(script), str(ROOT), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == {"eagle_ray": False, "ray": False, "s3fs": False, "gguf": False,
                                       "boto3": False, "pydantic": True, "yaml": True, "numpy": True, "root": True}


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_budget_that_runs_out_part_way_skips_the_rest_and_still_gives_verdicts(tmp_path, monkeypatch):
    gpu_step = load("bench/gpu_step.py")
    clock, measure = FakeClock(), gpu_step.decode_steps

    def steps_then_time_is_up(*args, **kwargs):   # the first timed row takes the whole budget
        times = measure(*args, **kwargs)
        clock.now = 1000.0
        return times

    monkeypatch.setattr(gpu_step, "decode_steps", steps_then_time_is_up)
    out = tmp_path / "cut.jsonl"
    gpu_step.main([*SMOKE, "--budget-s", "300", "--out", str(out)], clock=clock)
    lines = [json.loads(line) for line in out.read_text().splitlines()]   # every line is JSON
    flow = [(x["section"], x.get("part"), x.get("mode"), x.get("decode"), x.get("batch"),
             "skipped" if "skipped" in x else "measured") for x in lines if x["section"] != "verdicts"]
    assert flow == [
        ("versions", None, None, None, None, "measured"),
        ("bandwidth", None, None, None, None, "measured"),
        ("step", "key_steps", "graphs", "plain", 1, "measured"),
        ("step", "key_steps", "graphs", "eagle", 1, "skipped"),
        ("step", "key_steps", "graphs", "plain", 2, "skipped"),
        ("step", "key_steps", "graphs", "eagle", 2, "skipped"),
        ("engine", "key_steps", "graphs", None, None, "measured"),
        ("engine", "key_steps", "eager-fused", None, None, "skipped"),
        *[("step", "key_steps", "eager-fused", d, b, "skipped") for b in (1, 2) for d in ("plain", "eagle")],
        ("engine", "key_steps", "eager-modules", None, None, "skipped"),
        *[("step", "key_steps", "eager-modules", d, 1, "skipped") for d in ("plain", "eagle")],
        *[(section, None, None, None, None, "skipped") for section in SECTIONS[3:]],
        ("done", None, None, None, None, "measured")]
    assert next(x for x in lines if x["section"] == "step")["median_ms"] > 0
    skipped = next(x for x in lines if x["section"] == "step" and "skipped" in x)
    assert skipped["skipped"] == "budget: 0 s of 300 s left, row tiny graphs eagle 1 needs about 5 s"
    assert [x["after"] for x in lines if x["section"] == "verdicts"] == SECTIONS
    final = [x for x in lines if x["section"] == "verdicts"][-1]
    assert [(c["check"], c["status"]) for c in final["checks"]] == [
        ("tiny plain step at batch 1 (best mode)", "INFO"), ("tiny eagle step at batch 1 (best mode)", "NOT MEASURED"),
        ("graphs >= 3x eager modules at batch 1", "NOT MEASURED"),
        ("graphs against fused eager at batch 1", "NOT MEASURED"),
        ("plain batch 2 >= 60% of the measured bandwidth (best mode)", "NOT MEASURED"),
        ("fp32 greedy equality", "NOT MEASURED"), ("the probe's cause", "NOT MEASURED")]


def step(mode, decode, batch, median_ms, gb_per_s=0.0, part="key_steps"):
    return {"part": part, "shape": "llama-3.1-8b", "mode": mode, "decode": decode, "batch": batch,
            "median_ms": median_ms, "gb_per_s": gb_per_s}


def test_verdicts_read_graphs_against_eager_modules_the_best_mode_and_the_measured_copy(tmp_path):
    gpu_step = load("bench/gpu_step.py")
    report = gpu_step.Report(tmp_path / "v.jsonl", "test")
    report.write("bandwidth", gb_per_s=4300.0)
    for line in (step("graphs", "plain", 1, 4.2), step("graphs", "eagle", 1, 8.4), step("eager-fused", "plain", 1, 9.0),
                 step("eager-fused", "eagle", 1, 7.5), step("eager-modules", "plain", 1, 14.0),
                 step("graphs", "plain", 64, 9.0, 2700.0), step("eager-fused", "plain", 64, 8.0, 2750.0),
                 step("eager-modules", "plain", 64, 7.0, 2800.0, part="rest")):
        report.write("step", **line)
    report.write("engine", part="key_steps", shape="llama-3.1-8b", mode="graphs", eager_decode_passes=0)
    report.write("fidelity", shape="llama-3.2-1b", prompts=16, eagle_equals_plain=16, fused_equals_modules=16,
                 graphs_eagle_equal_eager=16, graphs_plain_equal_eager=15)
    report.write("probe", shape="llama-3.1-8b", cause="not a per-shape build")
    lines = [c["text"] for c in gpu_step.verdicts(report, "NVIDIA H200", "llama-3.1-8b")]
    assert lines == [
        "PASS llama-3.1-8b plain step at batch 1 (best mode): read step llama-3.1-8b graphs plain batch 1: median "
        "4.2 ms (target <= 5.0 ms on an H200)",
        "PASS llama-3.1-8b eagle step at batch 1 (best mode): read step llama-3.1-8b eager-fused eagle batch 1: median "
        "7.5 ms (target <= 8.0 ms on an H200)",
        "PASS graphs >= 3x eager modules at batch 1: 3.33x, read step llama-3.1-8b eager-modules plain batch 1: median "
        "14.0 ms / step llama-3.1-8b graphs plain batch 1: median 4.2 ms; decode passes left eager: 0",
        "INFO graphs against fused eager at batch 1: 2.14x, read step llama-3.1-8b eager-fused plain batch 1: median "
        "9.0 ms / step llama-3.1-8b graphs plain batch 1: median 4.2 ms",
        "PASS plain batch 64 >= 60% of the measured bandwidth (best mode): 2800.0 GB/s = 65% of 4300.0 GB/s "
        "(bandwidth line: a timed device copy); read step llama-3.1-8b eager-modules plain batch 64: median 7.0 ms",
        "FAIL fp32 greedy equality: eagle_equals_plain 16/16, fused_equals_modules 16/16, graphs_eagle_equal_eager "
        "16/16, graphs_plain_equal_eager 15/16 (read fidelity llama-3.2-1b)",
        "INFO the probe's cause: not a per-shape build (read probe llama-3.1-8b)"]
    h100 = [c["status"] for c in gpu_step.verdicts(report, "NVIDIA H100 80GB HBM3", "llama-3.1-8b")]
    assert h100[:2] == ["PASS", "PASS"]


def test_the_probe_names_a_per_shape_build_only_when_the_same_shapes_again_are_fast():
    cause = load("bench/gpu_step.py").probe_cause
    runs = ("default", "cudnn allowed, every key length new", "cudnn allowed, the same shapes again",
            "cudnn allowed, key lengths in buckets")
    assert cause(dict(zip(runs, (25.0, 230.0, 24.0, 26.0)))) == (
        "a build per new shape (cuDNN attention): default 25.0 ms, cuDNN allowed with new key lengths 230.0 ms, the "
        "same shapes again 24.0 ms, key lengths in buckets 26.0 ms")
    assert cause(dict(zip(runs, (25.0, 230.0, 228.0, 229.0)))) == (
        "not a per-shape build: default 25.0 ms, cuDNN allowed with new key lengths 230.0 ms, and the same shapes "
        "again are as slow (228.0 ms)")
    assert cause(dict(zip(runs, (25.0, 27.0, 25.0, 26.0)))) == (
        "no slow step with cuDNN allowed (default 25.0 ms, cuDNN allowed with new key lengths 27.0 ms): the old "
        "224-254 ms is not reproduced")
    assert cause({}) == "not measured"


def test_host_launches_count_a_replayed_graph_as_one_launch():
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    events = [SimpleNamespace(name=n, device_type=cpu) for n in (
        "aten::mm", "cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC_v11060", "cudaGraphLaunch",
        "cudaMemcpyAsync", "cudaStreamSynchronize")]
    events += [SimpleNamespace(name=f"kernel{i}", device_type=cuda) for i in range(40)]   # 37 of them in the graph
    assert load("bench/gpu_step.py").host_launches(events) == {"launches": 4, "graph_launches": 1,
                                                                "device_kernels": 40}


def test_the_device_table_changes_only_inside_its_block(tiny_dir):
    gpu_step = load("bench/gpu_step.py")
    with gpu_step.device_table("cpu", kv_bucket=256, sdpa_backends=("MATH",)):
        assert DEVICE_DEFAULTS["cpu"].kv_bucket == 256 and DEVICE_DEFAULTS["cpu"].sdpa_backends == ("MATH",)
        engine = EagleEngine.from_pretrained(str(tiny_dir), "random", dtype="float32", max_batch_size=1,
                                             max_model_len=256, tree=TREE)
    assert engine.target.cache.kv_bucket == 256 and DEVICE_DEFAULTS["cpu"].kv_bucket == 1
    assert DEVICE_DEFAULTS["cpu"].sdpa_backends is None
    cpu = DEVICE_DEFAULTS["cpu"]
    with gpu_step.device_table("cpu", **gpu_step.cuda_defaults_on_cpu()):
        assert DEVICE_DEFAULTS["cpu"] == dataclasses.replace(DEVICE_DEFAULTS["cuda"], auto_max_slots=cpu.auto_max_slots)
    assert DEVICE_DEFAULTS["cpu"] is cpu
