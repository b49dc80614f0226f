"""Rows in, rows out: reading prompt files tolerantly and the fixed Parquet schema of the output.

Input files are read on the driver, line by line, so that a line with invalid UTF-8, broken or absurdly nested
JSON, or no object at all becomes an error row instead of failing the whole file (Ray Data's JSON reader would
fail the read task); every row gets a stable ``row_index`` and an ``id`` (the row's own, or ``row-<index>``),
which is what exactly-once re-runs key on. What a row asks for is parsed by the engine's request parser
(:func:`eagle_ray.engine.request.parse_row`), the same one the Serve app uses.

Every error row names its kind (``error_kind``): what went wrong, in a word a summary can count.
"""
from __future__ import annotations

import contextlib
import gzip
import json
import math
from dataclasses import dataclass

import pyarrow as pa

from eagle_ray.engine.request import (CONTINUATION_KEYS, MAX_NESTING, PROMPT_KINDS, SAMPLING_KEYS, TEMPLATE_KEYS,
                                     TOOL_KEYS, nesting_depth, storable)
from eagle_ray.errors import ConfigError, EngineDeadError, InvalidRequestError, PromptTooLongError

# error kinds (the ``error_kind`` column and summary.json's ``error_kinds`` keys)
INVALID_UTF8 = "invalid_utf8"
INVALID_JSON = "invalid_json"
INVALID_ROW = "invalid_row"           # valid JSON, but not an object, or nested too deep
DUPLICATE_ID = "duplicate_id"
INVALID_REQUEST = "invalid_request"   # the request parser refused it (names the field)
PROMPT_TOO_LONG = "prompt_too_long"
ENGINE_FAILED = "engine_failed"       # the engine died under it: retried on resume
INTERNAL_ERROR = "internal_error"     # a bug: retried on resume
RETRIED_ON_RESUME = (ENGINE_FAILED, INTERNAL_ERROR)


def error_kind(err: BaseException) -> str:
    if isinstance(err, PromptTooLongError):
        return PROMPT_TOO_LONG
    if isinstance(err, InvalidRequestError):
        return INVALID_REQUEST
    if isinstance(err, EngineDeadError):
        return ENGINE_FAILED
    return INTERNAL_ERROR


@dataclass(slots=True)
class InputRow:
    row_index: int | None
    id: str
    payload: str          # the row as JSON text ("" when it could not be parsed)
    error: str = ""       # set when the row is already known to be bad (parse error, duplicate id)
    kind: str = ""        # its error kind
    own_id: bool = False  # the id is the row's own (else ``row-<index>``, given here)

    def as_item(self) -> dict:
        return {"row_index": self.row_index, "id": self.id, "payload": self.payload, "error": self.error,
                "error_kind": self.kind}


def _files(uri: str, fs, fmt: str) -> list[tuple[str, str]]:
    """(path, format) of every input file under ``uri`` in a stable order; a ConfigError naming ``input.uri``
    when there is nothing to read."""
    if any(c in uri for c in "*?[") and not fs.exists(uri):   # a path that exists is read as written
        paths = []
        for p in sorted(fs.glob(uri)):
            if fs.isdir(p):
                paths += sorted(_data_files(fs, p))
            elif _is_data_file(p):
                paths.append(p)
    elif not fs.exists(uri):
        raise ConfigError(f"input.uri: {uri} does not exist")
    elif fs.isdir(uri):
        paths = sorted(_data_files(fs, uri))
    else:
        paths = [uri]    # named on its own: read whatever its name (JSON lines unless .parquet or format says)
        if uri.endswith(UNREAD_COMPRESSIONS):
            raise ConfigError(f"input.uri: {uri} is compressed in a way the job does not read; decompress it, or "
                              "gzip it (.jsonl.gz)")
    out = [(p, fmt if fmt != "auto" else ("parquet" if p.endswith(".parquet") else "jsonl")) for p in paths]
    if not out:
        raise ConfigError(f"input.uri: no .jsonl, .json or .parquet files (or .jsonl.gz, .json.gz) at {uri}")
    return out


DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".jsonl.gz", ".json.gz")
UNREAD_COMPRESSIONS = (".bz2", ".xz", ".zst", ".zip", ".tar", ".tgz", ".7z", ".lz4", ".snappy")


def _is_data_file(path: str) -> bool:
    """A file a directory or glob contributes: a data suffix, and not hidden or a marker (``.part-0.crc``,
    ``_SUCCESS``), whose lines would be rows and shift every later row's index."""
    name = path.rstrip("/").rsplit("/", 1)[-1]
    return name.endswith(DATA_SUFFIXES) and not name.startswith((".", "_"))


