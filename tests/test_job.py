"""The Ray Data job end to end on a real local Ray (127.0.0.1), real Parquet and a real S3 API (moto on
loopback): every input id exactly once with its stats, bad rows as error rows, actor and driver crashes survived,
bad configs refused before any model loads."""
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from stopping_driver import acting_after_part, wait_stopped
from tiny import save_target

from eagle_ray.batch.config import JobConfig
from eagle_ray.batch.job import committed_parts, read_output, run_job
from eagle_ray.errors import CheckpointError, ConfigError


pytestmark = pytest.mark.slow  # a real local Ray cluster
ROOT = Path(__file__).resolve().parent.parent


def prompts(n: int, start: int = 0) -> list[dict]:
    rows = []
    for i in range(start, start + n):
        words = " ".join(f"w{(i * 7 + j) % 50}" for j in range(1 + i % 9))
        kind = i % 3
        row = {"id": f"q{i}"}
        if kind == 0:
            row["prompt"] = words
        elif kind == 1:
            row["messages"] = [{"role": "user", "content": words}]
        else:
            row["turns"] = [words, "w1 w2"]
        rows.append(row)
    return rows


def write_jsonl(path: Path, rows: list, raw_lines: list[bytes] = ()) -> None:
    with open(path, "wb") as f:
        for r in rows:
            f.write(json.dumps(r).encode() + b"\n")
        for line in raw_lines:
            f.write(line + b"\n")


def config(pair, inp: str, out: str, **kw) -> JobConfig:
    target, head = pair
    data = {"engine": {"target": target, "draft": head, "dtype": "float32", "max_batch_size": 4,
                       "max_model_len": 128, "tree": {"total_tokens": 8, "depth": 3, "top_k": 3}},
            "sampling": {"max_new_tokens": 12, "ignore_eos": True},
            "input": {"uri": inp}, "output": {"uri": out, "rows_per_file": 25},
            # one actor, as most scenarios need: each actor is a process that imports torch and transformers
            "actors": {"num_actors": 1, "num_cpus": 1, "batch_size": 8, "max_concurrent_batches": 2}}
    for key, value in kw.items():
        node = data
        *parents, last = key.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return JobConfig(**data)


def both_up(monkeypatch) -> None:
    """Ray Data holds the rows until every actor of the pool has started (its default sends them to the first one
    up, which may run them all before a second one starts): a test that asserts every actor worked."""
    import ray.data
    monkeypatch.setattr(ray.data.DataContext.get_current(), "wait_for_min_actors_s", 600)


def ids_of(out_fs_path_table):
    ids = out_fs_path_table.column("id").to_pylist()
    return ids, set(ids)


def test_end_to_end_on_s3_with_two_actors(ray_local, pair, s3, tmp_path, monkeypatch):
    both_up(monkeypatch)
    fs, opts = s3
    bucket = f"data-{uuid.uuid4().hex[:8]}"  # moto's state lives as long as the process: a fresh bucket
    fs.mkdir(bucket)
    rows = prompts(210)
    write_jsonl(tmp_path / "in.jsonl", rows)
    fs.put(str(tmp_path / "in.jsonl"), f"{bucket}/in/prompts.jsonl")
    cfg = config(pair, f"s3://{bucket}/in/", f"s3://{bucket}/out/", s3={"endpoint_url": opts["endpoint_url"]},
                 actors__num_actors=2)
    summary = run_job(cfg, print_fn=lambda *_: None)
    table = read_output(fs, f"{bucket}/out")
    ids = table.column("id").to_pylist()
    assert sorted(ids) == sorted(r["id"] for r in rows) and len(ids) == len(set(ids)) == 210
    df = table.to_pylist()
    assert all(r["error"] is None and r["output_tokens"] > 0 and r["verify_steps"] > 0 and r["tau"] >= 1.0
               and r["worker_id"] and r["finished_at"] >= r["started_at"] for r in df)
    assert all(len(r["turn_outputs"]) == 2 for r in df if r["id"] in {x["id"] for x in rows if "turns" in x})
    assert len({r["worker_id"] for r in df}) == 2  # both actors worked
    assert summary["rows"] == 210 and summary["errors"] == 0 and len(summary["per_actor"]) == 2
    assert json.loads(fs.cat(f"{bucket}/out/summary.json"))["rows"] == 210
    # a re-run finds everything done and writes nothing
    again = run_job(cfg, print_fn=lambda *_: None)
    assert again["written_this_run"] == 0 and read_output(fs, f"{bucket}/out").num_rows == 210


