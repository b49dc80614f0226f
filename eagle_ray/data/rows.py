"""Rows in, rows out: reading prompt files tolerantly, turning one input row into engine requests, and the fixed
Parquet schema of the output.

Input files are read on the driver, line by line, so that a line with invalid UTF-8 or broken JSON becomes an
error row instead of failing the whole file (Ray Data's JSON reader would fail the read task); every row gets a
stable ``row_index`` and an ``id`` (the row's own, or ``row-<index>``), which is what exactly-once re-runs key on.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import pyarrow as pa

from eagle_ray.config import SamplingParams
from eagle_ray.errors import ConfigError, InvalidRequestError

SAMPLING_KEYS = ("sampling_params", "sampling")


@dataclass
class InputRow:
    row_index: int
    id: str
    payload: str          # the row as JSON text ("" when it could not be parsed)
    error: str = ""       # set when the row is already known to be bad (parse error, duplicate id)

    def as_item(self) -> dict:
        return {"row_index": self.row_index, "id": self.id, "payload": self.payload, "error": self.error}


def _files(uri: str, fs, fmt: str) -> list[tuple[str, str]]:
    """(path, format) of every input file under ``uri`` in a stable order."""
    if any(c in uri for c in "*?["):
        paths = sorted(fs.glob(uri))
    elif fs.isdir(uri):
        paths = sorted(p for p in fs.find(uri) if p.endswith((".jsonl", ".json", ".parquet")))
    else:
        paths = [uri]
    out = []
    for p in paths:
        f = fmt if fmt != "auto" else ("parquet" if p.endswith(".parquet") else "jsonl")
        out.append((p, f))
    if not out:
        raise ConfigError(f"input.uri: no .jsonl or .parquet files at {uri}")
    return out


def read_input(uri: str, fs, fmt: str = "auto", limit: int | None = None) -> list[InputRow]:
    """Every input row, tolerant of bad lines; duplicate ids become error rows keyed ``<id>@row<index>``."""
    rows: list[InputRow] = []
    for path, f in _files(uri, fs, fmt):
        if f == "parquet":
            import pyarrow.parquet as pq
            with fs.open(path, "rb") as fh:
                for rec in pq.read_table(fh).to_pylist():
                    rows.append(_row(len(rows), rec, ""))
                    if limit and len(rows) >= limit:
                        break
        else:
            with fs.open(path, "rb") as fh:
                for lineno, raw in enumerate(fh, 1):
                    if not raw.strip():
                        continue
                    try:
                        rec, err = json.loads(raw.decode("utf-8")), ""
                    except UnicodeDecodeError as e:
                        rec, err = None, f"{path}:{lineno}: invalid UTF-8 ({e.reason} at byte {e.start})"
                    except json.JSONDecodeError as e:
                        rec, err = None, f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})"
                    rows.append(_row(len(rows), rec, err))
                    if limit and len(rows) >= limit:
                        break
        if limit and len(rows) >= limit:
            break
    first: dict[str, int] = {}
    for r in rows:
        if r.id in first:
            r.error = r.error or f"duplicate id {r.id!r} (first at row {first[r.id]})"
            r.id = f"{r.id}@row{r.row_index}"
        else:
            first[r.id] = r.row_index
    return rows


def _row(index: int, rec, err: str) -> InputRow:
    if rec is not None and not isinstance(rec, dict):
        return InputRow(index, f"row-{index}", json.dumps(rec, ensure_ascii=False, default=str),
                        f"a row must be a JSON object, got {type(rec).__name__}")
    rid = rec.get("id") if rec else None
    rid = f"row-{index}" if rid is None or rid == "" else str(rid)
    return InputRow(index, rid, json.dumps(rec, ensure_ascii=False, default=str) if rec is not None else "", err)


@dataclass
class Request:
    """What one row asks for: a prompt, a chat, or MT-bench style turns answered one after another."""
    kind: str                    # "prompt" | "messages" | "turns"
    value: object
    params: SamplingParams


def parse_request(payload: str, defaults: SamplingParams) -> Request:
    """Validate one row; raises InvalidRequestError with a reason that names the field."""
    rec = json.loads(payload)
    kinds = [k for k in ("prompt", "messages", "turns") if k in rec]
    if len(kinds) != 1:
        raise InvalidRequestError(f"a row needs exactly one of prompt / messages / turns, got {kinds or sorted(rec)}")
    kind, value = kinds[0], rec[kinds[0]]
    if kind == "prompt":
        if not isinstance(value, str):
            raise InvalidRequestError(f"prompt must be a string, got {type(value).__name__}")
        if not value.strip():
            raise InvalidRequestError("prompt is empty")
    elif kind == "messages":
        if not isinstance(value, list) or not value:
            raise InvalidRequestError("messages must be a non-empty list of {role, content}")
        for i, m in enumerate(value):
            if not isinstance(m, dict):
                raise InvalidRequestError(f"messages[{i}] must be an object with role and content")
            if not isinstance(m.get("content"), str) or not m["content"]:
                raise InvalidRequestError(f"messages[{i}].content must be a non-empty string")
    else:
        if not isinstance(value, list) or not value or not all(isinstance(t, str) and t.strip() for t in value):
            raise InvalidRequestError("turns must be a non-empty list of non-empty strings")
    overrides = next((rec[k] for k in SAMPLING_KEYS if k in rec), None)
    params = defaults
    if overrides is not None:
        if not isinstance(overrides, dict):
            raise InvalidRequestError("sampling_params must be an object")
        overrides = dict(overrides)
        if "max_tokens" in overrides:  # the OpenAI / vLLM name
            overrides.setdefault("max_new_tokens", overrides.pop("max_tokens"))
        try:
            params = SamplingParams(**(defaults.model_dump() | overrides))
        except ConfigError as e:
            raise InvalidRequestError(str(e).replace("invalid SamplingParams: ", "sampling_params.")) from None
    return Request(kind, value, params)


STAT_FIELDS = [
    ("verify_steps", pa.int64()), ("new_tokens", pa.int64()), ("tau", pa.float64()),
    ("accept_hist", pa.list_(pa.int64())), ("accepted_per_depth", pa.list_(pa.int64())),
    ("mean_tree_size", pa.float64()), ("prefill_s", pa.float64()), ("draft_s", pa.float64()),
    ("verify_s", pa.float64()), ("other_s", pa.float64()), ("ttft_s", pa.float64()), ("total_s", pa.float64()),
    ("tokens_per_s", pa.float64()),
]

# Every column has an explicit type, so a batch of error rows (all-null outputs) writes the same schema.
OUTPUT_SCHEMA = pa.schema([
    ("id", pa.string()), ("row_index", pa.int64()), ("input", pa.string()),
    ("output", pa.string()), ("turn_outputs", pa.list_(pa.string())),
    ("prompt_tokens", pa.int64()), ("output_tokens", pa.int64()), ("finish_reason", pa.string()),
    ("error", pa.string()),
    ("target_model", pa.string()), ("draft_model", pa.string()), ("speculative", pa.bool_()),
    ("temperature", pa.float64()), ("top_p", pa.float64()), ("top_k", pa.int64()), ("max_new_tokens", pa.int64()),
    ("seed", pa.int64()), ("sampling_params", pa.string()), ("tree", pa.string()),
    *STAT_FIELDS,
    ("started_at", pa.timestamp("us", tz="UTC")), ("finished_at", pa.timestamp("us", tz="UTC")),
    ("worker_id", pa.string()),
])


def empty_row(item: dict) -> dict:
    row = {name: None for name in OUTPUT_SCHEMA.names}
    row.update(id=item["id"], row_index=int(item["row_index"]), input=item["payload"])
    return row


def to_table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=OUTPUT_SCHEMA)
