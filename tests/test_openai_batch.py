"""OpenAI batch files in the batch job: a line ``{custom_id, method, url, body}`` is answered as Serve answers its
body (the whole answer in ``response``, its first choice in the usual columns), a bad line is an error row holding
the HTTP error Serve would give, and the job writes OpenAI's batch output file, a line per row. No Ray needed: the
stage runs in-process."""
import json

import pytest
from fsspec.implementations.local import LocalFileSystem
from test_job_output import multi_turn_stage, run_rows

from eagle_ray.batch.config import JobConfig
from eagle_ray.batch.openai_batch import write_output_file
from eagle_ray.batch.rows import empty_row, read_input, to_table

FS = LocalFileSystem()
CHAT = [{"role": "user", "content": "w1 w2 w3"}]


def line(custom_id: str, url: str = "/v1/chat/completions", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "any-name", **body}}


def test_a_chat_line_is_the_chat_rows_answer_with_serves_whole_body(tiny_dir, tmp_path):
    plain, answered = run_rows(multi_turn_stage(tiny_dir, tmp_path), [
        {"messages": CHAT, "sampling_params": {"temperature": 0, "max_tokens": 6}},
        line("a", messages=CHAT, temperature=0, max_tokens=6, logprobs=True, top_logprobs=2)])
    assert answered["error"] is None and answered["output"] == plain["output"]
    assert answered["output_token_ids"] == plain["output_token_ids"] and len(plain["output_token_ids"]) == 6
    response = json.loads(answered["response"])
    assert response["status_code"] == 200 and response["request_id"].startswith("req_")
    body = response["body"]
    assert (body["object"], body["model"], body["id"][:9]) == ("chat.completion", "any-name", "chatcmpl-")
    choice, = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": plain["output"]}
    assert choice["finish_reason"] == plain["finish_reason"] == "length" and choice["stop_reason"] is None
    assert [len(e["top_logprobs"]) for e in choice["logprobs"]["content"]] == [2] * 6
    assert body["usage"] == {"prompt_tokens": plain["prompt_tokens"], "completion_tokens": 6,
                             "total_tokens": plain["prompt_tokens"] + 6}
    assert (answered["prompt_tokens"], answered["output_tokens"]) == (plain["prompt_tokens"], 6)
    assert answered["verify_steps"] == body["eagle"]["verify_steps"] > 0 and answered["sample_index"] == 0