BAD_ROWS = {
    "empty prompt": {"id": "bad-empty", "prompt": ""},
    "wrong type": {"id": "bad-type", "prompt": 42},
    "messages without content": {"id": "bad-msg", "messages": [{"role": "user"}]},
    "unknown role": {"id": "bad-role", "messages": [{"role": "wizard", "content": "w1"}]},
    "prompt too long": {"id": "bad-long", "prompt": " ".join(["w3"] * 400)},
    "invalid sampling": {"id": "bad-sampling", "prompt": "w1 w2", "sampling_params": {"temperature": -1}},
    "duplicate id": {"id": "q0", "prompt": "w5 w6"},
    "no prompt field": {"id": "bad-none", "text": "w1"},
    "not an object": ["w1", "w2"],
    "a batch line for another endpoint": {"custom_id": "b-embed", "url": "/v1/embeddings",
                                          "body": {"model": "m", "input": "w1"}},
}
BATCH_LINE = {"custom_id": "b-chat", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "m", "messages": [{"role": "user", "content": "w1 w2"}], "temperature": 0,
                       "max_tokens": 5}}


def test_bad_rows_become_error_rows_and_the_rest_complete(ray_local, pair, tmp_path):
    good = prompts(20)
    write_jsonl(tmp_path / "in.jsonl", good + list(BAD_ROWS.values()) + [BATCH_LINE],
                raw_lines=[b'{"id": "bad-utf8", "prompt": "caf\xe9 \xff"}', b'{"id": "bad-json", "prompt": '])
    cfg = config(pair, str(tmp_path / "in.jsonl"), str(tmp_path / "out"),
                 output__openai_batch_file=str(tmp_path / "results.jsonl"))
    summary = run_job(cfg, print_fn=lambda *_: None)
    rows = {r["id"]: r for r in read_output(_local(), str(tmp_path / "out")).to_pylist()}
    assert all(rows[r["id"]]["error"] is None and rows[r["id"]]["output_tokens"] == 12 * (2 if "turns" in r else 1)
               for r in good)
    errors = {k: (v["error_kind"], v["error"]) for k, v in rows.items() if v["error"]}
    assert len(errors) == 12 == summary["errors"]
    # OpenAI's batch output file: a line per row, the batch line's answer as its row holds it
    lines = {x["custom_id"]: x for x in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())}
    assert len(lines) == len(rows) == 33 and summary["openai_batch_file"]["answered"] == 1
    chat = lines["b-chat"]["response"]["body"]["choices"][0]
    assert chat["message"]["content"] == rows["b-chat"]["output"] and rows["b-chat"]["output_tokens"] == 5
    assert lines["b-embed"]["response"]["status_code"] == 400 and lines["b-embed"]["error"] is None
    assert lines["row-32"]["response"] is None and lines["row-32"]["error"]["code"] == "invalid_json"
    expect = {"bad-empty": ("invalid_request", "prompt is empty"),
              "bad-type": ("invalid_request", "prompt must be a string"),
              "bad-msg": ("invalid_request", "messages[0].content"),
              "bad-role": ("invalid_request", "role must be one of"),
              "bad-long": ("prompt_too_long", "the most this engine fits"),
              "bad-sampling": ("invalid_request", "sampling_params.temperature"),
              "q0@row26": ("duplicate_id", "duplicate id 'q0'"),
              "bad-none": ("invalid_request", "exactly one of prompt / messages / turns"),
              "row-28": ("invalid_row", "must be a JSON object"),
              "row-31": ("invalid_utf8", "invalid UTF-8"), "row-32": ("invalid_json", "invalid JSON"),
              "b-embed": ("invalid_request", "url: '/v1/embeddings' is not answered")}
    for rid, (kind, reason) in expect.items():
        assert errors[rid][0] == kind and reason in errors[rid][1], (rid, errors[rid])
    assert summary["error_kinds"] == {"invalid_request": 7, "prompt_too_long": 1, "duplicate_id": 1,
                                      "invalid_row": 1, "invalid_utf8": 1, "invalid_json": 1}


def _local():
    import fsspec
    return fsspec.filesystem("file")


