"""Feature extraction: run the target over templated conversations and keep what the drafter learns from.

One shard = a fixed, contiguous range of conversation indices, written atomically as safetensors with
``input_ids`` (int32), ``loss_mask`` (uint8), ``hidden`` (the target's final post-norm hidden state, bf16) and
``offsets`` (int64, conversation boundaries). A shard that exists is complete, so a restarted run skips it: every
conversation is written exactly once however often extraction is killed.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import load_file, save_file

from eagle_ray.train.data import iter_json_array, sharegpt_path, to_messages, tokenize_with_loss_mask


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def read_shard(path: str | Path) -> list[dict]:
    """Shard -> list of {input_ids, loss_mask, hidden} per conversation."""
    t = load_file(str(path))
    off = t["offsets"].tolist()
    return [{"input_ids": t["input_ids"][a:b].long(), "loss_mask": t["loss_mask"][a:b],
             "hidden": t["hidden"][a:b], "conv_index": int(t["conv_index"][i]),
             **({"aux": t["aux"][a:b]} if "aux" in t else {})}
            for i, (a, b) in enumerate(zip(off[:-1], off[1:]))]


def token_ids_and_mask(tokenizer, conv, max_len: int) -> tuple[list[int], list[int]]:
    """A conversation as (ids, loss mask): chat messages are templated; a self-distilled row already is token ids
    (``{"prompt_ids", "answer_ids"}``: the answer is what the head learns)."""
    if isinstance(conv, dict) and "answer_ids" in conv:
        ids = list(conv["prompt_ids"]) + list(conv["answer_ids"])
        mask = [0] * len(conv["prompt_ids"]) + [1] * len(conv["answer_ids"])
        return ids[:max_len], mask[:max_len]
    return tokenize_with_loss_mask(tokenizer, conv, max_len)


@torch.inference_mode()
def extract_features(model, tokenizer, conversations: list[tuple[int, object]], max_len: int,
                     capture: tuple[int, ...] | None = None) -> dict:
    """Tensors of one shard for ``conversations`` = [(global index, messages or token ids)]; conversations with no
    learnable token are skipped (recorded nowhere, as they carry no signal). With ``capture`` (an EAGLE-3 head's
    layers) the shard also holds ``aux``: the inputs of those layers, concatenated, from the same forward."""
    device = next(model.parameters()).device
    ids_all, mask_all, hid_all, aux_all, offsets, conv_index = [], [], [], [], [0], []
    for index, conv in conversations:
        ids, mask = token_ids_and_mask(tokenizer, conv, max_len)
        if sum(mask[1:]) == 0:
            continue
        x = torch.tensor([ids], device=device)
        out = model.model(input_ids=x, output_hidden_states=bool(capture))
        hidden = out.last_hidden_state[0]  # post-norm, = hidden_states[-1]
        if capture:  # hidden_states[i] is the input of layer i
            aux_all.append(torch.cat([out.hidden_states[i][0] for i in capture], -1).to("cpu", torch.bfloat16))
        ids_all.append(torch.tensor(ids, dtype=torch.int32))
        mask_all.append(torch.tensor(mask, dtype=torch.uint8))
        hid_all.append(hidden.to("cpu", torch.bfloat16))
        offsets.append(offsets[-1] + len(ids))
        conv_index.append(index)
    d = model.config.hidden_size
    if not ids_all:
        out = {"input_ids": torch.zeros(0, dtype=torch.int32), "loss_mask": torch.zeros(0, dtype=torch.uint8),
               "hidden": torch.zeros(0, d, dtype=torch.bfloat16),
               "offsets": torch.zeros(1, dtype=torch.int64), "conv_index": torch.zeros(0, dtype=torch.int64)}
        if capture:
            out["aux"] = torch.zeros(0, d * len(capture), dtype=torch.bfloat16)
        return out
    out = {"input_ids": torch.cat(ids_all), "loss_mask": torch.cat(mask_all), "hidden": torch.cat(hid_all),
           "offsets": torch.tensor(offsets, dtype=torch.int64), "conv_index": torch.tensor(conv_index)}
    if capture:
        out["aux"] = torch.cat(aux_all)
    return out


def write_shard(out_dir: Path, index: int, tensors: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / shard_name(index)
    tmp = out_dir / f".{shard_name(index)}.tmp{os.getpid()}"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, final)
    return final


def iter_job_output(source: str) -> Iterable[list[dict] | None]:
    """Conversations from a ``jobs/generate.py`` output (self-distillation): the row's messages (or prompt) plus
    the target's own answer, in input order; error rows yield None."""
    import json

    import pyarrow.parquet as pq
    path = Path(source)
    files = sorted(path.glob("part-*.parquet")) if path.is_dir() else [path]
    rows = sorted((r for f in files for r in pq.read_table(f, columns=["row_index", "input", "output", "error"])
                   .to_pylist()), key=lambda r: r["row_index"])
    for r in rows:
        if r["error"] or not r["output"]:
            yield None
            continue
        rec = json.loads(r["input"])
        msgs = rec.get("messages") or [{"role": "user", "content": rec.get("prompt", "")}]
        yield to_messages({"messages": msgs + [{"role": "assistant", "content": r["output"]}]})


