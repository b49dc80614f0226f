"""What the batch job does with its input and output paths before and around the engine: a resume keeps only the
answers that still belong to their ids and settings, one run at a time holds an output, paths are used as written,
and an output that cannot be written fails before any model loads. No Ray needed."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from fsspec.implementations.local import LocalFileSystem

from eagle_ray.batch.config import JobConfig
from eagle_ray.batch.job import (OutputLease, PartWriter, check_output_identity, filesystem, input_table,
                                 read_output, resume_output, run_job)
from eagle_ray.batch.summary import JobSummary
from eagle_ray.batch.rows import empty_row, read_input
from eagle_ray.batch.store import put_atomic
from eagle_ray.errors import ConfigError

FS = LocalFileSystem()


def job(inp="in.jsonl", out="out", **kw) -> JobConfig:
    return JobConfig(input={"uri": str(inp)}, output={"uri": str(out)}, **kw)


def write_rows(root, payloads: dict[str, str]) -> None:
    w = PartWriter(FS, str(root), 10, len(payloads))
    w.add([empty_row({"id": i, "row_index": n, "payload": p}) for n, (i, p) in enumerate(payloads.items())])
    w.close()


def test_a_resume_reruns_the_ids_that_now_stand_for_another_request(tmp_path):
    """Rows without ids are keyed by position: a row inserted at the top shifts every later id. The stored input
    tells which answers still belong to their id; the others run again."""
    old = ['{"prompt": "a"}', '{"prompt": "b"}', '{"prompt": "c"}']
    write_rows(tmp_path, {f"row-{i}": p for i, p in enumerate(old)})
    (tmp_path / "in.jsonl").write_text("\n".join(['{"prompt": "new"}'] + old) + "\n")
    now = input_table(read_input(str(tmp_path / "in.jsonl"), FS))
    assert resume_output(FS, str(tmp_path), now, JobSummary()).changed == 3
    assert read_output(FS, str(tmp_path)).num_rows == 0
    write_rows(tmp_path, {"row-0": '{"prompt": "new"}'})
    resumed = resume_output(FS, str(tmp_path), now, JobSummary())
    assert resumed.changed == 0 and resumed.done.to_pylist() == ["row-0"]   # an answer that still fits its id stays


def test_a_resume_with_other_settings_is_refused_naming_each(tmp_path):
    check_output_identity(FS, str(tmp_path), job(sampling={"max_new_tokens": 16}))
    write_rows(tmp_path, {"row-0": '{"prompt": "a"}'})
    check_output_identity(FS, str(tmp_path), job(sampling={"max_new_tokens": 16}))   # the same: resumes
    with pytest.raises(ConfigError, match=r"other settings \(speculative: True there, False now; sampling: "):
        check_output_identity(FS, str(tmp_path), job(sampling={"max_new_tokens": 32}, speculative=False))


def test_one_run_at_a_time_holds_an_output(tmp_path):
    first, second = OutputLease(FS, str(tmp_path), "run-a"), OutputLease(FS, str(tmp_path), "run-b")
    first.acquire()
    with pytest.raises(ConfigError, match="is in use by run run-a on .* wait for it to end"):
        second.acquire()
    first.release()
    second.acquire()   # free again
    second.release()


def test_a_lease_whose_run_died_is_taken_over(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lease = OutputLease(FS, str(tmp_path), "run-new")
    (tmp_path / "_lease.json").write_text(json.dumps(lease.mine | {"run": "run-killed", "pid": int(gone.stdout),
                                                                   "heartbeat": time.time()}))
    lease.acquire()   # a killed driver on this host, resumed at once
    lease.release()
    (tmp_path / "_lease.json").write_text(json.dumps({"run": "run-elsewhere", "host": "another-host", "pid": 1,
                                                      "heartbeat": time.time() - 200}))
    lease.acquire()   # silent for longer than stale_s: a run that died elsewhere
    lease.release()


def _this_namespace() -> dict:
    """What names this process's PID space (as a lease records it)."""
    return {"pid_ns": os.readlink("/proc/self/ns/pid"),
            "boot_id": open("/proc/sys/kernel/random/boot_id").read().strip()}


