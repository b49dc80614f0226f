r"""Train an EAGLE-1/2 or EAGLE-3 head on extracted features (see jobs/extract_features.py); resumable.

    python jobs/train_drafter.py --features /data/features --out runs/head --epochs 4
    (kill it, run the same command again: it continues from runs/head/checkpoint.pt)
    python jobs/train_drafter.py --head-type eagle3 --features /data/features3 --out runs/head3 \
        --unroll-steps 7 --unroll-weight 0.8          # features extracted with `eagle-ray extract --eagle3`
    python jobs/train_drafter.py --answers selfdistill --device cuda --out runs/gpu --time-budget-s 300
        # on a GPU: the target's states for every committed self-distilled answer are computed in memory
        # (minutes, no feature files), then the schedule is fitted to 5 minutes of training
    python jobs/train_drafter.py --answers selfdistill --device cuda --out runs/gpu --wall-budget-s 540
        # the same, the whole run (states included) ending within 9 minutes: for a machine lent by the minute

An EAGLE-3 head starts with the target's final norm and lm_head rows as its scorer (``--lm-head-init target``;
``random`` as the reference does).

The final head is written to ``--out/head`` in the SafeAILab layout (bf16 safetensors, embedding taken from the
target at load) with ``training.json`` (config, tokens seen, per-epoch held-out accuracy).
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import fields

import torch

from eagle_ray.train.drafter_job import DrafterJob, run_drafter_job
from eagle_ray.train.trainer import TrainConfig


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--features", nargs="+", help="one or more feature shard directories")
    src.add_argument("--answers", nargs="+", help="self-distilled answer sets (a set directory, their root, or "
                     "'selfdistill' for every committed set): the target's states are computed in memory on "
                     "--device first, instead of read from feature shards")
    p.add_argument("--batch-tokens", type=int, default=65536,
                   help="--answers: padded tokens per target forward (conversations of similar length together)")
    p.add_argument("--target-dtype", default="float32", help="--answers: the target's dtype for its states")
    p.add_argument("--limit-conversations", type=int, default=None, help="--answers: the first N of each source")
    p.add_argument("--states-device", default=None,
                   help="--answers: where the states are kept (default: --device); 'cpu' keeps them in host memory "
                   "when the GPU has no room for them (EAGLE-3 on every answer: about 58 GB), one batch copied a step")
    p.add_argument("--matmul-precision", choices=["highest", "high", "medium"], default="highest",
                   help="torch.set_float32_matmul_precision: 'high' lets a GPU run fp32 products as TF32 (the "
                   "target's states and the head's training, several times faster there; no effect on a CPU)")
    p.add_argument("--wall-budget-s", type=float, default=0.0,
                   help="end the whole run within this many seconds of its start: the schedule is fitted to what "
                   "loading and the target's states leave (replaces --time-budget-s)")
    p.add_argument("--out", required=True)
    p.add_argument("--target", default=None, help="target checkpoint (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--init", default=None, help="start from this head's weights, e.g. fine-tune a ShareGPT head on "
                   "self-distilled features (a resumed run continues from its checkpoint instead)")
    p.add_argument("--keep-token-map", action="store_true",
                   help="EAGLE-2 with --init: keep the --init head's draft vocabulary (its token_map) instead of "
                   "choosing one from these features, e.g. to fine-tune on a slice of new data")
    p.add_argument("--limit-tokens", type=int, default=None)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (resume later)")
    p.add_argument("--token-map-size", type=int, default=8192,
                   help="draft vocabulary: most frequent assistant tokens (0 = none, full vocabulary)")
    p.add_argument("--head-type", choices=["eagle2", "eagle3"], default="eagle2")
    p.add_argument("--intermediate-size", type=int, default=None,
                   help="EAGLE-2: MLP width of the head (default: the target's); with --init a wider MLP grows the "
                   "init head's, computing the same function at the start (trainer.widen_mlp)")
    p.add_argument("--lm-head-init", choices=["target", "random"], default="target",
                   help="EAGLE-3: start the head's norm and lm_head from the target's (its draft-vocabulary rows), "
                   "so its first scores are the target's own scoring of the fused state; 'random' as the reference")
    for f in fields(TrainConfig):
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default) if f.type != "bool" else int,
                       default=f.default)
    return p


def main(argv=None) -> int:
    started = time.time()
    a = parser().parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.set_float32_matmul_precision(a.matmul_precision)
    try:
        cfg = TrainConfig(**{f.name: (bool(getattr(a, f.name)) if f.type == "bool" else getattr(a, f.name))
                             for f in fields(TrainConfig)})
    except ValueError as e:
        raise SystemExit(str(e)) from None
    job = DrafterJob(**{f.name: getattr(a, f.name) for f in fields(DrafterJob)})
    return run_drafter_job(job, cfg, started)


if __name__ == "__main__":
    sys.exit(main())
