"""The batch job's driver at scale, with an instant engine (``instant_engine.py``) so that the pipeline alone is
measured: the driver's peak memory and wall time for a whole job and for a no-op resume of its finished output,
and the rows/s the pipeline moves once rows flow.

    python bench/job_driver.py SUBCOMMAND --help

``scale``
    Each shape (``short``: 8-token answers; ``long``: 1,024-token answers) and rows count, each checkout in turn
    (``--code NAME=PATH``: whose ``eagle_ray`` the driver and the actors import; ``.`` is this one): a job into a new
    output, then a resume of that finished output (every row already there: nothing runs), each in a fresh process
    whose peak RSS (``ru_maxrss``) is the driver's. Ray is local (``--ray-cpus`` logical CPUs), two actors.

        python bench/job_driver.py scale --code before=/path/to/base --code after=. \
            --shape short:1000000 --shape long:100000 --out bench/results/<hardware>/job_driver_scale.json

``throughput``
    Rows/s of the pipeline at one shape, the checkouts taking turns over ``--rounds`` (A B B A ...): from the first
    progress line that counts a row to the last, so Ray's start and the summary are left out (both are reported).

        python bench/job_driver.py throughput --code before=/path/to/base --code after=. --rows 100000 --rounds 2 \
            --out bench/results/<hardware>/job_driver_throughput.json

``resume``
    The no-op resume alone at each shape and rows count, on one finished output written straight to Parquet (the
    rows an instant-engine job writes, ``rows_per_file`` 256, no Ray): each checkout in turn resumes it in a fresh
    process (nothing to run: its peak RSS and wall time are the resume's and the summary's). For sizes whose job
    would take long on a small machine.

        python bench/job_driver.py resume --code before=/path/to/base --code after=. \
            --shape short:1000000 --shape long:100000 --out bench/results/<hardware>/job_driver_resume.json

Every subcommand writes JSON naming the hardware, torch version, threads and command line (``harness.py``).
"""
from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import run_entry, subcommand, write_result

SCRIPT = "bench/job_driver.py"
HERE = Path(__file__).resolve().parent
SHAPES = {"short": 8, "long": 1024}   # answer tokens per row
PROGRESS = re.compile(r"eagle-ray job: (\d+)/(\d+) rows")


def write_input(path: Path, rows: int) -> Path:
    """``rows`` JSON lines of short prompts with ids (written once per size and reused)."""
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            for i in range(rows):
                f.write(json.dumps({"id": f"r{i}", "prompt": f"Classify item {i}: w{i % 97} w{i % 13} w{i % 7}"})
                        + "\n")
        tmp.rename(path)
    return path


def job_config(inp: Path, out: Path, batch_size: int) -> dict:
    return {"input": {"uri": str(inp)}, "output": {"uri": str(out)}, "progress_every_s": 1.0,
            "engine": {"tree": {"total_tokens": 8, "depth": 2, "top_k": 3}},
            "actors": {"num_actors": 2, "num_cpus": 1, "batch_size": batch_size, "max_concurrent_batches": 4}}


