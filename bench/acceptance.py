"""How well does a draft head guess the target: tau per task on real decoding, and held-out top-1 per draft step.

    python bench/acceptance.py SUBCOMMAND --help

``tau``
    Several heads on the same prompts and trees, in one run (greedy, fp32 by default): each head runs every tree
    (with each ``--lookup`` length: prompt-lookup tokens grafted onto the tree, 0 = the head's tree alone; and each
    ``--context-vocab``) on every task's first turns. A row holds tau (the mean over requests of tokens per verify
    step) and the pooled ratio (all tokens / all verify steps). Greedy output is the target's whatever the head, so
    the result counts the outputs that differ from the first run's (fp32: near-ties at most). A task is a bundled
    EAGLE file or ``name=path.jsonl``. Above batch 1, a step's token budget (``--max-step-tokens``) cuts trees while
    long prompts are read: tau then counts that too, not the head alone.

        python bench/acceptance.py tau --heads embedded runs/head/head --tasks mt_bench humaneval \\
            --num-prompts 20 --max-new-tokens 256 --out bench/results/<hardware>/head_acceptance.json

``top1``
    Held-out top-1 of several heads on the same conversations, per draft step: step 0 drafts from the target's true
    feature (the tree's first level), step s from s of the head's own predictions (level s; see
    ``trainer.head_forward_unrolled``). Each head is read through its own token map, as served, so a target token
    outside the map counts as a miss. The conversations, one of:

    - ``--features DIR``: extracted features (an EAGLE-3 head needs ``--eagle3`` ones); pick conversations no head
      trained on (train_drafter holds out the first 2% of its first feature directory);
    - ``--answers SET_DIR``: a self-distilled answer set, the target's states computed here (fp32);
      ``train_drafter.py --answers SET_DIR --eval-fraction F`` holds out the first F of its conversations, so
      ``--first`` that many scores a head on what its run held out;
    - ``--tasks``: the target's own greedy answers to benchmark first turns (made here, fp32, plain decoding), the
      first ``--test-prompts`` of each task (those ``tau`` runs) and the rest apart. EAGLE-1/2 heads only.

        python bench/acceptance.py top1 --answers datasets/selfdistill/sharegpt-turn2-fp32 --first 122 \\
            --heads embedded NEW --out bench/results/<hardware>/heldout_top1.json

``adaptation``
    Online adaptation on a domain the head was not trained for: the batch job over ``--num-prompts`` requests of
    one ``--workload`` (``workloads.py``: ``sympy_code``, explain SymPy functions; ``bbc_news``, summarise BBC News
    articles), once with ``engine.adaptation`` off and once on, one actor each, the same rows. Rows are ordered by
    when they finished; tau of the first and last ``--window`` rows of each run (pooled: tokens over verify steps),
    the off run's tau on the on run's last rows, and each job's wall time.

        python bench/acceptance.py adaptation --num-prompts 1000 --max-new-tokens 64 \
            --out bench/results/<hardware>/adaptation_sympy_1000.json

``adaptation-merge``
    Several actors adapting their own copies of one head on one such job (``--actors``, the threads shared out),
    each writing its adapted head; then each actor's head, their element-wise mean, a head one actor adapted on the
    whole job (``--single``) and the starting head run ``--eval-prompts`` held-out requests of the same domain with
    adaptation off: tau of each, whether merging the actors' heads pays.

        python bench/acceptance.py adaptation-merge --draft random-eagle3 --tree 8/2/3 --num-prompts 300 \
            --out bench/results/<hardware>/adaptation_merge_eagle3.json

All write JSON naming the hardware, torch version, threads and command line (``harness.py``).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from harness import run_entry, subcommand, write_result
from workloads import DOMAINS, task_records
from workloads import prompts as workload_prompts

from eagle_ray.config import SamplingParams, TreeConfig
from eagle_ray.prompts import EAGLE_TASKS, first_turn_prompt

SCRIPT = "bench/acceptance.py"
TREES = {"default": TreeConfig(), "60": TreeConfig(total_tokens=60, depth=5, top_k=10)}


# ---- tau ----------------------------------------------------------------------------------------------------------
def tree_of(name: str) -> TreeConfig:
    """A named tree, or ``total/depth/top_k`` (``12/3/4``) for any other dynamic tree."""
    if name in TREES:
        return TREES[name]
    try:
        return TreeConfig.from_spec(name)
    except ValueError:
        raise argparse.ArgumentTypeError(f"tree {name!r}: a name in {list(TREES)} or total/depth/top_k") from None


def tree_name(name: str) -> str:
    """argparse type: a name ``tree_of`` reads (rows keep the name)."""
    tree_of(name)
    return name


def tau_rows(head: str, tree: str, context_vocab: int, lookup: int, tasks: dict, a) -> list[dict]:
    """One head, tree, context vocabulary and lookup over every task: one row per task."""
    from eagle_ray.engine.engine import EagleEngine
    engine = EagleEngine.from_pretrained(draft=None if head == "embedded" else head, dtype=a.dtype,
                                         max_batch_size=a.batch_size, threads=a.threads,
                                         tree=tree_of(tree).model_copy(update={"lookup": lookup}),
                                         context_vocab=context_vocab, max_step_tokens=a.max_step_tokens)
    rows = []
    for task, records in tasks.items():
        outs = engine.generate([first_turn_prompt(r) for r in records], SamplingParams(max_new_tokens=a.max_new_tokens))
        tokens = sum(len(o.token_ids) for o in outs)
        rows.append({"head": head, "tree": tree, "context_vocab": context_vocab, "lookup": lookup, "task": task,
                     "prompts": len(outs), "tokens": tokens, "tau": sum(o.stats.tau for o in outs) / len(outs),
                     "tau_pooled": tokens / max(sum(o.stats.verify_steps for o in outs), 1),
                     "token_ids": [o.token_ids for o in outs]})
        print(f"{head} tree {tree} context {context_vocab} lookup {lookup} {task}: tau {rows[-1]['tau']:.3f} "
              f"(pooled {rows[-1]['tau_pooled']:.3f})", flush=True)
    return rows


def cmd_tau(a) -> int:
    tasks = {t: task_records(t)[1][:a.num_prompts] for t in a.tasks}
    rows = [r for head in a.heads for tree in a.trees for c in a.context_vocab for lk in a.lookup
            for r in tau_rows(head, tree, c, lk, tasks, a)]
    same = {}
    for r in rows:
        same.setdefault((r["tree"], r["task"]), []).append(r.pop("token_ids"))
    differ = {f"{tree}/{task}": sum(o != outs[0] for o in outs[1:]) for (tree, task), outs in same.items()}
    write_result(a.out, {"dtype": a.dtype, "trees": {k: tree_of(k).model_dump(exclude_none=True) for k in a.trees},
                         "outputs_differing_between_runs": differ, "rows": rows}, a.command)
    print("outputs differing from the first run (fp32: near-ties at most):", differ)
    return 0


# ---- top1 ---------------------------------------------------------------------------------------------------------
def first_conversations(features_dir: str, n: int) -> list[dict]:
    from eagle_ray.train.extract import read_shard
    convs = []
    for shard in sorted(Path(features_dir).glob("shard-*.safetensors")):
        convs += read_shard(shard)
    return sorted(convs, key=lambda c: c["conv_index"])[:n]


def task_conversations(tasks: list[str], target, max_new_tokens: int, threads: int | None) -> dict[str, list]:
    """The target's greedy answers to each task's first turns, as feature conversations (prompt not scored)."""
    from eagle_ray.engine.engine import EagleEngine
    from eagle_ray.train.extract import extract_features

    engine = EagleEngine.from_pretrained(draft="none", dtype="float32", max_batch_size=16, threads=threads)
    out = {}
    for task in tasks:
        answers = engine.generate([first_turn_prompt(r) for r in task_records(task)[1]],
                                  SamplingParams(max_new_tokens=max_new_tokens), speculative=False)
        t = extract_features(target, None, [(i, {"prompt_ids": o.prompt_token_ids, "answer_ids": o.token_ids})
                                            for i, o in enumerate(answers)], 2048)
        off = t["offsets"].tolist()
        out[task] = [{"input_ids": t["input_ids"][a:b].long(), "loss_mask": t["loss_mask"][a:b],
                      "hidden": t["hidden"][a:b]} for a, b in zip(off[:-1], off[1:])]
    return out


def conversation_sets(a, target) -> dict[str, list]:
    from eagle_ray.train.trainer import TrainConfig
    if a.features:
        return {"held_out": first_conversations(a.features, a.first)}
    if a.answers:
        from eagle_ray.train.extract import conversations_in_memory
        return {"held_out": conversations_in_memory(target, None, a.answers, TrainConfig().max_len, limit=a.first,
                                                    log=lambda m: None)}
    sets = {}
    for task, convs in task_conversations(a.tasks, target, a.max_new_tokens, a.threads).items():
        sets[f"{task}/test"], sets[f"{task}/rest"] = convs[:a.test_prompts], convs[a.test_prompts:]
    return sets


def cmd_top1(a) -> int:
    import json

    from transformers import AutoModelForCausalLM

    from eagle_ray.model.heads import load_head
    from eagle_ray.model.loading import EMBEDDED_DRAFT_DIR, resolve_target
    from eagle_ray.train.trainer import TrainConfig, evaluate
    if sum(x is not None for x in (a.features, a.answers, a.tasks)) != 1:
        a.parser.error("give one of --features, --answers and --tasks")
    if a.threads:
        torch.set_num_threads(a.threads)
    target = AutoModelForCausalLM.from_pretrained(str(resolve_target(a.target)), dtype=torch.float32)
    lm_weight, embed = target.lm_head.weight.detach(), target.model.embed_tokens.weight
    sets = conversation_sets(a, target)
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
    write_result(a.out, {"features": a.features, "answers": a.answers, "tasks": a.tasks,
                         "conversations": {k: len(v) for k, v in sets.items()}, "results": results}, a.command)
    return 0


# ---- the command line ---------------------------------------------------------------------------------------------
def pooled_tau(rows) -> float:
    """Tokens over verify steps of output rows (each with its ``tau`` and ``verify_steps``)."""
    return sum(r["step_tokens"] if "step_tokens" in r else r["tau"] * r["verify_steps"] for r in rows) / \
        max(sum(r["verify_steps"] for r in rows), 1)


def adaptation_run(prompts_path: Path, out_dir: Path, adapt: bool, a, draft: str | None = None, actors: int = 1,
                   save_dir: Path | None = None) -> dict:
    """The job on ``prompts_path`` with adaptation on or off (``draft``: instead of ``a.draft``; ``actors``: that
    many, the threads shared out; ``save_dir``: where each actor writes its adapted head)."""
    import time

    from eagle_ray.batch.config import JobConfig
    from eagle_ray.batch.job import run_job
    threads = max(1, a.threads // actors)
    engine = {"max_batch_size": a.max_batch_size, "max_model_len": 1024, "threads": threads, "dtype": a.dtype,
              "adaptation": {"enabled": adapt, "time_share": a.time_share, "lr": a.lr, "round_steps": a.round_steps,
                             "save": save_dir is not None, "save_dir": str(save_dir) if save_dir else None}}
    if draft or a.draft:
        engine["draft"] = draft or a.draft
    if a.tree:   # a fixed tree: every step drafts, whatever the head is worth
        engine["tree"] = tree_of(a.tree).model_dump()
    if a.max_step_tokens:   # wider steps: prompt chunks cut running sequences' trees less
        engine["max_step_tokens"] = a.max_step_tokens
    cfg = JobConfig(engine=engine,
                    sampling={"max_new_tokens": a.max_new_tokens},
                    input={"uri": str(prompts_path)}, output={"uri": str(out_dir)}, resume=False,
                    actors={"num_actors": actors, "num_cpus": threads, "batch_size": 8, "max_concurrent_batches": 4})
    t0 = time.perf_counter()
    summary = run_job(cfg, print_fn=lambda *_: None)
    wall = time.perf_counter() - t0
    from eagle_ray.batch.job import filesystem, read_output
    fs, root = filesystem(str(out_dir), cfg)
    rows = read_output(fs, root).to_pylist()
    rows = sorted((r for r in rows if not r["error"] and r["verify_steps"]), key=lambda r: r["finished_at"])
    w = a.window
    return {"adaptation": adapt, "wall_s": round(wall, 1), "rows": len(rows), "tau_all": round(pooled_tau(rows), 4),
            "tau_first": round(pooled_tau(rows[:w]), 4), "tau_last": round(pooled_tau(rows[-w:]), 4),
            "first_ids": [r["id"] for r in rows[:w]], "last_ids": [r["id"] for r in rows[-w:]],
            "tau_by_id": {r["id"]: {"tau": r["tau"], "verify_steps": r["verify_steps"]} for r in rows},
            "head_versions": sorted({r["head_version"] for r in rows}),
            "outputs": {r["id"]: r["output_token_ids"] for r in rows},
            "tau_over_time": summary.get("tau_over_time"), "tokens": sum(r["output_tokens"] for r in rows)}


def cmd_adaptation(a) -> int:
    import json
    import tempfile

    work = Path(a.work_dir or tempfile.mkdtemp(prefix="adaptation-"))
    work.mkdir(parents=True, exist_ok=True)
    prompts_path = work / "prompts.jsonl"
    with open(prompts_path, "w") as f:
        for i, p in enumerate(workload_prompts(a.workload, a.num_prompts)):
            f.write(json.dumps({"id": f"q{i:05d}", "prompt": p}) + "\n")
    runs = {mode: adaptation_run(prompts_path, work / f"out-{mode}", mode == "on", a) for mode in a.order}
    on, off = runs.get("on"), runs.get("off")
    result = {"workload": a.workload, "prompts": a.num_prompts, "max_new_tokens": a.max_new_tokens,
              "window": a.window, "settings": {"time_share": a.time_share, "lr": a.lr, "round_steps": a.round_steps,
                                               "max_batch_size": a.max_batch_size, "dtype": a.dtype,
                                               "max_step_tokens": a.max_step_tokens,
                                               "draft": a.draft or "embedded", "tree": a.tree or "auto"},
              "runs": {m: {k: v for k, v in r.items() if k not in ("tau_by_id", "first_ids", "last_ids", "outputs")}
                       for m, r in runs.items()}}
    if on and off:   # the same rows, adaptation off: what the last window's gain owes to adaptation
        same = [off["tau_by_id"][i] for i in on["last_ids"] if i in off["tau_by_id"]]
        result["off_tau_on_the_last_rows_of_on"] = round(pooled_tau(same), 4)   # pooled as tau_last is
        result["last_rows_gain_vs_off"] = round(on["tau_last"] / max(result["off_tau_on_the_last_rows_of_on"], 1e-9)
                                                - 1, 4)
        result["wall_on_vs_off"] = round(on["wall_s"] / off["wall_s"], 4)
        result["outputs_identical"] = sum(on["outputs"][i] == off["outputs"].get(i) for i in on["outputs"])
    write_result(a.out, result, a.command)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    for m, r in result["runs"].items():
        print(m, {k: r[k] for k in ("wall_s", "tau_first", "tau_last", "head_versions")})
    return 0


def average_heads(dirs: list[Path], out: Path) -> None:
    """The element-wise mean of heads adapted from one head (the same architecture and config), saved to ``out``."""
    import shutil

    from safetensors.torch import load_file, save_file
    states = [load_file(str(d / "model.safetensors")) for d in dirs]
    mean = {k: (sum(s[k].float() for s in states) / len(states)).to(states[0][k].dtype) for k in states[0]}
    out.mkdir(parents=True, exist_ok=True)
    for f in dirs[0].iterdir():
        if f.name not in ("model.safetensors", "model_card.json"):
            shutil.copy(f, out / f.name)
    save_file(mean, str(out / "model.safetensors"), metadata={"format": "pt"})


def cmd_adaptation_merge(a) -> int:
    """Several actors adapt their own copies of one head on one job; then each actor's head, their mean, a head one
    actor adapted on the whole job, and the head they all started from run held-out prompts of the same domain
    (adaptation off): whether merging the actors' heads pays."""
    import json
    import tempfile

    work = Path(a.work_dir or tempfile.mkdtemp(prefix="adaptation-merge-"))
    work.mkdir(parents=True, exist_ok=True)
    prompts = workload_prompts(a.workload, a.num_prompts + a.eval_prompts)
    paths = {"train": work / "train.jsonl", "eval": work / "eval.jsonl"}
    for name, part in (("train", prompts[: a.num_prompts]), ("eval", prompts[a.num_prompts:])):
        with open(paths[name], "w") as f:
            for i, p in enumerate(part):
                f.write(json.dumps({"id": f"{name}{i:05d}", "prompt": p}) + "\n")
    jobs = {"actors": adaptation_run(paths["train"], work / "out-actors", True, a, actors=a.actors,
                                     save_dir=work / "heads-actors")}
    if a.single:
        jobs["single"] = adaptation_run(paths["train"], work / "out-single", True, a, save_dir=work / "heads-single")
    actor_heads = sorted(d for d in (work / "heads-actors").glob("*") if d.is_dir())
    heads = {"base": a.draft or "embedded"}
    heads |= {f"actor{i}": str(d) for i, d in enumerate(actor_heads)}
    if len(actor_heads) > 1:
        average_heads(actor_heads, work / "merged")
        heads["merged"] = str(work / "merged")
    single = sorted((work / "heads-single").glob("*")) if a.single else []
    if single:
        heads["single_actor_all_rows"] = str(single[0])
    scored = {}
    for name, head in heads.items():
        run = adaptation_run(paths["eval"], work / f"eval-{name}", False, a,
                             draft=None if head == "embedded" else head)
        scored[name] = {"tau": run["tau_all"], "wall_s": run["wall_s"], "rows": run["rows"]}
        print(name, scored[name], flush=True)
    result = {"workload": a.workload, "train_prompts": a.num_prompts, "eval_prompts": a.eval_prompts,
              "actors": a.actors, "max_new_tokens": a.max_new_tokens,
              "settings": {"time_share": a.time_share, "lr": a.lr, "round_steps": a.round_steps,
                           "max_batch_size": a.max_batch_size, "dtype": a.dtype, "draft": a.draft or "embedded",
                           "tree": a.tree or "auto"},
              "adaptation_jobs": {k: {"wall_s": r["wall_s"], "tau_first": r["tau_first"], "tau_last": r["tau_last"],
                                      "head_versions": r["head_versions"]} for k, r in jobs.items()},
              "actor_heads_adapted": len(actor_heads), "held_out_tau": scored}
    write_result(a.out, result, a.command)
    print(json.dumps(result["held_out_tau"], indent=1))
    return 0


