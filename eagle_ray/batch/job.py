"""The batch generation job: input rows -> actor pool of engines -> Parquet parts + summary.json.

Exactly once: the driver collects the results and writes them as ``part-<run>-<n>.parquet`` files, each one
committed atomically (a local rename; an S3 object appears only when its upload completes) and never holding an
id twice. A re-run reads the ids already committed and sends only the rest, so a crash of an actor (Ray Data
retries its batch) or of the driver (re-run the job) ends with every row exactly once. Rows that failed because
the engine failed or on a bug (``error_kind`` ``engine_failed`` / ``internal_error``) are not done: a re-run
rewrites their part without them and runs them again.

The driver's path is columnar and its memory does not grow with the output: result batches arrive as Arrow tables,
are deduplicated by their input row's position (a bit per input row), written as they are, and folded into the
summary (``summary.py``) as each part commits; a resume reads only the columns it needs of each part, once. Input
goes to Ray as Arrow blocks of a few actor batches (:func:`rows_per_block`): what a killed actor's retry redoes, and
the grain of the job's tail.

The driver stops promptly on SIGTERM (what ``ray job stop`` and Kubernetes send): it commits the rows that are
finished, writes the summary and exits with status 143; a re-run resumes. A run whose output another run took
over (``lease.py``) stops with :class:`LeaseLostError`, committing nothing more.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from eagle_ray.batch.config import SUMMARY_FILE, JobConfig, ProcessorConfig, new_run_id, part_file
from eagle_ray.batch.lease import LEASE_FILE, LeaseLostError, OutputLease  # noqa: F401 - LEASE_FILE: public name
from eagle_ray.batch.openai_batch import write_output_file
from eagle_ray.batch.rows import (OUTPUT_SCHEMA, PROMPT_TOO_LONG, RETRIED_ON_RESUME, InputRow, empty_row, read_input,
                                  to_table)
from eagle_ray.batch.stage import now
from eagle_ray.batch.store import put_atomic, write_parquet_atomic
from eagle_ray.batch.summary import COLUMNS as SUMMARY_COLUMNS, JobSummary, format_summary
from eagle_ray.cluster import ensure_ray
from eagle_ray.engine.request import storable
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


def prepare_output(fs, root: str, uri: str, name: str = "output.uri") -> None:
    """Make the output folder where folders exist; on S3 the bucket must exist already: writing into a missing one
    would create it (in the store's default region, with its default policies), so it fails here, naming it."""
    if isinstance(fs, LocalFileSystem):
        fs.makedirs(root, exist_ok=True)
        return
    bucket = root.split("/", 1)[0]
    try:
        fs.info(bucket)
    except FileNotFoundError:
        raise ConfigError(f"{name} {uri}: the bucket {bucket!r} does not exist (or these credentials cannot "
                          "see it); create it, with the region and policies it needs, or name another") from None


def committed_parts(fs, root: str) -> list[str]:
    if not fs.exists(root):
        return []
    if not fs.isdir(root):
        raise ConfigError(f"output.uri: {root} is a file; give a directory for the part files")
    return sorted(p for p in fs.ls(root, detail=False) if p.rsplit("/", 1)[-1].startswith("part-")
                  and p.endswith(".parquet"))


def read_part(fs, path: str, columns: list[str] | tuple[str, ...] | None = None) -> pa.Table:
    """A committed part, whole or only ``columns`` (the others are not read; a column an older part lacks is
    null; ``sampling_params``, mostly one value repeated, is read as a dictionary)."""
    try:
        with fs.open(path, "rb") as f:
            if columns is None:
                return pq.read_table(f)
            have = set(pq.ParquetFile(f).schema_arrow.names)
            f.seek(0)
            table = pq.read_table(f, columns=[c for c in columns if c in have],
                                  read_dictionary=[c for c in ("sampling_params",) if c in columns and c in have])
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"output part {path} is not readable Parquet ({e}); move it out of the output "
                          "directory and run again: its rows will be generated again") from None
    return pa.table({c: table[c] if c in have else pa.nulls(table.num_rows, OUTPUT_SCHEMA.field(c).type)
                     for c in columns})


