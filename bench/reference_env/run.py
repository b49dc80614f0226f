"""The ``reference`` subcommand: the reference decodes each prompt greedily in fp32 with a given head and tree, and
what it did is written as JSON (and, with ``--golden``, as the compact golden trace the tests compare against)."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from .checkout import environment_info, import_reference
from .prompts import chat_prompt_ids, load_prompts
from .recording import Recorder, install_wrappers

NOTES = {
    "tau": "reference's count: new_token / cycles, new_token += accept_length + 1 per cycle; prefill is "
    "not a cycle; overshoots max_new_tokens; counts tokens after EOS within the last cycle",
    "accept_lengths": "accepted draft tokens per verify step (bonus token not included)",
    "first_tree": "tree built by topK_genrate right after prefill; node 0 is the root (the token sampled "
    "from the prefill logits); scores are cumulative draft log-probs; tokens are target ids",
}


def cmd_reference(args) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ea_model_mod = import_reference(args.eagle_dir)
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    model = load_model(ea_model_mod, args)
    load_s = time.perf_counter() - t0
    vocab_size = int(model.base_model.lm_head.weight.shape[0])

    rec = Recorder()
    install_wrappers(ea_model_mod, model, rec, vocab_size)

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = load_prompts(args.prompts, args.num_prompts)
    results = []
    for n, record in enumerate(prompts):
        results.append(run_prompt(model, rec, tokenizer, record, f"{n + 1}/{len(prompts)}", n, args))

    summary = summarize(results, args, load_s)
    report = {
        "kind": "reference",
        "settings": settings(args, model, vocab_size, len(results)),
        "environment": environment_info(args.eagle_dir),
        "notes": NOTES,
        "summary": summary,
        "prompts": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f)
    if args.golden:
        json.dump(golden_trace(report, args.golden_root), open(args.golden, "w"), separators=(",", ":"))
    print(json.dumps(summary, indent=1))


def load_model(ea_model_mod, args):
    """The reference's ``EaModel`` with the target, head and tree asked for, fp32, in eval mode."""
    model = ea_model_mod.EaModel.from_pretrained(
        use_eagle3=args.head_type == "eagle3",
        base_model_path=args.target,
        ea_model_path=args.head,
        total_token=args.total_token,
        depth=args.depth,
        top_k=args.top_k,
        torch_dtype=torch.float32,
    )
    model.eval()
    return model


def prompt_token_ids(model, tokenizer, record: dict) -> tuple[list[int], list[int]]:
    """The prompt's ids, and the same prompt through the reference's own (slow) tokenizer, as a check."""
    if "prompt_ids" in record:  # given as token ids
        return record["prompt_ids"], record["prompt_ids"]
    text = record["turns"][0]
    return chat_prompt_ids(tokenizer, text), chat_prompt_ids(model.tokenizer, text)


