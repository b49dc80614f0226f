"""Does eagle-ray decode what it should: step by step what the SafeAILab EAGLE reference does (the same target, head,
prompts and tree, fp32, greedy: the first draft tree's tokens, parents, depths and scores, every step's accepted
length and the whole output must agree), and, greedy, what plain decoding and transformers ``generate()`` do.

    python bench/fidelity.py SUBCOMMAND --help

The ``reference`` and ``make-random-eagle3`` subcommands run in the reference's own environment (torch 2.13 CPU,
transformers 4.53.1; the reference does not run under transformers 5.x) and never import eagle_ray (nor this
folder's modules, which do); they import ``eagle.model`` from a checkout of https://github.com/SafeAILab/EAGLE at
run time (``--eagle-dir``) and wrap, from the outside, the functions ``eagenerate`` calls once per cycle, to record
what the reference did; none of the reference's code is copied. The ``eagle-ray`` subcommand runs in eagle-ray's
environment on a ``reference`` result and writes the comparison; ``lossless`` runs there too. Nothing is downloaded
at run time.

Subcommands
-----------
``reference``
    For each prompt (first turn of each JSONL record with ``"turns"``): prompt ids from the target's chat template
    (``add_generation_prompt=True``, the template's default system prompt), then
    ``EaModel.from_pretrained(use_eagle3=..., base_model_path=TARGET, ea_model_path=HEAD, total_token=T, depth=D,
    top_k=K, torch_dtype=torch.float32)`` and ``eagenerate(input_ids, temperature=0.0, max_new_tokens=N, log=True)``.
    Recorded per prompt: prompt ids, the new token ids exactly as returned (the reference overshoots
    ``max_new_tokens`` and keeps tokens after EOS within the last cycle) plus a cleaned copy (cut after the first
    EOS and at ``max_new_tokens``), the accepted length of every verify step (read from ``evaluate_posterior``), the
    best candidate row, the reference's own ``new_token`` counter and cycle count, tau = new_token / cycles (the
    reference's count), and the FIRST draft tree (built right after prefill, ``initialize_tree`` ->
    ``topK_genrate``): node tokens (target ids, root first, in the reference's layout order), parent of each node,
    depth (``tree_position_ids``), ``retrieve_indices``, the tree mask, the cumulative draft log-prob (score) of
    every drafted node, and the whole candidate pool the reference ranked (tokens, scores, parent pool index).
    Scores are read by recording ``torch.topk`` calls during that single ``topK_genrate`` call.
    ``--check-greedy`` also runs the reference's ``naivegenerate`` (plain greedy, same KV model) and records whether
    the speculative output equals it.

``make-random-eagle3``
    Builds a randomly initialised EAGLE-3 head for the target with the reference's own inference class
    (``eagle/model/cnets.py: Model``) and the config conventions of its EAGLE-3 training code
    (``eagle/traineagle3/config.json``: Llama config, ``num_hidden_layers`` 1, ``draft_vocab_size``, no
    ``target_hidden_size``, so the embedding is the target's, taken from the target at load and not saved, like the
    training script's ``save_16bit_model(exclude_frozen_parameters=True)``). Draft vocabulary: ``--draft-vocab-size``
    (default 8192, so the d2t/t2d mapping path of the reference is exercised; 49152 = full vocabulary is also clean:
    the reference then deletes d2t/t2d and uses draft ids as target ids). d2t/t2d follow the reference's
    ``scandata`` convention (eagle/traineagle3/cnets.py): take the N most frequent tokens, sort the ids ascending,
    ``d2t[i] = used[i] - i`` (int64), ``t2d[v] = v in used`` (bool). The reference has no standalone frequency
    helper (``scandata`` needs its training data set and the Llama-3 template), so the frequency ranking is read
    from ``--token-ids`` (a safetensors file holding one 1-D integer tensor, or a JSON list, most frequent first);
    without it the identity mapping over the first N ids is used. Saves ``config.json`` plus
    ``pytorch_model.bin`` (what the reference's loader tries first) and/or ``model.safetensors`` (its fallback;
    identical tensors), fp32, then checks that ``EaModel.from_pretrained(use_eagle3=True, ...)`` loads every saved
    tensor (its load is non-strict, so this is checked key by key), that the embedding is the target's, and that a
    short ``eagenerate`` equals ``naivegenerate``.

How it was run (2026-11-23, 2-core AMD EPYC, reference commit cb7e0841; $REF is any work directory)
---------------------------------------------------------------------------------------------------------
Environment (its own venv, not eagle-ray's)::

    python3.11 -m venv $REF/venv
    $REF/venv/bin/pip install torch==2.13.0   # the CPU wheel
    $REF/venv/bin/pip install transformers==4.53.1 accelerate safetensors sentencepiece protobuf

Target copy $REF/target = the embedded SmolLM2-135M-Instruct fp32 safetensors
(``resolve_target(None)``) plus: top-level ``"rope_theta"`` (and ``"rope_scaling": null``) in config.json,
``model.safetensors.index.json`` mapping every tensor to model.safetensors, ``vocab.json``/``merges.txt`` from
tokenizer.json and a ``GPT2Tokenizer`` tokenizer_config.json carrying the chat template (the reference loads the
tokenizer with ``use_fast=False``). EAGLE-2 head $REF/heads/eagle2-v3 = the embedded head's model.safetensors
with its config.json plus a top-level ``"rope_theta"`` (the reference loads the embedding from the target, so none
is added; token_map.safetensors is not used: the reference drafts over the full vocabulary).

Commands (from the repository root)::

    nice -n 19 $REF/venv/bin/python bench/fidelity.py make-random-eagle3 \\
        --eagle-dir $REF/EAGLE --target $REF/target --out $REF/heads/random-eagle3 --seed 0 \\
        --token-ids eagle_ray/assets/smollm2-135m-instruct-eagle/token_map.safetensors
    nice -n 19 $REF/venv/bin/python bench/fidelity.py reference --eagle-dir $REF/EAGLE \\
        --target $REF/target --head $REF/heads/random-eagle3 --head-type eagle3 \\
        --prompts eagle_ray/assets/benchmarks/mt_bench.jsonl --num-prompts 10 --max-new-tokens 128 \\
        --total-token 8 --depth 2 --top-k 3 --check-greedy --out $REF/results/ref_eagle3_random_8-2-3.json
    nice -n 19 $REF/venv/bin/python bench/fidelity.py reference --eagle-dir $REF/EAGLE \\
        --target $REF/target --head $REF/heads/eagle2-v3 --head-type eagle2 \\
        --prompts eagle_ray/assets/benchmarks/mt_bench.jsonl --num-prompts 10 --max-new-tokens 128 \\
        --total-token 8 --depth 2 --top-k 3 --check-greedy --out $REF/results/ref_eagle2_v3_8-2-3.json
    (the same with --total-token 60 --depth 5 --top-k 10 --out $REF/results/ref_eagle2_v3_60-5-10.json)

Then eagle-ray on the same prompts, heads and trees, in its own environment, compared step by step::

    .venv/bin/python bench/fidelity.py eagle-ray --reference $REF/results/ref_eagle3_random_8-2-3.json \
        --head $REF/heads/random-eagle3 --out bench/results/epyc-avx2-2core/fidelity_eagle3_random_8-2-3.json
    .venv/bin/python bench/fidelity.py eagle-ray --reference $REF/results/ref_eagle2_v3_8-2-3.json \
        --head eagle_ray/assets/smollm2-135m-instruct-eagle --out bench/results/epyc-avx2-2core/fidelity_eagle2_v3_8-2-3.json
    (and ref_eagle2_v3_60-5-10.json -> fidelity_eagle2_v3_60-5-10.json)

``lossless``
    Greedy outputs of speculative decoding against plain decoding on the same runtime and against transformers
    ``generate()`` on a prompt file (eagle-ray's environment): where an output first differs, the reference's top-2
    logit gap there and whether that is a near-tie (fp32: under 1e-3; bf16/fp16: at most one unit of the dtype at
    the top logit; ``--tie-gap`` to set one). Exit status 1 when a difference is not a near-tie::

    .venv/bin/python bench/fidelity.py lossless --dtype float32 --prompts mt_bench --num-prompts 40 \
        --max-new-tokens 128 --out bench/results/<hardware>/lossless_fp32_40x128.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

# Passive OpenMP waiting: on a loaded 2-core machine (this ran at nice 19 beside other measurements) busy-waiting
# OpenMP threads made a small fp32 matmul ~20x slower with 2 threads than with 1; PASSIVE removes that. It must be
# set before torch is imported; it does not change any result.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

DEFAULT_EAGLE_DIR = os.path.join(os.environ.get("REF", "ref"), "EAGLE")
DEFAULT_TARGET = os.path.join(os.environ.get("REF", "ref"), "target")


# --------------------------------------------------------------------------------------------------------------
# common helpers


def import_reference(eagle_dir: str):
    """Import the reference package ``eagle.model`` from a checkout (nothing is copied)."""
    eagle_dir = os.path.abspath(eagle_dir)
    if not os.path.isdir(os.path.join(eagle_dir, "eagle", "model")):
        raise SystemExit(
            f"{eagle_dir} is not a SafeAILab/EAGLE checkout (no eagle/model)"
        )
    if eagle_dir not in sys.path:
        sys.path.insert(0, eagle_dir)
    import transformers

    transformers.logging.set_verbosity_error()  # the reference's KV model classes trigger long, harmless warnings
    import eagle.model.ea_model as ea_model_mod

    return ea_model_mod


def git_commit(path: str) -> str | None:
    """The checkout's commit: ``git rev-parse HEAD``, or a ``COMMIT`` file beside ``eagle/`` (a ``git archive``
    export of one commit has no repository)."""
    stamp = Path(path) / "COMMIT"
    if stamp.is_file():
        return stamp.read_text().strip()
    try:
        out = subprocess.run(
            ["git", "-C", path, "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def environment_info(eagle_dir: str) -> dict:
    import transformers

    return {
        "reference_commit": git_commit(eagle_dir),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }


def load_prompts(path: str, num_prompts: int) -> list[dict]:
    """First turns of a JSONL file of records with ``"turns"``, or, from a ``.json`` file holding
    ``{"prompts": [{"id", "prompt_ids"}, ...]}`` (the golden prompts), prompts given as token ids."""
    if path.endswith(".json"):
        with open(path) as f:
            given = json.load(f)["prompts"]
        given = given[:num_prompts] if num_prompts > 0 else given
        return [{"question_id": p["id"], "prompt_ids": [int(t) for t in p["prompt_ids"]]} for p in given]
    records = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            if not rec.get("turns"):
                continue
            records.append(rec)
            if num_prompts > 0 and len(records) >= num_prompts:
                break
    return records


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """The target's chat template, one user turn, generation prompt added; its default system prompt."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


