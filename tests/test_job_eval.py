"""The batch job's eval rows: log-probabilities as typed columns, n samples as rows of their own, continuations
scored without generating, bad fields as invalid_request rows; and the exactly-once output keyed by (id, sample).
No Ray needed: the stage runs in-process."""
import json

import pyarrow as pa
import pytest
from fsspec.implementations.local import LocalFileSystem
from test_job_output import multi_turn_stage, run_rows

from eagle_ray.batch.job import PartWriter, read_output, resume_output
from eagle_ray.batch.rows import OUTPUT_SCHEMA, empty_row, to_table
from eagle_ray.batch.summary import JobSummary

FS = LocalFileSystem()


def test_logprobs_samples_and_scores_come_back_as_typed_columns(tiny_dir, tmp_path):
    stage = multi_turn_stage(tiny_dir, tmp_path)
    engine = stage.engine
    rows = run_rows(stage, [
        {"prompt": "w1 w2 w3", "sampling_params": {"logprobs": 2}},
        {"prompt": "w4 w5", "sampling_params": {"n": 3, "temperature": 1.0, "seed": 5}},
        {"prompt": "w6 w7 w8", "continuations": [" w9", " w10 w11"]},
        {"prompt": "w6 w7 w8", "continuation": " w10 w11"}])
    lp, s0, s1, s2, mc, single = rows
    assert lp["sample_index"] == 0 and len(lp["output_logprobs"]) == len(lp["output_token_ids"]) == 8
    assert [len(t) for t in lp["output_top_logprobs"]] == [2] * 8 and set(lp["output_top_logprobs"][0][0]) == \
        {"token_id", "logprob"}
    assert [(r["id"], r["sample_index"]) for r in (s0, s1, s2)] == [("r1", 0), ("r1", 1), ("r1", 2)]
    assert len({tuple(r["output_token_ids"]) for r in (s0, s1, s2)}) == 3 and s0["output_logprobs"] is None
    want = engine.score([("w6 w7 w8", [" w9", " w10 w11"])])[0]
    assert mc["continuation_logprobs"] == pytest.approx([s.logprob for s in want], abs=1e-6)
    assert mc["continuation_tokens"] == [1, 2] and mc["continuation_greedy"] == [s.greedy for s in want]
    assert mc["output"] is None and mc["output_tokens"] == 0 and mc["prompt_tokens"] == 3
    assert single["continuation_logprobs"] == mc["continuation_logprobs"][1:]
    frame = to_table([dict(r) for r in rows]).to_pandas()   # the schema holds every row, and pandas reads it
    assert list(frame["sample_index"]) == [0, 0, 1, 2, 0, 0]
    assert frame["output_top_logprobs"][0][0][0]["token_id"] == lp["output_top_logprobs"][0][0]["token_id"]


@pytest.mark.parametrize("row,reason", [
    ({"prompt": "w1", "sampling_params": {"n": 2000}}, "sampling_params.n: Input should be less than or equal to "
                                                       "1024"),
    ({"prompt": "w1", "sampling_params": {"logprobs": 21}}, "sampling_params.logprobs: Input should be less than"),
    ({"prompt": "w1", "sampling_params": {"logprobs": "2"}}, "sampling_params.logprobs: an integer is required"),
    ({"turns": ["w1", "w2"], "sampling_params": {"n": 2}}, "sampling_params.n: samples of a conversation"),
    ({"messages": [{"role": "user", "content": "w1"}], "continuation": " w2"}, "not after messages"),
    ({"prompt": "w1", "continuations": []}, "non-empty list"),
    ({"prompt": "w1", "continuation": " w2", "sampling_params": {"n": 2}}, "takes no samples"),
    ({"prompt": "w1", "continuation": " w2", "continuations": [" w3"]}, "not both"),
])
def test_bad_eval_fields_are_invalid_request_rows_naming_the_field(tiny_dir, tmp_path, row, reason):
    out, = run_rows(multi_turn_stage(tiny_dir, tmp_path), [row])
    assert out["error_kind"] == "invalid_request" and reason in out["error"], out["error"]
    assert out["output"] is None and out["continuation_logprobs"] is None


def sample_row(rid: str, at: int, index: int | None, n: int, error: str | None = None) -> dict:
    row = empty_row({"id": rid, "row_index": at, "payload": "{}"})
    row.update(sample_index=index, sampling_params=json.dumps({"n": n}), error=error,
               error_kind="invalid_request" if error else None)
    return row


INPUTS = pa.table({"row_index": pa.array([0, 1, 2], pa.int64()), "id": ["a", "b", "c"], "payload": ["{}"] * 3})


def resumed(root) -> tuple[set[str], set[tuple[str, int]]]:
    """What a resume of ``root`` finds: the ids done, and the (id, sample) pairs there of rows not done."""
    found = resume_output(FS, str(root), INPUTS.select(["id", "payload"]), JobSummary())
    return set(found.done.to_pylist()), set(zip(*(found.partial.column(c).to_pylist() for c in ("id", "sample_index"))))