def test_invalid_config_fails_before_any_model_loads(tmp_path):
    bad = tmp_path / "job.yaml"
    bad.write_text("input: {uri: x.jsonl}\noutput: {uri: out}\nactors: {num_actors: 0}\n")
    with pytest.raises(ConfigError, match=r"actors\.num_actors"):
        JobConfig.from_yaml(bad)
    proc = subprocess.run([sys.executable, str(ROOT / "jobs" / "batch.py"), "--config", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "actors.num_actors" in proc.stderr and "Loading" not in proc.stderr
    bad.write_text("engine: {tree: {top_k: 0}}\ninput: {uri: x.jsonl}\noutput: {uri: out}\n")
    with pytest.raises(ConfigError, match=r"engine\.(speculation\.)?tree\.top_k"):
        JobConfig.from_yaml(bad)


def test_a_missing_or_mismatched_model_fails_in_one_line_before_ray_starts(pair, tmp_path, monkeypatch):
    """On a local Ray the actors read the driver's paths: a head that does not exist, or one for another target,
    used to kill every actor again and again (174 lines of Ray traces, exit 1) after Ray had started."""
    import eagle_ray.batch.job as job
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    target, head = pair
    other = save_target(tmp_path / "other", vocab_size=80)
    (tmp_path / "in.jsonl").write_text('{"prompt": "w1"}\n')
    cases = [({"target": target, "draft": str(tmp_path / "nope")}, "is not a directory"),
             ({"target": str(tmp_path / "nope"), "draft": head}, "is not a directory"),
             ({"target": str(tmp_path / "nope.gguf")}, "does not exist"),
             ({"target": str(other), "draft": head}, "vocab_size=64, target vocab_size=80")]
    for engine, reason in cases:
        cfg = JobConfig(engine=engine, input={"uri": str(tmp_path / "in.jsonl")}, output={"uri": str(tmp_path / "o")})
        monkeypatch.setattr(job, "ensure_ray", lambda *a: pytest.fail("Ray started"))
        with pytest.raises(CheckpointError, match=reason):
            job.run_job(cfg)
    bad = tmp_path / "job.yaml"
    bad.write_text(f"engine: {{target: {target}, draft: {tmp_path / 'nope'}}}\ninput: {{uri: {tmp_path / 'in.jsonl'}}}\n"
                   f"output: {{uri: {tmp_path / 'o'}}}\n")
    proc = subprocess.run([sys.executable, str(ROOT / "jobs" / "batch.py"), "--config", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "is not a directory" in proc.stderr


def test_shipped_configs_validate():
    for path in (ROOT / "configs").glob("*.yaml"):
        if path.name.startswith("serve"):
            continue
        JobConfig.from_yaml(path)


def test_the_job_tunes_its_tree_unless_told_or_not_drafting():
    io = {"input": {"uri": "x.jsonl"}, "output": {"uri": "out"}}
    assert JobConfig(**io).engine.speculation.tree_policy == "auto"
    assert JobConfig(**io, engine={"max_batch_size": 4}).engine.speculation.tree_policy == "auto"
    assert JobConfig(**io, engine={"tree": {"total_tokens": 4}}).engine.speculation.tree_policy == "fixed"
    assert JobConfig(**io, speculative=False).engine.speculation.tree_policy == "fixed"  # plain decoding: nothing to tune


def test_a_killed_actor_loses_no_row(ray_local, pair, tmp_path, monkeypatch):
    """The actor that ran the first committed part is SIGKILLed as that part is written (rows still to run):
    Ray restarts it and redoes its blocks, and the output holds every row exactly once."""
    from eagle_ray.batch.job import PartWriter
    write_jsonl(tmp_path / "in.jsonl", prompts(80))
    out = tmp_path / "out"
    cfg = config(pair, str(tmp_path / "in.jsonl"), str(out), sampling__max_new_tokens=24, output__rows_per_file=5,
                 actors__batch_size=2, actors__num_actors=2)   # blocks of 8 rows: 10 blocks, a part after one
    killed: list = []

    def kill_its_actor(writer, first_row):
        pid = int(first_row.column("worker_id")[0].as_py().split(":")[1])   # worker_id: host:pid:actor
        os.kill(pid, signal.SIGKILL)
        killed.append((pid, writer.written))

    monkeypatch.setattr(PartWriter, "_commit", acting_after_part(1, kill_its_actor))
    run_job(cfg, print_fn=lambda *_: None)
    ids = read_output(_local(), str(out)).column("id").to_pylist()
    assert killed and killed[0][1] == 5
    assert sorted(ids) == sorted(f"q{i}" for i in range(80))


ADAPTING = {"enabled": True, "save": True, "time_share": 1.0, "round_steps": 2, "batch_tokens": 64, "hold_back": 2}


@pytest.mark.parametrize("adaptation", [None, ADAPTING], ids=["frozen_head", "adapting_head"])
def test_a_killed_driver_resumes_exactly_once(ray_local, pair, tmp_path, adaptation):
    write_jsonl(tmp_path / "in.jsonl", prompts(80))
    out = tmp_path / "out"
    cfg = config(pair, str(tmp_path / "in.jsonl"), str(out), sampling__max_new_tokens=24, output__rows_per_file=10,
                 actors__batch_size=2,   # blocks of 8 rows: the kill after two parts finds rows still to run
                 **({"engine__adaptation": adaptation} if adaptation else {}))
    base_head = {f.name: f.read_bytes() for f in Path(pair[1]).iterdir()}
    proc = _job_process(tmp_path, cfg, _on_session_ray(ray_local), stop_after_parts=2)
    wait_stopped(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert read_output(_local(), str(out)).num_rows == 20
    run_job(cfg, print_fn=lambda *_: None)
    table = read_output(_local(), str(out))
    assert sorted(table.column("id").to_pylist()) == sorted(f"q{i}" for i in range(80))
    assert not list(out.glob(".tmp-*")) or all(pq.read_table(p) for p in committed_parts(_local(), str(out)))
    assert {f.name: f.read_bytes() for f in Path(pair[1]).iterdir()} == base_head   # the head on disk is never changed
    if adaptation:   # every row says which head version it ran with
        assert None not in table.column("head_version").to_pylist()


def test_rows_that_failed_on_an_engine_failure_are_run_again_on_resume(ray_local, pair, tmp_path):
    """A part holding rows that failed because the engine failed (or on a bug) is rewritten without them and
    they are run again; rows that failed on their own input stay as they are."""
    from eagle_ray.batch.job import PartWriter
    rows = prompts(12)
    write_jsonl(tmp_path / "in.jsonl", rows + [{"id": "bad", "prompt": ""}])
    out = tmp_path / "out"
    cfg = config(pair, str(tmp_path / "in.jsonl"), str(out))
    run_job(cfg, print_fn=lambda *_: None)
    table = read_output(_local(), str(out)).to_pylist()
    for r in table:  # pretend q0 and q1 died with the engine, and q2 on a bug
        if r["id"] in ("q0", "q1"):
            r.update(output=None, turn_outputs=None, error="the engine failed: CUDA error", error_kind="engine_failed")
        if r["id"] == "q2":
            r.update(output=None, turn_outputs=None, error="KeyError: 'x'", error_kind="internal_error")
    for p in committed_parts(_local(), str(out)):
        os.remove(p)
    writer = PartWriter(_local(), str(out), 100, len(table))
    writer.add(table)
    writer.close()
    summary = run_job(cfg, print_fn=lambda *_: None)
    final = {r["id"]: r for r in read_output(_local(), str(out)).to_pylist()}
    assert len(final) == 13 == summary["rows"] and summary["written_this_run"] == 3
    assert all(final[i]["error"] is None and final[i]["output"] for i in ("q0", "q1", "q2"))
    assert final["bad"]["error_kind"] == "invalid_request"


def test_a_resume_says_how_many_written_rows_no_input_row_claims_any_more(ray_local, pair, tmp_path):
    """Rows are keyed by id: once an input's ids change, its rows already written are kept, and the resume says
    how many match no input row, since their prompts run again under the new ids."""
    write_jsonl(tmp_path / "in.jsonl", prompts(3))
    out = tmp_path / "out"
    cfg = config(pair, str(tmp_path / "in.jsonl"), str(out))
    assert run_job(cfg, print_fn=lambda *_: None)["rows_matching_no_input"] == 0
    write_jsonl(tmp_path / "in.jsonl", [r | {"id": f"new-{r['id']}"} if r["id"] == "q1" else r for r in prompts(3)])
    said = []
    summary = run_job(cfg, print_fn=said.append)
    assert summary["rows_matching_no_input"] == 1 and summary["written_this_run"] == 1 and summary["rows"] == 4
    assert any(line.startswith("eagle-ray job: 1 rows already in") and "match no input row id" in line
               for line in said)


def _job_process(tmp_path, cfg, env=None, stop_after_parts: int | None = None):
    """``jobs/batch.py`` on ``cfg`` in a process of its own; with ``stop_after_parts`` it stops itself (SIGSTOP)
    once it has committed that many parts (tests/stopping_driver.py): wait for it with :func:`wait_stopped`."""
    (tmp_path / "job.yaml").write_text(json.dumps(json.loads(cfg.model_dump_json())))
    env = dict(env or os.environ)
    script = ROOT / "jobs" / "batch.py"
    if stop_after_parts is not None:
        script = ROOT / "tests" / "stopping_driver.py"
        env["STOP_AFTER_PARTS"] = str(stop_after_parts)
    return subprocess.Popen([sys.executable, str(script), "--config", str(tmp_path / "job.yaml")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _on_session_ray(ray) -> dict:
    return dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address)


def test_sigterm_commits_what_is_finished_and_stops_promptly(ray_local, pair, tmp_path):
    """What Kubernetes and `ray job stop` send: the driver commits finished rows, writes the summary and exits
    (status 143) within seconds; a re-run completes the rest exactly once."""
    write_jsonl(tmp_path / "in.jsonl", prompts(120))
    out = tmp_path / "out"
    cfg = config(pair, str(tmp_path / "in.jsonl"), str(out), sampling__max_new_tokens=24, output__rows_per_file=10)
    proc = _job_process(tmp_path, cfg, _on_session_ray(ray_local), stop_after_parts=1)
    wait_stopped(proc.pid)
    proc.send_signal(signal.SIGTERM)
    t0 = time.time()
    proc.send_signal(signal.SIGCONT)
    log, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, log[-2000:]
    assert time.time() - t0 < 20
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] and 0 < summary["rows"] < 120
    run_job(cfg, print_fn=lambda *_: None)
    ids = read_output(_local(), str(out)).column("id").to_pylist()
    assert sorted(ids) == sorted(f"q{i}" for i in range(120))


def _start_head(tmp: Path, env: dict, tries: int = 3):
    """`ray start --head --block` up: its process and the record it wrote. A new node's raylet waits a fixed 15 s
    for each port its dashboard agent (a Python process importing ray) writes and aborts when one is late; Ray then
    exits "timed out during startup". A loaded 2-core machine, another test process beside it, can exceed that:
    such a start is tried again. The wait ends when the head is up or gone, not at a guessed time."""
    ray_bin = str(Path(sys.executable).parent / "ray")
    record = tmp / "ray" / "ray_current_cluster"
    for attempt in range(tries):
        log = tmp / f"head-{attempt}.log"
        with log.open("w") as log_file:
            head = subprocess.Popen([ray_bin, "start", "--head", "--block", "--num-cpus=2",
                                     "--node-ip-address=127.0.0.1", "--include-dashboard=false",
                                     f"--temp-dir={tmp}/ray", "--port=0"],
                                    env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 600
        while time.time() < deadline and not record.exists() and head.poll() is None:
            time.sleep(0.2)
        if record.exists():
            return head, record
        _kill_group(head)   # what the failed start left running
        if "timed out during startup" not in log.read_text():
            break
    pytest.fail(f"the head (exit {head.poll()}) wrote no record: {log.read_text()[-3000:]}")


def _kill_group(proc: subprocess.Popen) -> None:
    """The process and every process it started (its own session): a head's graceful stop takes ~30 s."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


def test_the_job_joins_a_running_head_and_ignores_a_stale_record_of_one(pair, tmp_path):
    """`ray start --head` already running on this machine: the job connects to it. A record of a head that is
    gone: the job starts its own Ray. (Separate Ray temp dirs keep this away from the test session's Ray.) Neither
    the head nor the job is told an auth mode, as on a user's machine where a local Ray has run before: with a token
    in ~/.ray (a home of its own here, so whatever ran before does not decide it) the head requires it, and the job
    must send it."""
    import secrets
    write_jsonl(tmp_path / "in.jsonl", prompts(6))
    tmp = Path(f"/tmp/er{uuid.uuid4().hex[:6]}")
    (tmp / "home" / ".ray").mkdir(parents=True)
    (tmp / "home" / ".ray" / "auth_token").write_text(secrets.token_hex(32))   # what a local ray.init() writes
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env.update(HOME=str(tmp / "home"), RAY_TMPDIR=str(tmp), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
               RAY_USAGE_STATS_ENABLED="0")
    head, record = _start_head(tmp, env)
    try:
        cfg = config(pair, str(tmp_path / "in.jsonl"), str(tmp_path / "out1"))
        proc = _job_process(tmp_path, cfg, env)
        log, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0 and "connected to the Ray head running on this machine" in log, log[-3000:]
    finally:
        _kill_group(head)
    record.write_text("127.0.0.1:9")   # nothing listens there
    cfg = config(pair, str(tmp_path / "in.jsonl"), str(tmp_path / "out2"))
    proc = _job_process(tmp_path, cfg, env)
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0 and "started a local Ray" in log, log[-3000:]
    assert read_output(_local(), str(tmp_path / "out2")).num_rows == 6


def _paused_after_first_part(tmp_path, pair, stale_s: float, rows: int = 80):
    """A real driver process (jobs/batch.py) on the session's Ray, stopped (SIGSTOP) as it has committed its first
    part: its config, output folder and process."""
    import ray
    write_jsonl(tmp_path / "in.jsonl", prompts(rows))
    out = tmp_path / "out"
    cfg = config(pair, str(tmp_path / "in.jsonl"), str(out), sampling__max_new_tokens=24, output__rows_per_file=10,
                 lease_stale_s=stale_s)
    proc = _job_process(tmp_path, cfg, _on_session_ray(ray), stop_after_parts=1)
    wait_stopped(proc.pid)
    return cfg, out, proc


def test_a_paused_driver_keeps_its_output_and_a_second_run_is_refused(ray_local, pair, tmp_path):
    """Run A stopped past lease_stale_s is alive on this host: run B is refused (it used to take the output over and
    finish, and A, resumed, committed its rows a second time); A resumed finishes every row exactly once."""
    cfg, out, proc = _paused_after_first_part(tmp_path, pair, stale_s=2)
    try:
        time.sleep(3)   # past lease_stale_s
        with pytest.raises(ConfigError, match="is in use by run .* alive [0-9]+ s ago"):
            run_job(cfg, print_fn=lambda *_: None)
    finally:
        proc.send_signal(signal.SIGCONT)
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log[-2000:]
    ids = read_output(_local(), str(out)).column("id").to_pylist()
    assert sorted(ids) == sorted(f"q{i}" for i in range(80))


def test_a_driver_whose_output_was_taken_over_stops_and_commits_nothing_more(ray_local, pair, tmp_path):
    """Taken over from elsewhere while it was silent (another host's run judged it by its heartbeat): resumed, the
    paused driver commits no further part and no summary, and says why (exit status 1)."""
    # no renewal due while the test runs: one the stop froze half-way would write the lease back over the takeover
    cfg, out, proc = _paused_after_first_part(tmp_path, pair, stale_s=600)
    try:
        (out / "_lease.json").write_text(json.dumps({"run": "run-elsewhere", "host": "another-host", "pid": 1,
                                                     "heartbeat": time.time()}))
        parts = {p.name for p in out.glob("part-*.parquet")}
    finally:
        proc.send_signal(signal.SIGCONT)
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 1 and "taken over by run run-elsewhere on another-host" in log, log[-2000:]
    after = {p.name for p in out.glob("part-*.parquet")}
    assert after == parts and len(parts) == 1 and not (out / "summary.json").exists()
    assert json.loads((out / "_lease.json").read_text())["run"] == "run-elsewhere"
    assert read_output(_local(), str(out)).num_rows == 10


def test_an_s3_output_in_a_bucket_that_does_not_exist_fails_before_any_model_loads(s3, tmp_path, monkeypatch):
    """Writing into it would create it, in the store's default region: the job names the bucket instead."""
    import eagle_ray.batch.job as job
    import eagle_ray.engine.engine as engine
    fs, opts = s3
    write_jsonl(tmp_path / "in.jsonl", prompts(3))
    monkeypatch.setattr(engine.EagleEngine, "from_config", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr(job, "ensure_ray", lambda *a: pytest.fail("Ray started"))
    cfg = JobConfig(input={"uri": str(tmp_path / "in.jsonl")}, output={"uri": "s3://no-such-bucket-here/out"},
                    s3={"endpoint_url": opts["endpoint_url"]})
    with pytest.raises(ConfigError, match="the bucket 'no-such-bucket-here' does not exist"):
        run_job(cfg, print_fn=lambda *_: None)
    fs.invalidate_cache()
    assert not fs.exists("no-such-bucket-here")
