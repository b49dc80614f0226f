"""The batch generation job: input rows -> actor pool of engines -> Parquet parts + summary.json.

Exactly once: the driver collects the results and writes them as ``part-<run>-<n>.parquet`` files, each one
committed atomically (a local rename; an S3 object appears only when its upload completes) and never holding an
id twice. A re-run reads the ids already committed and sends only the rest, so a crash of an actor (Ray Data
retries its batch) or of the driver (re-run the job) ends with every row exactly once. Rows that failed because
the engine failed or on a bug (``error_kind`` ``engine_failed`` / ``internal_error``) are not done: a re-run
rewrites their part without them and runs them again.

The driver stops promptly on SIGTERM (what ``ray job stop`` and Kubernetes send): it commits the rows that are
finished, writes the summary and exits with status 143; a re-run resumes.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import statistics
import time
from datetime import datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from eagle_ray.batch.config import SUMMARY_FILE, JobConfig, ProcessorConfig, new_run_id, part_file
from eagle_ray.cluster import ensure_ray
from eagle_ray.batch.rows import OUTPUT_SCHEMA, RETRIED_ON_RESUME, empty_row, output_key, read_input, to_table
from eagle_ray.batch.stage import now
from eagle_ray.errors import ConfigError

log = logging.getLogger(__name__)


def filesystem(uri: str, cfg: JobConfig):
    """The filesystem and path of ``uri``: ``s3://`` through s3fs, anything else a local path used as written
    (fsspec would read ``a::b`` as a chain of filesystems and ``file://`` prefixes as URLs)."""
    import fsspec
    if uri.startswith("s3://"):
        return fsspec.core.url_to_fs(uri, **cfg.s3.storage_options())
    path = uri.removeprefix("file://")
    if "://" in path:
        raise ConfigError(f"{uri}: only local paths and s3:// URIs are read and written")
    return LocalFileSystem(), os.path.abspath(os.path.expanduser(path))


def committed_parts(fs, root: str) -> list[str]:
    if not fs.exists(root):
        return []
    if not fs.isdir(root):
        raise ConfigError(f"output.uri: {root} is a file; give a directory for the part files")
    return sorted(p for p in fs.ls(root, detail=False) if p.rsplit("/", 1)[-1].startswith("part-")
                  and p.endswith(".parquet"))


def read_part(fs, path: str, columns: list[str] | None = None) -> pa.Table:
    try:
        with fs.open(path, "rb") as f:
            table = pq.read_table(f)
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"output part {path} is not readable Parquet ({e}); move it out of the output "
                          "directory and run again: its rows will be generated again") from None
    if columns is None:
        return table
    have = set(table.column_names)
    return pa.table({c: table[c] if c in have else pa.nulls(table.num_rows, OUTPUT_SCHEMA.field(c).type)
                     for c in columns})


def read_output(fs, root: str, columns: list[str] | None = None) -> pa.Table:
    tables = [read_part(fs, p, columns) for p in committed_parts(fs, root)]
    if not tables:
        return OUTPUT_SCHEMA.empty_table() if columns is None else \
            pa.schema([OUTPUT_SCHEMA.field(c) for c in columns]).empty_table()
    return pa.concat_tables(tables, promote_options="default")


def drop_rows(fs, root: str, drop) -> int:
    """Rewrite every part holding rows for which ``drop(row)`` is true without them, one atomic replace per part,
    so that this run does them again. Returns how many."""
    dropped = 0
    for path in committed_parts(fs, root):
        table = read_part(fs, path)
        keep = [not drop(r) for r in table.select([c for c in ("id", "input", "error_kind")
                                                   if c in table.column_names]).to_pylist()]
        if all(keep):
            continue
        dropped += keep.count(False)
        _write_atomic(fs, path, table.filter(pa.array(keep)))
    return dropped


def drop_retryable_rows(fs, root: str) -> int:
    """Drop the rows that failed for a reason other than the row itself (the engine failed, a bug)."""
    return drop_rows(fs, root, lambda r: r.get("error_kind") in RETRIED_ON_RESUME)