def run_prompt(model, rec: Recorder, tokenizer, record: dict, progress: str, n: int, args) -> dict:
    """One prompt through ``eagenerate`` (greedy), with what the recorder saw, and ``naivegenerate`` with
    ``--check-greedy``; prints one line after ``progress`` (``3/10``)."""
    eos_id = model.tokenizer.eos_token_id
    prompt_ids, ref_tok_ids = prompt_token_ids(model, tokenizer, record)
    input_ids = torch.tensor([prompt_ids], dtype=torch.long)

    rec.reset()
    t0 = time.perf_counter()
    out, new_token, idx = model.eagenerate(
        input_ids,
        temperature=0.0,
        max_new_tokens=args.max_new_tokens,
        max_length=args.max_length,
        log=True,
    )
    wall = time.perf_counter() - t0
    output_ids = [int(t) for t in out[0, len(prompt_ids) :].tolist()]
    clean = output_ids[: args.max_new_tokens]
    if eos_id in clean:
        clean = clean[: clean.index(eos_id) + 1]
    cycles = int(idx) + 1
    entry = {
        "index": n,
        "question_id": record.get("question_id"),
        "category": record.get("category"),
        "prompt_ids": prompt_ids,
        "prompt_ids_match_reference_tokenizer": prompt_ids == ref_tok_ids,
        "output_ids": output_ids,
        "output_ids_clean": clean,
        "new_token": int(new_token),
        "steps": cycles,
        "accept_lengths": rec.accept_lengths,
        "best_candidates": rec.best_candidates,
        "tau": int(new_token) / cycles,
        "mean_accept": sum(rec.accept_lengths) / max(1, len(rec.accept_lengths)),
        "wall_s": wall,
        "first_tree": rec.first_tree,
    }
    assert len(rec.accept_lengths) == cycles, (len(rec.accept_lengths), cycles)
    if args.check_greedy:
        g = model.naivegenerate(
            input_ids,
            temperature=0.0,
            max_new_tokens=args.max_new_tokens,
            max_length=args.max_length,
        )
        greedy_ids = [int(t) for t in g[0, len(prompt_ids) :].tolist()]
        m = min(len(greedy_ids), len(output_ids))
        entry["greedy_ids"] = greedy_ids
        entry["greedy_match"] = greedy_ids[:m] == output_ids[:m]
    print(
        f"[{progress}] q{record.get('question_id')} prompt {len(prompt_ids)} new {new_token} "
        f"steps {cycles} tau {entry['tau']:.3f} wall {wall:.1f}s"
        + (f" greedy_match {entry['greedy_match']}" if args.check_greedy else ""),
        flush=True,
    )
    return entry


def summarize(results: list[dict], args, load_s: float) -> dict:
    """tau over the prompts (mean and pooled), totals, and whether every output equalled plain greedy decoding."""
    total_new = sum(r["new_token"] for r in results)
    total_steps = sum(r["steps"] for r in results)
    return {
        "mean_tau": sum(r["tau"] for r in results) / max(1, len(results)),
        "pooled_tau": total_new / max(1, total_steps),
        "total_new_token": total_new,
        "total_steps": total_steps,
        "all_greedy_match": all(r.get("greedy_match", True) for r in results)
        if args.check_greedy
        else None,
        "load_s": load_s,
        "generate_wall_s": sum(r["wall_s"] for r in results),
    }


def settings(args, model, vocab_size: int, num_prompts: int) -> dict:
    """What the run decoded with: head, target, prompts, tree, dtype and vocabularies."""
    with open(os.path.join(args.head, "config.json")) as f:
        head_cfg = json.load(f)
    return {
        "head_type": args.head_type,
        "use_eagle3": args.head_type == "eagle3",
        "head": os.path.abspath(args.head),
        "target": os.path.abspath(args.target),
        "prompts": args.prompts,
        "num_prompts": num_prompts,
        "max_new_tokens": args.max_new_tokens,
        "max_length": args.max_length,
        "total_token": args.total_token,
        "depth": args.depth,
        "top_k": args.top_k,
        "temperature": 0.0,
        "dtype": "float32",
        "eos_token_id": model.tokenizer.eos_token_id,
        "vocab_size": vocab_size,
        "draft_vocab_size": head_cfg.get(
            "draft_vocab_size", head_cfg.get("vocab_size")
        ),
    }


def golden_trace(report: dict, root: str) -> dict:
    """The report reduced to what ``eagle_ray.fidelity.compare`` reads (a golden trace; this side never imports
    eagle_ray), with paths relative to ``root``."""
    keep_tree = ("tokens", "parents", "depths", "scores")
    keep_prompt = ("index", "question_id", "prompt_ids", "output_ids_clean", "accept_lengths", "new_token", "steps",
                   "tau", "greedy_match")
    settings = dict(report["settings"])
    for key in ("head", "target"):
        settings[key] = os.path.relpath(settings[key], root)
    return {"kind": "golden trace", "settings": settings, "environment": report["environment"],
            "notes": report["notes"], "summary": report["summary"],
            "prompts": [{**{k: p[k] for k in keep_prompt if k in p},
                         "first_tree": {k: p["first_tree"][k] for k in keep_tree}} for p in report["prompts"]]}
