"""The batch generation job: input rows -> actor pool of engines -> Parquet parts + summary.json.

Exactly once: the driver collects the results and writes them as ``part-<run>-<n>.parquet`` files, each one
committed atomically (a local rename; an S3 object appears only when its upload completes) and never holding an
id twice. A re-run reads the ids already committed and sends only the rest, so a crash of an actor (Ray Data
retries its batch) or of the driver (re-run the job) ends with every row exactly once.
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import time
import uuid
from datetime import datetime, timezone

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from eagle_ray.config import JobConfig
from eagle_ray.data.rows import OUTPUT_SCHEMA, empty_row, read_input, to_table
from eagle_ray.data.stage import now

log = logging.getLogger(__name__)


def filesystem(uri: str, cfg: JobConfig):
    import fsspec
    opts = cfg.s3.storage_options() if uri.startswith("s3://") else {}
    fs, path = fsspec.core.url_to_fs(uri, **opts)
    return fs, path


def committed_parts(fs, root: str) -> list[str]:
    if not fs.exists(root):
        return []
    return sorted(p for p in fs.ls(root, detail=False) if p.rsplit("/", 1)[-1].startswith("part-")
                  and p.endswith(".parquet"))


def read_output(fs, root: str, columns: list[str] | None = None) -> pa.Table:
    tables = []
    for p in committed_parts(fs, root):
        with fs.open(p, "rb") as f:
            tables.append(pq.read_table(f, columns=columns))
    if not tables:
        return OUTPUT_SCHEMA.empty_table() if columns is None else \
            pa.schema([OUTPUT_SCHEMA.field(c) for c in columns]).empty_table()
    return pa.concat_tables(tables)


class PartWriter:
    """Buffers result rows and commits them ``rows_per_file`` at a time, skipping ids already committed."""

    def __init__(self, fs, root: str, rows_per_file: int, committed: set[str]):
        self.fs, self.root, self.rows_per_file = fs, root.rstrip("/"), rows_per_file
        self.committed = committed
        self.run = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
        self.buffer: list[dict] = []
        self.parts = 0
        self.written = 0
        fs.makedirs(self.root, exist_ok=True)

    def add(self, rows: list[dict]) -> None:
        for row in rows:
            if row["id"] in self.committed:
                continue  # a retried batch re-emitted it
            self.committed.add(row["id"])
            self.buffer.append(row)
        while len(self.buffer) >= self.rows_per_file:
            self._commit(self.buffer[: self.rows_per_file])
            self.buffer = self.buffer[self.rows_per_file:]

    def close(self) -> None:
        if self.buffer:
            self._commit(self.buffer)
            self.buffer = []

    def _commit(self, rows: list[dict]) -> None:
        path = f"{self.root}/part-{self.run}-{self.parts:05d}.parquet"
        table = to_table(rows)
        if isinstance(self.fs, LocalFileSystem):
            tmp = f"{self.root}/.tmp-{self.run}-{self.parts:05d}.parquet"
            with self.fs.open(tmp, "wb") as f:
                pq.write_table(table, f)
            os.replace(tmp, path)
        else:  # object stores: serialise first, then one PUT, so an interrupted write leaves no object at all
            buf = pa.BufferOutputStream()
            pq.write_table(table, buf)
            self.fs.pipe_file(path, buf.getvalue().to_pybytes())
        self.parts += 1
        self.written += len(rows)


def ensure_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Connect to ``address`` / RAY_ADDRESS if given, else start a local Ray bound to 127.0.0.1 (the job and the
    Serve CLI both start Ray this way)."""
    import ray
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
        return
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=num_cpus)