def read_output(fs, root: str, columns: list[str] | None = None) -> pa.Table:
    tables = [read_part(fs, p, columns) for p in committed_parts(fs, root)]
    if not tables:
        return OUTPUT_SCHEMA.empty_table() if columns is None else \
            pa.schema([OUTPUT_SCHEMA.field(c) for c in columns]).empty_table()
    return pa.concat_tables(tables, promote_options="default")


JOB_FILE = "_job.json"
STRICT_IDENTITY = ("target", "draft", "dtype", "speculative", "sampling", "split_special_tokens", "chat_template",
                   "chat_template_kwargs", "reasoning_parser", "tool_call_parser")


def output_identity(cfg: JobConfig) -> dict:
    """What the output's rows depend on besides each row's own request: a resume into an output written with other
    values would mix answers of two configurations (``max_model_len`` may grow: see :func:`check_output_identity`)."""
    m = cfg.engine.model
    return {"target": m.target, "draft": m.draft, "dtype": m.dtype, "speculative": cfg.speculative,
            "sampling": answer_sampling(cfg.sampling), "split_special_tokens": cfg.split_special_tokens,
            "chat_template": None if m.chat_template is None else   # its digest: a template may be pages long
            "sha256:" + hashlib.sha256(m.chat_template.encode()).hexdigest()[:16],
            "chat_template_kwargs": m.chat_template_kwargs, "reasoning_parser": cfg.reasoning_parser,
            "tool_call_parser": cfg.tool_call_parser, "row_fields_read": True,
            "max_model_len": cfg.engine.cache.max_model_len}


def answer_sampling(p) -> dict:
    """The sampling defaults an output's answers depend on: all but ``priority``, which orders the work alone."""
    return p.model_dump(mode="json", exclude={"priority"})


def check_output_identity(fs, root: str, cfg: JobConfig) -> dict | None:
    """Refuse to resume into an output written with another target, head, dtype, speculation, sampling defaults
    (``priority`` aside), ``split_special_tokens``, chat template and its variables, parsers, or a smaller
    ``max_model_len`` (rows answered with
    more room than this run has would sit beside rows refused or cut for the lack of it); record them for the first
    run. A larger ``max_model_len`` resumes: the rows the smaller one refused or cut run again
    (:func:`resume_output`). Returns the identity the output records, with ``unread``: the pattern of the rows that
    hold fields the writing code passed by (None for a first run). A record from before a
    field was recorded binds nothing for that field, but for the chat template and its variables, which a run before
    they could be set had as the tokenizer's own."""
    path, mine = f"{root}/{JOB_FILE}", output_identity(cfg)
    if fs.exists(path) and committed_parts(fs, root):   # a first run that wrote no row binds nothing
        theirs = json.loads(fs.cat_file(path))
        theirs.setdefault("chat_template", None)   # older than these settings: written with the tokenizer's own
        theirs.setdefault("chat_template_kwargs", {})
        theirs.setdefault("reasoning_parser", None)   # older than the settings: outputs whole, no calls read
        # rows' fields read since (tools, chat-template fields) were passed by: the rows holding them run again
        theirs["unread"] = "|".join(rx for since, rx in UNREAD_SINCE.items() if since not in theirs) or None
        theirs.setdefault("tool_call_parser", None)
        try:   # sampling fields added since it was written take their defaults, which it ran with
            from eagle_ray.config import SamplingParams
            theirs["sampling"] = answer_sampling(SamplingParams(**theirs["sampling"]))
        except (ConfigError, TypeError, KeyError):
            pass
        changed = [k for k in STRICT_IDENTITY if k in theirs and theirs[k] != mine[k]]
        if isinstance(theirs.get("max_model_len"), int) and mine["max_model_len"] < theirs["max_model_len"]:
            changed.append("max_model_len")
        if changed:
            raise ConfigError(f"output.uri {cfg.output.uri} was written with other settings ("
                              + "; ".join(f"{k}: {theirs.get(k)!r} there, {mine[k]!r} now" for k in changed)
                              + "): resuming would mix answers of two configurations; write to a new output"
                              + (" (or keep max_model_len at least the one it was written with)"
                                 if "max_model_len" in changed else ""))
        return theirs
    put_atomic(fs, path, json.dumps(mine, indent=1).encode())
    return None


