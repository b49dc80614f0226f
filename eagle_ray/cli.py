"""Command line: ``eagle-ray generate`` (run prompts), ``eagle-ray measure`` (tau, speed, losslessness -> JSON),
``eagle-ray benchmark`` (EAGLE-2's Table 1 -> Parquet + report), ``eagle-ray extract`` (drafter features)."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from eagle_ray.config import SamplingParams, TreeConfig, out_path_problem
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


def cmd_measure(a) -> int:
    """``eagle-ray measure``: see :func:`eagle_ray.measure.measure`."""
    from eagle_ray.measure import measure
    problem = a.out and out_path_problem(a.out, directory=False)
    if problem:
        raise ConfigError(f"--out {problem}")
    records, _ = read_prompt_records(a)
    out = measure(build_engine(a), records, a)
    out["summary"]["config"] = {k: v for k, v in vars(a).items() if k not in ("func",)}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1))
    brief = {k: v for k, v in out["summary"].items() if k not in ("config",)}
    for key in ("mismatches_vs_plain", "mismatches_vs_hf"):
        if key in brief:
            brief[key] = {k: v for k, v in brief[key].items() if k != "all"}
    print(json.dumps(brief, indent=1))
    return 0


def _benchmark_spec(a, methods=None):
    from eagle_ray.benchmark import BenchmarkSpec
    return BenchmarkSpec(tasks=a.tasks, methods=methods or a.methods, temperatures=a.temperatures,
                         batch_sizes=a.batch_sizes, num_prompts=a.num_prompts, max_new_tokens=a.max_new_tokens,
                         seed=a.seed)


def _benchmark_engine_config(a):
    from eagle_ray.config import EngineConfig
    return EngineConfig(target=a.target, draft=a.draft, dtype=a.dtype, device=a.device, tree=tree_of(a),
                        tree_policy=a.tree_policy, max_batch_size=max(max(a.batch_sizes), a.batch_size),
                        max_model_len=a.max_model_len, threads=a.threads, max_verify_tokens=a.max_verify_tokens,
                        **precision_kwargs(a))


def _benchmark_engine(a):
    from eagle_ray.engine.engine import EagleEngine
    return EagleEngine.from_config(_benchmark_engine_config(a))


def cmd_benchmark(a) -> int:
    """EAGLE-2's Table 1 on this machine: Parquet + summary.json + report.md + PNGs in ``--out``."""
    from eagle_ray.benchmark import run_benchmark
    from eagle_ray.report import write_report, write_results
    try:   # validate before loading anything: a bad value found after the run would lose it
        spec = _benchmark_spec(a)
        _benchmark_engine_config(a)
        from eagle_ray.prompts import load_dataset
        for task in a.tasks:
            for r in load_dataset(task)[1][: spec.num_prompts]:
                first_turn_prompt(r)
    except (ValueError, TypeError, LookupError) as e:
        raise ConfigError(str(e)) from None
    problem = out_path_problem(a.out, directory=True)
    if problem:
        raise ConfigError(f"--out {problem}")
    command = "eagle-ray benchmark " + " ".join(sys.argv[2:]) if a.command is None else a.command
    if a.ray:
        rows, extras = _benchmark_on_ray(a)
    else:
        rows, extras = run_benchmark(_benchmark_engine(a), _benchmark_spec(a))
    write_results(a.out, rows, extras)
    print(f"report: {write_report(a.out, command)}")
    return 0


def _benchmark_on_ray(a):
    """One Ray actor per method (each loads its own engine). Ratios between actors are only meaningful when the
    actors run on identical, unshared devices (one GPU each); on one shared CPU machine run locally instead."""
    import ray

    from eagle_ray.cluster import ensure_ray

    ensure_ray(a.ray_address, None)

    @ray.remote(num_cpus=a.actor_cpus, num_gpus=a.actor_gpus)
    def one_method(method):
        from eagle_ray.benchmark import run_benchmark
        if a.actor_gpus == 0 and a.threads is None:
            a.threads = max(1, int(a.actor_cpus))
        return run_benchmark(_benchmark_engine(a), _benchmark_spec(a, [method]), log=lambda m: None)

    results = ray.get([one_method.remote(m) for m in a.methods])
    rows = [r for rs, _ in results for r in rs]
    extras = next((ex for (rs, ex), m in zip(results, a.methods) if m.startswith("eagle2")), results[0][1])
    extras["spec"]["methods"] = list(a.methods)
    extras["ray_actors"] = len(a.methods)
    return rows, extras


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
    m = sub.add_parser("measure", help="tau, tokens/s, greedy mismatches and time split -> JSON")
    add_engine_args(m)
    m.add_argument("--prompts", required=True)
    m.add_argument("--num-prompts", type=int, default=None)
    m.add_argument("--max-new-tokens", type=int, default=128)
    m.add_argument("--temperature", type=float, default=0.0)
    m.add_argument("--compare-hf", action="store_true", help="also run transformers generate() (greedy)")
    m.add_argument("--skip-plain", action="store_true", help="do not run plain decoding (speed ratios then read 1)")
    m.add_argument("--tie-gap", type=float, default=None,
                   help="top-2 logit gap under which a divergence counts as a near-tie (default: 1e-3 for fp32; for "
                   "bf16/fp16 one unit of the dtype at the top logit's size)")
    m.add_argument("--out", default=None)
    m.set_defaults(func=cmd_measure)
    bm = sub.add_parser("benchmark", help="EAGLE-2 Table 1 on this machine: methods x tasks x T -> Parquet + report")
    add_engine_args(bm)
    from eagle_ray.benchmark import ALL_METHODS, BenchmarkSpec
    d = BenchmarkSpec()
    bm.add_argument("--tree-policy", default="fixed", choices=["fixed", "auto"],
                    help="eagle2's tree: the --total-tokens/--depth/--top-k one, or tuned per batch size")
    bm.add_argument("--tasks", nargs="+", default=d.tasks,
                    help="bundled EAGLE tasks, mtbench-wheel, humaneval-wheel, or name=path.jsonl")
    bm.add_argument("--methods", nargs="+", default=d.methods, choices=ALL_METHODS)
    bm.add_argument("--temperatures", nargs="+", type=float, default=d.temperatures)
    bm.add_argument("--batch-sizes", nargs="+", type=int, default=d.batch_sizes)
    bm.add_argument("--num-prompts", type=int, default=d.num_prompts)
    bm.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    bm.add_argument("--seed", type=int, default=0)
    bm.add_argument("--out", required=True, help="output directory")
    bm.add_argument("--ray", action="store_true", help="one Ray actor per method")
    bm.add_argument("--ray-address", default=None)
    bm.add_argument("--actor-cpus", type=float, default=1)
    bm.add_argument("--actor-gpus", type=float, default=0)
    bm.add_argument("--command", default=None, help=argparse.SUPPRESS)
    bm.set_defaults(func=cmd_benchmark)
    sv = sub.add_parser("serve", help="OpenAI-compatible Ray Serve app (see configs/serve-embedded.yaml)")
    sv.add_argument("--config", default=None, help="ServeConfig YAML (default: the embedded pair on 127.0.0.1:8000)")
    sv.add_argument("--host", default=None)
    sv.add_argument("--port", type=int, default=None)
    sv.set_defaults(func=cmd_serve)
    e = sub.add_parser("extract", add_help=False,   # its own parser answers --help
                       help="extract drafter features (see eagle_ray.train.extract)")
    e.set_defaults(func=None)
    a, rest = parser.parse_known_args(argv)
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