def add_tau(sub) -> None:
    p = subcommand(sub, "tau", cmd_tau, "tau of several heads x trees x lookups on the same task prompts",
                   out_required=True)
    p.add_argument("--heads", nargs="+", required=True, help="head directories ('embedded' = the shipped head)")
    p.add_argument("--trees", nargs="+", type=tree_name, default=list(TREES),
                   help="names in TREES or total/depth/top_k")
    p.add_argument("--max-step-tokens", type=int, default=None,
                   help="tokens a step may run (default: the device's latency budget, 48 on a CPU, which cuts "
                        "running sequences' trees while long prompts arrive: above batch 1 tau then counts it too)")
    p.add_argument("--tasks", nargs="+", default=["mt_bench", "humaneval"],
                   help=f"bundled tasks ({', '.join(EAGLE_TASKS)}) or name=path.jsonl of EAGLE-style questions")
    p.add_argument("--context-vocab", nargs="+", type=int, default=[256],
                   help="context tokens a sequence adds to its draft vocabulary (0: the map alone); one run each")
    p.add_argument("--lookup", nargs="+", type=int, default=[TreeConfig().lookup],
                   help="prompt-lookup tokens grafted onto each tree (0: the head's tree alone); one run each")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)


def add_top1(sub) -> None:
    p = subcommand(sub, "top1", cmd_top1, "held-out top-1 of several heads per draft step")
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
    p.set_defaults(parser=p)


