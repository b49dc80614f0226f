"""Self-distillation answers: the embedded target answers ShareGPT turns or code-completion requests (plain
greedy, fp32, batched), appended as token-id shards to a committed set under datasets/selfdistill/ (see
eagle_ray/train/selfdistill.py).

    python jobs/selfdistill.py                       # resume the default set until stopped (Ctrl-C loses < 1 shard)
    python jobs/selfdistill.py --limit 64 --set-dir /tmp/try
    python jobs/selfdistill.py --source python-functions --stop-repeat-ngram 32 \
        --set-dir datasets/selfdistill/python-functions-fp32
"""
from __future__ import annotations

import argparse

from eagle_ray.train.selfdistill import REPO_DATA, generate


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
    p.add_argument("--source", choices=["sharegpt", "python-functions"], default="sharegpt",
                   help="ShareGPT user turns, or code-completion requests made from documented Python functions")
    p.add_argument("--limit", type=int, default=None, help="answers to write in this run (default: all prompts)")
    a = p.parse_args(argv)
    n = generate(a.set_dir, max_batch_size=a.batch_size, max_new_tokens=a.max_new_tokens, dtype=a.dtype,
                 threads=a.threads, shard_rows=a.shard_rows, limit=a.limit, skip_sets=a.skip_sets,
                 stop_repeat_ngram=a.stop_repeat_ngram, second_turns=a.second_turns, source=a.source)
    print(f"wrote {n} answers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
