"""The driver at scale without Ray: the summary folded part by part says what one pass over every row says, a
resume reads each part once and only the columns it needs, a retried batch adds no row twice, and a resume with a
larger max_model_len runs again the rows the smaller one refused or cut."""
import json
import random
import statistics
from datetime import datetime, timedelta, timezone

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fsspec.implementations.local import LocalFileSystem

from eagle_ray.batch import job as job_module
from eagle_ray.batch.config import JobConfig
from eagle_ray.batch.job import PartWriter, read_output, resume_output, run_job
from eagle_ray.batch.rows import OUTPUT_SCHEMA, empty_row, read_input
from eagle_ray.batch.summary import FinishOrder, JobSummary

FS = LocalFileSystem()
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def result_rows(n: int, seed: int = 0, start: int = 0, errors: bool = True) -> list[dict]:
    """Output rows as actors return them: answers with stats, a few error rows of several kinds."""
    g = random.Random(seed)
    rows = []
    for i in range(start, start + n):
        r = empty_row({"id": f"r{i}", "row_index": i, "payload": json.dumps({"prompt": f"w{i}"})})
        begun = T0 + timedelta(seconds=g.uniform(0, 100))
        r.update(started_at=begun, finished_at=begun + timedelta(seconds=g.uniform(0.1, 5)),
                 worker_id=f"host:{g.randrange(3)}", head_version=g.randrange(2))
        if errors and g.random() < 0.1:
            r.update(error="bad", error_kind=g.choice(["invalid_request", "prompt_too_long", "engine_failed"]))
        else:
            steps = g.randrange(1, 40)
            r.update(output="x", output_token_ids=[1] * 8, output_tokens=g.randrange(1, 60), verify_steps=steps,
                     tau=g.uniform(1, 5), finish_reason="length", max_new_tokens=8)
        rows.append(r)
    return rows


