"""Does eagle-ray decode what it should: step by step what the SafeAILab EAGLE reference does (the same target, head,
prompts and tree, fp32, greedy: the first draft tree's tokens, parents, depths and scores, every step's accepted
length and the whole output must agree), and, greedy, what plain decoding and transformers ``generate()`` do.

    python bench/fidelity.py SUBCOMMAND --help

This file is the command line alone; each subcommand's code lies with the environment it runs in. The ``reference``
and ``make-random-eagle3`` subcommands run in the reference's own environment (torch 2.13 CPU, transformers 4.53.1;
the reference does not run under transformers 5.x) from ``bench/reference_env/``, which never imports eagle_ray
(nor this folder's other modules, which do); they import ``eagle.model`` from a checkout of
https://github.com/SafeAILab/EAGLE at run time (``--eagle-dir``) and wrap, from the outside, the functions
``eagenerate`` calls once per cycle, to record what the reference did; none of the reference's code is copied. The
``eagle-ray`` subcommand (``bench/against_reference.py``) runs in eagle-ray's environment on a ``reference`` result
and writes the comparison; ``lossless`` (``bench/lossless.py``) runs there too. Nothing is downloaded at run time.

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
import os
import sys

# Passive OpenMP waiting: on a loaded 2-core machine (this ran at nice 19 beside other measurements) busy-waiting
# OpenMP threads made a small fp32 matmul ~20x slower with 2 threads than with 1; PASSIVE removes that. It must be
# set before torch is imported; it does not change any result.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:   # run as a file without bench/ on the import path (runpy): its sides live beside it
    sys.path.insert(0, HERE)

from reference_env.checkout import DEFAULT_EAGLE_DIR, DEFAULT_TARGET  # noqa: E402 - after the OpenMP setting


# --------------------------------------------------------------------------------------------------------------
# each subcommand imports only its own side: the reference's environment has no eagle_ray


def run_reference(args) -> None:
    from reference_env.run import cmd_reference

    cmd_reference(args)


def run_make_random_eagle3(args) -> None:
    from reference_env.random_head import cmd_make_random_eagle3

    cmd_make_random_eagle3(args)


def run_eagle_ray(args) -> None:
    from against_reference import cmd_eagle_ray

    cmd_eagle_ray(args)


def run_lossless(args) -> None:
    from lossless import run

    run(args)


# --------------------------------------------------------------------------------------------------------------
# the command line


def add_reference(sub) -> None:
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
    r.set_defaults(func=run_reference)


def add_make_random_eagle3(sub) -> None:
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
    m.set_defaults(func=run_make_random_eagle3)


def add_eagle_ray(sub) -> None:
    e = sub.add_parser("eagle-ray", help="run eagle-ray like a reference result and compare (eagle-ray's venv)")
    e.add_argument("--reference", required=True, help="a result JSON of the `reference` subcommand")
    e.add_argument("--head", required=True, help="the same head directory the reference ran")
    e.add_argument("--target", default=None, help="target (default: eagle-ray's embedded SmolLM2-135M-Instruct)")
    e.add_argument("--score-tol", type=float, default=1e-4, help="largest draft score difference counted as equal")
    e.add_argument("--batch-size", type=int, default=1, help="run the prompts continuously batched, this many at once")
    e.add_argument("--threads", type=int, default=2)
    e.add_argument("--out", required=True)
    e.set_defaults(func=run_eagle_ray)


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
    g.set_defaults(func=run_lossless)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    add_reference(sub)
    add_make_random_eagle3(sub)
    add_eagle_ray(sub)
    add_lossless(sub)
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    args.func(args)


if __name__ == "__main__":
    main()