def run_job(cfg: JobConfig, print_fn=print) -> dict:
    """Run the job to completion (resuming into an existing output) and return the summary."""
    import ray

    in_fs, in_path = filesystem(cfg.input.uri, cfg)
    out_fs, out_root = filesystem(cfg.output.uri, cfg)
    rows = read_input(in_path, in_fs, cfg.input.format, cfg.input.limit)
    done = set(read_output(out_fs, out_root, ["id"]).column("id").to_pylist()) if cfg.resume else set()
    if not cfg.resume and committed_parts(out_fs, out_root):
        from eagle_ray.errors import ConfigError
        raise ConfigError(f"output.uri {cfg.output.uri} already holds results and resume is false; "
                          "choose an empty output or set resume: true")
    todo = [r for r in rows if r.id not in done]
    print_fn(f"eagle-ray job: {len(rows)} input rows, {len(rows) - len(todo)} already in {cfg.output.uri}, "
             f"{len(todo)} to run on {cfg.actors.num_actors} actor(s)")
    writer = PartWriter(out_fs, out_root, cfg.output.rows_per_file, done)
    t0 = time.time()
    started = now()
    pre_failed = [r for r in todo if r.error]
    if pre_failed:  # unreadable lines and duplicate ids need no model: write their error rows now
        writer.add([empty_row(r.as_item()) | {"error": r.error, "started_at": started, "finished_at": started}
                    for r in pre_failed])
    runnable = [r.as_item() for r in todo if not r.error]
    if runnable:
        ensure_ray(cfg.ray_address, max(os.cpu_count() or 1, int(cfg.actors.num_actors * cfg.actors.num_cpus)))
        from eagle_ray.data.stage import GenerateStage
        a = cfg.actors
        ds = ray.data.from_items(runnable, override_num_blocks=max(1, min(len(runnable) // a.batch_size, 1000)))
        ds = ds.map_batches(
            GenerateStage, fn_constructor_kwargs={"config_json": cfg.model_dump_json()},
            batch_size=a.batch_size, batch_format="pyarrow", num_cpus=a.num_cpus, num_gpus=a.num_gpus or None,
            compute=ray.data.ActorPoolStrategy(size=a.num_actors, max_tasks_in_flight_per_actor=a.max_concurrent_batches,
                                               max_concurrent_calls_per_actor=a.max_concurrent_batches))
        for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            writer.add(batch.to_pylist())
    writer.close()
    wall = time.time() - t0
    summary = summarize(read_output(out_fs, out_root), writer, wall, started)
    with out_fs.open(f"{out_root.rstrip('/')}/summary.json", "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print_fn(format_summary(summary))
    return summary


def summarize(table: pa.Table, writer: PartWriter, wall: float, run_started: datetime) -> dict:
    rows = table.to_pylist()
    ok = [r for r in rows if not r["error"]]
    this_run = [r for r in ok if r["started_at"] is not None and r["started_at"] >= run_started]
    taus = sorted(r["tau"] for r in ok if r["tau"])
    gen = sum(r["output_tokens"] or 0 for r in this_run)

    def pct(q):
        return taus[min(len(taus) - 1, int(q * len(taus)))] if taus else None

    actors = {}
    for r in this_run:
        a = actors.setdefault(r["worker_id"], {"rows": 0, "tokens": 0, "first": r["started_at"], "last": r["finished_at"]})
        a["rows"] += 1
        a["tokens"] += r["output_tokens"] or 0
        a["first"], a["last"] = min(a["first"], r["started_at"]), max(a["last"], r["finished_at"])
    per_actor = {w: {"rows": a["rows"], "tokens": a["tokens"],
                     "tokens_per_s": a["tokens"] / max((a["last"] - a["first"]).total_seconds(), 1e-9)}
                 for w, a in actors.items()}
    gen_span = None
    if this_run:
        gen_span = (max(r["finished_at"] for r in this_run) - min(r["started_at"] for r in this_run)).total_seconds()
    return {
        "rows": len(rows), "errors": len(rows) - len(ok), "written_this_run": writer.written,
        "error_kinds": _error_kinds(rows),
        "tau_mean": statistics.mean(taus) if taus else None, "tau_p50": pct(0.5), "tau_p90": pct(0.9),
        "generated_tokens_this_run": gen, "wall_s": wall,
        "generated_tokens_per_s": gen / wall if wall > 0 else None,
        "generation_span_s": gen_span,
        "generation_tokens_per_s": gen / gen_span if gen_span else None,
        "per_actor": per_actor,
    }


def _error_kinds(rows: list[dict]) -> dict:
    kinds: dict[str, int] = {}
    for r in rows:
        if r["error"]:
            k = r["error"].split(":", 1)[0]
            kinds[k] = kinds.get(k, 0) + 1
    return kinds


def format_summary(s: dict) -> str:
    def f(x, spec=".2f"):
        return "-" if x is None else format(x, spec)
    lines = ["", "eagle-ray job summary", "---------------------",
             f"rows            {s['rows']}", f"errors          {s['errors']}  {s['error_kinds'] or ''}",
             f"tau mean/p50/p90 {f(s['tau_mean'])} / {f(s['tau_p50'])} / {f(s['tau_p90'])}",
             f"generated tokens {s['generated_tokens_this_run']} in {s['wall_s']:.1f} s = "
             f"{f(s['generated_tokens_per_s'], '.1f')} tok/s (generation only: {f(s['generation_tokens_per_s'], '.1f')})",
             "per actor:"]
    for w, a in s["per_actor"].items():
        lines.append(f"  {w:<40} rows {a['rows']:>6}  tokens {a['tokens']:>8}  {a['tokens_per_s']:.1f} tok/s")
    return "\n".join(lines)