def reference(rows: list[dict], this_run: set[str]) -> dict:
    """The summary as one pass over every row in memory computes it (what the driver did before folding)."""
    ok = [r for r in rows if not r["error"]]
    mine = [r for r in ok if r["id"] in this_run]
    taus = sorted(r["tau"] for r in ok if r["tau"])
    kinds: dict = {}
    for r in rows:
        if r["error"]:
            kinds[r["error_kind"]] = kinds.get(r["error_kind"], 0) + 1
    actors: dict = {}
    for r in mine:
        a = actors.setdefault(r["worker_id"], [0, 0, r["started_at"], r["finished_at"]])
        a[0] += 1
        a[1] += r["output_tokens"]
        a[2], a[3] = min(a[2], r["started_at"]), max(a[3], r["finished_at"])
    done = sorted((r for r in mine if r["tau"]), key=lambda r: r["finished_at"])
    block = max(1, -(-len(done) // 10))
    over_time = [{"rows": len(done[i:i + block]), "tau": round(statistics.mean(r["tau"] for r in done[i:i + block]), 4),
                  "head_versions": sorted({r["head_version"] for r in done[i:i + block]})}
                 for i in range(0, len(done), block)]
    return {"rows": len(rows), "errors": len(rows) - len(ok), "error_kinds": kinds,
            "tau_mean": statistics.mean(taus), "tau_p50": taus[int(0.5 * len(taus))],
            "tau_p90": taus[int(0.9 * len(taus))], "generated_tokens_this_run": sum(r["output_tokens"] for r in mine),
            "per_actor": {w: {"rows": a[0], "tokens": a[1], "tokens_per_s": a[1] / (a[3] - a[2]).total_seconds()}
                          for w, a in actors.items()},
            "generation_span_s": (max(r["finished_at"] for r in mine) - min(r["started_at"] for r in mine))
            .total_seconds() if mine else None,
            "tau_over_time": over_time}


def test_the_summary_folded_part_by_part_says_what_one_pass_over_every_row_says():
    earlier, now = result_rows(300, seed=1), result_rows(700, seed=2, start=300)
    summary = JobSummary()
    summary.add(pa.Table.from_pylist(earlier, schema=OUTPUT_SCHEMA))
    for i in range(0, 700, 64):   # parts as this run commits them
        summary.add(pa.Table.from_pylist(now[i:i + 64], schema=OUTPUT_SCHEMA), this_run=True)
    got, want = summary.result(written_this_run=700, wall=10.0), reference(earlier + now, {r["id"] for r in now})
    for key in ("rows", "errors", "error_kinds", "generated_tokens_this_run", "tau_over_time"):
        assert got[key] == want[key], key
    assert got["tau_mean"] == pytest.approx(want["tau_mean"], rel=1e-12)
    assert abs(got["tau_p50"] - want["tau_p50"]) <= 5e-4 and abs(got["tau_p90"] - want["tau_p90"]) <= 5e-4
    assert {w: (a["rows"], a["tokens"]) for w, a in got["per_actor"].items()} == \
        {w: (a["rows"], a["tokens"]) for w, a in want["per_actor"].items()}
    assert all(got["per_actor"][w]["tokens_per_s"] == pytest.approx(a["tokens_per_s"])
               for w, a in want["per_actor"].items())
    assert got["generation_span_s"] == pytest.approx(want["generation_span_s"])


def test_tau_over_time_past_a_thousand_rows_has_even_tenths_in_finish_order():
    """Past FinishOrder.ROWS rows, runs of equal size in arrival order: each tenth's edge within one run."""
    order, n = FinishOrder(), 10_000
    tau = [1.0 + i / n for i in range(n)]   # rising: each tenth's mean tells where its edges fell
    for i in range(0, n, 16):
        order.add(*(pa.array(x).to_numpy() for x in (tau[i:i + 16], [i // 5000] * 16, list(range(i, i + 16)))))
    tenths = order.tenths()
    run = -(-n // FinishOrder.ROWS) * 2   # rows per run once merged, at most
    assert sum(t["rows"] for t in tenths) == n and len(tenths) in (10, 11)
    assert all(abs(t["rows"] - n / 10) <= run for t in tenths[:9])
    assert tenths[0]["head_versions"] == [0] and tenths[-1]["head_versions"] == [1]
    edge = 0
    for t in tenths:
        exact = statistics.mean(tau[edge:edge + t["rows"]])
        assert t["tau"] == pytest.approx(exact, abs=1e-4)
        edge += t["rows"]


def finished_output(tmp_path, n: int = 100, rows_per_file: int = 10):
    """An input of ``n`` prompts and an output holding every answer, in parts of ``rows_per_file``."""
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"w{i}"}) + "\n"
                                               for i in range(n)))
    inputs = read_input(str(tmp_path / "in.jsonl"), FS)
    rows = result_rows(n, errors=True)
    for r, inp in zip(rows, inputs):
        r["input"] = inp.payload
        if r["error_kind"] == "engine_failed":   # would run again
            r["error_kind"] = "invalid_row"
    w = PartWriter(FS, str(tmp_path / "out"), rows_per_file, n)
    w.add(rows)
    w.close()
    return JobConfig(input={"uri": str(tmp_path / "in.jsonl")}, output={"uri": str(tmp_path / "out")}), rows


def test_a_resume_of_a_finished_output_reads_each_part_once_and_only_the_columns_it_needs(tmp_path, monkeypatch):
    """Nothing to run: no Ray, no model; each part is opened once for its ids, samples, inputs, errors and taus."""
    import eagle_ray.engine.engine as engine
    cfg, rows = finished_output(tmp_path)
    reads = []
    real = pq.read_table
    monkeypatch.setattr(pq, "read_table", lambda f, *a, **k: reads.append(k.get("columns")) or real(f, *a, **k))
    monkeypatch.setattr(engine.EagleEngine, "from_config", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr(job_module, "ensure_ray", lambda *a: pytest.fail("Ray started"))
    summary = run_job(cfg, print_fn=lambda *_: None)
    assert len(reads) == 10 and all(set(c) == {"id", "input", "sample_index", "sampling_params", "error", "error_kind",
                                              "tau"} for c in reads)
    want = reference(rows, set())
    assert (summary["rows"], summary["errors"], summary["error_kinds"], summary["written_this_run"]) == \
        (100, want["errors"], want["error_kinds"], 0)
    assert summary["tau_mean"] == pytest.approx(want["tau_mean"])


def test_a_retried_batch_and_a_row_twice_in_one_batch_are_each_written_once(tmp_path):
    w = PartWriter(FS, str(tmp_path), 4, 10)
    batch = pa.Table.from_pylist(result_rows(6, errors=False), schema=OUTPUT_SCHEMA)
    assert w.add(batch).num_rows == 6
    assert w.add(batch).num_rows == 0                                     # Ray retried it
    twice = pa.concat_tables([batch.slice(0, 1)] * 2).to_pylist()
    assert w.add([dict(r, id="r6", row_index=6) for r in twice]).num_rows == 1
    w.close()
    ids = read_output(FS, str(tmp_path)).column("id").to_pylist()
    assert sorted(ids) == [f"r{i}" for i in range(7)]
    assert [pq.read_metadata(p).num_rows for p in sorted(tmp_path.glob("part-*.parquet"))] == [4, 3]


def test_a_resume_with_a_larger_max_model_len_runs_again_the_rows_the_smaller_one_refused_or_cut(tmp_path):
    rows = result_rows(4, errors=False)
    rows[0].update(output_token_ids=[1] * 8)                     # all it asked for: kept
    rows[1].update(output_token_ids=[1] * 5)                     # cut at the context's end: runs again
    rows[2].update(output=None, output_token_ids=None, finish_reason=None, tau=None, error="too long",
                   error_kind="prompt_too_long")                 # refused: runs again
    rows[3].update(output_token_ids=[1] * 5, finish_reason="stop")   # stopped on its own: kept
    w = PartWriter(FS, str(tmp_path), 10, 4)
    w.add(rows)
    w.close()
    inputs = pa.table({"id": [r["id"] for r in rows], "payload": [r["input"] for r in rows]})
    same = resume_output(FS, str(tmp_path), inputs, JobSummary())     # the same max_model_len: nothing runs again
    assert same.done.to_pylist() == ["r0", "r1", "r2", "r3"]
    summary = JobSummary()
    resumed = resume_output(FS, str(tmp_path), inputs, summary, roomier_than=128)
    assert resumed.roomier == 2 and sorted(resumed.done.to_pylist()) == ["r0", "r3"]
    assert sorted(read_output(FS, str(tmp_path)).column("id").to_pylist()) == ["r0", "r3"] and summary.rows == 2