def _data_files(fs, root: str) -> list[str]:
    return [p for p in fs.find(root) if _is_data_file(p)]


def decode_line(raw: bytes, first: bool, what: str = "JSON") -> tuple[object, str, str]:
    """(record, error, kind) of one JSONL line (or of a whole ``.json`` document: ``what`` then names it, and its
    errors name their line). A UTF-8 byte order mark starts the first line of files written by some Windows tools;
    it is not part of the row."""
    if first and raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"invalid UTF-8 ({e.reason} at byte {e.start})", INVALID_UTF8
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as e:
        where = f"column {e.colno}" if what == "JSON" else f"line {e.lineno} column {e.colno}"
        return None, f"invalid {what} ({e.msg} at {where})", INVALID_JSON
    except ValueError as e:   # an integer of more digits than Python converts (4,300)
        return None, f"invalid {what} ({str(e).split(';')[0]})", INVALID_JSON
    except RecursionError:
        return None, f"JSON nested deeper than {MAX_NESTING} levels", INVALID_ROW
    return rec, "", ""


def read_input(uri: str, fs, fmt: str = "auto", limit: int | None = None) -> list[InputRow]:
    """Every input row, tolerant of bad lines; duplicate ids become error rows keyed ``<id>@row<index>``."""
    rows: list[InputRow] = []
    for path, f in _files(uri, fs, fmt):
        if f == "parquet":
            import pyarrow.parquet as pq
            try:
                with fs.open(path, "rb") as fh:
                    records = parquet_records(pq.read_table(fh))
            except (pa.ArrowException, OSError) as e:
                raise ConfigError(f"input file {path} is not readable Parquet: {e}") from None
            for rec in records:
                rows.append(parquet_row(len(rows), rec, path))
                if limit and len(rows) >= limit:
                    break
        else:
            for row in text_file_rows(fs, path, len(rows)):
                rows.append(row)
                if limit and len(rows) >= limit:
                    break
        if limit and len(rows) >= limit:
            break
    if not rows:
        raise ConfigError(f"input.uri: {uri} holds no rows")
    return unique_ids(rows)


def unique_ids(rows: list[InputRow]) -> list[InputRow]:
    """Give every row an id no other row has (ids key exactly-once re-runs, so two rows sharing one would lose
    one). A row's own id wins over a given ``row-<index>``; the second row with an id is an error row keyed
    ``<id>@row<index>``; a given id that a row's own id already holds becomes ``row-<index>@row<index>``. Either is
    suffixed ``#2``, ``#3``, ... should a row hold that name too. Deterministic, so a re-run keys rows the same."""
    first: dict[str, int] = {}
    moved = []
    for r in sorted(rows, key=lambda r: not r.own_id):   # stable: own ids first, each group in file order
        if r.id not in first:
            first[r.id] = r.row_index
            continue
        if r.own_id and not r.error:
            r.error, r.kind = (f"duplicate id {r.id!r} (first at row {first[r.id]}; ids are compared as text, so 1 "
                               f"and \"1\" are one id)"), DUPLICATE_ID
        moved.append(r)
    taken = set(first)
    for r in moved:
        base = name = f"{r.id}@row{r.row_index}"
        k = 1
        while name in taken:
            k += 1
            name = f"{base}#{k}"
        r.id = name
        taken.add(name)
    return rows


def text_file_rows(fs, path: str, first_index: int):
    """A JSON-lines file's rows, or a ``.json`` file's rows whether it holds JSON lines or one array; gzipped
    where the name ends in ``.gz``."""
    if path.endswith((".json", ".json.gz")):
        with _open_text_file(fs, path) as fh:
            doc = json_document_rows(fh.read(), path, first_index)
        if doc is not None:
            yield from doc
            return
    with _open_text_file(fs, path) as fh:
        yield from rows_from_lines(fh, path, first_index)


@contextlib.contextmanager
def _open_text_file(fs, path: str):
    with fs.open(path, "rb") as raw:
        if not path.endswith(".gz"):
            yield raw
            return
        try:
            with gzip.GzipFile(fileobj=raw) as fh:
                yield fh
        except (OSError, EOFError) as e:   # BadGzipFile is an OSError; a cut file ends early
            raise ConfigError(f"input file {path} is not readable gzip: {e}") from None


