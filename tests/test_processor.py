"""eagle-ray in a user's own Ray Data pipeline: ``build_processor`` applied to a Dataset the user built gives the
rows the batch job gives for the same input, error rows included; a small target's engines share a GPU."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
from test_job import both_up, config, prompts, write_jsonl

from eagle_ray.batch.config import ActorsConfig, JobConfig, ProcessorConfig
from eagle_ray.batch.job import read_output, run_job
from eagle_ray.batch.processor import build_processor, request_item
from eagle_ray.errors import ConfigError

# what must agree between the job and the processor: the answers (acceptance counts follow which rows share a
# step, as the verify cap is chosen per batch size, and timings follow the machine)
SAME = ("id", "output", "turn_outputs", "output_token_ids", "finish_reason", "prompt_tokens", "output_tokens",
        "error_kind", "new_tokens", "tree")


def test_a_request_item_is_the_row_preprocess_makes_and_a_failing_preprocess_is_an_error_row():
    item = request_item({"q": "w1 w2", "n": 7}, lambda r: {"id": r["n"], "prompt": r["q"]})
    assert (item["id"], json.loads(item["payload"]), item["error"]) == ("7", {"id": 7, "prompt": "w1 w2"}, "")
    anonymous = request_item({"prompt": "w1 w2"})
    assert anonymous["id"] == request_item({"prompt": "w1 w2"})["id"] and anonymous["id"].startswith("row-")
    assert request_item({"prompt": "w3"})["id"] != anonymous["id"]
    bad = request_item({"q": 1}, lambda r: r["question"])
    assert bad["error_kind"] == "invalid_row" and bad["error"] == "preprocess failed: KeyError: 'question'"
    assert request_item({"q": 1}, lambda r: None)["error"] == "a request row must be a dict, got None"


def test_the_processor_config_is_the_job_config_without_input_and_output(pair):  # noqa: F811
    job = config(pair, "in.jsonl", "out")
    proc = ProcessorConfig.of(job)
    assert type(proc) is ProcessorConfig and proc.engine == job.engine and proc.actors == job.actors
    assert ProcessorConfig.of(proc.model_dump()) == proc
    with pytest.raises(ConfigError, match="actors.num_actors"):
        ProcessorConfig.of({"actors": {"num_actors": [3, 2]}})
    assert ActorsConfig(num_actors=[1, 3]).pool == (1, 3) and ActorsConfig().pool == (1, 1)


@pytest.mark.slow
def test_a_user_pipeline_gives_the_jobs_rows(ray_local, pair, tmp_path):  # noqa: F811
    """read_parquet -> filter -> processor -> write_parquet on the user's side; the job on the same rows (an OpenAI
    batch line among them)."""
    line = {"custom_id": "line", "url": "/v1/chat/completions", "body": {
        "model": "m", "messages": [{"role": "user", "content": "w1 w2"}], "temperature": 0, "max_tokens": 6}}
    rows = prompts(14) + [{"id": "bad", "messages": "not a chat"}, line]
    kept = [r for r in rows if r.get("id") != "q3"]
    write_jsonl(tmp_path / "in.jsonl", kept)
    job = run_job(config(pair, str(tmp_path / "in.jsonl"), str(tmp_path / "job")))
    assert job["rows"] == len(kept)

    user = tmp_path / "user.parquet"   # the user's table: their own column names, one JSON column per request
    pq.write_table(pa.table({"qid": [r.get("id", r.get("custom_id")) for r in rows],
                             "request": [json.dumps(r) for r in rows]}), user)
    # the actors take half a CPU each: the user's read and filter tasks need CPUs of this 2-CPU Ray too
    processor = build_processor(ProcessorConfig.of(config(pair, "x", "y", actors__num_cpus=0.5)),
                                preprocess=lambda r: json.loads(r["request"]),
                                postprocess=lambda r: {k: r[k] for k in SAME} | {
                                    "qid": r["request"].get("id", r["request"].get("custom_id"))})
    ds = ray.data.read_parquet(str(user)).filter(lambda r: r["qid"] != "q3")
    processor(ds).write_parquet(str(tmp_path / "user-out"))
    mine = sorted(pq.read_table(tmp_path / "user-out").to_pylist(), key=lambda r: r["id"])
    theirs = sorted(read_output(*_local(tmp_path / "job")).to_pylist(), key=lambda r: r["id"])
    assert [r["qid"] for r in mine] == [r["id"] for r in mine] == sorted(r.get("id", "line") for r in kept)
    assert [{k: r[k] for k in SAME} for r in mine] == [{k: r[k] for k in SAME} for r in theirs]
    assert [r["error_kind"] for r in mine if r["error_kind"]] == ["invalid_request"]


@pytest.mark.slow
def test_two_engines_share_one_gpu_at_half_a_gpu_each(ray_local, pair, tmp_path, monkeypatch):  # noqa: F811
    """Ray counts the GPU (this CPU machine's Ray is started with one logical GPU): two actors at 0.5 run at once
    on it, each engine planning its memory from half of it. The work items are made before the pool starts (all
    12 blocks wait for it), so each actor is handed one as soon as both are up: made one at a time by a task on
    the CPU the actors leave, the first actor ran every block before the next arrived."""
    both_up(monkeypatch)
    cfg = config(pair, "x", "y", actors__num_gpus=0.5, actors__num_actors=2, actors__num_cpus=0.5,
                 actors__batch_size=2, actors__max_concurrent_batches=1)
    items = ray.data.from_items(prompts(24), override_num_blocks=12).map(request_item).materialize()
    out = build_processor(ProcessorConfig.of(cfg)).generate(items).take_all()
    assert sorted(r["id"] for r in out) == sorted(r["id"] for r in prompts(24)) and not any(r["error"] for r in out)
    assert len({r["worker_id"] for r in out}) == 2
    assert JobConfig(**cfg.model_dump()).engine.for_ray_worker(0.5, 0.5).cache.memory_share == 0.5


def _local(path):
    import fsspec
    return fsspec.filesystem("file"), str(path)


@pytest.mark.slow
def test_an_autoscaling_pool_answers_every_row(ray_local, pair, tmp_path):  # noqa: F811
    """``num_actors: [1, 2]``: Ray Data starts one actor and may add a second while batches wait."""
    cfg = config(pair, "x", "y", actors__num_actors=[1, 2], actors__num_cpus=0.5, actors__batch_size=2,
                 actors__max_concurrent_batches=1)
    out = build_processor(ProcessorConfig.of(cfg))(ray.data.from_items(prompts(12), override_num_blocks=6)).take_all()
    assert sorted(r["id"] for r in out) == sorted(r["id"] for r in prompts(12)) and not any(r["error"] for r in out)
    assert 1 <= len({r["worker_id"] for r in out}) <= 2


def test_actors_restart_and_batches_retry_as_long_as_the_job_runs_unless_a_bound_is_set():
    """Losing a node must not use up a budget: its actor's batch retries reach the dead node for the seconds before
    Ray declares it dead (three retries were gone in about 5 s, and the job with them)."""
    from ray.data import DataContext
    from ray.data._internal.execution.operators.actor_pool_map_operator import ActorPoolMapOperator

    from eagle_ray.batch.processor import pool_options

    def applied(actors):   # the actor options Ray Data builds the pool with, from what the job passes it
        named = ("batch_size", "batch_format", "num_cpus", "num_gpus", "compute")
        remote = {k: v for k, v in pool_options(actors).items() if k not in named}
        args = ActorPoolMapOperator._apply_default_remote_args(remote, DataContext.get_current())
        return remote, (args["max_restarts"], args.get("max_task_retries"))

    assert applied(ActorsConfig(num_actors=2)) == ({}, (-1, -1))   # nothing Ray Data deprecates is passed
    assert applied(ActorsConfig(num_actors=2, max_restarts=5)) == ({"max_restarts": 5}, (5, -1))
    assert applied(ActorsConfig(num_actors=2, max_restarts=0)) == ({"max_restarts": 0}, (0, None))


def test_one_actor_failing_to_start_costs_that_actor_the_budget_scaling_with_the_pool():
    """Ray Data ends the dataset at the first actor whose constructor raised unless
    ``max_consecutive_actor_init_deaths`` allows more: the pool's largest size by default, a budget set higher
    (or unlimited, -1) on the context is kept."""
    from ray.data import DataContext

    from eagle_ray.batch.processor import allow_start_failures
    for pool, start_failures, have, want in (((2, 5), None, 0, 5), (4, None, 0, 4), (4, 1, 0, 1), (4, None, 9, 9),
                                             (4, None, -1, -1)):
        context = DataContext()
        context.max_consecutive_actor_init_deaths = have
        allow_start_failures(context, ActorsConfig(num_actors=pool, start_failures=start_failures))
        assert context.max_consecutive_actor_init_deaths == want, (pool, start_failures, have)


def test_a_postprocess_that_raises_on_a_row_makes_that_row_an_error_row_keeping_its_answer():
    from eagle_ray.batch.processor import finish_row
    from eagle_ray.batch.rows import empty_row
    good = empty_row({"id": "a", "row_index": None, "payload": '{"prompt": "w1", "qid": 7}'}) | {"output": "w2 w3"}
    bad = empty_row({"id": "b", "row_index": None, "payload": '{"prompt": "w4"}'}) | {"output": "w5"}
    failed = empty_row({"id": "c", "row_index": None, "payload": "", "error": "no prompt",
                        "error_kind": "invalid_request"})

    def post(r):
        return {"qid": r["request"]["qid"], "answer": r["output"]}
    assert finish_row(good, post) == {"qid": 7, "answer": "w2 w3"}
    ray_data_llm = finish_row(good | {"output_token_ids": [8, 9], "output_tokens": 2, "prompt_tokens": 1}, lambda r: {
        k: r[k] for k in ("generated_text", "generated_tokens", "num_generated_tokens", "num_input_tokens")})
    assert ray_data_llm == {"generated_text": "w2 w3", "generated_tokens": [8, 9], "num_generated_tokens": 2,
                            "num_input_tokens": 1}   # a postprocess written for Ray Data LLM reads its names
    row = finish_row(bad, post)
    assert (row["id"], row["output"], row["error_kind"], row["error"]) == \
        ("b", "w5", "postprocess_failed", "postprocess failed: KeyError: 'qid'")
    assert set(row) == set(bad) and "request" not in row   # the job's own columns
    row = finish_row(failed, post)
    assert row["error_kind"] == "postprocess_failed" and row["error"] == (
        "postprocess failed: TypeError: 'NoneType' object is not subscriptable; the row had failed already "
        "(invalid_request): no prompt")


def test_a_pool_holding_every_cpu_of_the_cluster_is_refused_before_the_pipeline_waits_forever(monkeypatch):
    """The README's example with configs/embedded.yaml (one actor of 2 CPUs) on a 2-CPU machine: Ray Data's read
    task never got a CPU and the pipeline waited, silently, forever."""
    import ray as ray_module

    from eagle_ray.batch.processor import check_cpus_left
    monkeypatch.setattr(ray_module, "is_initialized", lambda: True)
    cpus = {"CPU": 2.0}
    monkeypatch.setattr(ray_module, "cluster_resources", lambda: cpus)
    with pytest.raises(ConfigError, match=r"takes 2 of this Ray cluster's 2 CPUs .* Set actors.num_cpus to 1 or less"):
        check_cpus_left(ActorsConfig(num_cpus=2))
    with pytest.raises(ConfigError, match="leaves none for the dataset's read and map tasks"):
        check_cpus_left(ActorsConfig(num_actors=2, num_cpus=0.75))
    check_cpus_left(ActorsConfig(num_cpus=1))               # one CPU left for the read
    check_cpus_left(ActorsConfig(num_actors=[1, 4], num_cpus=1))   # the pool grows only while CPUs are free
    cpus["CPU"] = 0.0   # a head without CPUs, workers still to come: the autoscaler's business
    check_cpus_left(ActorsConfig(num_cpus=2))


@pytest.mark.slow
def test_the_readme_example_on_a_two_cpu_ray_fails_at_once_instead_of_hanging(ray_local, tmp_path):
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    processor = build_processor(root / "configs" / "embedded.yaml",
                                preprocess=lambda r: {"id": r["qid"], "prompt": r["question"]})
    assert processor.config.actors.num_cpus == 2 and ray.cluster_resources()["CPU"] == 2
    pq.write_table(pa.table({"qid": ["a"], "question": ["Name a river."]}), tmp_path / "q.parquet")
    with pytest.raises(ConfigError, match="the pipeline would wait for a CPU forever"):
        processor(ray.data.read_parquet(str(tmp_path / "q.parquet")))


@pytest.mark.slow
def test_a_postprocess_raising_on_one_row_costs_that_row_not_the_pipeline(ray_local, pair, tmp_path):  # noqa: F811
    """All 8 answers were lost when postprocess raised on one row; now that row is a ``postprocess_failed`` row
    holding its answer, the others are what postprocess made, and the dataset writes as Parquet."""
    cfg = config(pair, "x", "y", actors__num_actors=1, actors__num_cpus=0.5, actors__batch_size=4)

    def post(r):
        if r["id"] == "q3":
            raise ValueError("no such field")
        return {"qid": r["id"], "answer": r["output"]}
    ds = build_processor(ProcessorConfig.of(cfg), postprocess=post)(ray.data.from_items(prompts(8)))
    ds.write_parquet(str(tmp_path / "out"))
    parts = [pq.read_table(f) for f in sorted((tmp_path / "out").glob("*.parquet"))]   # schemas differ by file
    rows = sorted(pa.concat_tables(parts, promote_options="default").to_pylist(), key=lambda r: r["qid"] or r["id"])
    failed = [r for r in rows if r.get("error_kind") == "postprocess_failed"]
    assert len(rows) == 8 and [r["id"] for r in failed] == ["q3"] and failed[0]["output"]
    assert failed[0]["error"] == "postprocess failed: ValueError: no such field"
    assert sorted(r["qid"] for r in rows if r["qid"]) == sorted(f"q{i}" for i in range(8) if i != 3)
    assert all(r["answer"] for r in rows if r["qid"])
