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

from eagle_ray.train.data import holds_json_array, iter_json_array, sharegpt_path, to_messages, tokenize_with_loss_mask
from eagle_ray.train.records import differences


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def read_shard(path: str | Path) -> list[dict]:
    """Shard -> list of {input_ids, loss_mask, hidden} per conversation."""
    return split_conversations(load_file(str(path)))


def split_conversations(t: dict) -> list[dict]:
    """Shard tensors (as :func:`extract_features` returns them) -> one dict per conversation (its states are
    views of the shard's)."""
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


def length_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped by length so that a batch's padded size (longest x count) stays within ``batch_tokens``;
    ``batch_tokens <= 0``: one sequence per batch."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, cur = [], []
    for i in order:
        if cur and (batch_tokens <= 0 or lengths[i] * (len(cur) + 1) > batch_tokens):
            batches.append(cur)
            cur = []
        cur.append(i)
    return batches + [cur] if cur else batches


@torch.inference_mode()
def target_states(model, sequences: list[list[int]], capture: tuple[int, ...] | None = None,
                  batch_tokens: int = 0, out_device="cpu") -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(final post-norm hidden state, the ``capture`` layers' inputs concatenated or None) per sequence, bf16 on
    ``out_device``, as views of their batch's output (callers concatenate them). Sequences of similar length share a
    forward (``batch_tokens``, right-padded: causal attention keeps a sequence's states independent of the padding
    after it), which is what makes a GPU fast here."""
    device = next(model.parameters()).device
    out: list = [None] * len(sequences)
    for idx in length_batches([len(s) for s in sequences], batch_tokens):
        n = max(len(sequences[i]) for i in idx)
        x = torch.zeros(len(idx), n, dtype=torch.long)
        for b, i in enumerate(idx):
            x[b, : len(sequences[i])] = torch.tensor(sequences[i])
        res = model.model(input_ids=x.to(device), output_hidden_states=bool(capture))
        hidden = res.last_hidden_state.to(out_device, torch.bfloat16)  # post-norm, = hidden_states[-1]
        aux = torch.cat([res.hidden_states[i] for i in capture], -1).to(out_device, torch.bfloat16) \
            if capture else None  # hidden_states[i] is the input of layer i
        for b, i in enumerate(idx):
            m = len(sequences[i])
            out[i] = (hidden[b, :m], aux[b, :m] if capture else None)
    return out


@torch.inference_mode()
def extract_features(model, tokenizer, conversations: list[tuple[int, object]], max_len: int,
                     capture: tuple[int, ...] | None = None, batch_tokens: int = 0, out_device="cpu") -> dict:
    """Tensors of one shard for ``conversations`` = [(global index, messages or token ids)]; conversations with no
    learnable token are skipped (recorded nowhere, as they carry no signal). With ``capture`` (an EAGLE-3 head's
    layers) the shard also holds ``aux``: the inputs of those layers, concatenated, from the same forward.
    ``batch_tokens``: see :func:`target_states` (0, one conversation per forward, suits a CPU)."""
    rows = []
    for index, conv in conversations:
        ids, mask = token_ids_and_mask(tokenizer, conv, max_len)
        if sum(mask[1:]):
            rows.append((index, ids, mask))
    d = model.config.hidden_size
    if not rows:
        out = {"input_ids": torch.zeros(0, dtype=torch.int32), "loss_mask": torch.zeros(0, dtype=torch.uint8),
               "hidden": torch.zeros(0, d, dtype=torch.bfloat16),
               "offsets": torch.zeros(1, dtype=torch.int64), "conv_index": torch.zeros(0, dtype=torch.int64)}
        if capture:
            out["aux"] = torch.zeros(0, d * len(capture), dtype=torch.bfloat16)
        return out
    states = target_states(model, [ids for _, ids, _ in rows], capture, batch_tokens, out_device)
    offsets = [0]
    for _, ids, _ in rows:
        offsets.append(offsets[-1] + len(ids))
    out = {"input_ids": torch.tensor([t for _, ids, _ in rows for t in ids], dtype=torch.int32, device=out_device),
           "loss_mask": torch.tensor([t for _, _, m in rows for t in m], dtype=torch.uint8, device=out_device),
           "hidden": torch.cat([h for h, _ in states]),
           "offsets": torch.tensor(offsets, dtype=torch.int64), "conv_index": torch.tensor([i for i, _, _ in rows])}
    if capture:
        out["aux"] = torch.cat([a for _, a in states])
    return out


def conversations_in_memory(model, tokenizer, source: str | None, max_len: int,
                            capture: tuple[int, ...] | None = None, batch_tokens: int = 0, device="cpu",
                            chunk: int = 512, limit: int | None = None, log=print) -> list[dict]:
    """Every conversation of ``source`` (see :func:`iter_conversations`) with its target states, held in memory on
    ``device`` instead of written as shards: the form training reads, for a machine that extracts faster than a
    disk round trip is worth (a GPU: one pass over the committed self-distilled set takes minutes)."""
    convs, pending, t0, tokens = [], [], time.time(), 0

    def flush():
        nonlocal tokens
        t = extract_features(model, tokenizer, pending, max_len, capture, batch_tokens, device)
        convs.extend(split_conversations(t))
        tokens += len(t["input_ids"])
        log(f"{len(convs)} conversations, {tokens} tokens, {tokens / (time.time() - t0):.0f} tok/s")
        pending.clear()
    for i, conv in enumerate(iter_conversations(source)):
        if limit is not None and i >= limit:
            break
        if conv is not None:
            pending.append((i, conv))
        if len(pending) == chunk:
            flush()
    if pending:
        flush()
    return convs


def write_shard(out_dir: Path, index: int, tensors: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / shard_name(index)
    tmp = out_dir / f".{shard_name(index)}.tmp{os.getpid()}"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, final)
    return final


def iter_job_output(source: str) -> Iterable[list[dict] | None]:
    """Conversations from a ``jobs/batch.py`` output (self-distillation): the row's messages (or prompt) plus
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


def is_answer_sets(source: str | None) -> bool:
    """Whether ``source`` names self-distilled answer sets: ``selfdistill``, a set, or a directory of sets."""
    return source == "selfdistill" or (source is not None and (Path(source, "manifest.json").exists() or
                                                               any(Path(source).glob("*/manifest.json"))))


def iter_conversations(source: str | None) -> Iterable[list[dict] | dict | None]:
    """Messages per record of ``source`` (None = the ShareGPT wheel; a ShareGPT .json; JSONL of messages; a
    batch-job output directory / .parquet file; or ``selfdistill``: the committed self-distilled answers as token
    ids), None for records without an assistant turn."""
    if is_answer_sets(source):
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
        for record in jsonl_records(Path(source)):
            yield to_messages(record)


def check_source(source: str | None, flag: str = "--source") -> None:
    """Fail before the target loads (and before a feature directory records it) where ``source`` names nothing
    :func:`iter_conversations` can read."""
    if source is None:
        return
    path = Path(source)
    if source != "selfdistill" and not path.exists():
        raise SystemExit(f"{flag} {source} does not exist")
    if is_answer_sets(source):
        from eagle_ray.train.selfdistill import AnswerSetError, read_manifest, set_dirs
        try:   # the manifests now; the shards are checked against them as they are read
            for d in set_dirs(None if source == "selfdistill" else source):
                read_manifest(d)
        except AnswerSetError as e:
            raise SystemExit(f"{flag} {source}: {e}") from None
        return
    if path.is_file() and source.endswith(".json") and not holds_json_array(path):
        raise SystemExit(f"{flag} {source} does not hold a JSON array of conversations")
    if path.is_file() and not source.endswith((".json", ".parquet")):   # JSON lines: its first record, now
        next(iter(jsonl_records(path, 1)), None)


def jsonl_records(path: Path, n: int | None = None) -> Iterable[dict]:
    """The records of a JSON-lines file (the first ``n``), each a JSON object; a line that is not one fails
    naming its line (the features extracted so far are kept: extraction resumes)."""
    import json
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise SystemExit(f"{path}:{lineno}: not a JSON record ({str(e).split(';')[0]})") from None
            if not isinstance(record, dict):
                raise SystemExit(f"{path}:{lineno}: a record must be a JSON object, got {type(record).__name__}")
            yield record
            if n is not None:
                n -= 1
                if n == 0:
                    return


def check_loading_info(path, info: dict) -> None:
    """transformers fills a tensor the files lack (or hold in another shape) with random values and only logs
    it: such a checkpoint is refused, naming the tensors."""
    from eagle_ray.model.decoder import refuse_incomplete
    refuse_incomplete(path, sorted(info.get("missing_keys") or []) + sorted(
        str(k[0] if isinstance(k, (tuple, list)) else k) for k in info.get("mismatched_keys") or []))


def load_target(target: str | None, dtype: str, threads: int | None, storage_options: dict | None = None,
                device: str | None = None):
    """(model, tokenizer) of the target for extraction, on ``device`` (default: CUDA when there is one)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle_ray.model.loading import resolve_target
    if threads:
        torch.set_num_threads(threads)
    path = resolve_target(target, storage_options)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), output_loading_info=True,
                                                       ignore_mismatched_sizes=True, use_safetensors=True)
    check_loading_info(path, info)   # states of randomly filled tensors would train a head on noise
    model = model.to(device).eval()
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
              eagle3: bool = False, batch_tokens: int = 0) -> None:
    """Single-process extraction; ``workers`` processes split the shards by index. Each shard is written
    atomically, so a killed run restarted with the same arguments writes every conversation exactly once.
    ``extraction.json`` records what the shards were made with; extending a directory made otherwise (another
    target, length cap, shard size, source or layer set) is refused, since its shards would be mixed silently."""
    if shard_size < 1 or max_conversations < shard_size or max_len < 2 or not 0 <= worker < num_workers:
        raise SystemExit(f"extract: need shard_size >= 1, max_conversations >= shard_size (whole shards only), "
                         f"max_len >= 2 and 0 <= worker < workers; got {shard_size}, {max_conversations}, {max_len}, "
                         f"{worker}, {num_workers}")
    check_source(source)
    check_extraction_record(Path(out_dir), {"target": str(target or "embedded"), "source": str(source or "sharegpt"),
                                            "max_len": max_len, "shard_size": shard_size, "eagle3": eagle3})
    model, tok = load_target(target, dtype, threads)
    capture = None
    if eagle3:
        from eagle_ray.model.eagle3_head import capture_layers
        capture = capture_layers(model.config.num_hidden_layers)
    out = Path(out_dir)
    t0, done_tokens = time.time(), 0
    skip = lambda k: k % num_workers != worker or (out / shard_name(k)).exists()  # noqa: E731
    for shard, batch in pending_shards(source, max_conversations, shard_size, skip):
        tensors = extract_features(model, tok, batch, max_len, capture, batch_tokens)
        write_shard(out, shard, tensors)
        done_tokens += len(tensors["input_ids"])
        print(f"shard {shard}: {len(batch)} convs, {len(tensors['input_ids'])} tokens, "
              f"{done_tokens / (time.time() - t0):.0f} tok/s", flush=True)


def check_extraction_record(out: Path, record: dict) -> None:
    """Write ``out/extraction.json`` on a directory's first run; on a later one, fail naming what differs."""
    import json
    path = out / "extraction.json"
    if path.exists():
        try:
            before = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"extract: {path} cannot be read ({e})") from None
        diff = differences(before, record)
        if diff:
            raise SystemExit(f"extract: {out} holds shards made otherwise ({'; '.join(diff)}); use another --out")
        return
    if any(out.glob("shard-*.safetensors")):
        raise SystemExit(f"extract: {out} holds shards with no extraction.json: not knowing how they were made, "
                         "this run will not add to them; use another --out")
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".extraction.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)


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
    p.add_argument("--batch-tokens", type=int, default=0,
                   help="run conversations of similar length together, up to this many (padded) tokens a forward "
                   "(0: one at a time; use e.g. 65536 on a GPU)")
    a = p.parse_args(argv)
    from eagle_ray.train.selfdistill import AnswerSetError
    try:
        run_local(a.out, a.target, a.source, a.max_conversations, a.shard_size, a.max_len, a.dtype, a.threads,
                  a.worker, a.workers, a.eagle3, a.batch_tokens)
    except AnswerSetError as e:   # a damaged answer set, named with its file
        raise SystemExit(f"extract: {e}") from None


if __name__ == "__main__":
    main()