def test_the_output_holds_each_sample_once_and_a_row_is_done_when_all_its_samples_are(tmp_path):
    writer = PartWriter(FS, str(tmp_path), 2, 3)
    writer.add([sample_row("a", 0, 0, 3), sample_row("a", 0, 1, 3), sample_row("a", 0, 1, 3), sample_row("b", 1, 0, 1)])
    writer.close()
    assert sorted((r["id"], r["sample_index"]) for r in read_output(FS, str(tmp_path)).to_pylist()) == \
        [("a", 0), ("a", 1), ("b", 0)]
    assert resumed(tmp_path) == ({"b"}, {("a", 0), ("a", 1)})   # a's third sample is missing: a runs again
    again = PartWriter(FS, str(tmp_path), 10, 3)
    again.written_before(resume_output(FS, str(tmp_path), INPUTS.select(["id", "payload"]), JobSummary()).partial,
                         INPUTS)
    again.add([sample_row("a", 0, 0, 3), sample_row("a", 0, 1, 3), sample_row("a", 0, 2, 3),
               sample_row("c", 2, None, 4, "bad")])
    again.close()
    assert again.written == 2 and resumed(tmp_path) == ({"a", "b", "c"}, set())


def test_an_output_written_before_samples_existed_resumes(tmp_path):
    """Parts without the sample columns read them as null: every row is sample 0 of one."""
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"id": ["a"], "input": ["{}"], "error": pa.array([None], pa.string())}),
                   tmp_path / "part-old-0.parquet")
    assert "sample_index" in OUTPUT_SCHEMA.names
    assert resumed(tmp_path) == ({"a"}, set())


def test_an_output_written_before_the_eval_fields_resumes_with_the_same_sampling(tmp_path):
    from eagle_ray.batch.config import JobConfig
    from eagle_ray.batch.job import JOB_FILE, check_output_identity, output_identity
    cfg = JobConfig(input={"uri": str(tmp_path / "in.jsonl")}, output={"uri": str(tmp_path)})
    old = output_identity(cfg)
    for field in ("logprobs", "n"):
        del old["sampling"][field]
    (tmp_path / JOB_FILE).write_text(json.dumps(old))
    writer = PartWriter(FS, str(tmp_path), 10, 1)
    writer.add([sample_row("a", 0, 0, 1)])
    writer.close()
    check_output_identity(FS, str(tmp_path), cfg)   # resumes: nothing it ran with has changed


def test_the_progress_line_counts_an_input_row_once_however_many_samples_it_has():
    from eagle_ray.batch.job import Progress
    lines = []
    progress = Progress(2, every_s=1e9, print_fn=lines.append, clock=lambda: 1.0)
    progress.add(pa.Table.from_pylist([{"sample_index": i, "output_tokens": 4, "verify_steps": 2, "tau": 2.0}
                                       for i in range(3)] + [{"sample_index": None, "output_tokens": 4,
                                                              "verify_steps": 2, "tau": 2.0}]))
    assert progress.rows == 2 and progress.tokens == 16 and lines[-1].startswith("eagle-ray job: 2/2 rows (100%)")


def test_a_rows_stop_reason_names_the_stop_that_ended_it(tiny_dir, tmp_path):
    """vLLM's ``stop_reason``: the stop token id (as its digits: the column is text) or the stop string; none at
    the length or EOS."""
    stage = multi_turn_stage(tiny_dir, tmp_path)
    full, = run_rows(stage, [{"prompt": "w1 w2 w3", "sampling_params": {"temperature": 0}}])
    tok = full["output_token_ids"][3]
    stage = multi_turn_stage(tiny_dir, tmp_path)
    by_token, at_length = run_rows(stage, [
        {"prompt": "w1 w2 w3", "sampling_params": {"temperature": 0, "stop_token_ids": [tok]}},
        {"prompt": "w1 w2 w3", "sampling_params": {"temperature": 0}}])
    end = full["output_token_ids"].index(tok) + 1
    assert by_token["output_token_ids"] == full["output_token_ids"][:end] and by_token["stop_reason"] == str(tok)
    assert (at_length["finish_reason"], at_length["stop_reason"]) == ("length", None)


def test_a_rows_n_is_read_first_whatever_its_schema_holds(tiny_dir, tmp_path):
    """A resume reads ``n`` from ``sampling_params``: a schema holding ``"n": 5`` of its own must not be read as
    five samples (the row would run again on every resume)."""
    from eagle_ray.batch.job import samples_asked
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "examples": [{"n": 5}]}
    row, = run_rows(multi_turn_stage(tiny_dir, tmp_path), [{"prompt": "w1", "sampling_params": {
        "guided_json": schema, "max_tokens": 4}}])
    assert row["error"] is None and samples_asked(pa.chunked_array([[row["sampling_params"]]])).to_pylist() == [1]