@dataclass
class Resumed:
    """What a resume found: the ids already done (every sample there, or an error row), the (id, sample) pairs
    already there of rows not done (a stop between two parts left some of a row's ``n`` samples out), every id
    kept, and how many rows it dropped to run again, by why."""
    done: pa.Array
    partial: pa.Table
    ids: pa.Array
    retried: int = 0        # failed with the engine or on a bug
    changed: int = 0        # their id now stands for another input row
    unread: int = 0         # they hold fields the code that wrote them passed by
    roomier: int = 0        # refused or cut by a smaller max_model_len than this run's

    @classmethod
    def nothing(cls) -> "Resumed":
        empty = pa.array([], pa.string())
        return cls(empty, pa.table({"id": empty, "sample_index": pa.array([], pa.int64())}), empty)


RESUME_GROUP_ROWS, RESUME_GROUP_BYTES = 1 << 18, 64 << 20   # parts checked against the input together
_N_ASKED = r'[{,]\s*"n"\s*:\s*(?P<n>[0-9]+)'   # ``n`` in a row's ``sampling_params`` (a JSON object)


def samples_asked(params: pa.ChunkedArray) -> pa.Array:
    """Each row's ``n`` (1 where not recorded), read from ``sampling_params`` (read as a dictionary: a job's rows
    mostly share theirs, so each distinct value is matched once)."""
    out = []
    for chunk in params.chunks:
        values, indices = (chunk.dictionary, chunk.indices) if pa.types.is_dictionary(chunk.type) else (chunk, None)
        n = pc.cast(pc.struct_field(pc.extract_regex(values, _N_ASKED), [0]), pa.int64())
        out.append(pc.fill_null(n if indices is None else pc.take(n, indices), 1))
    return pa.concat_arrays(out) if out else pa.array([], pa.int64())


def resume_output(fs, root: str, inputs: pa.Table, summary: JobSummary, roomier_than: int | None = None,
                  before_commit=lambda: None, unread: str | None = None) -> Resumed:
    """One pass over the committed parts, reading only the columns it needs of each: drop (one atomic rewrite of
    the part) the rows this run does again: those that failed with the engine or on a bug, those whose id now
    stands for another input row (``inputs``: this run's ``id`` and ``payload``; an inserted row shifts every later
    ``row-<index>``, an edited prompt keeps its id) and, where ``roomier_than`` is the ``max_model_len`` the output
    was written with and this run's is larger, those it refused (``prompt_too_long``) or cut at the context's end,
    and where ``unread`` (a pattern of the row fields the output was written before they were read: tools, chat
    template fields, OpenAI batch lines), the rows whose input holds them; fold the rest into
    ``summary``. Parts are matched to the input a group at a time (up to ``RESUME_GROUP_ROWS``
    rows or ``RESUME_GROUP_BYTES``), so that the input's ids are hashed once a group, not once a part."""
    columns = ["id", "input", "sample_index", "sampling_params", *SUMMARY_COLUMNS]
    if roomier_than is not None:
        columns += ["finish_reason", "output_token_ids", "max_new_tokens"]
    out, done, ids, samples, group = Resumed.nothing(), [], [], [], []

    def check(group: list[tuple[str, pa.Table]]) -> None:
        table = pa.concat_tables([t for _, t in group])
        drop, why = rerun_mask(table, inputs, roomier_than is not None, unread)
        for name, mask in why.items():
            setattr(out, name, getattr(out, name) + (pc.sum(mask).as_py() or 0))
        offset = 0
        for path, part in group:
            mask = drop.slice(offset, part.num_rows)
            offset += part.num_rows
            dropped = pc.sum(mask).as_py() or 0
            if dropped:
                before_commit()
                if dropped == part.num_rows:
                    fs.rm(path)
                else:
                    write_parquet_atomic(fs, path, read_part(fs, path).filter(pc.invert(mask)))
        kept = table.filter(pc.invert(drop))
        summary.add(kept.select(SUMMARY_COLUMNS))
        kept_ids = kept.column("id").combine_chunks()
        ids.append(kept_ids)
        # a row is done by itself where it asked one sample or failed; a row of n samples once all n are there
        asked = samples_asked(kept.column("sampling_params"))
        failed = pc.fill_null(pc.greater(pc.utf8_length(kept.column("error")), 0), False).combine_chunks()
        alone = pc.or_(failed, pc.less_equal(asked, 1))
        done.append(kept_ids.filter(alone))
        if not pc.all(alone).as_py():
            several = pc.invert(alone)
            samples.append(pa.table({"id": kept_ids.filter(several),
                                     "sample_index": pc.fill_null(kept.column("sample_index"), 0)
                                     .combine_chunks().filter(several),
                                     "n": asked.filter(several)}))

    rows = size = 0
    for path in committed_parts(fs, root):
        part = read_part(fs, path, columns)
        group.append((path, part))
        rows, size = rows + part.num_rows, size + part.nbytes
        if rows >= RESUME_GROUP_ROWS or size >= RESUME_GROUP_BYTES:
            check(group)
            group, rows, size = [], 0, 0
    if group:
        check(group)
    out.ids = pa.concat_arrays(ids) if ids else out.ids
    done = pa.concat_arrays(done) if done else out.done
    if samples:
        several = pa.concat_tables(samples)
        per = several.group_by("id").aggregate([("sample_index", "count_distinct"), ("n", "max")])
        all_there = per.column("id").filter(pc.greater_equal(per.column("sample_index_count_distinct"),
                                                              per.column("n_max")))
        done = pa.concat_arrays([done, all_there.combine_chunks()])
        out.partial = several.filter(pc.invert(pc.is_in(several.column("id"), value_set=done))) \
            .select(["id", "sample_index"])
    out.done = done
    return out