# --------------------------------------------------------------------------------------------------------------
# recording wrappers (applied from outside; the reference files are not edited)


class Recorder:
    """Collects what the reference did for one ``eagenerate`` call."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.accept_lengths: list[int] = []
        self.best_candidates: list[int] = []
        self.capture_next_tree = True
        self.first_tree: dict | None = None


def install_wrappers(ea_model_mod, model, rec: Recorder, vocab_size: int):
    """Wrap ``evaluate_posterior`` (module global of ea_model, called once per verify step) and the head instance's
    ``topK_genrate`` (the first call after prefill is captured, with every ``torch.topk`` it makes)."""
    orig_evaluate = ea_model_mod.evaluate_posterior

    def evaluate_posterior(logits, candidates, logits_processor):
        best, accept, sample_p = orig_evaluate(logits, candidates, logits_processor)
        rec.accept_lengths.append(int(accept))
        rec.best_candidates.append(int(best))
        return best, accept, sample_p

    ea_model_mod.evaluate_posterior = evaluate_posterior

    layer = model.ea_layer
    orig_topk_genrate = layer.topK_genrate  # bound method of the reference's head

    def topK_genrate(hidden_states, input_ids, head, logits_processor):
        if not rec.capture_next_tree:
            return orig_topk_genrate(hidden_states, input_ids, head, logits_processor)
        rec.capture_next_tree = False
        calls = []
        real_topk = torch.topk

        def recording_topk(inp, k, *args, **kwargs):
            out = real_topk(inp, k, *args, **kwargs)
            calls.append(
                (
                    inp.detach().clone(),
                    out.indices.detach().clone(),
                    out.values.detach().clone(),
                )
            )
            return out

        torch.topk = recording_topk
        try:
            result = orig_topk_genrate(hidden_states, input_ids, head, logits_processor)
        finally:
            torch.topk = real_topk
        rec.first_tree = describe_tree(
            layer, result, calls, hidden_states, input_ids, vocab_size
        )
        return result

    layer.topK_genrate = topK_genrate


def describe_tree(layer, result, calls, hidden_states, input_ids, vocab_size) -> dict:
    """Turn one ``topK_genrate`` result (+ its recorded ``torch.topk`` calls) into plain lists.

    Call order inside topK_genrate: [root top-k over the draft vocabulary], then per depth step
    [top-k of each frontier row over the draft vocabulary, global top-k of the k*k cumulative scores], then the
    final top-(total_token-1) over the flat pool of k + depth*k^2 candidate scores.
    """
    draft_tokens, retrieve_indices, tree_mask, tree_position_ids = result
    k, depth = layer.top_k, layer.depth
    mask = tree_mask[0, 0].bool()
    n_nodes = mask.shape[0]
    parents = [-1]
    for i in range(1, n_nodes):
        anc = [j for j in range(i) if bool(mask[i, j])]
        parents.append(max(anc))

    # EAGLE-3 with draft_vocab_size < vocab_size maps draft ids with d2t; otherwise draft ids are target ids
    # (the EAGLE-1/2 class, cnets1.Model, keeps no config and has no d2t)
    cfg = getattr(layer, "config", None)
    d2t = getattr(layer, "d2t", None)
    mapped = (
        cfg is not None
        and d2t is not None
        and getattr(cfg, "draft_vocab_size", cfg.vocab_size) != cfg.vocab_size
    )

    def to_target(ids: torch.Tensor) -> torch.Tensor:
        return ids + d2t[ids] if mapped else ids

    expected_calls = 1 + 2 * depth + 1
    tree = {
        "tokens": [int(t) for t in draft_tokens[0].tolist()],
        "parents": parents,
        "depths": [int(d) for d in tree_position_ids.tolist()],
        "retrieve_indices": retrieve_indices.tolist(),
        "tree_mask": [[int(v) for v in row] for row in mask.int().tolist()],
        "num_nodes": n_nodes,
        "head_input": {
            "feature_shape": list(hidden_states.shape),
            "draft_input_len": int(input_ids.shape[1]) - 1,
        },
        "draft_vocab_mapped_with_d2t": bool(mapped),
        "topk_calls": len(calls),
    }
    if len(calls) != expected_calls:
        tree["warning"] = (
            f"expected {expected_calls} torch.topk calls, saw {len(calls)}; pool/scores not decoded"
        )
        return tree

    # candidate pool, in the reference's flat order: level 1 (k), then k*k per depth step
    pool_tokens = [to_target(calls[0][1].view(-1))]
    pool_parent = [torch.full((k,), -1, dtype=torch.long)]  # -1 = root
    frontier = torch.arange(k)  # pool indices of the frontier (level 1 at first)
    offset = k
    for i in range(depth):
        _, row_idx, _ = calls[1 + 2 * i]  # [k, k] draft ids per frontier row
        _, cs_idx, _ = calls[2 + 2 * i]  # chosen flat indices into the k*k block
        pool_tokens.append(to_target(row_idx.reshape(-1)))
        pool_parent.append(frontier.repeat_interleave(k))
        frontier = offset + cs_idx.view(-1)
        offset += k * k
    pool_scores, chosen, _ = calls[-1]
    pool_scores = pool_scores.view(-1)
    chosen_sorted = torch.sort(chosen.view(-1)).values
    pool_tokens_t = torch.cat(pool_tokens)
    tree.update(
        {
            "scores": [None] + [float(s) for s in pool_scores[chosen_sorted].tolist()],
            "pool_index": [None] + [int(i) for i in chosen_sorted.tolist()],
            "pool": {
                "tokens": [int(t) for t in pool_tokens_t.tolist()],
                "scores": [float(s) for s in pool_scores.tolist()],
                "parent_pool_index": [int(p) for p in torch.cat(pool_parent).tolist()],
            },
            "root_topk_logprobs": [float(v) for v in calls[0][2].view(-1).tolist()],
        }
    )
    # self-check: the nodes' tokens are the pool tokens at the chosen indices
    tree["pool_consistent"] = bool(
        torch.equal(pool_tokens_t[chosen_sorted], draft_tokens[0, 1:].cpu())
    )
    return tree


# --------------------------------------------------------------------------------------------------------------
# subcommand: reference


def cmd_reference(args) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ea_model_mod = import_reference(args.eagle_dir)
    from transformers import AutoTokenizer

    use_eagle3 = args.head_type == "eagle3"
    t0 = time.perf_counter()
    model = ea_model_mod.EaModel.from_pretrained(
        use_eagle3=use_eagle3,
        base_model_path=args.target,
        ea_model_path=args.head,
        total_token=args.total_token,
        depth=args.depth,
        top_k=args.top_k,
        torch_dtype=torch.float32,
    )
    model.eval()
    load_s = time.perf_counter() - t0
    vocab_size = int(model.base_model.lm_head.weight.shape[0])
    eos_id = model.tokenizer.eos_token_id

    rec = Recorder()
    install_wrappers(ea_model_mod, model, rec, vocab_size)

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = load_prompts(args.prompts, args.num_prompts)
    results = []
    for n, record in enumerate(prompts):
        if "prompt_ids" in record:  # given as token ids
            prompt_ids = ref_tok_ids = record["prompt_ids"]
        else:
            text = record["turns"][0]
            prompt_ids = chat_prompt_ids(tokenizer, text)
            ref_tok_ids = chat_prompt_ids(
                model.tokenizer, text
            )  # the reference's own (slow) tokenizer, as a check
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
        results.append(entry)
        print(
            f"[{n + 1}/{len(prompts)}] q{record.get('question_id')} prompt {len(prompt_ids)} new {new_token} "
            f"steps {cycles} tau {entry['tau']:.3f} wall {wall:.1f}s"
            + (f" greedy_match {entry['greedy_match']}" if args.check_greedy else ""),
            flush=True,
        )

    total_new = sum(r["new_token"] for r in results)
    total_steps = sum(r["steps"] for r in results)
    with open(os.path.join(args.head, "config.json")) as f:
        head_cfg = json.load(f)
    summary = {
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
    report = {
        "kind": "reference",
        "settings": {
            "head_type": args.head_type,
            "use_eagle3": use_eagle3,
            "head": os.path.abspath(args.head),
            "target": os.path.abspath(args.target),
            "prompts": args.prompts,
            "num_prompts": len(results),
            "max_new_tokens": args.max_new_tokens,
            "max_length": args.max_length,
            "total_token": args.total_token,
            "depth": args.depth,
            "top_k": args.top_k,
            "temperature": 0.0,
            "dtype": "float32",
            "eos_token_id": eos_id,
            "vocab_size": vocab_size,
            "draft_vocab_size": head_cfg.get(
                "draft_vocab_size", head_cfg.get("vocab_size")
            ),
        },
        "environment": environment_info(args.eagle_dir),
        "notes": {
            "tau": "reference's count: new_token / cycles, new_token += accept_length + 1 per cycle; prefill is "
            "not a cycle; overshoots max_new_tokens; counts tokens after EOS within the last cycle",
            "accept_lengths": "accepted draft tokens per verify step (bonus token not included)",
            "first_tree": "tree built by topK_genrate right after prefill; node 0 is the root (the token sampled "
            "from the prefill logits); scores are cumulative draft log-probs; tokens are target ids",
        },
        "summary": summary,
        "prompts": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f)
    if args.golden:
        json.dump(golden_trace(report, args.golden_root), open(args.golden, "w"), separators=(",", ":"))
    print(json.dumps(summary, indent=1))


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


# --------------------------------------------------------------------------------------------------------------
# subcommand: make-random-eagle3


def read_token_ranking(path: str) -> list[int]:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        tensors = load_file(path)
        if len(tensors) != 1:
            raise SystemExit(f"{path}: expected one tensor, found {list(tensors)}")
        return [int(t) for t in next(iter(tensors.values())).view(-1).tolist()]
    with open(path) as f:
        return [int(t) for t in json.load(f)]


def build_d2t_t2d(vocab_size: int, draft_vocab_size: int, ranking: list[int] | None):
    """The reference's convention (eagle/traineagle3/cnets.py scandata): used = the N most frequent ids, sorted
    ascending; d2t[i] = used[i] - i (so target = draft + d2t[draft]); t2d[v] = v in used."""
    if ranking is None:
        used = list(range(draft_vocab_size))
    else:
        seen, used = set(), []
        for t in ranking:
            if 0 <= t < vocab_size and t not in seen:
                seen.add(t)
                used.append(t)
            if len(used) == draft_vocab_size:
                break
        if len(used) < draft_vocab_size:
            raise SystemExit(
                f"token ranking has only {len(used)} distinct valid ids, need {draft_vocab_size}"
            )
    used.sort()
    d2t = torch.tensor([used[i] - i for i in range(draft_vocab_size)], dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.tensor(used)] = True
    return d2t, t2d


def cmd_make_random_eagle3(args) -> None:
    torch.set_num_threads(args.threads)
    ea_model_mod = import_reference(args.eagle_dir)
    from eagle.model.cnets import Model as Eagle3Model
    from eagle.model.configs import EConfig

    with open(os.path.join(args.target, "config.json")) as f:
        tcfg = json.load(f)
    vocab_size = int(tcfg["vocab_size"])
    draft_vocab = int(args.draft_vocab_size)
    if not 0 < draft_vocab <= vocab_size:
        raise SystemExit(f"--draft-vocab-size must be in 1..{vocab_size}")
    rope_theta = tcfg.get(
        "rope_theta", (tcfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    )
    # field set of the reference's EAGLE-3 training config (eagle/traineagle3/config.json), filled from the target
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "bos_token_id": tcfg.get("bos_token_id"),
        "eos_token_id": tcfg.get("eos_token_id"),
        "pad_token_id": tcfg.get("pad_token_id", 0),
        "hidden_act": tcfg.get("hidden_act", "silu"),
        "hidden_size": tcfg["hidden_size"],
        "initializer_range": tcfg.get("initializer_range", 0.02),
        "intermediate_size": tcfg["intermediate_size"],
        "max_position_embeddings": tcfg["max_position_embeddings"],
        "num_attention_heads": tcfg["num_attention_heads"],
        "num_key_value_heads": tcfg.get(
            "num_key_value_heads", tcfg["num_attention_heads"]
        ),
        "num_hidden_layers": 1,
        "rms_norm_eps": tcfg["rms_norm_eps"],
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": vocab_size,
        "draft_vocab_size": draft_vocab,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "config.json", "w") as f:
        json.dump(cfg, f, indent=2)

    config = EConfig.from_pretrained(str(out))
    torch.manual_seed(args.seed)
    head = Eagle3Model(
        config, load_emb=True, path=args.target
    )  # embedding: the target's (not saved)
    ranking = read_token_ranking(args.token_ids) if args.token_ids else None
    d2t, t2d = build_d2t_t2d(vocab_size, draft_vocab, ranking)
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
    state = {
        k: v.detach()
        .to(torch.float32 if v.is_floating_point() else v.dtype)
        .contiguous()
        .clone()
        for k, v in head.state_dict().items()
        if not k.startswith("embed_tokens.")
    }
    if (
        draft_vocab == vocab_size
    ):  # the reference deletes d2t/t2d in that case; do not save them
        state.pop("d2t", None)
        state.pop("t2d", None)
    if args.format in ("bin", "both"):
        torch.save(state, out / "pytorch_model.bin")
    if args.format in ("safetensors", "both"):
        from safetensors.torch import save_file

        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    info = {
        "created_by": "bench/fidelity.py make-random-eagle3",
        "reference_commit": git_commit(args.eagle_dir),
        "class": "eagle/model/cnets.py:Model",
        "seed": args.seed,
        "draft_vocab_size": draft_vocab,
        "token_ranking": args.token_ids
        or "identity over the first draft_vocab_size ids",
        "keys": {k: [list(v.shape), str(v.dtype)] for k, v in state.items()},
    }
    with open(out / "head_info.json", "w") as f:
        json.dump(info, f, indent=1)
    for k, v in state.items():
        print(f"  {k:48s} {tuple(v.shape)} {v.dtype}")

    # --- check that the reference loads it (its load_state_dict is non-strict: compare key by key)
    model = ea_model_mod.EaModel.from_pretrained(
        use_eagle3=True,
        base_model_path=args.target,
        ea_model_path=str(out),
        total_token=8,
        depth=2,
        top_k=3,
        torch_dtype=torch.float32,
    )
    model.eval()
    loaded = model.ea_layer.state_dict()
    problems = [
        k
        for k in state
        if k not in loaded or not torch.equal(loaded[k].cpu(), state[k])
    ]
    problems += [
        k for k in loaded if k not in state and not k.startswith("embed_tokens.")
    ]
    if not torch.equal(
        loaded["embed_tokens.weight"],
        model.base_model.model.embed_tokens.weight.detach(),
    ):
        problems.append("embed_tokens.weight != target embedding")
    if problems:
        raise SystemExit(f"reference did not load the head as saved: {problems}")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.target)
    ids = torch.tensor([chat_prompt_ids(tok, "Write a haiku about the sea.")])
    spec = model.eagenerate(ids, temperature=0.0, max_new_tokens=24)
    plain = model.naivegenerate(ids, temperature=0.0, max_new_tokens=24)
    m = min(spec.shape[1], plain.shape[1])
    same = torch.equal(spec[0, :m], plain[0, :m])
    print(
        f"loaded by EaModel.from_pretrained(use_eagle3=True): all {len(state)} tensors match, embedding is the "
        f"target's; eagenerate == naivegenerate on a short prompt: {same}"
    )
    if not same:
        raise SystemExit("speculative output differs from greedy")


# --------------------------------------------------------------------------------------------------------------
# eagle-ray side (runs in eagle-ray's own environment: .venv/bin/python)


def cmd_eagle_ray(args) -> None:
    """Run eagle-ray on the prompts, head and tree of a ``reference`` result and compare, step by step
    (``eagle_ray.fidelity``: what the golden test runs on every commit)."""
    from harness import command_line, write_result

    from eagle_ray.fidelity import compare, engine_like, read_trace, run_prompts, trace_tree
    from eagle_ray.model.device import cpu_model

    ref = read_trace(args.reference)
    st = ref["settings"]
    engine = engine_like(ref, args.target, args.head, args.batch_size, threads=args.threads)
    runs = run_prompts(engine, [p["prompt_ids"] for p in ref["prompts"]], st["max_new_tokens"])
    eos = st.get("eos_token_id")
    rows = []
    for run, p in zip(runs, ref["prompts"]):
        row = compare(run, p, args.score_tol)
        steps = max(len(run.accept_lengths), 1)
        row.update(tau_ours=(len(run.tokens) - 1) / steps, tau_reference=p["tau"],
                   tau_reference_count_on_ours=(len(run.tokens) + (1 if run.tokens and run.tokens[-1] == eos
                                                                   else 0)) / steps)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not isinstance(v, (dict, list))}), flush=True)
    n = len(rows)
    agree = {k: sum(r[k] for r in rows) for k in ("first_tree", "accept_lengths", "output")}
    result = {"kind": "eagle-ray vs reference", "reference_file": args.reference, "head": args.head,
              "head_kind": engine.draft.kind, "tree": trace_tree(ref).model_dump(), "batch_size": args.batch_size,
              "prompts": n, "cpu": cpu_model(), "agree": {k: f"{v}/{n}" for k, v in agree.items()},
              "max_score_gap": max(r["max_score_gap"] for r in rows),
              "tau_ours_mean": sum(r["tau_ours"] for r in rows) / n,
              "tau_reference_mean": sum(r["tau_reference"] for r in rows) / n, "rows": rows,
              "reference_settings": st, "reference_environment": ref.get("environment")}
    result = write_result(args.out, result, command_line("bench/fidelity.py", args.argv), engine.device)
    print(json.dumps({k: v for k, v in result.items() if k not in ("rows", "reference_settings",
                                                                   "reference_environment")}, indent=1))
    if min(agree.values()) < n:
        raise SystemExit(1)


# --------------------------------------------------------------------------------------------------------------
# subcommand: lossless (eagle-ray's environment)


def lossless_engine(args):
    from eagle_ray.config import EngineConfig, TreeConfig
    from eagle_ray.engine.engine import EagleEngine
    from eagle_ray.errors import ConfigError

    try:
        tree = TreeConfig.from_spec(args.tree, lookup=args.lookup) if args.tree else TreeConfig(lookup=args.lookup)
        settings = dict(s.split("=", 1) for s in args.engine)
        config = EngineConfig(target=args.target, draft=args.draft, dtype=args.dtype, device=args.device, tree=tree,
                              max_batch_size=args.batch_size, max_model_len=args.max_model_len,
                              threads=args.threads, **{k: json_or_text(v) for k, v in settings.items()})
    except ValueError as e:  # pydantic's ValidationError is one
        raise ConfigError(str(e)) from None
    return EagleEngine.from_config(config)


def json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def greedy_generate(hf, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt_ids], device=hf.device)
    with torch.inference_mode():
        return hf.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0, ids.shape[1]:].tolist()


def mismatches(rows: list[dict], key: str, dtype, tie_gap: float | None) -> dict:
    """The rows' divergences under ``key``: how many, how many are near-ties, and the real ones."""
    from eagle_ray.fidelity import near_tie

    bad = [r[key] | {"id": r["id"], "near_tie": near_tie(r[key], dtype, tie_gap)} for r in rows if r.get(key)]
    return {"count": len(bad), "near_ties": sum(b["near_tie"] for b in bad),
            "real": [b for b in bad if not b["near_tie"]], "all": bad}