def one_run(a) -> int:
    """In a fresh process: the job (or its resume) once; prints its figures as JSON."""
    # the harness put this repository first and imported its eagle_ray: the checkout's replaces both
    import repo_root
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != repo_root.ROOT]
    for name in [m for m in sys.modules if m == "eagle_ray" or m.startswith("eagle_ray.")]:
        del sys.modules[name]
    sys.path.insert(0, a.code)
    from eagle_ray.batch.config import JobConfig
    from eagle_ray.batch.job import run_job
    import eagle_ray
    assert Path(eagle_ray.__file__).resolve().is_relative_to(Path(a.code).resolve()), eagle_ray.__file__
    cfg = JobConfig(**json.loads(a.config))
    if a.block_rows:
        import eagle_ray.batch.job as job
        job.rows_per_block = lambda cfg: a.block_rows
    lines: list[tuple[float, int, float]] = []

    def cpu() -> float:
        u = resource.getrusage(resource.RUSAGE_SELF)
        return u.ru_utime + u.ru_stime

    def progress(line: str) -> None:
        m = PROGRESS.match(line)
        if m:
            lines.append((time.perf_counter(), int(m.group(1)), cpu(), time.thread_time()))

    ray_s = 0.0
    if a.phase == "resume":   # nothing may run: a resume that finds rows to send fails rather than starting Ray
        import eagle_ray.batch.job as job

        def no_ray(*args):
            raise RuntimeError("the resume found rows to run")
        job.ensure_ray = no_ray
    if a.phase == "job":
        import ray
        from instant_engine import ray_runtime_env
        t = time.perf_counter()
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=a.ray_cpus,
                 log_to_driver=False, runtime_env=ray_runtime_env(SHAPES[a.shape], a.code))
        ray_s = time.perf_counter() - t
    t0 = time.perf_counter()
    summary = run_job(cfg, print_fn=progress)
    wall = time.perf_counter() - t0
    flowing = [x for x in lines if x[1] > 0]
    rate = cpu_per_row = main_per_row = None
    if len(flowing) >= 2 and flowing[-1][1] > flowing[0][1]:
        (t0_, n0, c0, m0), (t1, n1, c1, m1) = flowing[0], flowing[-1]
        rate, cpu_per_row, main_per_row = (n1 - n0) / (t1 - t0_), (c1 - c0) / (n1 - n0), (m1 - m0) / (n1 - n0)
    print(json.dumps({"phase": a.phase, "wall_s": round(wall, 2), "ray_init_s": round(ray_s, 2),
                      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                      "rows": summary["rows"], "written_this_run": summary["written_this_run"],
                      "errors": summary["errors"], "tau_p50": summary["tau_p50"],
                      "rows_per_s_flowing": None if rate is None else round(rate, 1),
                      "driver_cpu_us_per_row_flowing": None if cpu_per_row is None else round(cpu_per_row * 1e6, 1),
                      "main_thread_cpu_us_per_row_flowing": None if main_per_row is None else round(main_per_row * 1e6,
                                                                                                    1),
                      "driver_cpu_s": round(cpu(), 2),
                      "first_row_after_s": round(flowing[0][0] - t0, 2) if flowing else None,
                      "last_row_to_end_s": round(t0 + wall - flowing[-1][0], 2) if flowing else None}))
    return 0


def child(code: str, shape: str, rows: int, work: Path, phase: str, a, block_rows: int | None = None) -> dict:
    """One run in a fresh process (its own peak RSS), its stdout's last line parsed."""
    inp = write_input(work / f"in-{rows}.jsonl", rows)
    out = work / f"out-{Path(code).resolve().name}-{shape}-{rows}"
    if phase == "job" and out.exists():
        shutil.rmtree(out)
    cfg = job_config(inp, out, a.batch_size)
    cmd = [sys.executable, str(HERE / "job_driver.py"), "one", "--code", code, "--shape", shape, "--phase", phase,
           "--config", json.dumps(cfg), "--ray-cpus", str(a.ray_cpus)] + \
        (["--block-rows", str(block_rows)] if block_rows else [])
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
    env.update(PYTHONPATH=os.pathsep.join([code, str(HERE)]), RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:8])} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write_finished_output(inp: Path, out: Path, shape: str, rows_per_file: int = 256) -> int:
    """The output an instant-engine job of ``inp`` leaves (this checkout's schema and answers), written part by part
    straight to Parquet; returns its rows."""
    from datetime import datetime, timezone

    import pyarrow as pa
    import pyarrow.parquet as pq
    from instant_engine import instant_answer

    from eagle_ray.batch.config import JobConfig
    from eagle_ray.batch.rows import OUTPUT_SCHEMA, read_input
    from eagle_ray.batch.store import write_parquet_atomic
    from fsspec.implementations.local import LocalFileSystem
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    fs, tokens = LocalFileSystem(), SHAPES[shape]
    rows = read_input(str(inp), fs)
    cfg = JobConfig(**job_config(inp, out, 16))
    import zlib
    fixed = {"target_model": "instant", "draft_model": "instant", "speculative": True, "temperature": 0.0,
             "top_p": 1.0, "top_k": 0, "max_new_tokens": tokens, "sampling_params": cfg.sampling.model_dump_json(),
             "tree": json.dumps({"instant": True}), "head_version": 0, "sample_index": 0}
    # a row's answer depends on its id only through tau's 400 values: one answer row each, taken by index
    answers = [instant_answer(rid, tokens) for rid in (next(f"x{i}" for i in range(10**6)
                                                            if zlib.crc32(f"x{i}".encode()) % 400 == k)
                                                       for k in range(400))]
    per_row = [f for f in OUTPUT_SCHEMA if f.name in answers[0] or f.name in fixed]
    answer_table = pa.table({f.name: pa.array([fixed[f.name] if f.name in fixed else x[f.name] for x in answers],
                                              f.type) for f in per_row})
    stamp = datetime.now(timezone.utc)
    for n, start in enumerate(range(0, len(rows), rows_per_file)):
        chunk = rows[start:start + rows_per_file]
        which = pa.array([zlib.crc32(r.id.encode("utf-8", "surrogatepass")) % 400 for r in chunk])
        taken = answer_table.take(which)
        own = {"id": pa.array([r.id for r in chunk], pa.string()),
               "row_index": pa.array([r.row_index for r in chunk], pa.int64()),
               "input": pa.array([r.payload for r in chunk], pa.string()),
               "started_at": pa.array([stamp] * len(chunk), OUTPUT_SCHEMA.field("started_at").type),
               "finished_at": pa.array([stamp] * len(chunk), OUTPUT_SCHEMA.field("finished_at").type),
               "worker_id": pa.array([f"instant-{i % 2}" for i in range(len(chunk))], pa.string())}
        table = pa.table({f.name: own[f.name] if f.name in own else taken.column(f.name) if f.name in
                          taken.column_names else pa.nulls(len(chunk), f.type) for f in OUTPUT_SCHEMA},
                         schema=OUTPUT_SCHEMA)
        write_parquet_atomic(fs, str(out / f"part-finished-{n:06d}.parquet"), table)
    assert pq.ParquetFile(next(out.iterdir())).schema_arrow.names == OUTPUT_SCHEMA.names
    return len(rows)


