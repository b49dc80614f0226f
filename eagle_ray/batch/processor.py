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
from eagle_ray.errors import ConfigError

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


POSTPROCESS_FAILED = "postprocess_failed"


RAY_DATA_LLM_NAMES = {"generated_text": "output", "generated_tokens": "output_token_ids",
                      "num_generated_tokens": "output_tokens", "num_input_tokens": "prompt_tokens"}


def finish_row(row: Row, postprocess: Callable[[Row], Row]) -> Row:
    """``postprocess`` of one output row, given also ``request`` (the row preprocess made, as a dict) and Ray Data
    LLM's names of its answer (``generated_text``, ...), so a postprocess written for Ray Data LLM runs as it is.
    A row that postprocess fails on stays the processor's own output row (the job's columns, its answer kept) with
    ``error_kind`` ``postprocess_failed`` and the error; a row that had failed already says that too."""
    given = {alias: row.get(name) for alias, name in RAY_DATA_LLM_NAMES.items()} | dict(row)   # a column wins
    given["request"] = json.loads(row["input"]) if row.get("input") else None
    try:
        return postprocess(given)
    except Exception as e:  # noqa: BLE001 - the user's function failed on one row: that row fails, not the pipeline
        before = f"; the row had failed already ({row['error_kind']}): {row['error']}" if row.get("error") else ""
        return dict(row) | {"error": f"postprocess failed: {type(e).__name__}: {e}{before}",
                            "error_kind": POSTPROCESS_FAILED}


def check_cpus_left(a) -> None:
    """A pool that holds every CPU of the cluster leaves none for the dataset's read and map tasks (a task asks
    one CPU), and Ray Data would wait for one forever, saying nothing: refuse it here instead. A pool larger than
    the cluster is left to wait: an autoscaler may be adding nodes. (The job reads on its driver and needs no such
    CPU.)"""
    import ray
    if not ray.is_initialized():
        return
    total = ray.cluster_resources().get("CPU", 0.0)
    ask = a.pool[0] * a.num_cpus
    if ask <= total < ask + 1:
        fits = (total - 1) / a.pool[0]
        raise ConfigError(
            f"the actor pool takes {ask:g} of this Ray cluster's {total:g} CPUs ({a.pool[0]} actor(s) x "
            f"actors.num_cpus {a.num_cpus:g}), which leaves none for the dataset's read and map tasks: the pipeline "
            f"would wait for a CPU forever. "
            + (f"Set actors.num_cpus to {fits:g} or less, " if fits > 0 else "Use fewer actors, ")
            + "or run on a cluster with more CPUs")


@dataclass
class Processor:
    """Apply to a ``ray.data.Dataset``: ``processor(ds)`` returns the dataset of
    output rows (``eagle_ray.batch.rows.OUTPUT_SCHEMA``, or what ``postprocess`` makes of each)."""
    config: ProcessorConfig
    preprocess: Callable[[Row], Row] | None = None
    postprocess: Callable[[Row], Row] | None = None

    def __call__(self, ds):
        check_cpus_left(self.config.actors)
        return self.generate(ds.map(partial(request_item, preprocess=self.preprocess)))

    def generate(self, items):
        """The dataset of work items (``InputRow.as_item()``) through the actor pool, then postprocess."""
        from eagle_ray.batch.stage import GenerateStage, batch_ledger, saved_heads
        heads = saved_heads(self.config)
        if heads and heads.startswith("s3://"):   # the same place from here as from the actors: checked now
            from eagle_ray.train.online import check_save_dir
            check_save_dir(heads, self.config.s3.storage_options())
        out = items.map_batches(GenerateStage, fn_constructor_kwargs={"config_json": self.config.model_dump_json(),
                                                                      "ledger": batch_ledger()},
                                **pool_options(self.config.actors))
        allow_start_failures(out.context, self.config.actors)
        return out.map(partial(finish_row, postprocess=self.postprocess)) if self.postprocess else out


def pool_options(a) -> dict:
    """What Ray Data reserves and runs for the actor pool (``ActorsConfig``): each actor's CPUs and GPUs (one per
    rank of a target split over GPUs: Ray hands the actor that many distinct devices on one node, and its engine
    starts its other ranks on them), the pool's size, and batches in flight per actor.

    An actor whose process dies (its node lost or preempted, a device fault, a stalled step) is restarted as long
    as the job runs, unless ``max_restarts`` bounds it, and its batches are retried without bound: a retry that
    reaches the dead node before Ray has declared it dead (about 15 s) must not use up a budget, and the actor
    comes back on another node. A batch that keeps killing its actors is ended by the stage instead
    (``stage.DEATHS_PER_BATCH``). Unbounded restarts and retries are Ray Data's own defaults for an actor pool, so
    nothing is passed for them: ``max_restarts`` is a generic Ray remote argument, which Ray Data warns will no
    longer be taken from 2.64 and has no named parameter for; it is passed only when set (Ray Data then still
    retries batches without bound unless it is 0)."""
    import ray
    lo, hi = a.pool
    restarts = {} if a.max_restarts is None else {"max_restarts": a.max_restarts}
    return dict(batch_size=a.batch_size, batch_format="pyarrow", num_cpus=a.num_cpus, num_gpus=a.num_gpus or None,
                compute=ray.data.ActorPoolStrategy(min_size=lo, max_size=hi,
                                                   max_tasks_in_flight_per_actor=a.max_concurrent_batches,
                                                   max_concurrent_calls_per_actor=a.max_concurrent_batches),
                **restarts)


def start_failure_budget(a) -> int:
    """Failed actor starts in a row the pool survives (``actors.start_failures``, default the pool's largest
    size): one engine that cannot start (a bad device, a node short of memory) is replaced, while a start that fails
    everywhere (a wrong path on the workers) still ends the job after about one failed start per actor."""
    return a.pool[1] if a.start_failures is None else a.start_failures


def allow_start_failures(context, a) -> None:
    """Ray Data fails the whole dataset on the first actor whose constructor raised
    (``DataContext.max_consecutive_actor_init_deaths`` is 0); raise it to this pool's budget. The context is the
    one the dataset runs with, shared with the datasets it was made from: a budget set there already (-1:
    unlimited, or higher) is kept."""
    have = context.max_consecutive_actor_init_deaths
    if have >= 0:
        context.max_consecutive_actor_init_deaths = max(have, start_failure_budget(a))


def build_processor(config, preprocess: Callable[[Row], Row] | None = None,
                    postprocess: Callable[[Row], Row] | None = None) -> Processor:
    """A processor for any ``ray.data.Dataset`` (in the spirit of ``ray.data.llm.build_llm_processor``).

    ``config``: a :class:`ProcessorConfig`, its mapping, or a YAML file (a job config's ``engine``, ``sampling``,
    ``speculative``, ``actors`` and ``s3`` sections). ``preprocess(row)`` returns the request row (``prompt``,
    ``messages`` or ``turns``, optional ``id`` and ``sampling_params``); ``postprocess(row)`` maps each output row
    (the job's columns, plus ``request``: the row preprocess returned) to the row the dataset holds. A bad config
    raises ``ConfigError`` here, before any actor starts."""
    return Processor(ProcessorConfig.of(config), preprocess, postprocess)