TOOLS_IN_ROW = r'"(tools|tool_choice)": *[\[{"]'   # a row's input (JSON text) holding tools or a tool choice
# ... or chat-template fields, or is an OpenAI batch line
TEMPLATE_IN_ROW = r'"(chat_template_kwargs|add_generation_prompt|continue_final_message|documents)": *[^n]'
BATCH_LINE_IN_ROW = r'"custom_id": *[^n]|"url": *"/v1/'
UNREAD_SINCE = {"tool_call_parser": TOOLS_IN_ROW,   # the identity key recorded since those fields are read
                "row_fields_read": f"{TEMPLATE_IN_ROW}|{BATCH_LINE_IN_ROW}"}


def rerun_mask(table: pa.Table, inputs: pa.Table, roomier: bool, unread: str | None = None
               ) -> tuple[pa.Array, dict[str, pa.Array]]:
    """Which written rows run again (see :func:`resume_output`), and each reason's rows (counted once, in the order
    ``retried``, ``changed``, ``unread``, ``roomier``)."""
    retry = pc.fill_null(pc.is_in(table.column("error_kind"), value_set=pa.array(RETRIED_ON_RESUME)), False)
    at = pc.index_in(table.column("id"), value_set=inputs.column("id"))
    asked_now = pc.take(inputs.column("payload"), at)
    changed = pc.and_(pc.is_valid(at), pc.fill_null(pc.not_equal(table.column("input"), asked_now), True))
    why = {"retried": retry, "changed": pc.and_(changed, pc.invert(retry))}
    drop = pc.or_(retry, changed)
    if unread:
        passed_by = pc.fill_null(pc.match_substring_regex(table.column("input"), unread), False)
        why["unread"] = pc.and_(passed_by, pc.invert(drop))
        drop = pc.or_(drop, passed_by)
    if roomier:
        cut = pc.and_(pc.equal(table.column("finish_reason"), "length"),
                      pc.less(pc.list_value_length(table.column("output_token_ids")), table.column("max_new_tokens")))
        limited = pc.or_(pc.fill_null(pc.equal(table.column("error_kind"), PROMPT_TOO_LONG), False),
                         pc.fill_null(cut, False))
        why["roomier"] = pc.and_(limited, pc.invert(drop))
        drop = pc.or_(drop, limited)
    return drop.combine_chunks() if isinstance(drop, pa.ChunkedArray) else drop, why


SAMPLE_BITS = 10   # sample indices below 1024 (``sampling_params.n`` is at most 1024)