def drop_changed_rows(fs, root: str, inputs: dict[str, str]) -> int:
    """Drop the rows whose id now stands for another request: the input row with that id is not the one they
    answered (an inserted row shifts every later ``row-<index>`` id; an edited prompt keeps its id)."""
    return drop_rows(fs, root, lambda r: r["id"] in inputs and r.get("input") != inputs[r["id"]])


JOB_FILE, LEASE_FILE = "_job.json", "_lease.json"


def output_identity(cfg: JobConfig) -> dict:
    """What the output's rows depend on besides each row's own request: a resume into an output written with other
    values would mix answers of two configurations."""
    m = cfg.engine.model
    return {"target": m.target, "draft": m.draft, "dtype": m.dtype, "speculative": cfg.speculative,
            "sampling": cfg.sampling.model_dump(mode="json")}


def check_output_identity(fs, root: str, cfg: JobConfig) -> None:
    """Refuse to resume into an output written with another target, head, dtype, speculation or sampling
    defaults; record them for the first run."""
    path, mine = f"{root}/{JOB_FILE}", output_identity(cfg)
    if fs.exists(path) and committed_parts(fs, root):   # a first run that wrote no row binds nothing
        theirs = json.loads(fs.cat_file(path))
        try:   # sampling fields added since it was written take their defaults, which it ran with
            from eagle_ray.config import SamplingParams
            theirs["sampling"] = SamplingParams(**theirs["sampling"]).model_dump(mode="json")
        except (ConfigError, TypeError, KeyError):
            pass
        changed = [k for k in mine if theirs.get(k) != mine[k]]
        if changed:
            raise ConfigError(f"output.uri {cfg.output.uri} was written with other settings ("
                              + "; ".join(f"{k}: {theirs.get(k)!r} there, {mine[k]!r} now" for k in changed)
                              + "): resuming would mix answers of two configurations; write to a new output")
    else:
        fs.pipe_file(path, json.dumps(mine, indent=1).encode())


class OutputLease:
    """One run at a time per output: a run holds ``_lease.json`` (renewed every ``stale_s / 4`` seconds) and a
    second run refuses while it is fresh, since both would run and commit every row. A lease older than
    ``stale_s`` is a run that died: it is taken over, as is at once the lease of a run on this host whose process
    is gone (a killed driver resumed right away). On S3 two runs starting in the same second may both write it;
    each reads it back, and the one whose write did not last refuses."""

    def __init__(self, fs, root: str, run: str, stale_s: float = 120.0):
        import socket
        self.fs, self.path, self.stale_s = fs, f"{root}/{LEASE_FILE}", stale_s
        self.mine = {"run": run, "host": socket.gethostname(), "pid": os.getpid()}
        self._stop = None

    def held(self) -> dict | None:
        try:
            return json.loads(self.fs.cat_file(self.path))
        except (FileNotFoundError, ValueError):
            return None

    def _write(self) -> None:
        self.fs.pipe_file(self.path, json.dumps(self.mine | {"heartbeat": time.time()}).encode())

    def alive(self, held: dict) -> bool:
        """Whether the run holding the lease may still be running."""
        if held.get("run") == self.mine["run"] or time.time() - held.get("heartbeat", 0) >= self.stale_s:
            return False
        if held.get("host") == self.mine["host"] and isinstance(held.get("pid"), int):
            try:
                os.kill(held["pid"], 0)
            except ProcessLookupError:
                return False   # its process is gone
            except OSError:
                pass
        return True

    def acquire(self) -> None:
        held = self.held()
        if held and self.alive(held):
            raise ConfigError(f"output.uri {self.path.rsplit('/', 1)[0]} is in use by run {held.get('run')} on "
                              f"{held.get('host')} (pid {held.get('pid')}), alive {time.time() - held['heartbeat']:.0f}"
                              f" s ago: two runs on one output would both write every row; wait for it to end, or "
                              f"remove {self.path} if it died")
        self._write()
        time.sleep(0.2)
        if (self.held() or {}).get("run") != self.mine["run"]:
            raise ConfigError(f"output.uri {self.path.rsplit('/', 1)[0]}: another run took it at the same moment")
        import threading
        self._stop = threading.Event()
        threading.Thread(target=self._renew, name="eagle-ray-lease", daemon=True).start()

    def _renew(self) -> None:
        while not self._stop.wait(self.stale_s / 4):
            try:
                self._write()
            except Exception:  # noqa: BLE001 - any store's error: retried next time; the lease outlives a few
                pass

    def release(self) -> None:
        if self._stop is not None:
            self._stop.set()
            if (self.held() or {}).get("run") == self.mine["run"]:
                self.fs.rm(self.path)


