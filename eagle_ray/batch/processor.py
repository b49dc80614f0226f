"""eagle-ray inside a user's own Ray Data pipeline: ``ds = build_processor(config, preprocess, postprocess)(ds)``.

The processor is the batch job without its reading and writing: the same actor pool (one engine per actor,
continuously batched), the same request rows (``prompt`` | ``messages`` | ``turns``, ``id``, ``sampling_params``),
the same typed output columns with per-request acceptance stats, and the same error policy (a bad row becomes an
error row; a row that breaks the engine is rerun alone, see ``stage.py``). The job (``job.py``) is its user: read,
drop the ids already written, the processor, exactly-once write. What a user's pipeline gives up is the job's
resume: the processor holds no output of its own.

    processor = build_processor({"engine": {...}, "sampling": {"max_new_tokens": 256}},
                                preprocess=lambda row: {"id": row["qid"], "prompt": row["question"]},
                                postprocess=lambda row: {"qid": row["id"], "answer": row["output"], "tau": row["tau"]})
    ds = ray.data.read_parquet("s3://bucket/questions/").filter(lambda row: row["lang"] == "en")
    processor(ds).write_parquet("s3://bucket/answers/")
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import partial
from typing import Callable

from eagle_ray.batch.config import ProcessorConfig  # noqa: F401 - also the public name, eagle_ray.ProcessorConfig
from eagle_ray.batch.rows import INVALID_ROW, InputRow, parquet_row

Row = dict


def request_item(row: Row, preprocess: Callable[[Row], Row] | None = None) -> Row:
    """One dataset row as the stage's work item: ``preprocess(row)`` (or the row) is the request row. A row that
    preprocess fails on, or that is not a request, becomes an error item: its error row says why."""
    try:
        rec = preprocess(row) if preprocess is not None else row
    except Exception as e:  # noqa: BLE001 - the user's function failed on one row: that row fails, not the pipeline
        return InputRow(None, f"row-{digest(repr(row))}", "", f"preprocess failed: {type(e).__name__}: {e}",
                        INVALID_ROW).as_item()
    if not isinstance(rec, dict):
        what = "None" if rec is None else type(rec).__name__
        return InputRow(None, f"row-{digest(repr(rec))}", "", f"a request row must be a dict, got {what}",
                        INVALID_ROW).as_item()
    row = parquet_row(None, dict(rec), "dataset row")   # bytes as text, as the job reads Parquet
    if not row.own_id:   # no id of its own: one from its content, the same on every run
        row.id = f"row-{digest(row.payload or repr(rec))}"
    return row.as_item()


def digest(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def finish_row(row: Row, postprocess: Callable[[Row], Row]) -> Row:
    """``postprocess`` of one output row, given also ``request``: the row preprocess made, as a dict."""
    row = dict(row)
    row["request"] = json.loads(row["input"]) if row.get("input") else None
    return postprocess(row)


@dataclass
class Processor:
    """Apply to a ``ray.data.Dataset``: ``processor(ds)`` returns the dataset of
    output rows (``eagle_ray.batch.rows.OUTPUT_SCHEMA``, or what ``postprocess`` makes of each)."""
    config: ProcessorConfig
    preprocess: Callable[[Row], Row] | None = None
    postprocess: Callable[[Row], Row] | None = None

    def __call__(self, ds):
        return self.generate(ds.map(partial(request_item, preprocess=self.preprocess)))

    def generate(self, items):
        """The dataset of work items (``InputRow.as_item()``) through the actor pool, then postprocess."""
        from eagle_ray.batch.stage import GenerateStage
        out = items.map_batches(GenerateStage, fn_constructor_kwargs={"config_json": self.config.model_dump_json()},
                                **pool_options(self.config.actors))
        return out.map(partial(finish_row, postprocess=self.postprocess)) if self.postprocess else out


def pool_options(a) -> dict:
    """What Ray Data reserves and runs for the actor pool (``ActorsConfig``): each actor's CPUs and GPUs (one per
    rank of a target split over GPUs: Ray hands the actor that many distinct devices on one node, and its engine
    starts its other ranks on them), the pool's size, and batches in flight per actor."""
    import ray
    lo, hi = a.pool
    return dict(batch_size=a.batch_size, batch_format="pyarrow", num_cpus=a.num_cpus, num_gpus=a.num_gpus or None,
                max_restarts=a.max_restarts, max_task_retries=a.max_restarts,
                compute=ray.data.ActorPoolStrategy(min_size=lo, max_size=hi,
                                                   max_tasks_in_flight_per_actor=a.max_concurrent_batches,
                                                   max_concurrent_calls_per_actor=a.max_concurrent_batches))


def build_processor(config, preprocess: Callable[[Row], Row] | None = None,
                    postprocess: Callable[[Row], Row] | None = None) -> Processor:
    """A processor for any ``ray.data.Dataset`` (in the spirit of ``ray.data.llm.build_llm_processor``).

    ``config``: a :class:`ProcessorConfig`, its mapping, or a YAML file (a job config's ``engine``, ``sampling``,
    ``speculative``, ``actors`` and ``s3`` sections). ``preprocess(row)`` returns the request row (``prompt``,
    ``messages`` or ``turns``, optional ``id`` and ``sampling_params``); ``postprocess(row)`` maps each output row
    (the job's columns, plus ``request``: the row preprocess returned) to the row the dataset holds. A bad config
    raises ``ConfigError`` here, before any actor starts."""
    return Processor(ProcessorConfig.of(config), preprocess, postprocess)