class PartWriter:
    """Buffers result rows (Arrow tables) and commits them ``rows_per_file`` at a time, each row once: rows are
    keyed by their input row's position (``row_index``, one bit each of ``slots``) and their ``sample_index`` (a
    row of ``n`` samples writes ``n``; samples past the first are kept in a set), so a batch that Ray retried adds
    nothing twice. ``before_commit()`` runs before every part is written (the lease's check: it raises to stop
    the run), ``after_commit(table)`` after (the summary's fold)."""

    def __init__(self, fs, root: str, rows_per_file: int, slots: int, run: str | None = None,
                 before_commit=lambda: None, after_commit=lambda table: None):
        self.fs, self.root, self.rows_per_file = fs, root.rstrip("/"), rows_per_file
        self.seen = np.zeros(slots, dtype=bool)     # sample 0 (a row's only one without n) of each input row
        self.samples: set[int] = set()               # further samples: row_index << SAMPLE_BITS | sample_index
        self.before_commit, self.after_commit = before_commit, after_commit
        self.run = run or new_run_id()
        self.buffer: list[pa.Table] = []
        self.buffered = 0
        self.parts = 0
        self.written = 0
        self.stopped = False          # committing nothing more (the lease was lost)
        self.committing = False       # a part is being written: SIGTERM waits for it (``pending_stop``)
        self.pending_stop = False
        if isinstance(fs, LocalFileSystem):
            fs.makedirs(self.root, exist_ok=True)

    def mark(self, row_index: np.ndarray, sample_index: np.ndarray) -> np.ndarray:
        """Mark these (input row, sample) pairs as written; returns which of them were not before (a pair twice in
        the arrays: its first)."""
        at, sample = row_index.astype(np.int64), sample_index.astype(np.int64)
        key = (at << SAMPLE_BITS) | sample
        first = np.zeros(len(at), dtype=bool)
        first[np.unique(key, return_index=True)[1]] = True
        new = first & ~self.seen[at]
        more = sample > 0
        if more.any():   # a row's further samples: by key (an eval job's n samples; rare, and few per row)
            for i in np.flatnonzero(more & first):
                k = int(key[i])
                new[i] = k not in self.samples
                self.samples.add(k)
        self.seen[at[new & ~more]] = True
        return new

    def written_before(self, pairs: pa.Table, inputs: pa.Table) -> None:
        """Mark (``id``, ``sample_index``) ``pairs`` already in the output (a resume's samples of rows not done:
        :attr:`Resumed.partial`) as written; ``inputs`` maps this run's ids to their ``row_index``."""
        if pairs.num_rows:
            at = pc.index_in(pairs.column("id"), value_set=inputs.column("id"))
            there = pc.is_valid(at)
            self.mark(pc.take(inputs.column("row_index"), at.filter(there)).to_numpy(),
                      pc.fill_null(pairs.column("sample_index"), 0).filter(there).to_numpy())

    def add(self, rows: pa.Table | list[dict]) -> pa.Table:
        """Buffer the rows not seen before and commit every full part; returns the rows taken."""
        table = rows if isinstance(rows, pa.Table) else to_table(rows)
        index = table.column("row_index")
        if index.null_count:
            raise ValueError("every row the job writes has its input row's position (row_index)")
        sample = pc.fill_null(table.column("sample_index"), 0) if "sample_index" in table.column_names else \
            pa.array(np.zeros(table.num_rows, dtype=np.int64))
        new = self.mark(index.to_numpy(), np.asarray(sample.to_numpy(zero_copy_only=False)))
        if not new.all():
            table = table.filter(pa.array(new))
        if table.num_rows:
            self.buffer.append(table)
            self.buffered += table.num_rows
        while self.buffered >= self.rows_per_file:
            self._commit(self.rows_per_file)
        return table

    def close(self) -> None:
        """Commit what is buffered (nothing once stopped)."""
        if self.buffered and not self.stopped:
            self._commit(self.buffered, stop_after=False)

    def _commit(self, n: int, stop_after: bool = True) -> None:
        if self.stopped:
            return
        table = pa.concat_tables(self.buffer, promote_options="default") if len(self.buffer) > 1 else self.buffer[0]
        part = table.slice(0, n)
        if part.schema != OUTPUT_SCHEMA:
            part = part.select(OUTPUT_SCHEMA.names).cast(OUTPUT_SCHEMA)
        self.committing = True
        try:
            try:
                self.before_commit()
            except LeaseLostError:
                self.stopped = True
                raise
            write_parquet_atomic(self.fs, f"{self.root}/{part_file(self.run, self.parts)}", part)
            self.parts += 1
            self.written += n
            rest = table.slice(n)
            self.buffer, self.buffered = ([rest] if rest.num_rows else []), rest.num_rows
            self.after_commit(part)
        finally:
            self.committing = False
        if stop_after and self.pending_stop:
            raise JobInterrupted()


