"""Command line: ``eagle-ray generate`` (run prompts), ``eagle-ray serve`` (the OpenAI-compatible Serve app),
``eagle-ray extract`` (drafter features). Benchmarks are the scripts in bench/ (``python bench/speed.py --help``);
``eagle-ray measure`` and ``eagle-ray benchmark`` say where they went."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from eagle_ray.config import SamplingParams, TreeConfig
from eagle_ray.errors import CheckpointError, ConfigError
from eagle_ray.prompts import demo_prompts_path, first_turn_prompt, read_jsonl


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="HF dir, .gguf or s3:// (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default=None, help="EAGLE head dir or s3:// (default: embedded head); 'random'")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--tree-mode", default="dynamic", choices=["dynamic", "static", "chain"])
    p.add_argument("--total-tokens", type=int, default=TreeConfig().total_tokens)
    p.add_argument("--depth", type=int, default=TreeConfig().depth)
    p.add_argument("--top-k", type=int, default=TreeConfig().top_k)
    p.add_argument("--lookup", type=int, default=TreeConfig().lookup,
                   help="prompt-lookup tokens grafted onto each tree (0: off)")
    p.add_argument("--lookup-ngram", type=int, default=TreeConfig().lookup_ngram)
    p.add_argument("--batch-size", type=int, default=1, help="max batch size of the engine")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-verify-tokens", type=int, default=None, help="cap on tree nodes per verify pass (batch)")
    add_precision_args(p)


def add_precision_args(p: argparse.ArgumentParser) -> None:
    """The precision switches (EngineConfig fields, ``auto`` unless turned off); read them back with
    :func:`precision_kwargs`."""
    p.add_argument("--no-fp32-activations", dest="fp32_activations", action="store_const", const=False,
                   default="auto",
                   help="bf16/fp16 residual stream and attention (faster on CPU; greedy ties may then flip)")
    p.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_const", const=False,
                   default="auto",
                   help="plain CPU kernels instead of row-invariant ones (faster; see EngineConfig.batch_invariant)")
    p.add_argument("--no-fp32-logits", dest="fp32_logits", action="store_const", const=False,
                   default="auto",
                   help="logits in the model dtype (no fp32 refinement of the top candidates)")
    p.add_argument("--cpu-linears", default="auto", choices=["auto", "native", "input_major", "packed"],
                   help="the target's linear layout on CPU (see EngineConfig.cpu_linears)")


def precision_kwargs(a) -> dict:
    return {"fp32_activations": a.fp32_activations, "batch_invariant": a.batch_invariant,
            "fp32_logits": a.fp32_logits, "cpu_linears": a.cpu_linears}


def tree_of(a) -> TreeConfig:
    return TreeConfig(mode=a.tree_mode, total_tokens=a.total_tokens, depth=a.depth, top_k=a.top_k, lookup=a.lookup,
                      lookup_ngram=a.lookup_ngram)


def build_engine(a):
    from eagle_ray.engine.engine import EagleEngine
    tree = tree_of(a)
    return EagleEngine.from_pretrained(target=a.target, draft=a.draft, dtype=a.dtype, device=a.device, tree=tree,
                                       max_batch_size=a.batch_size, max_model_len=a.max_model_len, threads=a.threads,
                                       max_verify_tokens=a.max_verify_tokens, **precision_kwargs(a))


def read_prompt_records(a) -> tuple[list[dict], list]:
    """``--prompts`` (default: the bundled demo set) cut to ``--num-prompts``: the records and the prompt of each.
    Everything wrong with them is a :class:`ConfigError`, found before any model loads."""
    if a.num_prompts is not None and a.num_prompts < 1:
        raise ConfigError("--num-prompts must be >= 1")
    if a.prompts and (not Path(a.prompts).exists() or Path(a.prompts).is_dir()):   # a pipe will do
        raise ConfigError(f"--prompts {a.prompts} is not a file")
    try:
        records = read_jsonl(a.prompts or demo_prompts_path())[: a.num_prompts]
        prompts = [first_turn_prompt(r) for r in records]
    except (ValueError, TypeError, LookupError) as e:
        raise ConfigError(f"--prompts {a.prompts}: not a JSONL of prompt/messages/turns records ({e})") from None
    if not records:
        raise ConfigError(f"--prompts {a.prompts} holds no prompts")
    return records, prompts


def cmd_generate(a) -> int:
    records, prompts = read_prompt_records(a)
    params = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k_sampling,
                            max_new_tokens=a.max_new_tokens)
    engine = build_engine(a)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, speculative=not a.plain)
    wall = time.perf_counter() - t0
    for r, o in zip(records, outs):
        print(json.dumps({"id": r.get("id", o.request_id), "text": o.text, "finish_reason": o.finish_reason,
                          "tokens": len(o.token_ids), "tau": round(o.stats.tau, 3)}, ensure_ascii=False))
    n = sum(len(o.token_ids) for o in outs)
    print(f"# {len(outs)} requests, {n} tokens in {wall:.1f}s = {n / wall:.1f} tok/s, "
          f"tau {statistics.mean(o.stats.tau for o in outs):.2f}", file=sys.stderr)
    return 0


MOVED = {"measure": "python bench/speed.py measure (tokens/s) or python bench/fidelity.py lossless (greedy outputs "
                    "against generate())",
         "benchmark": "python bench/speed.py table1"}


def cmd_serve(a) -> int:
    from eagle_ray.serve.config import ServeConfig
    from eagle_ray.serve.app import run
    run(ServeConfig.from_yaml(a.config, {"host": a.host or None, "port": a.port}))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="eagle-ray")
    sub = parser.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="run prompts through the engine, print JSON lines")
    add_engine_args(g)
    g.add_argument("--prompts", default=None, help="JSONL of prompt/messages/turns (default: bundled demo set)")
    g.add_argument("--num-prompts", type=int, default=None)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k-sampling", type=int, default=0)
    g.add_argument("--plain", action="store_true", help="plain autoregressive decoding")
    g.set_defaults(func=cmd_generate)
    for name, where in MOVED.items():   # what they did is a bench script now: say which
        sub.add_parser(name, add_help=False, help=f"moved: {where}").set_defaults(func=None)
    sv = sub.add_parser("serve", help="OpenAI-compatible Ray Serve app (see configs/serve-embedded.yaml)")
    sv.add_argument("--config", default=None, help="ServeConfig YAML (default: the embedded pair on 127.0.0.1:8000)")
    sv.add_argument("--host", default=None)
    sv.add_argument("--port", type=int, default=None)
    sv.set_defaults(func=cmd_serve)
    e = sub.add_parser("extract", add_help=False,   # its own parser answers --help
                       help="extract drafter features (see eagle_ray.train.extract)")
    e.set_defaults(func=None)
    a, rest = parser.parse_known_args(argv)
    if a.cmd in MOVED:
        print(f"eagle-ray {a.cmd}: moved to {MOVED[a.cmd]}", file=sys.stderr)
        return 2
    if a.cmd == "extract":
        from eagle_ray.train.extract import main as extract_main
        try:
            extract_main(rest)
        except SystemExit as e:   # its checks end with a message; argparse's own exits carry a status
            if isinstance(e.code, str):
                print(f"eagle-ray extract: {e.code.removeprefix('extract: ')}", file=sys.stderr)
                return 2
            raise
        return 0
    if rest:
        parser.error(f"unrecognized arguments: {rest}")
    try:
        return a.func(a)
    except (ConfigError, CheckpointError) as e:   # what the user gave is wrong: say what, in one line
        print(f"eagle-ray {a.cmd}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
