"""A target split over processes (model/tensor_parallel.py), on the CPU over gloo: the same tokens as one process,
greedy and sampled, with either head kind and either layer path; each rank holds only its slices; a rank that dies
fails the engine within the collective timeout, naming it."""
import time

import pytest
import torch
from test_engine import mixed_prompts, reference_greedy
from tiny import save_target

from eagle_ray.config import SamplingParams, TreeConfig
from eagle_ray.engine.engine import EagleEngine
from eagle_ray.errors import CheckpointError, EngineDeadError
from eagle_ray.model.tensor_parallel import load_shard

TREE = TreeConfig(total_tokens=10, depth=3, top_k=3)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_target(tmp_path_factory.mktemp("tp"), layers=7)   # 7 layers: an EAGLE-3 head reads three


def engine(path, tp: int, head: str = "random", max_batch_size: int = 4, **kw) -> EagleEngine:
    return EagleEngine.from_pretrained(str(path), head, dtype="float32", max_batch_size=max_batch_size, tree=TREE,
                                       tensor_parallel=tp, threads=1, cpu_linears="native", **kw)


@pytest.mark.parametrize("head, fused", [("random", False), ("random-eagle3", False), ("random", True)],
                         ids=["eagle2-modules", "eagle3-modules", "eagle2-fused"])
def test_two_ranks_give_one_ranks_tokens_greedy_and_sampled(target_dir, head, fused):
    prompts = mixed_prompts(4, seed=9)   # batch 4, different prompt lengths
    greedy = SamplingParams(max_new_tokens=20, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.9, top_p=0.95, seed=11)
    one = engine(target_dir, 1, head, fused_layers=fused)
    want = [[o.token_ids for o in one.generate(prompts, p)] for p in (greedy, sampled)]
    two = engine(target_dir, 2, head, fused_layers=fused)
    try:
        assert two.target.fused is not None if fused else two.target.fused is None
        got = [[o.token_ids for o in two.generate(prompts, p)] for p in (greedy, sampled)]
    finally:
        two.close()
    assert got == want
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    assert got[0] == [reference_greedy(hf, p, 20) for p in prompts]


def test_two_ranks_copy_a_prompt_start_from_a_running_sequence_as_one_rank_does(target_dir):
    """Automatic prefix sharing (engine/prefix_sharing.py) copies K/V slot to slot on every rank."""
    from test_prefix_sharing import one_long_then_short, under_one_preamble
    prompts, params = under_one_preamble(4), one_long_then_short(4)
    runs = {}
    for tp in (1, 2):
        e = engine(target_dir, tp, max_batch_size=2)
        try:
            runs[tp] = e.generate(prompts, params)
        finally:
            e.close()
    assert [o.stats.cached_prompt_tokens for o in runs[2]] == [0, 0, 39, 39]
    assert [o.token_ids for o in runs[2]] == [o.token_ids for o in runs[1]]


def test_each_rank_holds_its_slices_only(target_dir):
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(target_dir)
    full = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    layer = full.model.layers[3]
    for rank in (0, 1):
        part = load_shard(target_dir, cfg, torch.float32, "cpu", rank, 2).model.layers[3]
        rows, cols = layer.self_attn.k_proj.weight.shape[0] // 2, layer.mlp.down_proj.weight.shape[1] // 2
        assert torch.equal(part.self_attn.k_proj.weight, layer.self_attn.k_proj.weight[rank * rows:(rank + 1) * rows])
        assert torch.equal(part.mlp.down_proj.weight, layer.mlp.down_proj.weight[:, rank * cols:(rank + 1) * cols])
        assert torch.equal(part.input_layernorm.weight, layer.input_layernorm.weight)


def test_heads_the_ranks_do_not_divide_fail_at_load_naming_both(target_dir):
    with pytest.raises(CheckpointError, match="tensor_parallel 3 does not divide the target's 4 attention heads"):
        engine(target_dir, 3)