class JobInterrupted(Exception):
    """SIGTERM reached the driver."""


class Progress:
    """The driver's progress line, at a steady cadence: rows done of rows to run, rows/s, tokens/s, tau so far,
    and the time left at the rate so far."""

    def __init__(self, total: int, every_s: float, print_fn=print, clock=time.monotonic):
        self.total, self.every_s, self.print_fn, self.clock = total, every_s, print_fn, clock
        self.start = self.last = clock()
        self.rows = self.tokens = self.steps = 0
        self.step_tokens = 0.0

    def add(self, rows: pa.Table) -> None:
        """Count a table of result rows (column sums, no row loop; an input row's samples count once)."""
        sample = rows.column("sample_index") if "sample_index" in rows.column_names else None
        self.rows += rows.num_rows - (pc.sum(pc.fill_null(pc.greater(sample, 0), False).cast(pa.int64())).as_py()
                                      or 0 if sample is not None else 0)
        self.tokens += pc.sum(rows.column("output_tokens")).as_py() or 0
        steps = rows.column("verify_steps")
        self.steps += pc.sum(steps).as_py() or 0
        self.step_tokens += pc.sum(pc.multiply(rows.column("tau"), pc.cast(steps, pa.float64()))).as_py() or 0.0
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


def _on_sigterm(writer: PartWriter):
    """SIGTERM's handler: stop now, or once the part being written is committed."""
    def handler(signum, frame):
        if writer.committing:
            writer.pending_stop = True
        else:
            raise JobInterrupted()
    return handler


def check_local_models(cfg: JobConfig) -> None:
    """Where the actors run on this machine (a local Ray, no address given): a target or head path that does not
    exist, or a head that does not fit the target, fails here in one line. In the actors it would fail in every
    one, again and again as Ray restarts them, after Ray and the job had started. (On a cluster the paths are the
    workers', which this machine may not see: they are checked there.) S3 and the embedded pair are not read."""
    from eagle_ray.model.pair import check_local_pair
    if cfg.ray_address or os.environ.get("RAY_ADDRESS"):
        return
    check_local_pair(cfg.engine.model)


def input_table(rows: list[InputRow]) -> pa.Table:
    """The input rows as columns (what a work item holds: ``InputRow.as_item``)."""
    return pa.table({"row_index": pa.array([r.row_index for r in rows], pa.int64()),
                     "id": pa.array([r.id for r in rows], pa.string()),
                     "payload": pa.array([r.payload for r in rows], pa.string()),
                     "error": pa.array([storable(r.error) for r in rows], pa.string()),
                     "error_kind": pa.array([r.kind for r in rows], pa.string())})


def run_job(cfg: JobConfig, print_fn=print) -> dict:
    """Run the job to completion (resuming into an existing output) and return the summary (``interrupted`` is
    true when SIGTERM stopped it early: what finished is committed)."""
    from eagle_ray.engine.budgets import check_prompt_room
    check_prompt_room(cfg.engine.cache.max_model_len, cfg.engine.speculation.trees())
    check_local_models(cfg)
    in_fs, in_path = filesystem(cfg.input.uri, cfg)
    out_fs, out_root = filesystem(cfg.output.uri, cfg)
    out_root = out_root.rstrip("/")
    inputs = input_table(read_input(in_path, in_fs, cfg.input.format, cfg.input.limit))
    if committed_parts(out_fs, out_root) and not cfg.resume:   # an output that is a file fails here, naming it
        raise ConfigError(f"output.uri {cfg.output.uri} already holds results and resume is false; "
                          "choose an empty output or set resume: true")
    try:
        check_openai_batch_file(cfg)
    except OSError as e:
        raise ConfigError(f"output.openai_batch_file {cfg.output.openai_batch_file} cannot be written: "
                          f"{type(e).__name__}: {e}") from None
    try:   # the first writes: an output that cannot be written fails here, before any model loads
        prepare_output(out_fs, out_root, cfg.output.uri)
        lease = OutputLease(out_fs, out_root, new_run_id(), cfg.lease_stale_s)
        lease.acquire()
    except OSError as e:
        raise ConfigError(f"output.uri {cfg.output.uri} cannot be written: {type(e).__name__}: {e}") from None
    try:
        recorded = check_output_identity(out_fs, out_root, cfg)
        return run_leased(cfg, inputs, out_fs, out_root, lease, recorded, print_fn)
    finally:
        lease.release()


