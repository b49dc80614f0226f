"""Batch generation job (the main job): ``ray job submit -- python jobs/batch.py --config configs/embedded.yaml``.

Reads prompts (JSONL/Parquet, local or s3://), runs EAGLE-2 on a pool of Ray actors, writes Parquet with
per-request acceptance stats and a summary.json. Re-running into the same output resumes (exactly once).
"""
from __future__ import annotations

import argparse
import sys

import yaml

from eagle_ray.batch.config import JobConfig
from eagle_ray.batch.job import run_job
from eagle_ray.batch.lease import LeaseLostError
from eagle_ray.errors import CheckpointError, ConfigError


def parse_overrides(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ConfigError(f"--set expects key=value, got {pair!r}")
        try:
            out[key] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {key}: {value!r} is not a YAML value ({str(e).splitlines()[0]})") from None
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", required=True, help="job YAML (see configs/)")
    p.add_argument("--input", help="override input.uri")
    p.add_argument("--output", help="override output.uri")
    p.add_argument("--limit", type=int, help="override input.limit")
    p.add_argument("--openai-output", metavar="URI", help="override output.openai_batch_file: also write OpenAI's "
                   "batch output file (the input holds OpenAI batch lines)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any field, e.g. --set actors.num_actors=2 --set sampling.max_new_tokens=64")
    a = p.parse_args(argv)
    try:
        overrides = parse_overrides(a.set)
        for key, value in (("input.uri", a.input), ("output.uri", a.output), ("input.limit", a.limit),
                           ("output.openai_batch_file", a.openai_output)):
            if value is not None:
                overrides[key] = value
        cfg = JobConfig.from_yaml(a.config, overrides)
        summary = run_job(cfg)
    except (ConfigError, CheckpointError) as e:   # what the user gave is wrong: one line
        print(f"eagle-ray: {e}", file=sys.stderr)
        return 2
    except LeaseLostError as e:   # another run took the output over: this one stopped committing
        print(f"eagle-ray: {e}", file=sys.stderr)
        return 1
    if summary.get("interrupted"):
        return 143
    return 0 if summary["rows"] else 1


if __name__ == "__main__":
    sys.exit(main())