def test_a_rank_killed_mid_run_fails_the_engine_within_30_s_naming_it(target_dir):
    two = engine(target_dir, 2)
    try:
        for p in mixed_prompts(4, seed=2):
            two.add_request(p, SamplingParams(max_new_tokens=200, ignore_eos=True))
        for _ in range(3):
            two.step()
        proc = two.target.tp.procs[0]
        proc.kill()
        proc.join()
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=f"rank 1 \\(pid {proc.pid}\\)"):
            for _ in range(100):
                two.step()
        assert time.monotonic() - start < 30
    finally:
        two.close()


def test_a_killed_rank_makes_serves_queue_unhealthy(target_dir):
    """What Serve's /health reads: the queue over the engine fails the request in flight and reports unhealthy."""
    from eagle_ray.engine.queue import RequestQueue
    two = engine(target_dir, 2)
    queue = RequestQueue(two)
    try:
        assert queue.generate([5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True)).token_ids
        two.target.tp.procs[0].kill()
        future = queue.submit([5, 6, 7, 8], SamplingParams(max_new_tokens=64, ignore_eos=True))
        with pytest.raises(EngineDeadError, match="rank 1"):
            future.result(timeout=30)
        assert not queue.healthy
    finally:
        queue.shutdown(drain=False, timeout=10)
        two.close()


@pytest.mark.slow
def test_in_a_job_a_rank_killed_mid_batch_costs_no_row(target_dir, tmp_path):
    """The job's actor restarts the engine (its other ranks start again) and reruns the unanswered rows: every row
    is answered, as by an engine in one process."""
    import asyncio

    from test_batch_faults import batch_of

    from eagle_ray.batch.config import JobConfig
    from eagle_ray.batch.stage import GenerateStage

    def stage(tp):
        cfg = JobConfig(engine={"target": str(target_dir), "draft": "random", "dtype": "float32", "max_batch_size": 8,
                                "max_model_len": 128, "tree": {"total_tokens": 6, "depth": 2, "top_k": 2},
                                "tensor_parallel": tp, "threads": 1, "cpu_linears": "native"},
                        sampling={"max_new_tokens": 8, "ignore_eos": True},
                        input={"uri": str(tmp_path / "in.jsonl")}, output={"uri": str(tmp_path / "out")})
        return GenerateStage(cfg.model_dump_json())

    two = stage(2)
    step, killed = two.engine.step, []

    def kills_rank_1_once():
        if not killed and two.engine.counters["decode_passes"] >= 3:
            proc = two.engine.target.tp.procs[0]
            proc.kill()
            proc.join()
            killed.append(proc.pid)
        return step()

    two.engine.step = kills_rank_1_once
    try:
        rows = asyncio.run(two(batch_of(16))).to_pylist()
        assert killed and len(rows) == 16 and not any(r["error"] for r in rows)
        assert two.engine.target.tp.procs[0].pid != killed[0] and two.queue.healthy
    finally:
        two.queue.shutdown(drain=False, timeout=10)
        two.engine.close()
    one = stage(1)
    want = asyncio.run(one(batch_of(16))).to_pylist()
    one.queue.shutdown(drain=False, timeout=10)
    assert [r["output_token_ids"] for r in rows] == [r["output_token_ids"] for r in want]


PLACEMENT = """
import json, os, sys, time
import ray
from eagle_ray.batch.config import ProcessorConfig
from eagle_ray.batch.processor import pool_options

class Devices:   # stands in for the engine's actor: reports what Ray reserved for it
    def __call__(self, batch):
        time.sleep(0.2)
        ids = ",".join(str(g) for g in ray.get_gpu_ids())
        return {"gpus": [ids] * len(batch["id"]), "visible": [os.environ.get("CUDA_VISIBLE_DEVICES", "")] * len(batch["id"])}

ray.init(address="local", num_cpus=2, num_gpus=4, include_dashboard=False, log_to_driver=False,
         _node_ip_address="127.0.0.1")
cfg = ProcessorConfig(engine={"tensor_parallel": 2}, actors={"num_actors": 2, "num_gpus": 2, "num_cpus": 0.5,
                                                            "batch_size": 1})
options = pool_options(cfg.actors)
options["batch_format"] = "numpy"
ray.data.DataContext.get_current().wait_for_min_actors_s = 300   # both actors up before any row: both take rows
items = ray.data.range(40, override_num_blocks=8).map(lambda r: {"id": r["id"]}).materialize()   # all there at once
rows = items.map_batches(Devices, **options).take_all()
print(json.dumps(sorted({(r["gpus"], r["visible"]) for r in rows})))
"""