def test_a_completion_lines_choices_are_one_row_and_a_responses_line_is_a_response(tiny_dir, tmp_path):
    samples, responses = run_rows(multi_turn_stage(tiny_dir, tmp_path), [
        line("n", "/v1/completions", prompt="w4 w5", n=3, seed=7, max_tokens=4),
        line("r", "/v1/responses", input="w1 w2 w3", temperature=0, max_output_tokens=6)])
    body = json.loads(samples["response"])["body"]
    assert body["object"] == "text_completion" and [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert len({c["text"] for c in body["choices"]}) == 3 and samples["output"] == body["choices"][0]["text"]
    assert body["usage"]["completion_tokens"] == 12 == samples["output_tokens"]   # the row's: every choice's
    assert len(samples["output_token_ids"]) == 4   # the first choice's
    assert samples["temperature"] == 1.0 and json.loads(samples["sampling_params"])["n"] == 1   # one row
    answer = json.loads(responses["response"])["body"]
    assert (answer["object"], answer["status"]) == ("response", "incomplete")
    assert answer["output"][0]["content"][0]["text"] == responses["output"]
    assert answer["usage"]["output_tokens"] == responses["output_tokens"] == 6


@pytest.mark.parametrize("bad,status,kind,reason", [
    (line("a", "/v1/embeddings", input="w1"), 400, "invalid_request", "url: '/v1/embeddings' is not answered"),
    (line("a", messages=CHAT) | {"method": "GET"}, 400, "invalid_request", "method: only POST"),
    (line("a", messages=CHAT) | {"url": []}, 400, "invalid_request", "url: [] is not answered"),   # found by fuzzing
    ({k: v for k, v in line("a", messages=CHAT).items() if k != "custom_id"}, 400, "invalid_request",
     "custom_id: a non-empty string"),
    (line("a", messages=CHAT, stream=True), 400, "invalid_request", "stream: a batch line's answer is written whole"),
    (line("a", messages=CHAT, temperature=3), 400, "invalid_request", "temperature"),
    ({"custom_id": "a", "url": "/v1/chat/completions", "body": {"messages": CHAT}}, 400, "invalid_request",
     "model"),
    (line("a", messages=CHAT, max_tokens=500), 400, "prompt_too_long", "max_tokens"),
    (line("a", "/v1/responses", input="w1", previous_response_id="resp_1"), 400, "invalid_request",
     "previous_response_id"),
])
def test_a_bad_line_is_an_error_row_holding_the_http_error_serve_gives(tiny_dir, tmp_path, bad, status, kind,
                                                                        reason):
    row, = run_rows(multi_turn_stage(tiny_dir, tmp_path), [bad])
    assert row["error_kind"] == kind and reason in row["error"], row["error"]
    response = json.loads(row["response"])
    assert response["status_code"] == status and response["body"]["error"]["message"] == row["error"]
    assert row["output"] is None and row["output_token_ids"] is None


def test_a_responses_line_takes_its_priority():
    from eagle_ray.batch.openai_batch import parse_line
    kind, req = parse_line(line("r", "/v1/responses", input="w1", priority=-5), 8, None, None)
    assert (kind, req.params.priority) == ("responses", -5)


def test_a_lines_id_is_its_custom_id_and_a_row_with_a_url_column_stays_a_row(tmp_path):
    from eagle_ray.batch.rows import is_batch_line
    path = tmp_path / "batch.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (line("first", messages=CHAT), line("first", messages=CHAT),
                                                      {"id": "plain", "prompt": "w1"})) + "\n")
    rows = read_input(str(path), FS)
    assert [r.id for r in rows] == ["first", "first@row1", "plain"] and rows[1].kind == "duplicate_id"
    assert is_batch_line({"url": "/v1/completions", "body": {}}) and is_batch_line({"custom_id": "a"})
    assert not is_batch_line({"id": "d", "prompt": "Summarise", "url": "https://example.com/a"})
    assert not is_batch_line({"messages": CHAT, "body": "an article", "custom_id": "a"})


def test_the_batch_output_file_holds_a_line_per_row(tmp_path):
    def row(rid, at, **cols):
        return empty_row({"id": rid, "row_index": at, "payload": "{}"}) | {"sample_index": 0} | cols
    answered = {"status_code": 200, "request_id": "req_1", "body": {"object": "chat.completion"}}
    refused = {"status_code": 400, "request_id": "req_2", "body": {"error": {"message": "m"}}}
    table = to_table([row("a", 0, response=json.dumps(answered)),
                      row("b", 1, response=json.dumps(refused), error="m", error_kind="invalid_request"),
                      row("row-2", 2, error="in.jsonl:3: invalid JSON", error_kind="invalid_json", sample_index=None),
                      row("p", 3), row("p", 3, sample_index=1)])
    counts = write_output_file([table], FS, str(tmp_path / "results.jsonl"))
    lines = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert counts == {"lines": 4, "answered": 1}
    assert [(x["custom_id"], x["response"], x["error"]) for x in lines] == [
        ("a", answered, None), ("b", refused, None),
        ("row-2", None, {"code": "invalid_json", "message": "in.jsonl:3: invalid JSON"}),
        ("p", None, {"code": "not_a_batch_request",
                     "message": "this row is not an OpenAI batch request line (custom_id, method, url, body)"})]
    assert len({x["id"] for x in lines}) == 4 and all(x["id"].startswith("batch_req_") for x in lines)
    assert [p.name for p in tmp_path.iterdir()] == ["results.jsonl"]   # nothing left beside it


def test_the_batch_output_files_place_is_checked_before_any_model_loads(tmp_path):
    from eagle_ray.batch.job import check_openai_batch_file
    from eagle_ray.errors import ConfigError

    def job(batch_file: str) -> JobConfig:
        return JobConfig(input={"uri": str(tmp_path / "in")},
                         output={"uri": str(tmp_path / "out"), "openai_batch_file": batch_file})
    with pytest.raises(ValueError, match="output.openai_batch_file .* lies inside input.uri"):
        job(str(tmp_path / "in/res.jsonl"))
    with pytest.raises(ValueError, match="names output.uri, the parts' folder"):
        job(str(tmp_path / "out"))
    (tmp_path / "folder").mkdir()
    with pytest.raises(ConfigError, match="is a folder"):
        check_openai_batch_file(job(str(tmp_path / "folder")))
    with pytest.raises(ConfigError, match="gs://"):
        check_openai_batch_file(job("gs://bucket/res.jsonl"))
    check_openai_batch_file(job(str(tmp_path / "new/deeper/res.jsonl")))   # a local file's folder is made
    assert (tmp_path / "new/deeper").is_dir()