def json_document_rows(data: bytes, path: str, first_index: int) -> list[InputRow] | None:
    """The rows of a ``.json`` file holding one JSON array of rows (as many tools write it), or None where the
    file is JSON lines (its first line is a whole JSON value): then it is read one row a line. An array that does
    not parse is one ``invalid_json`` row naming where: read line by line, its pieces would be rows it never held."""
    body = data[3:] if data.startswith(b"\xef\xbb\xbf") else data
    if not body.lstrip().startswith(b"["):
        return None
    rec, err, kind = decode_line(body, False, what="JSON array")
    if not err and isinstance(rec, list):
        return [_row(first_index + i, r, "", "") for i, r in enumerate(rec)]
    first_line = body.lstrip().split(b"\n", 1)[0]
    if not decode_line(first_line, False)[1]:
        return None
    return [_row(first_index, None, f"{path}: {err}", kind)]


def rows_from_lines(lines, path: str, first_index: int = 0):
    """InputRows of a JSONL file's lines (bytes), blank lines skipped; ids are checked for duplicates later."""
    index = first_index
    for lineno, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        rec, err, kind = decode_line(raw, lineno == 1)
        yield _row(index, rec, f"{path}:{lineno}: {err}" if err else "", kind)
        index += 1


def _row(index: int, rec, err: str, kind: str) -> InputRow:
    if err:
        return InputRow(index, f"row-{index}", "", err, kind)
    if not isinstance(rec, dict):
        what = "null" if rec is None else type(rec).__name__
        return InputRow(index, f"row-{index}", _dump(rec), f"a row must be a JSON object, got {what}", INVALID_ROW)
    if nesting_depth(rec) > MAX_NESTING:
        return InputRow(index, f"row-{index}", "", f"row nested deeper than {MAX_NESTING} levels", INVALID_ROW)
    rid = rec.get("custom_id") if is_batch_line(rec) else rec.get("id")   # a batch line's id is its custom_id
    own = not (rid is None or rid == "")
    if own and not isinstance(rid, (str, int, bytes)) or isinstance(rid, bool):   # bytes: parquet_row says why
        if isinstance(rid, float) and rid.is_integer():
            rid = int(rid)   # a pandas id column with a gap turns 1 into 1.0; JSON lines said 1
        else:
            return InputRow(index, f"row-{index}", _dump(rec), f"id must be a string or an integer, got "
                            f"{_dump(rid)}", INVALID_ROW)
    return InputRow(index, storable(str(rid)) if own else f"row-{index}", _dump(rec), own_id=own)


BATCH_LINE_KEYS = ("custom_id", "method", "url", "body")   # an OpenAI batch file's line (batch/openai_batch.py)


def is_batch_line(rec) -> bool:
    """A line of an OpenAI batch file: no prompt field of a row, and a ``custom_id`` or an API ``url``
    (``/v1/...``); a row with a prompt and a ``url`` or ``body`` column (a web page's) stays a row."""
    if not isinstance(rec, dict) or any(rec.get(k) is not None for k in PROMPT_KINDS):
        return False
    url = rec.get("url")
    return rec.get("custom_id") is not None or isinstance(url, str) and url.startswith("/v1/")


# the fields a row's request is read from (:func:`eagle_ray.engine.request.parse_row`, or a batch line's)
READ_FIELDS = ("id", *PROMPT_KINDS, *SAMPLING_KEYS, *CONTINUATION_KEYS, *TOOL_KEYS, "parallel_tool_calls",
               *TEMPLATE_KEYS, *BATCH_LINE_KEYS)


def parquet_row(index: int, rec: dict, path: str) -> InputRow:
    """One Parquet record as a row. ``binary`` values are UTF-8 text: the fields a request is read from are decoded
    (a prompt stored as bytes is the prompt, never its Python repr) and make an ``invalid_utf8`` row, keeping the
    row's id, when they are not UTF-8; in other columns (a hash, say) each value that is text is decoded and the
    rest written as they are, like any column the job does not read."""
    out, bad = {}, ""
    for key, value in rec.items():
        out[key], err = text_bytes(value)
        if err and key in READ_FIELDS and not bad:
            bad = f"{path}: column {key!r} is not UTF-8 text ({err.reason} at byte {err.start})"
    row = _row(index, out, "", "")
    if bad and not row.error:
        row.error, row.kind = bad, INVALID_UTF8
        if isinstance(out.get("id"), bytes):
            row.id, row.own_id = f"row-{index}", False
    return row


