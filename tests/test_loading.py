"""Weights from s3:// (a real S3 API: moto's server on 127.0.0.1) load into the same engine as local files, and a
model cache shared by several processes gives each the source's bytes."""
import os
import time

import pytest
import torch
from cache_sharer import fetch_and_hash
from test_engine import reference_greedy
from tiny import GGUF_VOCAB, make_target, save_gguf

from eagle_ray.config import SamplingParams
from eagle_ray.engine.engine import EagleEngine


def test_target_and_head_from_s3(s3, tiny_dir, tiny_head, tmp_path):
    fs, opts = s3
    tiny_head.save(tmp_path / "head")
    fs.put(str(tiny_dir) + "/", "models/tiny/", recursive=True)
    fs.put(str(tmp_path / "head") + "/", "models/tiny-head/", recursive=True)
    remote = EagleEngine.from_pretrained(target="s3://models/tiny", draft="s3://models/tiny-head", dtype="float32",
                                         max_model_len=128, storage_options=opts)
    local = EagleEngine.from_pretrained(target=str(tiny_dir), draft=str(tmp_path / "head"), dtype="float32",
                                        max_model_len=128)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    prompt = [[5, 6, 7, 8, 9]]
    assert remote.generate(prompt, params)[0].token_ids == local.generate(prompt, params)[0].token_ids
    cached = [c for c in os.listdir(tmp_path / "cache" / "s3") if not c.endswith(".lock")]   # each beside its lock
    assert len(cached) == 2 and all(os.path.exists(tmp_path / "cache" / "s3" / c / ".complete") for c in cached)
    for a, b in zip(remote.draft.state_dict().values(), local.draft.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.slow   # six processes and an S3 server
def test_processes_sharing_a_cache_each_read_the_sources_bytes(s3, tmp_path):
    """Six processes ask for one s3:// model at once, the first to copy it starting a moment later: every one reads files whose hashes
    are the source's, and no reader looking at the cache ever finds an entry marked whole whose files are not (the
    others used to copy into the same folder after the first had marked it, one of six reading a model.safetensors
    another was still writing); the cache holds one whole copy."""
    import hashlib
    import multiprocessing as mp
    import threading
    fs, opts = s3
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(os.urandom(48 << 20))
    (src / "config.json").write_text('{"model_type": "llama"}')
    (src / "tokenizer.json").write_bytes(os.urandom(1 << 20))
    fs.put(str(src) + "/", "models/shared/", recursive=True)
    want = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(src.iterdir())}
    sizes = {f.name: f.stat().st_size for f in src.iterdir()}
    ctx = mp.get_context("spawn")
    asking, copied, results = ctx.Barrier(6), ctx.Event(), ctx.Queue()
    cache = tmp_path / "cache"
    procs = [ctx.Process(target=fetch_and_hash, args=("s3://models/shared", opts, str(cache), i == 0, asking,
                                                       copied, results)) for i in range(6)]
    seen_broken, done = [], threading.Event()

    def watch():   # a reader's view of the cache: an entry marked whole must be whole
        while not done.is_set():   # (a writer's own hidden folder, marked just before its rename, is no entry)
            for entry in (e for e in (cache / "s3").glob("*/.complete") if not e.parent.name.startswith(".")):
                have = {f: (entry.parent / f).stat().st_size if (entry.parent / f).exists() else None
                        for f in sizes}
                if have != sizes:
                    seen_broken.append(have)
            time.sleep(0.002)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    for p in procs:
        p.start()
    try:
        got = [results.get(timeout=600) for _ in procs]
    finally:
        done.set()
        for p in procs:
            p.join(60)
    assert [p.exitcode for p in procs] == [0] * 6
    assert got == [want] * 6 and not seen_broken, seen_broken[:3]
    (entry,) = [p for p in (cache / "s3").iterdir() if not p.name.endswith(".lock")]
    assert sorted(p.name for p in entry.iterdir()) == [".complete", "config.json", "model.safetensors",
                                                       "tokenizer.json"]


def test_a_gguf_target_is_read_once_into_the_cache_and_gives_the_source_models_tokens(tmp_path, monkeypatch):
    """A ``.gguf`` target (the embedded default is one) is read by transformers' GGUF reader into a safetensors copy
    in the model cache on its first use: exactly the source's weights, and tokens the source model itself would
    give. A fresh machine always takes this path, and the reader asks for packages of its own (it refuses to read
    without accelerate), so it runs here from an empty cache."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("EAGLE_RAY_CACHE", str(tmp_path / "cache"))
    source = make_target(vocab_size=GGUF_VOCAB)
    save_gguf(tmp_path / "tiny.gguf", source)
    engine = EagleEngine.from_pretrained(target=str(tmp_path / "tiny.gguf"), draft="random", dtype="float32",
                                         max_model_len=128)
    (copy,) = [d for d in (tmp_path / "cache").iterdir() if d.name.startswith("tiny-") and d.is_dir()]
    read = AutoModelForCausalLM.from_pretrained(copy, dtype=torch.float32).state_dict()
    assert read.keys() == source.state_dict().keys()
    assert all(torch.equal(read[k], w) for k, w in source.state_dict().items())
    prompt = engine.tokenizer("hello world").input_ids
    assert engine.tokenizer.decode(prompt) == "hello world"
    out = engine.generate([prompt], SamplingParams(max_new_tokens=24, ignore_eos=True))[0].token_ids
    assert out == reference_greedy(source, prompt, 24)
