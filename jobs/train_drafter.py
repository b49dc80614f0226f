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
import json
import sys
import time
from dataclasses import fields, replace
from pathlib import Path

import torch

from eagle_ray.config import out_path_problem
from eagle_ray.errors import CheckpointError
from eagle_ray.model.draft_head import DraftHead
from eagle_ray.model.heads import load_head
from eagle_ray.model.eagle3_head import Eagle3Head
from eagle_ray.model.loading import resolve_target
from eagle_ray.train.extract import check_source, read_shard
from eagle_ray.train.selfdistill import AnswerSetError
from eagle_ray.train.token_map import coverage, frequent_tokens
from eagle_ray.train.trainer import TrainConfig, TrainingDataError, config_dict, train, widen_mlp


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


def training_budget(wall_budget_s: float, elapsed_s: float, reserve_s: float = 15.0) -> float:
    """Seconds of training left to a run that must end within ``wall_budget_s`` of its start, ``elapsed_s`` in
    (loading, target states): the rest less ``reserve_s`` for writing the head. Too little left is an error
    before any step runs, not a run cut off mid-save."""
    left = wall_budget_s - elapsed_s - reserve_s
    if left < 30:
        raise SystemExit(f"--wall-budget-s {wall_budget_s:.0f}: {elapsed_s:.0f} s went to loading and the target's "
                         f"states, {max(left, 0):.0f} s would be left for training (at least 30 s needed)")
    return left


def main(argv=None) -> int:
    started = time.time()
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
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.set_float32_matmul_precision(a.matmul_precision)
    try:
        cfg = TrainConfig(**{f.name: (bool(getattr(a, f.name)) if f.type == "bool" else getattr(a, f.name))
                             for f in fields(TrainConfig)})
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {cfg.device}: this torch build sees no CUDA device")
    if a.token_map_size < 0 or a.batch_tokens < 1:
        raise SystemExit("--token-map-size must be >= 0 (0: the full vocabulary) and --batch-tokens >= 1")
    if (a.limit_conversations is not None and a.limit_conversations < 1) or \
            (a.limit_tokens is not None and a.limit_tokens < 1):
        raise SystemExit("--limit-conversations and --limit-tokens must be >= 1 where given")
    sources = a.features or a.answers
    if len({str(Path(x).resolve()) for x in sources}) < len(sources):
        raise SystemExit(f"a source is given twice: {' '.join(sources)}")
    for source in a.answers or ():
        check_source(source, "--answers")
    problem = out_path_problem(a.out, directory=True)
    if problem:   # found now, not after minutes of the target's states
        raise SystemExit(f"--out {problem}")
    try:
        if a.answers:
            target, convs = states_in_memory(a.answers, a.target, a.target_dtype, a.threads, cfg.device,
                                             a.batch_tokens, a.head_type == "eagle3", cfg.max_len,
                                             a.limit_conversations, a.states_device)
        else:
            from transformers import AutoModelForCausalLM
            target = AutoModelForCausalLM.from_pretrained(str(resolve_target(a.target)), dtype=torch.float32)
            convs = load_features(a.features, a.limit_tokens)
    except AnswerSetError as e:   # a damaged answer set, named with its file
        raise SystemExit(str(e)) from None
    lm_weight = target.lm_head.weight.detach().float()
    eos_id = target.config.eos_token_id
    n_tokens = sum(len(c["input_ids"]) for c in convs)
    n_target = sum(int(c["loss_mask"].sum()) for c in convs)
    print(f"{len(convs)} conversations, {n_tokens} tokens ({n_target} assistant tokens)", flush=True)
    if not n_target:
        raise SystemExit("no assistant tokens to train on in " + " ".join(sources))
    vocab_size = lm_weight.shape[0]
    # the draft vocabulary is chosen before training: the cross-entropy runs over it
    init = load_head(a.init, target.config, target.model.embed_tokens.weight) if a.init else None
    if a.keep_token_map:
        if init is None or init.kind != "eagle2" or a.head_type != "eagle2":
            raise SystemExit("--keep-token-map needs --init with an EAGLE-2 head and --head-type eagle2")
        draft_vocab = init.token_map
    else:
        draft_vocab = frequent_tokens(convs, vocab_size, a.token_map_size,
                                      always=[t for t in (eos_id,) if t is not None]) if a.token_map_size else None
    torch.manual_seed(cfg.seed)   # a head trained from scratch starts from the same weights for the same --seed
    if a.head_type == "eagle3":
        if any("aux" not in c for c in convs):
            raise SystemExit("EAGLE-3 training needs features extracted with `eagle-ray extract --eagle3`")
        head = Eagle3Head.for_target(target.config, draft_vocab=draft_vocab)
        if a.lm_head_init == "target":
            head.init_scorer_from_target(lm_weight, target.model.norm.weight.detach())
    else:
        head = DraftHead.for_target(target.config, intermediate_size=None if init else a.intermediate_size)
        head.token_map = draft_vocab
    head.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight)
    if init is not None:
        if init.kind != head.kind:
            raise SystemExit(f"--init {a.init} is an {init.kind} head; this run trains an {head.kind} head")
        if a.intermediate_size and init.kind == "eagle2" and \
                a.intermediate_size != init.layers[0].mlp.gate_proj.out_features:
            init = widen_mlp(init, a.intermediate_size, cfg.seed)
            head = DraftHead(init.config, bias=init.bias, qkv_bias=init.qkv_bias)
            head.token_map = draft_vocab
        head.load_state_dict(init.state_dict())
    del target
    if a.wall_budget_s:
        cfg = replace(cfg, time_budget_s=training_budget(a.wall_budget_s, time.time() - started))
        print(f"wall budget {a.wall_budget_s:.0f} s: {cfg.time_budget_s:.0f} s left for training", flush=True)
    out = Path(a.out)
    t0 = time.time()
    run = {"target": str(a.target), "init": a.init, "head_type": a.head_type, "sources": list(sources),
           "kept_token_map": a.keep_token_map, "lm_head_init": a.lm_head_init}
    try:
        state = train(convs, head, lm_weight, out, cfg, max_steps=a.max_steps,
                      log=lambda m: print(m, flush=True), vocab=draft_vocab, run=run)
    except (CheckpointError, TrainingDataError) as e:
        raise SystemExit(str(e)) from None
    done = bool(state.get("finished"))  # the whole schedule ran (a fitted one may end mid-epoch)
    head.to("cpu").save(out / "head", dtype=torch.bfloat16, include_embedding=False)
    card = {"target": str(a.target or "SmolLM2-135M-Instruct (embedded)"), "train_config": config_dict(cfg),
            "conversations": len(convs), "tokens": n_tokens, "assistant_tokens": n_target,
            "steps": state["step"], "epochs_completed": state["epoch"], "finished": done,
            "history": state["history"], "wall_s_this_run": time.time() - t0,
            "token_map_size": a.token_map_size, "kept_token_map": a.keep_token_map, "init": a.init,
            "features": a.features or [f"answers (states computed in memory): {s}" for s in a.answers],
            "head_type": a.head_type, "device": cfg.device,
            "token_map_coverage": coverage(convs, draft_vocab, vocab_size) if a.token_map_size else 1.0}
    (out / "head" / "training.json").write_text(json.dumps(card, indent=2))
    print(json.dumps(card["history"][-1:] or card, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