def _write_atomic(fs, path: str, table: pa.Table) -> None:
    """Write a Parquet file so that it appears whole or not at all (a local rename; an object store's single
    PUT)."""
    if isinstance(fs, LocalFileSystem):
        tmp = path.rsplit("/", 1)[0] + "/.tmp-" + path.rsplit("/", 1)[1]
        with fs.open(tmp, "wb") as f:
            pq.write_table(table, f)
        os.replace(tmp, path)
    else:
        buf = pa.BufferOutputStream()
        pq.write_table(table, buf)
        fs.pipe_file(path, buf.getvalue().to_pybytes())


def committed_rows(fs, root: str) -> tuple[set[tuple[str, int]], set[str]]:
    """What the output holds: each row's (id, sample index), and the ids that are done. A row with ``n`` samples
    (``sampling_params.n``) is done once all of its samples are there, or an error row for it (a retried batch, or
    a run stopped between two parts, may have left some of its samples out: the row runs again and only the
    missing ones are written)."""
    table = read_output(fs, root, ["id", "sample_index", "sampling_params", "error"])
    keys, samples, asked, failed = set(), {}, {}, set()
    for r in table.to_pylist():
        key = output_key(r)
        keys.add(key)
        samples.setdefault(r["id"], set()).add(key[1])
        if r["error"]:
            failed.add(r["id"])
        try:
            asked[r["id"]] = int(json.loads(r["sampling_params"] or "{}").get("n") or 1)
        except (ValueError, TypeError, AttributeError):
            asked[r["id"]] = 1
    done = {i for i, got in samples.items() if i in failed or len(got) >= asked.get(i, 1)}
    return keys, done


class PartWriter:
    """Buffers result rows and commits them ``rows_per_file`` at a time, skipping (id, sample) pairs already
    committed."""

    def __init__(self, fs, root: str, rows_per_file: int, committed: set[tuple[str, int]]):
        self.fs, self.root, self.rows_per_file = fs, root.rstrip("/"), rows_per_file
        self.committed = committed
        self.run = new_run_id()
        self.buffer: list[dict] = []
        self.parts = 0
        self.written = 0
        fs.makedirs(self.root, exist_ok=True)

    def add(self, rows: list[dict]) -> None:
        for row in rows:
            key = output_key(row)
            if key in self.committed:
                continue  # a retried batch re-emitted it
            self.committed.add(key)
            self.buffer.append(row)
        while len(self.buffer) >= self.rows_per_file:
            self._commit(self.buffer[: self.rows_per_file])
            self.buffer = self.buffer[self.rows_per_file:]

    def close(self) -> None:
        if self.buffer:
            self._commit(self.buffer)
            self.buffer = []

    def _commit(self, rows: list[dict]) -> None:
        _write_atomic(self.fs, f"{self.root}/{part_file(self.run, self.parts)}", to_table(rows))
        self.parts += 1
        self.written += len(rows)


class JobInterrupted(Exception):
    """SIGTERM reached the driver."""


