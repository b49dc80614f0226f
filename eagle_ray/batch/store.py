"""Writing an output's files so that a reader sees each one whole or not at all: locally a temporary file renamed
over the name (a rename is atomic within a folder), on an object store one upload (an object appears only when its
upload completes). Parts, ``summary.json``, ``_job.json``, ``_lease.json`` and an OpenAI batch output file are all
written this way."""
from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem


def put_atomic(fs, path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` whole."""
    if isinstance(fs, LocalFileSystem):
        _replace(path, lambda tmp: Path(tmp).write_bytes(data))
    else:
        fs.pipe_file(path, data)


def put_file_atomic(fs, path: str, local: str) -> None:
    """Copy the local file ``local`` to ``path`` whole (a file too large to hold in memory)."""
    if isinstance(fs, LocalFileSystem):
        _replace(path, lambda tmp: shutil.copyfile(local, tmp))
    else:
        fs.put_file(local, path)


def write_parquet_atomic(fs, path: str, table: pa.Table) -> None:
    """Write ``table`` as a Parquet file at ``path`` whole."""
    if isinstance(fs, LocalFileSystem):
        _replace(path, lambda tmp: pq.write_table(table, tmp))
    else:
        buf = pa.BufferOutputStream()
        pq.write_table(table, buf)
        fs.pipe_file(path, buf.getvalue().to_pybytes())


def _replace(path: str, write) -> None:
    """``write(tmp)`` a hidden file beside ``path``, then rename it over ``path``; nothing is left behind if the
    write fails (a hidden name: a folder read as input skips it)."""
    folder, name = path.rsplit("/", 1)
    tmp = f"{folder}/.tmp-{uuid.uuid4().hex[:8]}-{name}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
