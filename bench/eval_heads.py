"""Held-out top-1 of several EAGLE heads on the same conversations, per draft step.

Either head kind (EAGLE-1/2 or EAGLE-3; an EAGLE-3 head needs features extracted with ``--eagle3``).
Step 0 drafts from the target's true feature (the tree's first level), step s from s of the head's own
predictions (level s; see ``trainer.head_forward_unrolled``). Each head is read through its own token map, as
served, so a target token outside the map counts as a miss. Pick conversations no head trained on (train_drafter
holds out the first 2% of its first feature directory).

    python bench/eval_heads.py --features DIR --first 12 --heads embedded runs/head4/head --out R.json

``--answers SET_DIR`` reads a self-distilled answer set instead and computes the target's states here (fp32):
``train_drafter.py --answers SET_DIR ... --eval-fraction F`` holds out the first F of all its conversations, taken
from its first set, so ``--first`` that many scores a head on what its run held out (exactly, when each of those
records has an answer token within ``max_len``: a record without one is skipped by both).

    python bench/eval_heads.py --answers datasets/selfdistill/sharegpt-turn2-fp32 --first 122 --heads embedded NEW

``--tasks`` scores the heads on the target's own greedy answers to benchmark first turns instead (made here,
fp32, plain decoding; features as extraction makes them), the text acceptance is measured on: the first
``--test-prompts`` of each task (those ``head_acceptance.py`` runs) and the rest apart, so a training choice can be
made on the rest. EAGLE-1/2 heads only (the features are the final hidden state).

    python bench/eval_heads.py --tasks mt_bench humaneval --heads embedded runs/head/head --out R.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from eagle_ray.model.device import cpu_model
from eagle_ray.model.heads import load_head
from eagle_ray.model.loading import EMBEDDED_DRAFT_DIR, resolve_target
from eagle_ray.train.extract import read_shard
from eagle_ray.train.trainer import TrainConfig, evaluate


def first_conversations(features_dir: str, n: int) -> list[dict]:
    convs = []
    for shard in sorted(Path(features_dir).glob("shard-*.safetensors")):
        convs += read_shard(shard)
    return sorted(convs, key=lambda c: c["conv_index"])[:n]


def task_conversations(tasks: list[str], target, max_new_tokens: int, threads: int | None) -> dict[str, list]:
    """The target's greedy answers to each task's first turns, as feature conversations (prompt not scored)."""
    from eagle_ray.config import SamplingParams
    from eagle_ray.engine.engine import EagleEngine
    from eagle_ray.prompts import first_turn_prompt, load_dataset
    from eagle_ray.train.extract import extract_features

    engine = EagleEngine.from_pretrained(draft="none", dtype="float32", max_batch_size=16, threads=threads)
    out = {}
    for task in tasks:
        records = load_dataset(task)[1]
        answers = engine.generate([first_turn_prompt(r) for r in records],
                                  SamplingParams(max_new_tokens=max_new_tokens), speculative=False)
        t = extract_features(target, None, [(i, {"prompt_ids": o.prompt_token_ids, "answer_ids": o.token_ids})
                                            for i, o in enumerate(answers)], 2048)
        off = t["offsets"].tolist()
        out[task] = [{"input_ids": t["input_ids"][a:b].long(), "loss_mask": t["loss_mask"][a:b],
                      "hidden": t["hidden"][a:b]} for a, b in zip(off[:-1], off[1:])]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--features", default=None)
    p.add_argument("--answers", default=None, help="a self-distilled answer set: its first conversations")
    p.add_argument("--tasks", nargs="+", default=None, help="score on the target's answers to these tasks instead")
    p.add_argument("--test-prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--first", type=int, default=12, help="evaluate on the first N conversations")
    p.add_argument("--heads", nargs="+", required=True, help="head directories ('embedded' = the shipped head)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--target", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    target = AutoModelForCausalLM.from_pretrained(str(resolve_target(a.target)), dtype=torch.float32)
    lm_weight, embed = target.lm_head.weight.detach(), target.model.embed_tokens.weight
    if sum(x is not None for x in (a.features, a.answers, a.tasks)) != 1:
        p.error("give one of --features, --answers and --tasks")
    if a.features:
        sets = {"held_out": first_conversations(a.features, a.first)}
    elif a.answers:
        from eagle_ray.train.extract import conversations_in_memory
        sets = {"held_out": conversations_in_memory(target, None, a.answers, TrainConfig().max_len, limit=a.first,
                                                    log=lambda m: None)}
    else:
        sets = {}
        for task, convs in task_conversations(a.tasks, target, a.max_new_tokens, a.threads).items():
            sets[f"{task}/test"], sets[f"{task}/rest"] = convs[:a.test_prompts], convs[a.test_prompts:]
    results = {}
    for name in a.heads:
        head = load_head(EMBEDDED_DRAFT_DIR if name == "embedded" else name, target.config, embed).float()
        vocab = getattr(head, "token_map", None)  # an EAGLE-3 head scores its own draft vocabulary
        for set_name, convs in sets.items():
            metrics = evaluate(head, lm_weight, convs, TrainConfig(eval_steps=a.steps), vocab=vocab)
            results.setdefault(name, {})[set_name] = metrics
            print(name, set_name, json.dumps({k: (round(v, 4) if isinstance(v, float) else v)
                                              for k, v in metrics.items()}), flush=True)
    if not a.tasks:
        results = {name: r["held_out"] for name, r in results.items()}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"command": "python bench/eval_heads.py " + " ".join(
            sys.argv[1:] if argv is None else argv), "cpu": cpu_model(), "features": a.features, "answers": a.answers,
            "tasks": a.tasks,
            "conversations": {k: len(v) for k, v in sets.items()}, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