BATCHES_PER_BLOCK = 4   # what Ray Data runs at once of an async stage's batches within one call (its default)


def rows_per_block(cfg: JobConfig) -> int:
    """Rows of each block the job hands Ray: the batches one actor call runs at once. A block is what Ray redoes
    when an actor dies and the grain of the job's tail, so it is no larger; each costs Ray (and the driver's
    scheduling thread) a task, so it is no smaller."""
    return cfg.actors.batch_size * BATCHES_PER_BLOCK


def run_leased(cfg: JobConfig, inputs: pa.Table, out_fs, out_root: str, lease: OutputLease, recorded: dict | None,
               print_fn) -> dict:
    import ray
    summary = JobSummary()
    mine = output_identity(cfg)
    was = (recorded or {}).get("max_model_len")
    roomier_than = was if isinstance(was, int) and was < mine["max_model_len"] else None
    resumed = resume_output(out_fs, out_root, inputs.select(["id", "payload"]), summary, roomier_than, lease.check,
                            (recorded or {}).get("unread")) if cfg.resume else Resumed.nothing()
    if recorded is not None and recorded != mine:   # now that the rows it no longer binds are dropped
        lease.check()
        put_atomic(out_fs, f"{out_root}/{JOB_FILE}", json.dumps(mine, indent=1).encode())
    done, ids = resumed.done, resumed.ids
    todo = inputs.filter(pc.invert(pc.is_in(inputs.column("id"), value_set=done))) if len(done) else inputs
    unmatched = pc.count_distinct(ids.filter(pc.invert(pc.is_in(ids, value_set=inputs.column("id"))))).as_py() \
        if len(ids) else 0
    again = ", ".join(f"{n} {why}" for n, why in ((resumed.retried, "failed rows to retry"), (resumed.unread,
                                                   "rows with fields read since they were written"),
                                                  (resumed.roomier, f"rows refused or cut by max_model_len {was}"))
                      if n)
    print_fn(f"eagle-ray job: {inputs.num_rows} input rows, {inputs.num_rows - todo.num_rows} already in "
             f"{cfg.output.uri}{f' ({again})' if again else ''}, {todo.num_rows} to run on "
             f"{'-'.join(map(str, sorted(set(cfg.actors.pool))))} actor(s)")
    if resumed.changed:
        print_fn(f"eagle-ray job: {resumed.changed} rows in {cfg.output.uri} answered another request than the input "
                 "row now holding their id (rows inserted, removed or edited); they run again")
    if unmatched:   # kept as they are; said aloud, since the same prompt may now run again under another id
        print_fn(f"eagle-ray job: {unmatched} rows already in {cfg.output.uri} match no input row id (the input, "
                 "its ids or input.limit changed since they were written); they are kept")
    t0 = time.time()
    started = now()
    writer = PartWriter(out_fs, out_root, cfg.output.rows_per_file, inputs.num_rows, run=lease.mine["run"],
                        before_commit=lease.check, after_commit=lambda table: summary.add(table, this_run=True))
    writer.written_before(resumed.partial, inputs)
    interrupted = False
    previous = signal.signal(signal.SIGTERM, _on_sigterm(writer)) if _main_thread() else None
    try:
        failed = pc.fill_null(pc.greater(pc.utf8_length(todo.column("error")), 0), False)
        pre_failed = todo.filter(failed)
        for i in range(0, pre_failed.num_rows, 10_000):  # unreadable lines and duplicate ids need no model
            writer.add([empty_row(item) | {"started_at": started, "finished_at": started}
                        for item in pre_failed.slice(i, 10_000).to_pylist()])
        runnable = todo.filter(pc.invert(failed))
        if runnable.num_rows:
            print_fn(ensure_ray(cfg.ray_address, max(os.cpu_count() or 1,
                                                     int(cfg.actors.pool[1] * cfg.actors.num_cpus))))
            if _main_thread():  # ray.init may install its own handler
                signal.signal(signal.SIGTERM, _on_sigterm(writer))
            import ray.data

            from eagle_ray.batch.processor import Processor
            n = rows_per_block(cfg)
            blocks = [runnable.slice(i, n) for i in range(0, runnable.num_rows, n)]
            # blocks as they are, their metadata read here (from_arrow asks a task per block for it)
            from_blocks = getattr(ray.data, "from_blocks", ray.data.from_arrow)
            ds = Processor(ProcessorConfig.of(cfg)).generate(from_blocks(blocks))
            progress = Progress(runnable.num_rows, cfg.progress_every_s, print_fn)
            # no prefetch: with it, Ray Data hands on a finished block only once the next one has finished too
            for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=0):
                progress.add(writer.add(batch))
    except JobInterrupted:
        interrupted = True
        print_fn("eagle-ray job: SIGTERM received; committing the finished rows and stopping")
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        writer.close()
    wall = time.time() - t0
    lease.check()   # a run taken over writes no summary: the run that took over writes its own
    result = summary.result(writer.written, wall)
    result |= {"interrupted": interrupted, "rows_matching_no_input": unmatched,
               "openai_batch_file": write_openai_batch(cfg, out_fs, out_root, inputs, interrupted, print_fn)}
    put_atomic(out_fs, f"{out_root}/{SUMMARY_FILE}", json.dumps(result, indent=1, default=str).encode())
    print_fn(format_summary(result))
    if interrupted and ray.is_initialized():
        ray.shutdown()
    check_written(cfg, result["openai_batch_file"])   # after the summary, which the committed rows still get
    return result