class Progress:
    """The driver's progress line, at a steady cadence: rows done of rows to run, rows/s, tokens/s, tau so far,
    and the time left at the rate so far."""

    def __init__(self, total: int, every_s: float, print_fn=print, clock=time.monotonic):
        self.total, self.every_s, self.print_fn, self.clock = total, every_s, print_fn, clock
        self.start = self.last = clock()
        self.rows = self.tokens = self.steps = self.step_tokens = 0

    def add(self, rows: list[dict]) -> None:
        for r in rows:
            self.rows += not r.get("sample_index")   # an input row's samples count once
            self.tokens += r.get("output_tokens") or 0
            if r.get("verify_steps"):
                self.steps += r["verify_steps"]
                self.step_tokens += r["tau"] * r["verify_steps"]
        now = self.clock()
        if now - self.last >= self.every_s or self.rows == self.total:
            self.last = now
            self.print_fn(self.line(now - self.start))

    def line(self, elapsed: float) -> str:
        rate = self.rows / elapsed if elapsed > 0 else 0.0
        left = (self.total - self.rows) / rate if rate > 0 else None
        tau = f"{self.step_tokens / self.steps:.2f}" if self.steps else "-"
        return (f"eagle-ray job: {self.rows}/{self.total} rows ({self.rows / max(self.total, 1):.0%}), "
                f"{rate:.2f} rows/s, {self.tokens / elapsed if elapsed > 0 else 0:.1f} tok/s, tau {tau}, "
                f"ETA {'-' if left is None else f'{left:.0f} s'}")


def _raise_interrupted(signum, frame):
    raise JobInterrupted()


def check_local_models(cfg: JobConfig) -> None:
    """Where the actors run on this machine (a local Ray, no address given): a target or head path that does not
    exist, or a head that does not fit the target, fails here in one line. In the actors it would fail in every
    one, again and again as Ray restarts them, after Ray and the job had started. (On a cluster the paths are the
    workers', which this machine may not see: they are checked there.) S3 and the embedded pair are not read."""
    from eagle_ray.engine.builder import RANDOM_HEADS
    from eagle_ray.model.heads import check_head
    from eagle_ray.model.loading import check_gguf_path, resolve_draft, resolve_target, target_config_and_tokenizer
    if cfg.ray_address or os.environ.get("RAY_ADDRESS"):
        return
    m = cfg.engine.model
    local = lambda path: path is not None and not str(path).startswith("s3://")  # noqa: E731
    target_dir = None
    if local(m.target):
        if str(m.target).endswith(".gguf"):   # its dequantised copy is made by the actors, once
            check_gguf_path(Path(m.target).expanduser())
        else:
            target_dir = resolve_target(m.target)
    if local(m.draft) and m.draft not in ("none",) + RANDOM_HEADS:
        draft_dir = resolve_draft(m.draft)
        if target_dir is not None:
            check_head(draft_dir, target_config_and_tokenizer(target_dir)[0])


def run_job(cfg: JobConfig, print_fn=print) -> dict:
    """Run the job to completion (resuming into an existing output) and return the summary (``interrupted`` is
    true when SIGTERM stopped it early: what finished is committed)."""
    from eagle_ray.engine.tree_policy import check_prompt_room
    check_prompt_room(cfg.engine.cache.max_model_len, cfg.engine.speculation.trees())
    check_local_models(cfg)
    in_fs, in_path = filesystem(cfg.input.uri, cfg)
    out_fs, out_root = filesystem(cfg.output.uri, cfg)
    rows = read_input(in_path, in_fs, cfg.input.format, cfg.input.limit)
    if committed_parts(out_fs, out_root) and not cfg.resume:   # an output that is a file fails here, naming it
        raise ConfigError(f"output.uri {cfg.output.uri} already holds results and resume is false; "
                          "choose an empty output or set resume: true")
    try:   # the first writes: an output that cannot be written fails here, before any model loads
        writer = PartWriter(out_fs, out_root, cfg.output.rows_per_file, set())
        lease = OutputLease(out_fs, out_root.rstrip("/"), writer.run, cfg.lease_stale_s)
        lease.acquire()
    except OSError as e:
        raise ConfigError(f"output.uri {cfg.output.uri} cannot be written: {type(e).__name__}: {e}") from None
    try:
        check_output_identity(out_fs, out_root.rstrip("/"), cfg)
    except BaseException:
        lease.release()
        raise
    try:
        return run_leased(cfg, rows, out_fs, out_root, writer, print_fn)
    finally:
        lease.release()