@pytest.fixture()
def paused_process():
    """A live process of this host, stopped (SIGSTOP) as a paused driver is; yields its pid."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    os.kill(proc.pid, signal.SIGSTOP)
    yield proc.pid
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def test_a_paused_run_on_this_host_keeps_its_output_however_long_its_heartbeat_is_silent(tmp_path, paused_process):
    """A driver stopped past lease_stale_s (SIGSTOP, a long swap) is alive: taking its output over would let both
    runs commit every row once it goes on."""
    import socket
    (tmp_path / "_lease.json").write_text(json.dumps({"run": "run-paused", "host": socket.gethostname(),
                                                      "pid": paused_process, "heartbeat": time.time() - 1000,
                                                      **_this_namespace()}))
    with pytest.raises(ConfigError, match="is in use by run run-paused"):
        OutputLease(FS, str(tmp_path), "run-b", stale_s=2).acquire()


def test_a_lease_from_another_pid_namespace_is_judged_by_its_heartbeat_alone(tmp_path):
    """Two containers with host networking share a host name, not PIDs: the other's pid may name nothing here."""
    import socket
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    other = {"run": "run-next-door", "host": socket.gethostname(), "pid": int(gone.stdout),
             **_this_namespace(), "pid_ns": "pid:[1]"}
    (tmp_path / "_lease.json").write_text(json.dumps(other | {"heartbeat": time.time()}))
    with pytest.raises(ConfigError, match="is in use by run run-next-door"):
        OutputLease(FS, str(tmp_path), "run-b", stale_s=30).acquire()
    (tmp_path / "_lease.json").write_text(json.dumps(other | {"heartbeat": time.time() - 31}))
    lease = OutputLease(FS, str(tmp_path), "run-b", stale_s=30)
    lease.acquire()   # silent past stale_s: taken over
    lease.release()


def test_a_run_whose_output_was_taken_over_commits_nothing_more(tmp_path):
    from eagle_ray.batch.lease import LeaseLostError
    lease = OutputLease(FS, str(tmp_path), "run-a", stale_s=0.4)
    lease.acquire()
    writer = PartWriter(FS, str(tmp_path), 2, 10, before_commit=lease.check)
    writer.add([empty_row({"id": f"r{i}", "row_index": i, "payload": "{}"}) for i in range(2)])   # one part
    taken = {"run": "run-b", "host": "elsewhere", "pid": 1, "heartbeat": time.time()}
    with lease._lock:   # between two renewals, whole, as another run's takeover writes it
        put_atomic(FS, str(tmp_path / "_lease.json"), json.dumps(taken).encode())
    with pytest.raises(LeaseLostError, match="taken over by run run-b on elsewhere"):
        writer.add([empty_row({"id": f"r{i}", "row_index": i, "payload": "{}"}) for i in range(2, 4)])
    writer.close()
    time.sleep(0.3)   # past a renewal: it no longer writes the lease
    lease.release()
    assert read_output(FS, str(tmp_path)).column("id").to_pylist() == ["r0", "r1"]
    assert json.loads((tmp_path / "_lease.json").read_text()) == taken


def test_the_lease_is_replaced_whole_never_rewritten_in_place(tmp_path):
    """A reader (another run's start) sees the old lease or the new one, never an empty or half-written file."""
    lease = OutputLease(FS, str(tmp_path), "run-a", stale_s=0.4)
    lease.acquire()
    with open(tmp_path / "_lease.json") as reader:   # a reader holding the lease as it was
        deadline = time.time() + 30
        while os.fstat(reader.fileno()).st_nlink and time.time() < deadline:   # until a renewal
            time.sleep(0.05)
        assert os.fstat(reader.fileno()).st_nlink == 0   # replaced by a new file, not truncated and rewritten
        assert json.loads(reader.read())["run"] == "run-a"
    assert json.loads((tmp_path / "_lease.json").read_text())["heartbeat"] > 0
    lease.release()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


@pytest.mark.parametrize("folder", ["my data [final]", "runs?", "in[1]"])
@pytest.mark.parametrize("scheme", ["local", "s3"])
def test_an_output_inside_an_input_folder_whose_name_reads_as_a_glob_is_refused(tmp_path, folder, scheme):
    """The input path exists as written, so it is read as written (not as a glob): the output under it would be
    read back as input by the next run."""
    base = str(tmp_path) if scheme == "local" else "s3://bucket/data"
    with pytest.raises(ValueError, match="lies inside input.uri"):
        job(f"{base}/{folder}", f"{base}/{folder}/out")
    with pytest.raises(ValueError, match="lies inside input.uri"):
        job(f"{base}/{folder}/", f"{base}/{folder}/answers/run1")
    job(f"{base}/{folder}", f"{base}/elsewhere/out")   # beside it: fine