@pytest.mark.slow
def test_two_actors_of_a_two_rank_target_get_two_gpus_each_all_distinct():
    """On a Ray with 4 logical GPUs, a pool of 2 actors x tensor_parallel 2 holds 2 devices per actor, 4 in all."""
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", PLACEMENT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    pairs = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(pairs) == 2
    ids = [set(gpus.split(",")) for gpus, _ in pairs]
    assert all(len(i) == 2 for i in ids) and not ids[0] & ids[1]
    assert all(set(visible.split(",")) == set(gpus.split(",")) for gpus, visible in pairs)   # what CUDA sees


@pytest.mark.slow
def test_a_rank_that_hangs_fails_the_engine_after_the_collective_timeout(target_dir):
    import os
    import signal
    two = engine(target_dir, 2, collective_timeout_s=5)
    proc = two.target.tp.procs[0]
    try:
        two.add_request([5, 6, 7], SamplingParams(max_new_tokens=200, ignore_eos=True))
        two.step()
        os.kill(proc.pid, signal.SIGSTOP)   # alive, but never answers
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="all-reduce failed on rank 0"):
            for _ in range(100):
                two.step()
        assert 5 <= time.monotonic() - start < 20
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        two.close()


def test_a_script_without_the_main_guard_fails_at_once_saying_to_add_it(target_dir, tmp_path):
    """Each rank is a new process (a fork of the rank server) that imports the main script again: a script that
    builds its engine at the top level (no ``if __name__ == "__main__":``) fails with that advice, not after the join
    timeout with "ranks did not join"."""
    import os
    import subprocess
    import sys
    script = tmp_path / "unguarded.py"
    script.write_text(
        "from eagle_ray.engine.engine import EagleEngine\n"
        f"engine = EagleEngine.from_pretrained({str(target_dir)!r}, 'random', dtype='float32', max_batch_size=4,\n"
        "                                      tensor_parallel=2, threads=1, cpu_linears='native',\n"
        "                                      tree={'total_tokens': 10, 'depth': 3, 'top_k': 3})\n"
        "print('built')\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ), cwd=tmp_path)
    assert proc.returncode != 0 and "built" not in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("eagle_ray.model.tensor_parallel.NoMainGuard:"), proc.stderr[-3000:]
    assert 'if __name__ == "__main__":' in last and "did not join" not in proc.stderr



def test_the_main_guard_is_read_from_the_scripts_source_so_no_rank_starts_without_it(tmp_path):
    """Where a call to start ranks comes from: the main script's top level outside a guard's body (its own line,
    or a function it calls there) is unguarded, inside the body (either way round) it is guarded; a script with no
    source to read (``python -c``) is never refused (a rank then sees it: the test above)."""
    import subprocess
    import sys
    source = ("from eagle_ray.model.tensor_parallel import called_from_unguarded_main as unguarded\n"
              "def build():\n"
              "    return unguarded()\n"
              "print('top', unguarded(), build())\n"
              "if __name__ == '__main__':\n"
              "    print('guarded', unguarded(), build())\n"
              "if '__main__' == __name__:\n"
              "    print('reversed', unguarded())\n")
    (tmp_path / "where.py").write_text(source)
    run = subprocess.run([sys.executable, "where.py"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.stdout.splitlines() == ["top True True", "guarded False False", "reversed False"], run.stderr
    run = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=300)
    assert run.stdout.splitlines() == ["top False False", "guarded False False", "reversed False"], run.stderr
