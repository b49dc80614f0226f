"""A drafter training run end to end (what ``jobs/train_drafter.py`` runs): its settings checked before anything
loads, the conversations and the head to start from, the schedule fitted to a wall budget, training, and the head
written with the card that says how it was trained."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from eagle_ray.config import out_path_problem
from eagle_ray.errors import CheckpointError
from eagle_ray.train.conversations import training_conversations
from eagle_ray.train.extract import check_source
from eagle_ray.train.initial_head import initial_head
from eagle_ray.train.token_map import coverage
from eagle_ray.train.trainer import TrainConfig, TrainingDataError, config_dict, train


@dataclass
class DrafterJob:
    """What a run trains on and how its head starts, beside the training settings (``TrainConfig``)."""
    out: str
    features: list[str] | None = None
    answers: list[str] | None = None
    target: str | None = None
    threads: int | None = None
    init: str | None = None
    keep_token_map: bool = False
    limit_tokens: int | None = None
    max_steps: int | None = None
    token_map_size: int = 8192
    head_type: str = "eagle2"
    intermediate_size: int | None = None
    lm_head_init: str = "target"
    batch_tokens: int = 65536
    target_dtype: str = "float32"
    limit_conversations: int | None = None
    states_device: str | None = None
    wall_budget_s: float = 0.0

    @property
    def sources(self) -> list[str]:
        return self.features or self.answers


def check_job(job: DrafterJob, cfg: TrainConfig) -> None:
    """Settings no run can use end it here, before minutes of loading and the target's states."""
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {cfg.device}: this torch build sees no CUDA device")
    if job.token_map_size < 0 or job.batch_tokens < 1:
        raise SystemExit("--token-map-size must be >= 0 (0: the full vocabulary) and --batch-tokens >= 1")
    if (job.limit_conversations is not None and job.limit_conversations < 1) or \
            (job.limit_tokens is not None and job.limit_tokens < 1):
        raise SystemExit("--limit-conversations and --limit-tokens must be >= 1 where given")
    sources = job.sources
    if len({str(Path(x).resolve()) for x in sources}) < len(sources):
        raise SystemExit(f"a source is given twice: {' '.join(sources)}")
    for source in job.answers or ():
        check_source(source, "--answers")
    problem = out_path_problem(job.out, directory=True)
    if problem:   # found now, not after minutes of the target's states
        raise SystemExit(f"--out {problem}")


def training_budget(wall_budget_s: float, elapsed_s: float, reserve_s: float = 15.0) -> float:
    """Seconds of training left to a run that must end within ``wall_budget_s`` of its start, ``elapsed_s`` in
    (loading, target states): the rest less ``reserve_s`` for writing the head. Too little left is an error
    before any step runs, not a run cut off mid-save."""
    left = wall_budget_s - elapsed_s - reserve_s
    if left < 30:
        raise SystemExit(f"--wall-budget-s {wall_budget_s:.0f}: {elapsed_s:.0f} s went to loading and the target's "
                         f"states, {max(left, 0):.0f} s would be left for training (at least 30 s needed)")
    return left


def training_card(job: DrafterJob, cfg: TrainConfig, convs: list[dict], state: dict, draft_vocab, vocab_size: int,
                  wall_s: float) -> dict:
    """``training.json``: the settings, the data, what the run did and the held-out history."""
    return {"target": str(job.target or "SmolLM2-135M-Instruct (embedded)"), "train_config": config_dict(cfg),
            "conversations": len(convs), "tokens": sum(len(c["input_ids"]) for c in convs),
            "assistant_tokens": sum(int(c["loss_mask"].sum()) for c in convs),
            "steps": state["step"], "epochs_completed": state["epoch"],
            "finished": bool(state.get("finished")),  # the whole schedule ran (a fitted one may end mid-epoch)
            "history": state["history"], "wall_s_this_run": wall_s,
            "token_map_size": job.token_map_size, "kept_token_map": job.keep_token_map, "init": job.init,
            "features": job.features or [f"answers (states computed in memory): {s}" for s in job.answers],
            "head_type": job.head_type, "device": cfg.device,
            "token_map_coverage": coverage(convs, draft_vocab, vocab_size) if job.token_map_size else 1.0}


def run_drafter_job(job: DrafterJob, cfg: TrainConfig, started: float) -> int:
    """Check, load, build the head, train (resuming from ``out/checkpoint.pt``), then write ``out/head`` with its
    ``training.json``. ``started``: the run's start, which a wall budget counts from."""
    check_job(job, cfg)
    target, convs = training_conversations(job, cfg.device, cfg.max_len)
    lm_weight = target.lm_head.weight.detach().float()
    n_tokens = sum(len(c["input_ids"]) for c in convs)
    n_target = sum(int(c["loss_mask"].sum()) for c in convs)
    print(f"{len(convs)} conversations, {n_tokens} tokens ({n_target} assistant tokens)", flush=True)
    if not n_target:
        raise SystemExit("no assistant tokens to train on in " + " ".join(job.sources))
    head, draft_vocab = initial_head(job, target, convs, lm_weight, cfg.seed)
    del target
    if job.wall_budget_s:
        cfg = replace(cfg, time_budget_s=training_budget(job.wall_budget_s, time.time() - started))
        print(f"wall budget {job.wall_budget_s:.0f} s: {cfg.time_budget_s:.0f} s left for training", flush=True)
    out = Path(job.out)
    t0 = time.time()
    run = {"target": str(job.target), "init": job.init, "head_type": job.head_type, "sources": list(job.sources),
           "kept_token_map": job.keep_token_map, "lm_head_init": job.lm_head_init}
    try:
        state = train(convs, head, lm_weight, out, cfg, max_steps=job.max_steps,
                      log=lambda m: print(m, flush=True), vocab=draft_vocab, run=run)
    except (CheckpointError, TrainingDataError) as e:
        raise SystemExit(str(e)) from None
    head.to("cpu").save(out / "head", dtype=torch.bfloat16, include_embedding=False)
    card = training_card(job, cfg, convs, state, draft_vocab, lm_weight.shape[0], time.time() - t0)
    (out / "head" / "training.json").write_text(json.dumps(card, indent=2))
    print(json.dumps(card["history"][-1:] or card, indent=1))
    return 0
