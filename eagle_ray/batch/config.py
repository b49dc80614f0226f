"""The batch job's configuration (``jobs/batch.py --config job.yaml``): what to read, where to write, the actor
pool, and the engine every actor builds. The last two alone are a processor's (``processor.py``): a job is a
processor with an input and an output."""
from __future__ import annotations

import os
import re
import uuid
from datetime import datetime, timezone
from typing import Literal

from pydantic import Field, field_validator, model_validator

from eagle_ray.config import (EngineConfig, S3Options, SamplingParams, StrictModel, apply_overrides, gpus_for_ranks,
                              need_a_head_to_speculate, one_gpu_per_engine, read_yaml_mapping,
                              throughput_steps_unless_named, tune_tree_unless_named)


class InputConfig(StrictModel):
    uri: str = Field(..., description="a .jsonl/.parquet file, a directory or glob of them; local or s3://")
    format: Literal["auto", "jsonl", "parquet"] = "auto"
    limit: int | None = Field(None, ge=1, description="read only the first N rows")


class OutputConfig(StrictModel):
    uri: str = Field(..., description="output directory (local or s3://): part-*.parquet + summary.json")
    rows_per_file: int = Field(256, ge=1, le=1_000_000)
    openai_batch_file: str | None = Field(None, description="where the job, once done, also writes OpenAI's batch "
                                          "output file (JSON lines, local or s3://) of the output's rows")


class ActorsConfig(StrictModel):
    """The actor pool: one engine (target + draft pair) per actor."""
    num_actors: int | tuple[int, int] = Field(1, description="actors in the pool, or [min, max]: Ray Data starts "
                                              "min and adds actors up to max while batches wait")
    num_cpus: float = Field(1.0, gt=0, description="CPUs per actor (also its torch thread count on CPU)")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per actor: 0 = CPU actors; 0.5 or 0.25 put two or four "
                            "engines of a small target on one GPU, each planning its memory from its share; a "
                            "target split over N GPUs (engine.tensor_parallel N) takes N")
    batch_size: int = Field(16, ge=1, description="rows per Ray Data batch handed to an actor")
    max_concurrent_batches: int = Field(4, ge=1, description="calls in flight per actor, all feeding one "
                                        "continuously batched engine (a call of the job holds a block of four "
                                        "batches, run together)")
    row_retries: int = Field(1, ge=1, description="after the engine fails under a batch, each of its unfinished "
                             "rows runs alone on a restarted engine up to this many times; a row that still fails "
                             "is an engine_failed error row")
    max_restarts: int | None = Field(None, ge=0, description="times Ray restarts an actor whose process died (a "
                                     "lost node, a preemption, a device fault, a stalled step) before the job "
                                     "fails; null: as long as the job runs")
    start_failures: int | None = Field(None, ge=0, description="actor starts that may fail in a row (no actor "
                                       "starting in between), each replaced by a new actor, before the job fails; "
                                       "null: the pool's largest size")
    stall_floor_s: float = Field(120.0, gt=0, description="an engine step may run this long at least before it "
                                 "counts as stalled")
    stall_factor: float = Field(10.0, gt=1, description="... or this many times the slowest step seen so far, "
                                "whichever is longer; a stalled step fails the engine and restarts the actor")

    @field_validator("num_gpus")
    @classmethod
    def _one_gpu(cls, v):
        return one_gpu_per_engine(v, "num_actors")

    @field_validator("num_actors")
    @classmethod
    def _pool(cls, v):
        lo, hi = (v, v) if isinstance(v, int) else v
        if not 1 <= lo <= hi:
            raise ValueError(f"num_actors must be >= 1, or [min, max] with 1 <= min <= max (got {v!r})")
        return v

    @property
    def pool(self) -> tuple[int, int]:
        """(min, max) actors."""
        return (self.num_actors, self.num_actors) if isinstance(self.num_actors, int) else tuple(self.num_actors)