BATCH_FILE_COLUMNS = ("id", "sample_index", "response", "error", "error_kind")


def check_openai_batch_file(cfg: JobConfig) -> None:
    """The batch output file's place, before any model loads: a scheme the job cannot write, a folder, or an S3
    bucket that does not exist fails here; a local file's folder is made."""
    uri = cfg.output.openai_batch_file
    if not uri:
        return
    fs, path = filesystem(uri, cfg)
    if fs.isdir(path):
        raise ConfigError(f"output.openai_batch_file {uri} is a folder; name the file to write")
    prepare_output(fs, path.rstrip("/").rsplit("/", 1)[0] if "/" in path else ".", uri, "output.openai_batch_file")


def check_written(cfg: JobConfig, batch_file: dict | None) -> None:
    if batch_file and "error" in batch_file:
        raise ConfigError(f"output.openai_batch_file {batch_file['uri']} could not be written ({batch_file['error']});"
                          f" the rows are in {cfg.output.uri}: run again to write it (nothing is generated again)")


def write_openai_batch(cfg: JobConfig, fs, root: str, inputs: pa.Table, interrupted: bool, print_fn=print
                       ) -> dict | None:
    """OpenAI's batch output file of the output's rows that an input row still claims (``batch/openai_batch.py``),
    written anew by each run that ends with every row run (a resume with nothing left to run rewrites it); its uri
    and line counts, or the error that stopped its write (None: none asked, or the run was stopped)."""
    uri = cfg.output.openai_batch_file
    if not uri or interrupted:
        return None
    ids = inputs.column("id")
    parts = (t.filter(pc.is_in(t.column("id"), value_set=ids))
             for t in (read_part(fs, p, BATCH_FILE_COLUMNS) for p in committed_parts(fs, root)))
    try:
        counts = write_output_file(parts, *filesystem(uri, cfg))
    except (OSError, ConfigError) as e:
        return {"uri": uri, "error": f"{type(e).__name__}: {e}"}
    print_fn(f"eagle-ray job: {counts['lines']} lines in {uri}, {counts['answered']} of them answered")
    return {"uri": uri, **counts}


def _main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()