def text_bytes(value):
    """(value, first error): a Parquet ``binary`` value (bytes) as the UTF-8 text it holds, through lists, structs
    and maps (their keys too); bytes that are not UTF-8 stay bytes, and the first such value's UnicodeDecodeError is
    returned. A map key that is not text becomes its repr, as JSON keys must be text."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8"), None
        except UnicodeDecodeError as e:
            return value, e
    first = None
    if isinstance(value, dict):
        decoded = {}
        for k, v in value.items():
            (k, v), err = text_bytes([k, v])
            decoded[k if isinstance(k, (str, int, float, bool)) else repr(k)] = v
            first = first or err
        return decoded, first
    if isinstance(value, (list, tuple)):
        decoded = []
        for v in value:
            v, err = text_bytes(v)
            decoded.append(v)
            first = first or err
        return decoded, first
    return value, None


def parquet_records(table: pa.Table) -> list[dict]:
    """A Parquet table's rows as dicts, a map as the object it stands for (as Spark and pandas write dicts). A
    row whose map holds a key twice keeps that map as (key, value) pairs, which no request field accepts. A date
    or time that Python cannot hold (a timestamp of 2**62 microseconds, a common "never") makes its column's dates
    and times text, and a ``string`` value that is not UTF-8 (Parquet writers do not check) makes every text column
    bytes, decoded value by value (:func:`parquet_row`: an ``invalid_utf8`` row where a request field is not
    UTF-8), so a column the job does not read never spoils a row, nor a bad row the file."""
    try:
        return _pylist(table)
    except UnicodeDecodeError:
        return parquet_records(_retyped(table, lambda t: pa.binary() if pa.types.is_string(t) else
                                        pa.large_binary() if pa.types.is_large_string(t) else None))
    except (OverflowError, ValueError):
        return _pylist(_retyped(table, lambda t: pa.string() if pa.types.is_temporal(t) else None))


def _pylist(table: pa.Table) -> list[dict]:
    try:
        return table.to_pylist(maps_as_pydicts="strict")
    except TypeError:   # a pyarrow before 20 has no maps_as_pydicts: maps stay (key, value) pairs
        return table.to_pylist()
    except KeyError:   # a duplicate key: find its rows
        out = []
        for i in range(table.num_rows):
            row = table.slice(i, 1)
            try:
                out += row.to_pylist(maps_as_pydicts="strict")
            except KeyError:
                out += row.to_pylist()
        return out


def _retyped(table: pa.Table, leaf) -> pa.Table:
    """``table`` cast so that every type ``leaf`` maps (to a type; None: kept) is that type, inside lists, structs
    and maps too."""
    return table.cast(pa.schema([f.with_type(_retype(f.type, leaf)) for f in table.schema]))


def _retype(t: pa.DataType, leaf) -> pa.DataType:
    if leaf(t) is not None:
        return leaf(t)
    if pa.types.is_map(t):
        return pa.map_(_retype(t.key_type, leaf), _retype(t.item_type, leaf))
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        item = t.value_field.with_type(_retype(t.value_type, leaf))
        return (pa.list_(item, t.list_size) if pa.types.is_fixed_size_list(t)
                else pa.large_list(item) if pa.types.is_large_list(t) else pa.list_(item))
    if pa.types.is_struct(t):
        return pa.struct([t.field(i).with_type(_retype(t.field(i).type, leaf)) for i in range(t.num_fields)])
    return t


def _dump(rec) -> str:
    """JSON text of a row, as written to the ``input`` column (ASCII-escaped if it holds lone surrogates, which
    JSON allows and UTF-8 cannot hold; the escapes decode back to the same row). A NaN or infinite float (a Parquet
    float column may hold them; JSON cannot) is written as the text ``"NaN"``, ``"Infinity"``, ``"-Infinity"``,
    so every ``input`` parses as JSON, and a request field holding one is refused as the wrong type."""
    try:
        text = json.dumps(rec, ensure_ascii=False, default=str, allow_nan=False)
    except ValueError:
        rec = _finite(rec)
        text = json.dumps(rec, ensure_ascii=False, default=str)
    return text if storable(text) is text else json.dumps(rec, ensure_ascii=True, default=str)


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


STAT_FIELDS = [
    ("verify_steps", pa.int64()), ("new_tokens", pa.int64()), ("tau", pa.float64()),
    ("accept_hist", pa.list_(pa.int64())), ("accepted_per_depth", pa.list_(pa.int64())),
    ("mean_tree_size", pa.float64()), ("prefill_s", pa.float64()), ("draft_s", pa.float64()),
    ("verify_s", pa.float64()), ("other_s", pa.float64()), ("ttft_s", pa.float64()), ("total_s", pa.float64()),
    ("tokens_per_s", pa.float64()), ("head_version", pa.int64()), ("cached_prompt_tokens", pa.int64()),
]

# per token: its top alternatives, most probable first (a list of structs: pandas reads dicts, duckdb a STRUCT[])
TOP_LOGPROBS = pa.list_(pa.list_(pa.struct([("token_id", pa.int64()), ("logprob", pa.float32())])))
EVAL_FIELDS = [
    ("sample_index", pa.int64()),                                  # which of the row's n samples (0 without n)
    ("output_logprobs", pa.list_(pa.float32())), ("output_top_logprobs", TOP_LOGPROBS),   # sampling_params.logprobs
    ("prompt_logprobs", pa.list_(pa.float32())), ("prompt_top_logprobs", TOP_LOGPROBS),   # ... .prompt_logprobs
    ("continuation_logprobs", pa.list_(pa.float64())),   # a scoring row: per continuation, its summed logprob,
    ("continuation_tokens", pa.list_(pa.int64())),       # its token count,
    ("continuation_greedy", pa.list_(pa.bool_())),       # and whether every token is the target's argmax
]

# Every column has an explicit type, so a batch of error rows (all-null outputs) writes the same schema.
OUTPUT_SCHEMA = pa.schema([
    ("id", pa.string()), ("row_index", pa.int64()), ("input", pa.string()),
    ("output", pa.string()), ("reasoning", pa.string()),   # an output's thinking apart, with a reasoning parser
    ("tool_calls", pa.string()),                             # a chat row's tool calls (OpenAI's list, as JSON)
    ("response", pa.string()),     # a batch line's answer, as the batch output file's response object (JSON)
    ("turn_outputs", pa.list_(pa.string())), ("output_token_ids", pa.list_(pa.int64())),
    ("prompt_tokens", pa.int64()), ("output_tokens", pa.int64()), ("finish_reason", pa.string()),
    ("stop_reason", pa.string()),   # the stop string that ended the output, or a stop_token_ids id as its digits
    ("error", pa.string()), ("error_kind", pa.string()),
    *EVAL_FIELDS,
    ("target_model", pa.string()), ("draft_model", pa.string()), ("speculative", pa.bool_()),
    ("temperature", pa.float64()), ("top_p", pa.float64()), ("top_k", pa.int64()), ("max_new_tokens", pa.int64()),
    ("seed", pa.int64()), ("sampling_params", pa.string()), ("tree", pa.string()),
    *STAT_FIELDS,
    ("started_at", pa.timestamp("us", tz="UTC")), ("finished_at", pa.timestamp("us", tz="UTC")),
    ("worker_id", pa.string()),
])
STRING_COLUMNS = [f.name for f in OUTPUT_SCHEMA if pa.types.is_string(f.type)]


def empty_row(item: dict) -> dict:
    row = {name: None for name in OUTPUT_SCHEMA.names}
    index = item["row_index"]   # None for a processor's rows: a user's dataset has no global row position
    row.update(id=item["id"], row_index=None if index is None else int(index), input=item["payload"])
    if item.get("error"):
        row.update(error=item["error"], error_kind=item.get("error_kind") or INVALID_ROW)
    return row


def stop_text(reason: int | str | None) -> str | None:
    """A ``stop_reason`` as the column holds it: the stop string, or a stop token's id as its digits."""
    return None if reason is None else str(reason)