def add_adaptation_job_args(p, window: int, time_share: float, lr: float, round_steps: int) -> None:
    """The adaptation job's settings (what ``adaptation_run`` reads), with a subcommand's defaults."""
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--window", type=int, default=window, help="rows at each end of a job compared")
    p.add_argument("--time-share", type=float, default=time_share)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--round-steps", type=int, default=round_steps)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto", help="float32: outputs must match token for token")
    p.add_argument("--draft", default=None, help="head dir, or random / random-eagle3 (default: the embedded head)")
    p.add_argument("--tree", type=tree_name, default=None,
                   help="a fixed tree (a name or total/depth/top_k; default: the tuner's trees, measured choice)")
    p.add_argument("--work-dir", default=None, help="where prompts and outputs go (default: a new temp dir)")
    p.add_argument("--max-step-tokens", type=int, default=None,
                   help="tokens a step may run (default: the job's, 256 on a CPU); long prompts' chunks cut trees")
    p.add_argument("--workload", default="sympy_code", choices=DOMAINS,
                   help="one domain's requests (bench/workloads.py)")


def add_adaptation(sub) -> None:
    p = subcommand(sub, "adaptation", cmd_adaptation, "the job with online adaptation off and on, one domain",
                   out_required=True)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--order", nargs="+", default=["off", "on"], choices=["off", "on"])
    add_adaptation_job_args(p, window=200, time_share=0.1, lr=5e-5, round_steps=32)


def add_adaptation_merge(sub) -> None:
    p = subcommand(sub, "adaptation-merge", cmd_adaptation_merge,
                   "actors adapting their own heads on one job: each head, their mean and one actor's on held-out "
                   "prompts", out_required=True)
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=400, help="the job the actors share")
    p.add_argument("--eval-prompts", type=int, default=100, help="held-out prompts each head then runs")
    p.add_argument("--single", action=argparse.BooleanOptionalAction, default=True,
                   help="also adapt one actor on the whole job (what merging tries to reach)")
    add_adaptation_job_args(p, window=50, time_share=0.25, lr=1e-3, round_steps=16)


def main(argv=None) -> int:
    return run_entry(__doc__, SCRIPT, (add_tau, add_top1, add_adaptation, add_adaptation_merge), argv)


if __name__ == "__main__":
    raise SystemExit(main())
