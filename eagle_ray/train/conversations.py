"""Where a drafter's training conversations come from: feature shards written by extraction, or the target's states
computed in memory for self-distilled answer sets (no feature files), each with the target the head is trained
against."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from eagle_ray.model.loading import resolve_target
from eagle_ray.train.extract import read_shard
from eagle_ray.train.selfdistill import AnswerSetError


def load_features(features_dirs: list[str], limit_tokens: int | None = None) -> list[dict]:
    """Every conversation of the shard directories, in a fixed order (so the held-out split never moves)."""
    convs, tokens = [], 0
    for features_dir in features_dirs:
        part = []
        shards = sorted(Path(features_dir).glob("shard-*.safetensors"))
        if not shards:
            raise SystemExit(f"--features {features_dir}: no feature shards (shard-*.safetensors) there")
        for shard in shards:
            if limit_tokens and tokens >= limit_tokens:
                break
            new = read_shard(shard)
            part += new
            tokens += sum(len(c["input_ids"]) for c in new)
        convs += sorted(part, key=lambda c: c["conv_index"])
    return convs


def states_in_memory(sources: list[str], target: str | None, dtype: str, threads: int | None, device: str,
                     batch_tokens: int, eagle3: bool, max_len: int, limit: int | None,
                     states_device: str | None = None):
    """(target, conversations with the target's states) for self-distilled answer sets, computed on ``device``
    and kept on ``states_device`` (default: ``device``; see ``extract.conversations_in_memory``); the target is
    returned on the CPU for its lm_head. Host memory holds states a GPU has no room for: an EAGLE-3 head's three
    layer inputs take 3.5 KB a token in bf16 (43 GB for 12.6M tokens), and training copies one batch a step."""
    from eagle_ray.model.eagle3_head import capture_layers
    from eagle_ray.train.extract import conversations_in_memory, load_target
    model, tokenizer = load_target(target, dtype, threads, device=device)
    capture = capture_layers(model.config.num_hidden_layers) if eagle3 else None
    t0, convs = time.time(), []
    for source in sources:
        convs += conversations_in_memory(model, tokenizer, source, max_len, capture, batch_tokens,
                                         states_device or device, limit=limit,
                                         log=lambda m: print(f"{source}: {m}", flush=True))
    size = sum(t.numel() * t.element_size() for c in convs for k, t in c.items() if k in ("hidden", "aux"))
    print(f"target states of {len(convs)} conversations in {time.time() - t0:.0f} s: {size / 2**30:.2f} GiB on "
          f"{states_device or device}", flush=True)
    return model.to("cpu"), convs


def training_conversations(job, device: str, max_len: int):
    """(target, conversations) for a drafter job: its answer sets' states computed in memory, or its feature
    shards read with the target loaded in fp32. A damaged answer set ends the run naming its file."""
    try:
        if job.answers:
            return states_in_memory(job.answers, job.target, job.target_dtype, job.threads, device,
                                    job.batch_tokens, job.head_type == "eagle3", max_len,
                                    job.limit_conversations, job.states_device)
        from transformers import AutoModelForCausalLM
        target = AutoModelForCausalLM.from_pretrained(str(resolve_target(job.target)), dtype=torch.float32)
        return target, load_features(job.features, job.limit_tokens)
    except AnswerSetError as e:   # a damaged answer set, named with its file
        raise SystemExit(str(e)) from None