def lossless_rows(engine, records: list[dict], args) -> list[dict]:
    """Each prompt's speculative output against plain decoding's and ``generate()``'s (``--skip-hf``: not run)."""
    from eagle_ray.config import SamplingParams
    from eagle_ray.fidelity import divergence, hf_logits_fn
    from eagle_ray.prompts import first_turn_prompt

    prompts = [first_turn_prompt(r) for r in records]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    spec = engine.generate(prompts, params)
    plain = engine.generate(prompts, params, speculative=False)
    hf = None if args.skip_hf else engine.reference_model()
    rows = []
    for i, (r, s, p) in enumerate(zip(records, spec, plain)):
        row = {"id": r.get("question_id", r.get("id", i)), "tokens": len(s.token_ids), "tau": s.stats.tau,
               "vs_plain": divergence(engine.target.next_token_logits, s.prompt_token_ids, p.token_ids,
                                      s.token_ids)}
        if hf is not None:
            ref = greedy_generate(hf, s.prompt_token_ids, args.max_new_tokens)
            row["vs_hf"] = divergence(hf_logits_fn(hf), s.prompt_token_ids, ref, s.token_ids)
        rows.append(row)
    return rows


def cmd_lossless(args) -> None:
    from harness import check_out, command_line, write_result
    from workloads import task_records

    from eagle_ray.errors import ConfigError
    from eagle_ray.fidelity import tie_rule

    check_out(args.out)
    try:
        records = task_records(args.prompts)[1][: args.num_prompts]
    except ValueError as e:
        raise ConfigError(str(e)) from None
    engine = lossless_engine(args)
    rows = lossless_rows(engine, records, args)
    dtype = engine.target.dtype
    summary = {"dtype": str(dtype).replace("torch.", ""), "prompts": len(rows),
               "tie_rule": tie_rule(dtype, args.tie_gap), "tau_mean": sum(r["tau"] for r in rows) / len(rows),
               **{f"mismatches_{k}": mismatches(rows, k, dtype, args.tie_gap) for k in ("vs_plain", "vs_hf")
                  if not (k == "vs_hf" and args.skip_hf)}}
    write_result(args.out, {"summary": summary, "rows": rows}, command_line("bench/fidelity.py", args.argv),
                 engine.device)
    print(json.dumps({k: ({kk: vv for kk, vv in v.items() if kk != "all"} if isinstance(v, dict) else v)
                      for k, v in summary.items()}, indent=1))
    if any(v["real"] for k, v in summary.items() if k.startswith("mismatches_")):
        raise SystemExit(1)