def iter_conversations(source: str | None) -> Iterable[list[dict] | dict | None]:
    """Messages per record of ``source`` (None = the ShareGPT wheel; a ShareGPT .json; JSONL of messages; a
    batch-job output directory / .parquet file; or ``selfdistill``: the committed self-distilled answers as token
    ids), None for records without an assistant turn."""
    if source == "selfdistill" or (source is not None and Path(source, "manifest.json").exists()) or \
            (source is not None and list(Path(source).glob("*/manifest.json"))):
        from eagle_ray.train.selfdistill import load_answers
        table = load_answers(None if source == "selfdistill" else source)
        for p, a in zip(table["prompt_ids"].to_pylist(), table["answer_ids"].to_pylist()):
            yield {"prompt_ids": p, "answer_ids": a}
        return
    if source is not None and (Path(source).is_dir() or source.endswith(".parquet")):
        yield from iter_job_output(source)
        return
    if source is None or source.endswith(".json"):
        for rec in iter_json_array(source or sharegpt_path()):
            yield to_messages(rec)
    else:  # JSONL of {"messages": [...]} or ShareGPT records
        import json
        with open(source, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield to_messages(json.loads(line))


def load_target(target: str | None, dtype: str, threads: int | None, storage_options: dict | None = None):
    """(model, tokenizer) of the target for extraction, on CUDA when there is one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle_ray.model.loading import resolve_target
    if threads:
        torch.set_num_threads(threads)
    path = resolve_target(target, storage_options)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    return model, AutoTokenizer.from_pretrained(path)


def pending_shards(source: str | None, max_conversations: int, shard_size: int, skip=lambda shard: False):
    """Stream (shard index, [(conversation index, messages)]) for every shard ``skip`` does not reject.

    A shard covers conversations ``[k * shard_size, (k + 1) * shard_size)``; ``max_conversations`` is rounded down
    to whole shards, so shard ranges never change between runs. The source's last, short shard comes too when it
    holds a conversation to learn from."""
    limit = max_conversations - max_conversations % shard_size
    current, convs, seen = None, [], 0
    for i, msgs in enumerate(iter_conversations(source)):
        if i >= limit:
            break
        seen = i + 1
        shard = i // shard_size
        if shard != current:
            if current is not None and not skip(current):
                yield current, convs
            current, convs = shard, []
        if msgs is not None:
            convs.append((i, msgs))
    if current is not None and not skip(current) and (convs or seen == (current + 1) * shard_size):
        yield current, convs


def run_local(out_dir: str, target: str | None, source: str | None, max_conversations: int, shard_size: int,
              max_len: int, dtype: str, threads: int, worker: int = 0, num_workers: int = 1,
              eagle3: bool = False) -> None:
    """Single-process extraction; ``workers`` processes split the shards by index. Each shard is written
    atomically, so a killed run restarted with the same arguments writes every conversation exactly once."""
    model, tok = load_target(target, dtype, threads)
    capture = None
    if eagle3:
        from eagle_ray.model.eagle3_head import capture_layers
        capture = capture_layers(model.config.num_hidden_layers)
    out = Path(out_dir)
    t0, done_tokens = time.time(), 0
    skip = lambda k: k % num_workers != worker or (out / shard_name(k)).exists()  # noqa: E731
    for shard, batch in pending_shards(source, max_conversations, shard_size, skip):
        tensors = extract_features(model, tok, batch, max_len, capture)
        write_shard(out, shard, tensors)
        done_tokens += len(tensors["input_ids"])
        print(f"shard {shard}: {len(batch)} convs, {len(tensors['input_ids'])} tokens, "
              f"{done_tokens / (time.time() - t0):.0f} tok/s", flush=True)


def _shard_bytes(tensors: dict) -> bytes:
    from safetensors.torch import save
    return save({k: v.contiguous() for k, v in tensors.items()})


class ExtractStage:
    """Ray Data actor for :func:`run_ray`: one target per actor; each input row is one whole shard, written
    atomically (a local rename, or a single S3 PUT) before the row is returned."""

    def __init__(self, target: str | None, dtype: str, threads: int | None, max_len: int, out: str,
                 storage_options: dict):
        import fsspec
        self.model, self.tokenizer = load_target(target, dtype, threads, storage_options)
        self.max_len = max_len
        self.fs, self.root = fsspec.core.url_to_fs(out, **storage_options)
        self.local = "file" in self.fs.protocol

    def __call__(self, batch: dict) -> dict:
        import json
        shards, tokens = [], []
        for shard, convs in zip(batch["shard"], batch["conversations"]):
            tensors = extract_features(self.model, self.tokenizer, [tuple(c) for c in json.loads(convs)],
                                       self.max_len)
            if self.local:
                write_shard(Path(self.root), int(shard), tensors)
            else:
                self.fs.pipe_file(f"{self.root}/{shard_name(int(shard))}", _shard_bytes(tensors))
            shards.append(int(shard))
            tokens.append(len(tensors["input_ids"]))
        return {"shard": shards, "tokens": tokens}


def local_source(source: str | None, storage_options: dict, tmp: str) -> str | None:
    """A local copy of a remote (s3://) source file or job-output directory."""
    if source is None or "://" not in source:
        return source
    import fsspec
    fs, path = fsspec.core.url_to_fs(source, **storage_options)
    dest = Path(tmp) / Path(path.rstrip("/")).name
    fs.get(path, str(dest), recursive=fs.isdir(path))
    return str(dest)


def run_ray(out: str, target: str | None, source: str | None, max_conversations: int, shard_size: int,
            max_len: int, dtype: str, num_actors: int, num_cpus: float, num_gpus: float,
            storage_options: dict | None = None, ray_address: str | None = None, log=print) -> dict:
    """Extraction as a Ray Data job: the driver lists the shards not yet in ``out`` (local or s3://) and streams
    them to an actor pool; restarted with the same arguments it writes only the missing shards, so every
    conversation lands exactly once."""
    import json

    import fsspec
    import ray

    from eagle_ray.cluster import ensure_ray

    storage_options = storage_options or {}
    fs, root = fsspec.core.url_to_fs(out, **storage_options)
    fs.makedirs(root, exist_ok=True)  # a no-op on S3, where a prefix exists once a shard is in it
    fs.invalidate_cache(root)         # fsspec instances are shared: a cached listing would miss new shards
    names = {p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)} if fs.exists(root) else set()
    done = {int(n[6:11]) for n in names if n.startswith("shard-") and n.endswith(".safetensors")}
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        items = [{"shard": k, "conversations": json.dumps(c)} for k, c in
                 pending_shards(local_source(source, storage_options, tmp), max_conversations, shard_size,
                                done.__contains__)]
    log(f"{len(done)} shards already written, {len(items)} to extract")
    if not items:
        return {"written": 0, "tokens": 0, "skipped": len(done)}
    ensure_ray(ray_address)
    ds = ray.data.from_items(items).map_batches(
        ExtractStage, batch_size=1, compute=ray.data.ActorPoolStrategy(size=num_actors), num_cpus=num_cpus,
        num_gpus=num_gpus, fn_constructor_kwargs=dict(target=target, dtype=dtype, max_len=max_len, out=out,
                                                      threads=max(1, int(num_cpus)) if not num_gpus else None,
                                                      storage_options=storage_options))
    written = tokens = 0
    t0 = time.time()
    for row in ds.iter_rows():
        written += 1
        tokens += row["tokens"]
        log(f"shard {row['shard']}: {row['tokens']} tokens ({tokens / (time.time() - t0):.0f} tok/s)")
    return {"written": written, "tokens": tokens, "skipped": len(done)}


def main(argv=None):
    p = argparse.ArgumentParser(description="Extract target features for drafter training (local, resumable).")
    p.add_argument("--out", required=True)
    p.add_argument("--target", default=None)
    p.add_argument("--source", default=None, help="ShareGPT .json, JSONL of messages, a job output, or 'selfdistill' "
                   "(the committed self-distilled token ids); default: the ShareGPT wheel")
    p.add_argument("--max-conversations", type=int, default=20000)
    p.add_argument("--shard-size", type=int, default=32)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--worker", type=int, default=0, help="this process takes shards with index %% workers == worker")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--eagle3", action="store_true", help="also store the three layer inputs an EAGLE-3 head reads")
    a = p.parse_args(argv)
    run_local(a.out, a.target, a.source, a.max_conversations, a.shard_size, a.max_len, a.dtype, a.threads,
              a.worker, a.workers, a.eagle3)


if __name__ == "__main__":
    main()