def test_the_batch_output_file_holds_the_rows_an_input_row_claims_and_a_failed_write_is_said(tmp_path):
    from eagle_ray.batch.job import PartWriter, check_written, input_table, write_openai_batch
    from eagle_ray.batch.rows import InputRow
    from eagle_ray.errors import ConfigError
    out = tmp_path / "out"
    writer = PartWriter(FS, str(out), 10, 2)
    writer.add([empty_row({"id": rid, "row_index": i, "payload": "{}"}) | {"sample_index": 0}
                for i, rid in enumerate(("kept", "gone"))])
    writer.close()
    cfg = JobConfig(input={"uri": str(tmp_path / "in.jsonl")},
                    output={"uri": str(out), "openai_batch_file": str(tmp_path / "res.jsonl")})
    inputs = input_table([InputRow(0, "kept", "{}")])
    said = []
    assert write_openai_batch(cfg, FS, str(out), inputs, False, said.append) == {
        "uri": str(tmp_path / "res.jsonl"), "lines": 1, "answered": 0}
    assert [json.loads(x)["custom_id"] for x in (tmp_path / "res.jsonl").read_text().splitlines()] == ["kept"]
    assert write_openai_batch(cfg, FS, str(out), inputs, True, said.append) is None   # a stopped run writes none
    broken = cfg.model_copy(update={"output": cfg.output.model_copy(update={
        "openai_batch_file": str(tmp_path / "missing/res.jsonl")})})
    failed = write_openai_batch(broken, FS, str(out), inputs, False, said.append)
    assert failed["error"].startswith("FileNotFoundError")
    with pytest.raises(ConfigError, match="could not be written .* run again to write it"):
        check_written(broken, failed)


def test_a_predictions_tokens_are_counted_as_openai_counts_them(tiny_dir, tmp_path):
    """OpenAI's ``completion_tokens_details``: the predicted tokens the output holds, in order, are accepted; the
    rest of the prediction rejected."""
    from eagle_ray.serve.choices import prediction_tokens
    assert prediction_tokens([5, 6, 7, 8, 9], [5, 6, 1, 8, 9, 2]) == (4, 1)
    assert prediction_tokens([3, 4], [5, 6]) == (0, 2)
    stage = multi_turn_stage(tiny_dir, tmp_path)
    plain, = run_rows(stage, [line("p", messages=CHAT, temperature=0, max_tokens=6)])
    guess = stage.engine.tokenizer.decode(plain["output_token_ids"]) + " w50 w51"
    stage = multi_turn_stage(tiny_dir, tmp_path)
    predicted, = run_rows(stage, [line("p", messages=CHAT, temperature=0, max_tokens=6,
                                       prediction={"type": "content", "content": guess})])
    usage = json.loads(predicted["response"])["body"]["usage"]
    extra = len(stage.engine.tokenizer(" w50 w51", add_special_tokens=False)["input_ids"])
    assert predicted["output"] == plain["output"] and "completion_tokens_details" not in \
        json.loads(plain["response"])["body"]["usage"]
    assert usage["completion_tokens_details"] == {"accepted_prediction_tokens": 6, "rejected_prediction_tokens": extra}


