"""The ``lossless`` subcommand of ``bench/fidelity.py``, in eagle-ray's environment: greedy outputs of speculative
decoding against plain decoding on the same runtime and against transformers ``generate()``, each divergence judged a
near-tie or not, so that a real loss is told apart from a tie the dtype cannot resolve."""
from __future__ import annotations

import json
import sys

import torch
from harness import check_out, command_line, write_result
from workloads import task_records

from eagle_ray.config import EngineConfig, SamplingParams, TreeConfig
from eagle_ray.engine.engine import EagleEngine
from eagle_ray.errors import CheckpointError, ConfigError
from eagle_ray.fidelity import divergence, hf_logits_fn, near_tie, tie_rule
from eagle_ray.prompts import first_turn_prompt


def lossless_engine(args):
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
    bad = [r[key] | {"id": r["id"], "near_tie": near_tie(r[key], dtype, tie_gap)} for r in rows if r.get(key)]
    return {"count": len(bad), "near_ties": sum(b["near_tie"] for b in bad),
            "real": [b for b in bad if not b["near_tie"]], "all": bad}


def lossless_rows(engine, records: list[dict], args) -> list[dict]:
    """Each prompt's speculative output against plain decoding's and ``generate()``'s (``--skip-hf``: not run)."""
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


def run(args) -> None:
    """``cmd_lossless``, with what the user gave wrong said in one line, exit status 2."""
    try:
        cmd_lossless(args)
    except (ConfigError, CheckpointError) as e:
        print(f"bench/fidelity.py lossless: {e}", file=sys.stderr)
        raise SystemExit(2) from None