def logprob_columns(lp, prompt=None) -> dict:
    """``output_logprobs`` and ``output_top_logprobs`` of a ``TokenLogprobs``, and ``prompt_logprobs`` and
    ``prompt_top_logprobs`` of ``prompt``'s (its first token's null, as it has none; None: not asked)."""
    out = {}
    if lp is not None:
        out |= {"output_logprobs": list(lp.values),
                "output_top_logprobs": [[{"token_id": i, "logprob": v} for i, v in top] for top in lp.top]}
    if prompt is not None:
        out |= {"prompt_logprobs": [None] + list(prompt.values),
                "prompt_top_logprobs": [None] + [[{"token_id": i, "logprob": v} for i, v in top]
                                                 for top in prompt.top]}
    return out


def to_table(rows: list[dict]) -> pa.Table:
    """Rows as a table of :data:`OUTPUT_SCHEMA`. Text the rows carry back from anywhere (an error message quoting
    the input, an output) is made storable, so no row can fail the write of its batch."""
    for row in rows:
        for col in STRING_COLUMNS:
            if row.get(col) is not None:
                row[col] = storable(row[col])
        if row.get("turn_outputs"):
            row["turn_outputs"] = [storable(t) for t in row["turn_outputs"]]
    return pa.Table.from_pylist(rows, schema=OUTPUT_SCHEMA)