def _parquet_with_bytes(path, column: str, values: list[bytes]) -> None:
    """A Parquet file whose string column ``column`` holds ``values`` as they are, UTF-8 or not (as some writers
    store them: Parquet does not check)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    offsets = [0]
    for v in values:
        offsets.append(offsets[-1] + len(v))
    raw = pa.Array.from_buffers(pa.string(), len(values),
                                [None, pa.py_buffer(pa.array(offsets, pa.int32()).buffers()[1]),
                                 pa.py_buffer(b"".join(values))])
    table = {"id": [f"r{i}" for i in range(len(values))], "prompt": ["w1 w2"] * len(values), "note": ["n"] * len(values)}
    table[column] = raw
    pq.write_table(pa.table(table), path)


def test_non_utf8_bytes_in_a_parquet_string_column_make_an_error_row_not_a_crash(tmp_path):
    _parquet_with_bytes(tmp_path / "read.parquet", "prompt", [b"w1 w2", b"caf\xe9 \xff", b"w3"])
    rows = read_input(str(tmp_path / "read.parquet"), FS)
    assert [(r.id, r.kind) for r in rows] == [("r0", ""), ("r1", "invalid_utf8"), ("r2", "")]
    assert "column 'prompt' is not UTF-8 text" in rows[1].error
    assert json.loads(rows[2].payload) == {"id": "r2", "prompt": "w3", "note": "n"}
    _parquet_with_bytes(tmp_path / "unread.parquet", "note", [b"fine", b"\xff\xfe"])   # a column no request reads
    rows = read_input(str(tmp_path / "unread.parquet"), FS)
    assert [(r.id, r.kind, json.loads(r.payload)["prompt"]) for r in rows] == [("r0", "", "w1 w2"), ("r1", "", "w1 w2")]


def test_the_output_records_max_model_len_and_split_special_tokens_and_refuses_a_change_that_mixes_answers(tmp_path):
    check_output_identity(FS, str(tmp_path), job(engine={"max_model_len": 256}))
    recorded = json.loads((tmp_path / "_job.json").read_text())
    assert recorded["max_model_len"] == 256 and recorded["split_special_tokens"] is False
    write_rows(tmp_path, {"row-0": '{"prompt": "a"}'})
    with pytest.raises(ConfigError, match="split_special_tokens: False there, True now"):
        check_output_identity(FS, str(tmp_path), job(engine={"max_model_len": 256}, split_special_tokens=True))
    with pytest.raises(ConfigError, match="max_model_len: 256 there, 128 now.*keep max_model_len at least"):
        check_output_identity(FS, str(tmp_path), job(engine={"max_model_len": 128}))
    assert check_output_identity(FS, str(tmp_path), job(engine={"max_model_len": 512}))["max_model_len"] == 256


@pytest.mark.parametrize("name", ["my data [final]/p.jsonl", "in[1]/p.jsonl", "a?.jsonl"])
def test_an_input_path_that_exists_is_read_as_written_never_as_a_glob(tmp_path, name):
    for decoy in ("my data f/p.jsonl", "in1/p.jsonl", "ab.jsonl"):   # what the glob would match instead
        (tmp_path / decoy).parent.mkdir(exist_ok=True)
        (tmp_path / decoy).write_text('{"prompt": "decoy"}\n')
    (tmp_path / name).parent.mkdir(exist_ok=True)
    (tmp_path / name).write_text('{"prompt": "mine"}\n')
    assert [json.loads(r.payload)["prompt"] for r in read_input(str(tmp_path / name), FS)] == ["mine"]


def test_local_paths_are_used_as_written_and_other_schemes_refused(tmp_path):
    assert filesystem(str(tmp_path / "run::2"), job())[1] == str(tmp_path / "run::2")
    assert filesystem("file://" + str(tmp_path / "x"), job())[1] == str(tmp_path / "x")
    with pytest.raises(ConfigError, match="only local paths and s3:// URIs"):
        filesystem("gs://bucket/x", job())


def test_an_output_that_cannot_be_written_fails_before_any_model_loads(tmp_path, monkeypatch):
    (tmp_path / "in.jsonl").write_text('{"prompt": "a"}\n')
    (tmp_path / "a-file").write_text("")
    import eagle_ray.engine.engine as engine
    monkeypatch.setattr(engine.EagleEngine, "from_config", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(ConfigError, match="cannot be written: (NotADirectoryError|FileExistsError)"):
        run_job(job(tmp_path / "in.jsonl", tmp_path / "a-file" / "out"))


# ---- rows: ids, numbers JSON cannot hold, limits, forged roles ------------------------------------------------------
def rows_of(tmp_path, text: str):
    (tmp_path / "in.jsonl").write_text(text)
    return read_input(str(tmp_path / "in.jsonl"), FS)


def test_an_integral_float_id_is_the_integer_and_1_and_text_1_are_one_id(tmp_path):
    rows = rows_of(tmp_path, '{"id": 1.0, "prompt": "a"}\n{"id": "1", "prompt": "b"}\n{"id": 2.5, "prompt": "c"}\n')
    assert [r.id for r in rows] == ["1", "1@row1", "row-2"]
    assert rows[1].kind == "duplicate_id" and 'so 1 and "1" are one id' in rows[1].error
    assert rows[2].kind == "invalid_row" and rows[2].error == "id must be a string or an integer, got 2.5"


def test_nan_and_infinity_in_a_row_are_written_as_json_text(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"prompt": ["a", "b"], "score": [float("nan"), float("-inf")]}), tmp_path / "in.parquet")
    payloads = [json.loads(r.payload) for r in read_input(str(tmp_path / "in.parquet"), FS)]   # strict JSON
    assert payloads == [{"prompt": "a", "score": "NaN"}, {"prompt": "b", "score": "-Infinity"}]


def multi_turn_stage(tiny_dir, tmp_path):
    from test_batch_faults import stage_for
    return stage_for(tiny_dir, tmp_path)   # max_model_len 128, 8 new tokens


def run_rows(stage, payloads: list[dict]) -> list[dict]:
    import asyncio

    import pyarrow as pa
    batch = pa.Table.from_pylist([{"id": f"r{i}", "row_index": i, "error": None, "error_kind": None,
                                   "payload": json.dumps(p)} for i, p in enumerate(payloads)])
    try:
        return asyncio.run(stage(batch)).to_pylist()
    finally:
        stage.queue.shutdown(drain=False, timeout=10)


def test_a_multi_turn_row_that_outgrows_the_context_keeps_its_answered_turns(tiny_dir, tmp_path):
    """The job refuses what does not fit as Serve does (context_length_exceeded there): a turn whose prompt no
    longer fits, or a row asking for more new tokens than fit after its prompt, never a silent cut."""
    long_turn = " ".join(f"w{i % 50}" for i in range(120))
    turns, asks, fits = run_rows(multi_turn_stage(tiny_dir, tmp_path),
                                 [{"turns": ["w1 w2", long_turn]}, {"prompt": "w1 w2", "sampling_params":
                                                                   {"max_tokens": 100000}},
                                  {"prompt": "w1 w2", "sampling_params": {"max_tokens": 8}}])
    assert turns["error_kind"] == "prompt_too_long" and turns["error"].startswith("turn 2 of 2: ")
    assert "(turns 1-1 were answered: turn_outputs)" in turns["error"] and len(turns["turn_outputs"]) == 1
    assert turns["output"] is None and turns["turn_outputs"][0]
    assert asks["error_kind"] == "prompt_too_long" and "max_tokens=100000 asks for more" in asks["error"]
    assert fits["error"] is None and fits["output_tokens"] == 8


def test_the_job_takes_wide_steps_and_serve_short_ones_unless_the_config_names_a_budget():
    """A batch job has no stream to stall: its steps hold trees beside the prompt chunks of sequences that just
    started (on a 2-core CPU at max batch 32 that raised both plain and EAGLE throughput by about 40%)."""
    from eagle_ray.batch.config import ProcessorConfig
    from eagle_ray.model.numerics import step_tokens
    from eagle_ray.serve.config import ServeConfig
    assert job().engine.cache.step_goal == ProcessorConfig().engine.cache.step_goal == "throughput"
    assert ServeConfig().engine.cache.step_goal == "latency"
    named = job(engine={"max_step_tokens": 64})
    assert (named.engine.cache.step_goal, named.engine.cache.max_step_tokens) == ("latency", 64)
    assert [step_tokens(None, "cpu", goal) for goal in ("latency", "throughput")] == [48, 256]
    assert step_tokens(64, "cpu", "throughput") == 64


def test_two_rows_with_one_id_in_a_processors_batch_are_both_answered(tiny_dir, tmp_path):
    """A user's dataset may repeat an id (n samples of one question): each row is its own request."""
    import asyncio

    import pyarrow as pa
    stage = multi_turn_stage(tiny_dir, tmp_path)
    batch = pa.Table.from_pylist([{"id": "q", "row_index": None, "error": None, "error_kind": None,
                                   "payload": json.dumps({"prompt": "w1 w2"})}] * 2)
    try:
        rows = asyncio.run(stage(batch)).to_pylist()
    finally:
        stage.queue.shutdown(drain=False, timeout=10)
    assert [(r["id"], r["error"], r["output_tokens"]) for r in rows] == [("q", None, 8)] * 2


def test_a_refused_resume_releases_the_output_and_a_run_that_wrote_nothing_binds_nothing(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"prompt": "a"}\n')
    out = tmp_path / "out"
    check_output_identity(FS, str(out.mkdir() or out), job(tmp_path / "in.jsonl", out, speculative=False))
    check_output_identity(FS, str(out), job(tmp_path / "in.jsonl", out))   # no part written: other settings pass
    write_rows(out, {"row-0": '{"prompt": "a"}'})
    with pytest.raises(ConfigError, match="written with other settings"):
        run_job(job(tmp_path / "in.jsonl", out, speculative=False))
    assert not (out / "_lease.json").exists()   # refused, and the output is free again