class ProcessorConfig(StrictModel):
    """What a processor runs (``build_processor``): the engine, sampling defaults rows may override, and its
    actors."""
    engine: EngineConfig = Field(default_factory=EngineConfig)

    _default_tree = model_validator(mode="before")(tune_tree_unless_named)
    _wide_steps = model_validator(mode="before")(throughput_steps_unless_named)
    _head = model_validator(mode="after")(need_a_head_to_speculate)

    @model_validator(mode="after")
    def _gpus_for_ranks(self):
        gpus_for_ranks(self.actors.num_gpus, self.engine, "num_actors")
        return self

    sampling: SamplingParams = Field(default_factory=SamplingParams, description="defaults; rows may override")
    speculative: bool = True
    actors: ActorsConfig = Field(default_factory=ActorsConfig)
    s3: S3Options = Field(default_factory=S3Options)
    split_special_tokens: bool = Field(False, description="tokenise chat message content with special-token text "
                                       "(<|im_end|>, ...) split into plain text, so content cannot forge a role")
    tool_call_parser: Literal["hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder"] | None = Field(
        None, description="how a chat row's answer is read for tool calls where the model chooses (tool_choice "
        "auto, the default with tools): as Serve's tool_call_parser (engine/tools.py)")
    reasoning_parser: Literal["deepseek_r1", "qwen3", "mistral"] | None = Field(
        None, description="a reasoning model's thinking (<think> ... </think>; mistral: [THINK] ... [/THINK]) in the "
        "row's reasoning column, apart "
        "from its output, as Serve's reasoning_parser splits it (engine/reasoning.py)")

    @classmethod
    def of(cls, config) -> "ProcessorConfig":
        """A ProcessorConfig from itself, a JobConfig (its processor part), a mapping, or a YAML file (a job config
        is read without its input and output)."""
        if isinstance(config, ProcessorConfig):
            return config if type(config) is cls else cls(**config.model_dump(include=set(cls.model_fields)))
        if not isinstance(config, dict):
            config = read_yaml_mapping(config, "processor config")
        return cls(**{k: v for k, v in config.items() if k not in JOB_ONLY})


class JobConfig(ProcessorConfig):
    """``jobs/batch.py --config job.yaml``: a processor with what it reads, where it writes and how it resumes."""
    input: InputConfig
    output: OutputConfig
    resume: bool = Field(True, description="skip ids already in the output (exactly-once re-runs)")
    ray_address: str | None = Field(None, description="None: RAY_ADDRESS or a new local Ray on 127.0.0.1")
    progress_every_s: float = Field(10.0, gt=0, description="seconds between the driver's progress lines")
    lease_stale_s: float = Field(120.0, gt=1, description="a run holds its output with a lease renewed every "
                                 "quarter of this; a second run refuses while it is fresh, takes it over once stale")

    @model_validator(mode="after")
    def _adapted_heads_beside_outputs(self):
        a = self.engine.adaptation
        if a.save and a.save_dir is None:
            self.engine.adaptation.save_dir = self.output.uri.rstrip("/") + "/head"
        return self

    @model_validator(mode="after")
    def _output_outside_input(self):
        """Output files under the input would be read back as input rows by the next run."""
        def where(u: str) -> str:
            return u.rstrip("/") if "://" in u else os.path.abspath(u)
        for name, uri in (("output.uri", self.output.uri), ("output.openai_batch_file", self.output.openai_batch_file)):
            if uri is not None and reads_path(where(self.input.uri), where(uri)):
                raise ValueError(f"{name} {uri} lies inside input.uri {self.input.uri}: the next run would read the "
                                 "job's own output as input; write it elsewhere")
        if self.output.openai_batch_file and where(self.output.openai_batch_file) == where(self.output.uri):
            raise ValueError("output.openai_batch_file names output.uri, the parts' folder; name a file (it may lie "
                             "inside that folder)")
        return self

    @classmethod
    def from_yaml(cls, path, overrides: dict | None = None) -> "JobConfig":
        """Load a YAML file; ``overrides`` maps dotted keys (``input.uri``) to values applied on top."""
        return cls(**apply_overrides(read_yaml_mapping(path, "job config"), overrides or {}))


def reads_path(input_uri: str, path: str) -> bool:
    """Whether reading ``input_uri`` (a file, a directory read whole, or a glob whose matches are read whole) could
    read ``path`` or a file under it. A name holding ``*``, ``?`` or ``[`` is read as written where it exists and
    as a glob where it does not (``rows.py``); which one cannot be known before the run, so both count."""
    if path == input_uri or path.startswith(input_uri + "/"):
        return True
    if not any(c in input_uri for c in "*?["):
        return False
    from fsspec.utils import glob_translate   # the pattern as fsspec's glob reads it (``**`` spans 0+ folders)
    pattern = re.compile(glob_translate(input_uri))
    parts = path.split("/")
    under = [f"{path}/{part_file(new_run_id(), 0)}", f"{path}/{SUMMARY_FILE}"]  # what a job writes there
    return any(pattern.fullmatch("/".join(parts[:i])) for i in range(1, len(parts) + 1)) or \
        any(pattern.fullmatch(p) for p in under)


SUMMARY_FILE = "summary.json"
JOB_ONLY = ("input", "output", "resume", "ray_address", "progress_every_s", "lease_stale_s")


def new_run_id() -> str:
    """A run's name in its part files: when it started (UTC) and a random suffix."""
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]


def part_file(run: str, n: int) -> str:
    """The ``n``-th Parquet part a run commits."""
    return f"part-{run}-{n:05d}.parquet"