def codes(a) -> dict[str, str]:
    out = {}
    for spec in a.code:
        name, _, path = spec.partition("=")
        out[name] = str(Path(path or name).resolve())
    return out


def blocks(a) -> dict[str, int]:
    return {name: int(rows) for name, _, rows in (spec.partition("=") for spec in a.block)}


def cmd_scale(a) -> int:
    work = Path(a.work or tempfile.mkdtemp(prefix="bench-job-driver-"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for spec in a.shape:
        shape, _, rows = spec.partition(":")
        for name, code in codes(a).items():
            job = child(code, shape, int(rows), work, "job", a)
            resume = child(code, shape, int(rows), work, "resume", a)
            results.append({"code": name, "shape": shape, "answer_tokens": SHAPES[shape], "rows": int(rows),
                            "job": job, "resume": resume})
            print(json.dumps(results[-1]), flush=True)
            shutil.rmtree(work / f"out-{Path(code).name}-{shape}-{rows}", ignore_errors=True)
    result = {"what": "the batch job's driver with an instant engine: a job into a new output, then a no-op resume "
                      "of it, each in a fresh process (peak_rss_mb: the driver's ru_maxrss)",
              "checkouts": codes(a), "ray_cpus": a.ray_cpus, "actors": 2, "batch_size": a.batch_size,
              "runs": results}
    write_result(a.out, result, a.command)
    return 0


def cmd_resume(a) -> int:
    work = Path(a.work or tempfile.mkdtemp(prefix="bench-job-driver-"))
    work.mkdir(parents=True, exist_ok=True)
    results, names = [], list(codes(a))
    for spec in a.shape:
        shape, _, rows = spec.partition(":")
        inp = write_input(work / f"in-{rows}.jsonl", int(rows))
        finished = work / f"finished-{shape}-{rows}"
        t = time.perf_counter()
        written = write_finished_output(inp, finished, shape)
        made_s = time.perf_counter() - t
        for r in range(a.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                for extra in ("_job.json", "summary.json"):   # each checkout records its own settings
                    (finished / extra).unlink(missing_ok=True)
                out = work / f"out-{Path(codes(a)[name]).name}-{shape}-{rows}"
                shutil.rmtree(out, ignore_errors=True)
                shutil.copytree(finished, out)
                resume = child(codes(a)[name], shape, int(rows), work, "resume", a)
                shutil.rmtree(out, ignore_errors=True)
                results.append({"round": r, "code": name, "shape": shape, "answer_tokens": SHAPES[shape],
                                "rows": int(rows), "output_written_s": round(made_s, 1), "resume": resume})
                print(json.dumps(results[-1]), flush=True)
                if resume["rows"] != written or resume["written_this_run"]:
                    raise RuntimeError(f"{name}: the resume did not find the {written} rows finished: {resume}")
        shutil.rmtree(finished, ignore_errors=True)
    result = {"what": "a no-op resume of a finished output (written straight to Parquet as an instant-engine job "
                      "leaves it, 256 rows per part), each checkout in turn in a fresh process: peak_rss_mb is the "
                      "driver's ru_maxrss, wall_s the resume and the summary",
              "checkouts": codes(a), "runs": results,
              "notes": "the machine (2 cores) was shared with other work while this ran; the checkouts took turns"}
    write_result(a.out, result, a.command)
    return 0


def cmd_throughput(a) -> int:
    work = Path(a.work or tempfile.mkdtemp(prefix="bench-job-driver-"))
    work.mkdir(parents=True, exist_ok=True)
    names = list(codes(a))
    runs = []
    for r in range(a.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            job = child(codes(a)[name], a.shape, a.rows, work, "job", a, blocks(a).get(name))
            runs.append({"round": r, "code": name, "block_rows": blocks(a).get(name), **job})
            print(json.dumps(runs[-1]), flush=True)
    by = {n: [x["rows_per_s_flowing"] for x in runs if x["code"] == n] for n in names}
    result = {"what": "rows/s of the batch job's pipeline with an instant engine, from the first progress line "
                      "counting a row to the last; the checkouts take turns (A B B A ...)",
              "checkouts": codes(a), "shape": a.shape, "answer_tokens": SHAPES[a.shape], "rows": a.rows,
              "ray_cpus": a.ray_cpus, "actors": 2, "batch_size": a.batch_size, "runs": runs,
              "rows_per_s": {n: {"each": v, "mean": round(sum(v) / len(v), 1)} for n, v in by.items()},
              "notes": "the machine was shared with other work while this ran; the checkouts took turns"}
    write_result(a.out, result, a.command)
    return 0


def add_commands(sub) -> None:
    def common(p):
        p.add_argument("--code", action="append", default=[], metavar="NAME=PATH",
                       help="a checkout whose eagle_ray runs (repeat: they take turns); default: this one")
        p.add_argument("--ray-cpus", type=int, default=4, help="logical CPUs of the local Ray")
        p.add_argument("--batch-size", type=int, default=16, help="actors.batch_size")
        p.add_argument("--work", default=None, help="folder for inputs and outputs (default: a new temp folder)")
        p.add_argument("--block", action="append", default=[], metavar="NAME=ROWS",
                       help="rows per input block of the checkout NAME (one that has rows_per_block)")

    p = subcommand(sub, "scale", cmd_scale, "driver peak RSS and wall time of a job and of its no-op resume")
    common(p)
    p.add_argument("--shape", action="append", default=[], metavar="SHAPE:ROWS", help="short:N or long:N")
    p = subcommand(sub, "resume", cmd_resume, "driver peak RSS and wall time of a no-op resume, checkouts in turn")
    common(p)
    p.add_argument("--shape", action="append", default=[], metavar="SHAPE:ROWS", help="short:N or long:N")
    p.add_argument("--rounds", type=int, default=1)
    p = subcommand(sub, "throughput", cmd_throughput, "pipeline rows/s with the instant engine, checkouts in turn")
    common(p)
    p.add_argument("--shape", default="short", choices=list(SHAPES))
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--rounds", type=int, default=2)
    p = sub.add_parser("one", help="(internal) one run in this process")
    p.add_argument("--code", required=True)
    p.add_argument("--shape", required=True, choices=list(SHAPES))
    p.add_argument("--phase", required=True, choices=["job", "resume"])
    p.add_argument("--config", required=True)
    p.add_argument("--ray-cpus", type=int, default=4)
    p.add_argument("--block-rows", type=int, default=None, help="rows per input block (a checkout that has "
                   "rows_per_block)")
    p.set_defaults(run=one_run)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] != ["one"] and "--code" not in argv:
        argv += ["--code", "this=."]
    return run_entry(__doc__, SCRIPT, (add_commands,), argv)


if __name__ == "__main__":
    raise SystemExit(main())