def test_return_token_ids_and_tokens_as_ids_are_vllms(tiny_dir, tmp_path):
    """``return_token_ids``: chat's prompt ids beside its choices and each choice's output ids; a completion's both
    in each choice. ``return_tokens_as_token_ids``: logprobs name tokens ``token_id:<id>``."""
    chat, completion = run_rows(multi_turn_stage(tiny_dir, tmp_path), [
        line("c", messages=CHAT, temperature=0, max_tokens=4, return_token_ids=True, logprobs=True,
             top_logprobs=1, return_tokens_as_token_ids=True),
        line("t", "/v1/completions", prompt="w1 w2", temperature=0, max_tokens=3, logprobs=1,
             return_token_ids=True, return_tokens_as_token_ids=True)])
    body = json.loads(chat["response"])["body"]
    ids = chat["output_token_ids"]
    assert body["choices"][0]["token_ids"] == ids and len(body["prompt_token_ids"]) == chat["prompt_tokens"]
    entries = body["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in entries] == [f"token_id:{t}" for t in ids]
    assert entries[0]["top_logprobs"][0]["token"] == f"token_id:{ids[0]}"   # greedy: the top one is the token
    choice = json.loads(completion["response"])["body"]["choices"][0]
    assert choice["token_ids"] == completion["output_token_ids"] and len(choice["prompt_token_ids"]) == \
        completion["prompt_tokens"]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in completion["output_token_ids"]]
    assert set(choice["logprobs"]["top_logprobs"][0]) == {f"token_id:{completion['output_token_ids'][0]}"}


def test_a_chat_lines_echo_starts_its_answer_with_the_last_message_as_vllms_does(tiny_dir, tmp_path):
    """vLLM's chat ``echo``: the last message's text first, where it has the answer's role (an assistant's prefill,
    continued); a user's last message, with the assistant's turn opened, is not echoed."""
    prefilled = CHAT + [{"role": "assistant", "content": "w7 w8"}]
    cont = {"add_generation_prompt": False, "continue_final_message": True, "temperature": 0, "max_tokens": 4}
    plain, echoed, opened = run_rows(multi_turn_stage(tiny_dir, tmp_path), [
        line("p", messages=prefilled, **cont), line("e", messages=prefilled, echo=True, **cont),
        line("u", messages=CHAT, echo=True, temperature=0, max_tokens=4)])
    content = [json.loads(r["response"])["body"]["choices"][0]["message"]["content"] for r in (plain, echoed, opened)]
    assert plain["output"] == content[0] and echoed["output"] == content[1] == "w7 w8" + plain["output"]
    assert echoed["output_token_ids"] == plain["output_token_ids"]   # the tokens made, as the usage counts them
    assert content[2] == opened["output"]


def test_a_line_of_several_choices_is_one_row_that_a_resume_finds_done(tiny_dir, tmp_path):
    import pyarrow as pa

    from eagle_ray.batch.job import PartWriter, resume_output
    from eagle_ray.batch.summary import JobSummary
    row, = run_rows(multi_turn_stage(tiny_dir, tmp_path), [line("n", "/v1/completions", prompt="w1", n=3,
                                                                max_tokens=2)])
    out = tmp_path / "written"
    writer = PartWriter(FS, str(out), 10, 1)
    writer.add([row])
    writer.close()
    found = resume_output(FS, str(out), pa.table({"id": [row["id"]], "payload": [row["input"]]}), JobSummary())
    assert found.done.to_pylist() == [row["id"]] and found.partial.num_rows == 0


def test_a_batch_file_in_parquet_is_read_as_its_lines(tiny_dir, tmp_path):
    """Arrow gives every line's body the keys any line's has, as nulls (a chat's ``prompt``, a completion's
    ``messages``): a null is absent, so each line reads as it was written."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    lines = [line("c", messages=CHAT, temperature=0, max_tokens=3),
             line("t", "/v1/completions", prompt="w1 w2", temperature=0, max_tokens=3, logprobs=1)]
    pq.write_table(pa.Table.from_pylist(lines), tmp_path / "batch.parquet")
    rows = read_input(str(tmp_path / "batch.parquet"), FS)
    assert [r.id for r in rows] == ["c", "t"] and json.loads(rows[0].payload)["body"]["prompt"] is None
    stage = multi_turn_stage(tiny_dir, tmp_path)
    import asyncio
    batch = pa.Table.from_pylist([r.as_item() for r in rows])
    try:
        chat, text = asyncio.run(stage(batch)).to_pylist()
    finally:
        stage.queue.shutdown(drain=False, timeout=10)
    assert chat["error"] is None and text["error"] is None
    assert json.loads(chat["response"])["body"]["object"] == "chat.completion"
    assert json.loads(text["response"])["body"]["choices"][0]["logprobs"]["tokens"]