def run_leased(cfg: JobConfig, rows, out_fs, out_root: str, writer: "PartWriter", print_fn) -> dict:
    import ray
    retried = drop_retryable_rows(out_fs, out_root) if cfg.resume else 0
    changed = drop_changed_rows(out_fs, out_root, {r.id: r.payload for r in rows}) if cfg.resume else 0
    keys, done = committed_rows(out_fs, out_root) if cfg.resume else (set(), set())
    writer.committed = keys
    todo = [r for r in rows if r.id not in done]
    print_fn(f"eagle-ray job: {len(rows)} input rows, {len(rows) - len(todo)} already in {cfg.output.uri}"
             f"{f' ({retried} failed rows to retry)' if retried else ''}, {len(todo)} to run on "
             f"{'-'.join(map(str, sorted(set(cfg.actors.pool))))} actor(s)")
    if changed:
        print_fn(f"eagle-ray job: {changed} rows in {cfg.output.uri} answered another request than the input row "
                 "now holding their id (rows inserted, removed or edited); they run again")
    unmatched = len({k for k, _ in keys} - {r.id for r in rows})
    if unmatched:   # kept as they are; said aloud, since the same prompt may now run again under another id
        print_fn(f"eagle-ray job: {unmatched} rows already in {cfg.output.uri} match no input row id (the input, "
                 "its ids or input.limit changed since they were written); they are kept")
    t0 = time.time()
    started = now()
    interrupted = False
    previous = signal.signal(signal.SIGTERM, _raise_interrupted) if _main_thread() else None
    try:
        pre_failed = [r for r in todo if r.error]
        if pre_failed:  # unreadable lines and duplicate ids need no model: write their error rows now
            writer.add([empty_row(r.as_item()) | {"started_at": started, "finished_at": started}
                        for r in pre_failed])
        runnable = [r.as_item() for r in todo if not r.error]
        if runnable:
            print_fn(ensure_ray(cfg.ray_address, max(os.cpu_count() or 1,
                                                     int(cfg.actors.pool[1] * cfg.actors.num_cpus))))
            if _main_thread():  # ray.init may install its own handler
                signal.signal(signal.SIGTERM, _raise_interrupted)
            from eagle_ray.batch.processor import Processor
            blocks = max(1, min(len(runnable) // cfg.actors.batch_size, 1000))
            ds = Processor(ProcessorConfig.of(cfg)).generate(ray.data.from_items(runnable, override_num_blocks=blocks))
            progress = Progress(len(runnable), cfg.progress_every_s, print_fn)
            for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
                rows = batch.to_pylist()
                writer.add(rows)
                progress.add(rows)
    except JobInterrupted:
        interrupted = True
        print_fn("eagle-ray job: SIGTERM received; committing the finished rows and stopping")
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        writer.close()
    wall = time.time() - t0
    summary = summarize(read_output(out_fs, out_root), writer, wall, started)
    summary["interrupted"] = interrupted
    summary["rows_matching_no_input"] = unmatched
    with out_fs.open(f"{out_root.rstrip('/')}/{SUMMARY_FILE}", "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print_fn(format_summary(summary))
    if interrupted and ray.is_initialized():
        ray.shutdown()
    return summary


def _main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


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
    over_time = []   # tau of this run's rows in tenths, in the order they finished (online adaptation raises it)
    done = sorted((r for r in this_run if r["tau"]), key=lambda r: r["finished_at"])
    block = max(1, -(-len(done) // 10))
    for i in range(0, len(done), block):
        part = done[i:i + block]
        over_time.append({"rows": len(part), "tau": round(statistics.mean(r["tau"] for r in part), 4),
                          "head_versions": sorted({r.get("head_version") or 0 for r in part})})
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
        "per_actor": per_actor, "tau_over_time": over_time,
    }


def _error_kinds(rows: list[dict]) -> dict:
    kinds: dict[str, int] = {}
    for r in rows:
        if r["error"]:
            k = r.get("error_kind") or "unknown"
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
    if s.get("tau_over_time"):
        lines.append("tau over time    " + " ".join(f"{b['tau']:.2f}" for b in s["tau_over_time"]))
    return "\n".join(lines)
