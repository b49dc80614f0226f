"""Held-out top-1 of several EAGLE heads on the same conversations, per draft step.

Either head kind (EAGLE-1/2 or EAGLE-3; an EAGLE-3 head needs features extracted with ``--eagle3``).
Step 0 drafts from the target's true feature (the tree's first level), step s from s of the head's own
predictions (level s; see ``trainer.head_forward_unrolled``). Each head is read through its own token map, as
served, so a target token outside the map counts as a miss. Pick conversations no head trained on (train_drafter
holds out the first 2% of its first feature directory).

    python bench/eval_heads.py --features DIR --first 12 --heads embedded runs/head4/head --out R.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from eagle_ray.model.draft_head import load_head
from eagle_ray.model.loading import EMBEDDED_DRAFT_DIR, resolve_target
from eagle_ray.train.extract import read_shard
from eagle_ray.train.trainer import TrainConfig, evaluate


def first_conversations(features_dir: str, n: int) -> list[dict]:
    convs = []
    for shard in sorted(Path(features_dir).glob("shard-*.safetensors")):
        convs += read_shard(shard)
    return sorted(convs, key=lambda c: c["conv_index"])[:n]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--features", required=True)
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
    convs = first_conversations(a.features, a.first)
    results = {}
    for name in a.heads:
        head = load_head(EMBEDDED_DRAFT_DIR if name == "embedded" else name, target.config, embed).float()
        vocab = getattr(head, "token_map", None)  # an EAGLE-3 head scores its own draft vocabulary
        metrics = evaluate(head, lm_weight, convs, TrainConfig(eval_steps=a.steps), vocab=vocab)
        results[name] = metrics
        print(name, json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in metrics.items()}),
              flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"features": a.features, "conversations": len(convs),
                                           "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