def add_lossless(sub) -> None:
    g = sub.add_parser("lossless", help="greedy outputs against plain decoding and transformers generate() "
                       "(eagle-ray's venv)")
    g.add_argument("--prompts", default="mt_bench", help="a bundled task (mt_bench, ...), name=path.jsonl or a path")
    g.add_argument("--num-prompts", type=int, default=None)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--target", default=None, help="target (default: eagle-ray's embedded SmolLM2-135M-Instruct)")
    g.add_argument("--draft", default=None, help="EAGLE head dir (default: the embedded head); 'random'")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto")
    g.add_argument("--tree", default=None, help="total/depth/top_k (default: the engine's)")
    g.add_argument("--lookup", type=int, default=5, help="prompt-lookup tokens grafted onto each tree (0: off)")
    g.add_argument("--batch-size", type=int, default=1, help="max batch size of the engine")
    g.add_argument("--max-model-len", type=int, default=2048)
    g.add_argument("--threads", type=int, default=None)
    g.add_argument("--engine", nargs="*", default=[], metavar="KEY=VALUE",
                   help="any other engine setting, e.g. cpu_linears=packed fp32_activations=false")
    g.add_argument("--skip-hf", action="store_true", help="compare with plain decoding only")
    g.add_argument("--tie-gap", type=float, default=None,
                   help="top-2 logit gap under which a divergence counts as a near-tie (default: 1e-3 for fp32; for "
                   "bf16/fp16 one unit of the dtype at the top logit's size)")
    g.add_argument("--out", default=None)
    g.set_defaults(func=cmd_lossless)


# --------------------------------------------------------------------------------------------------------------


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser(
        "reference",
        help="run the SafeAILab reference and record steps and the first tree",
    )
    r.add_argument(
        "--eagle-dir", default=DEFAULT_EAGLE_DIR, help="SafeAILab/EAGLE checkout"
    )
    r.add_argument(
        "--target",
        default=DEFAULT_TARGET,
        help="target dir (fixed-up copy, see the module docstring)",
    )
    r.add_argument(
        "--head",
        required=True,
        help="draft head dir (config.json + pytorch_model.bin/model.safetensors)",
    )
    r.add_argument("--head-type", choices=["eagle2", "eagle3"], required=True)
    r.add_argument("--prompts", default="eagle_ray/assets/benchmarks/mt_bench.jsonl")
    r.add_argument("--num-prompts", type=int, default=10)
    r.add_argument("--max-new-tokens", type=int, default=128)
    r.add_argument(
        "--max-length",
        type=int,
        default=2048,
        help="eagenerate max_length (KV cache size)",
    )
    r.add_argument("--total-token", type=int, default=60)
    r.add_argument("--depth", type=int, default=5)
    r.add_argument("--top-k", type=int, default=10)
    r.add_argument("--threads", type=int, default=2)
    r.add_argument(
        "--check-greedy", action="store_true", help="also run naivegenerate and compare"
    )
    r.add_argument("--out", required=True)
    r.add_argument("--golden", default=None, help="also write the compact golden trace here")
    r.add_argument("--golden-root", default=".", help="paths in the golden trace are relative to this directory")
    r.set_defaults(func=cmd_reference)

    m = sub.add_parser(
        "make-random-eagle3",
        help="random EAGLE-3 head with the reference's cnets.py Model",
    )
    m.add_argument("--eagle-dir", default=DEFAULT_EAGLE_DIR)
    m.add_argument("--target", default=DEFAULT_TARGET)
    m.add_argument("--out", required=True)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--draft-vocab-size", type=int, default=8192)
    m.add_argument(
        "--token-ids",
        default=None,
        help="token ranking, most frequent first (safetensors with one 1-D int tensor, or JSON list); "
        "default: identity over the first N ids",
    )
    m.add_argument("--format", choices=["bin", "safetensors", "both"], default="both")
    m.add_argument("--threads", type=int, default=2)
    m.set_defaults(func=cmd_make_random_eagle3)

    e = sub.add_parser("eagle-ray", help="run eagle-ray like a reference result and compare (eagle-ray's venv)")
    e.add_argument("--reference", required=True, help="a result JSON of the `reference` subcommand")
    e.add_argument("--head", required=True, help="the same head directory the reference ran")
    e.add_argument("--target", default=None, help="target (default: eagle-ray's embedded SmolLM2-135M-Instruct)")
    e.add_argument("--score-tol", type=float, default=1e-4, help="largest draft score difference counted as equal")
    e.add_argument("--batch-size", type=int, default=1, help="run the prompts continuously batched, this many at once")
    e.add_argument("--threads", type=int, default=2)
    e.add_argument("--out", required=True)
    e.set_defaults(func=cmd_eagle_ray)

    add_lossless(sub)

    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    if args.cmd != "lossless":
        args.func(args)
        return
    from eagle_ray.errors import CheckpointError, ConfigError

    try:
        args.func(args)
    except (ConfigError, CheckpointError) as e:  # what the user gave is wrong: say what, in one line
        print(f"bench/fidelity.py lossless: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
