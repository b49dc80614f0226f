"""The GPU step, measured in one command that downloads nothing (about 6 minutes on an H100 or H200).

Builds random-weight targets of Llama-3.2-1B and Llama-3.1-8B shape on the device, each with a random EAGLE-2 head,
and writes one JSON line per section to ``--out`` as it goes (a cut run still reports what it measured):

- ``versions``: torch, CUDA, cuDNN, the device;
- ``sdpa_choice``: which SDPA kernel torch picks (``torch._fused_sdp_choice``) for the engine's attention shapes,
  left to itself and under the engine's kernel choice (``model/numerics.py`` ``attention_kernels``);
- ``probe``: decode-step times at batch 1 with each suspect removed in turn: the default engine, the same prompt
  again, cuDNN attention off, key lengths bucketed, fused layers (is a step slow because of a per-shape build?);
- ``joined_step``: a step where a new prompt arrives while sequences decode with EAGLE: its chunk in the decode rows'
  target pass (each weight read once; the default) or in a pass of its own before them, at the largest shape;
- ``shapes``: distinct (batch, tokens, key length) shapes of the target over the run's decode steps;
- ``step_times`` (per shape): for each mode {eager with the modules' layers, eager with fused layers (SDPA, and
  flex tree attention: each row reads its own slot only), graphs (the fused target's decode passes and the head's
  draft loop as CUDA graphs captured by hand, ``model/graphs.py``, ``engine/draft_graphs.py``; on a CPU their
  replay stand-in)} x
  {plain, EAGLE depth 3 / 16-token verify} x batch: median, p90 and first step ms, draft and verify ms (CUDA
  events), tokens/s, achieved GB/s = (weights + K/V read) / step time;
- ``launches``: kernels per decode step (torch.profiler over 3 steps), per mode;
- ``host_reads``: reads back and blocking copies per decode step (``engine/host_reads.py``; the budget is 2);
- ``memory``: peak memory per mode, the graph pool's growth, graphs captured, replays and decode passes left eager;
- ``fused_ops``: whether RoPE and SwiGLU (``model/kernels.py``) run as compiled kernels, or why not;
- ``fidelity``: fp32 greedy equality at the 1B shape (EAGLE = plain, fused = modules, flex = modules, graphs =
  eager for EAGLE and plain decoding), and with
  ``--embedded-gguf`` the embedded pair's EAGLE against transformers ``generate()``;
- ``verdicts``: PASS / FAIL lines for the GPU step's targets (8B, bf16, batch 1: plain <= 5.0 ms on an H200,
  6.5 ms on an H100; EAGLE <= 8 / 10 ms; graphs >= 3x eager; plain at batch 64 >= 60% of the memory bandwidth).

    python bench/gpu_step.py --out $OUT/gpu_step.jsonl                  # on a machine with a GPU
    python bench/gpu_step.py --device cpu --shapes tiny --dtype float32 --out /tmp/gpu_step.jsonl   # the CPU smoke run

Copy the file to ``bench/results/<gpu>/gpu_step.jsonl`` and commit it. ``bench/costs.py`` holds the CPU's cost tables.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

SHAPES = {  # the published configurations' sizes
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False),
}
EAGLE_TREE = dict(total_tokens=16, depth=3, top_k=4, lookup=0)   # depth 3, a 16-token verify
BANDWIDTH_GBS = {"H200": 4800, "H100": 3350}                       # HBM3e / HBM3, the data sheets' figures
TARGETS_MS = {"H200": {"plain": 5.0, "eagle": 8.0}, "H100": {"plain": 6.5, "eagle": 10.0}}


class Report:
    """JSON lines to ``out`` (flushed after each) and a short line each to stdout."""

    def __init__(self, out: Path, command: str):
        self.out = out
        self.command = command
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("")
        self.lines: list[dict] = []

    def write(self, section: str, **fields) -> dict:
        line = {"section": section, **fields}
        self.lines.append(line)
        with self.out.open("a") as f:
            f.write(json.dumps(line, default=str) + "\n")
        print(json.dumps(line, default=str)[:400], flush=True)
        return line


# ---- building ----------------------------------------------------------------------------------------------------
def word_tokenizer(vocab_size: int):
    """A word-level tokenizer of ``vocab_size`` ids (outputs are detokenised; no tokenizer is downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ["<unk>", "</s>", "<s>"] + [f"w{i}" for i in range(vocab_size - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>", bos_token="<s>")


def random_target(shape: str, device, dtype, logit_scale: float = 8.0):
    """A transformers Llama of ``shape``'s sizes, random weights made on the device in its dtype (no fp32 copy of
    8B); its logits scaled up so that greedy near-ties are rare."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=2,
                      eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        hf.lm_head.weight.mul_(logit_scale)
    return hf


def build_engine(hf, device, dtype, max_batch_size: int, max_model_len: int, fused="auto", tree=None,
                 tree_attention="sdpa"):
    """An engine over ``hf`` (its layers fused at most once: a fused model keeps its merged weights) with a random
    EAGLE-2 head."""
    from eagle_ray.config import EngineConfig, TreeConfig
    from eagle_ray.engine.engine import EagleEngine
    from eagle_ray.model.draft_head import DraftHead
    from eagle_ray.model.target import TargetModel
    import torch
    config = EngineConfig(dtype=str(dtype).replace("torch.", ""), device=str(device), max_batch_size=max_batch_size,
                          max_model_len=max_model_len, tree=TreeConfig(**(tree or EAGLE_TREE)), fused_layers=fused,
                          cpu_linears="native", tree_attention=tree_attention)   # the GPU's layout; on a CPU the smoke run keeps ``hf`` as built
    target = TargetModel(hf, max_batch_size, max_model_len, **config.precision.model_dump())
    torch.manual_seed(1)
    head = DraftHead.for_target(hf.config)
    head.embed_tokens.weight.data.copy_(hf.model.embed_tokens.weight)
    return EagleEngine(target, head.to(device=device, dtype=dtype).eval(), word_tokenizer(hf.config.vocab_size), config)


def sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize()


def prompts_of(engine, batch: int, length: int, seed: int = 0) -> list[list[int]]:
    import torch
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, engine.target.vocab_size, (length,), generator=g).tolist() for _ in range(batch)]


def decode_steps(engine, prompts, steps: int, speculative: bool, measure=None, span=None) -> list[float]:
    """Prefill ``prompts``, one warm-up step, then ``steps`` decode steps: their wall times (ms, synchronised), each
    step wrapped by ``measure`` and all of them by ``span`` (context manager factories) where given."""
    from eagle_ray.config import SamplingParams
    params = SamplingParams(max_new_tokens=10**6, ignore_eos=True)
    seqs = [engine.add_request(p, params, speculative=speculative) for p in prompts]
    while engine.scheduler.prefilling or engine.scheduler.waiting:
        engine.step()
    engine.step()
    times = []
    with (span() if span else contextlib.nullcontext()):
        for _ in range(steps):
            sync(engine.device)
            t = time.perf_counter()
            with (measure() if measure else contextlib.nullcontext()):
                engine.step()
            sync(engine.device)
            times.append(1e3 * (time.perf_counter() - t))
    for s in seqs:
        engine.abort(s.request_id)
    return times


def summary_ms(times: list[float]) -> dict:
    ordered = sorted(times)
    return {"first_ms": round(times[0], 3), "median_ms": round(statistics.median(times), 3),
            "p90_ms": round(ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)], 3)}


def weight_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


# ---- sections ------------------------------------------------------------------------------------------------------
def versions(report: Report, device) -> None:
    import torch
    import transformers

    from eagle_ray.model.device import cpu_model, device_name
    report.write("versions", command=report.command, device=device_name(device), cpu=cpu_model(),
                 torch=torch.__version__, transformers=transformers.__version__, cuda=torch.version.cuda,
                 cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)


def sdpa_choice(report: Report, device, dtype, shape: str) -> None:
    """The kernel torch picks for the engine's folded grouped-query attention (codes: torch's SDPBackend)."""
    import torch

    from eagle_ray.model.numerics import attention_kernels
    cfg = SHAPES[shape]
    heads, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"] // cfg[
        "num_attention_heads"]
    rep = heads // kv
    rows = []
    for batch, tokens, keys in ((1, 1, 300), (1, 16, 300), (32, 16, 1100)):
        q = torch.randn(batch, kv, rep * tokens, d, device=device, dtype=dtype)
        k = torch.randn(batch, kv, keys, d, device=device, dtype=dtype)
        mask = torch.ones(batch, 1, rep * tokens, keys, device=device, dtype=torch.bool)
        left = int(torch._fused_sdp_choice(q, k, k, mask))
        with attention_kernels(device):
            chosen = int(torch._fused_sdp_choice(q, k, k, mask))
        rows.append({"batch": batch, "tokens": tokens, "keys": keys, "default": left, "engine": chosen})
    from torch.nn.attention import SDPBackend
    names = {int(getattr(SDPBackend, n)): n for n in dir(SDPBackend) if n.isupper()}
    report.write("sdpa_choice", shape=shape, rows=rows, backends=names)


def probe(report: Report, hf, device, dtype, a) -> None:
    """Batch-1 plain decode steps with each suspect of a slow step removed in turn."""
    import torch
    engine = build_engine(hf, device, dtype, 1, a.max_model_len, fused=False)
    prompt = prompts_of(engine, 1, 32)
    runs = {}

    def run(label):
        runs[label] = [round(t, 2) for t in decode_steps(engine, prompt, a.probe_steps, speculative=False)]

    engine.target.cache.kv_bucket = engine.draft.cache.kv_bucket = 1
    with contextlib.nullcontext():
        run("default, every key length new")
        run("same prompt again: the same shapes")
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
        try:
            run("cudnn attention off")
        finally:
            torch.backends.cuda.enable_cudnn_sdp(True)
    engine.target.cache.kv_bucket = engine.draft.cache.kv_bucket = 256
    run("key lengths in buckets of 256")
    fused = build_engine(hf, device, dtype, 1, a.max_model_len, fused=True)
    runs["fused layers, buckets"] = [round(t, 2) for t in decode_steps(fused, prompt, a.probe_steps, False)]
    medians = {k: statistics.median(v) for k, v in runs.items()}
    first, again = medians["default, every key length new"], medians["same prompt again: the same shapes"]
    cause = ("a build per new shape (cuDNN attention): the same shapes again are fast"
             if again < 0.5 * first else "not a per-shape build: the same shapes again are as slow")
    report.write("probe", steps_ms=runs, median_ms=medians, cause=cause)
    del engine, fused


def joined_step(report: Report, hf, shape: str, device, dtype, a, chunk: int = 512, arrivals: int = 4) -> None:
    """Steps in which a ``chunk``-token prompt arrives while ``batch`` sequences decode with EAGLE: the chunk joins
    the decode rows' target pass (``StepPlan.one_pass``) or runs in a pass of its own first."""
    from eagle_ray.config import SamplingParams
    batches = sorted({min(a.batches), max(b for b in a.batches if b <= 32)})
    engine = build_engine(hf, device, dtype, batches[-1] + 1, a.max_model_len, fused=True)
    rows = []
    for batch in batches:
        for one_pass in (True, False):
            engine.scheduler.one_pass = one_pass
            params = SamplingParams(max_new_tokens=10**6, ignore_eos=True)
            seqs = [engine.add_request(p, params) for p in prompts_of(engine, batch, a.context // 4)]
            while engine.scheduler.prefilling or engine.scheduler.waiting:
                engine.step()
            engine.step()
            joined, alone = [], []
            for k in range(arrivals):
                new = engine.add_request(prompts_of(engine, 1, chunk, seed=k + 1)[0], params)
                sync(device)
                t = time.perf_counter()
                engine.step()
                sync(device)
                joined.append(1e3 * (time.perf_counter() - t))
                engine.abort(new.request_id)
                sync(device)
                t = time.perf_counter()
                engine.step()
                sync(device)
                alone.append(1e3 * (time.perf_counter() - t))
            for s in seqs:
                engine.abort(s.request_id)
            engine.step()
            rows.append({"batch": batch, "one_pass": one_pass, "chunk": chunk,
                         "step_with_chunk_ms": round(statistics.median(joined), 3),
                         "decode_step_ms": round(statistics.median(alone), 3)})
    engine.scheduler.one_pass = True
    report.write("joined_step", shape=shape, rows=rows)
    del engine


def step_times(report: Report, hf, shape: str, device, dtype, a) -> dict:
    """Decode-step times per mode, decoding and batch size; launches, host reads and memory per mode."""
    import torch

    from eagle_ray.engine.host_reads import count_host_reads
    rows, launches, reads, memory, shapes_seen = [], [], [], [], set()
    modes = ["eager-modules", "eager-fused", "eager-fused-flex"] + (["graphs"] if shape in a.graphs else [])
    weights = weight_bytes(hf)
    deadline = time.perf_counter() + a.section_seconds
    for mode in modes:
        if time.perf_counter() > deadline:
            report.write("step_times_cut", shape=shape, mode=mode, reason="section time spent")
            break
        fused = mode != "eager-modules"
        engine = build_engine(hf, device, dtype, max(a.batches), a.max_model_len, fused=fused,
                              tree_attention="flex" if mode.endswith("flex") else "sdpa")
        pool_before = torch.cuda.memory_reserved() if device.type == "cuda" else 0
        if mode == "graphs":   # captured by hand (model/graphs.py); on a CPU its replay stand-in (the smoke run)
            from eagle_ray.model.graphs import DecodeGraphs
            from eagle_ray.engine.draft_graphs import DraftGraphs
            backend = "cuda" if device.type == "cuda" else "replay"
            engine.target.graphs = DecodeGraphs(engine.target, engine.target.cache.num_slots, backend=backend)
            engine.runner.draft_graphs = DraftGraphs(engine.draft, engine.target.cache.num_slots,
                                                     engine.runner.context_vocab, backend=backend)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        head = weight_bytes(engine.draft)
        kv_token = engine.target.cache.k[:, :1, :, :1].numel() * engine.target.cache.k.element_size() * 2
        for decode in ("plain", "eagle"):
            for batch in a.batches:
                engine.runner.profile = True
                prompts = prompts_of(engine, batch, a.context, seed=batch)
                phase = {"draft_s": 0.0, "verify_s": 0.0, "steps": 0, "tokens": 0}

                def measure():
                    return _PhaseTimes(engine, phase)

                times = decode_steps(engine, prompts, a.steps, decode == "eagle", measure)
                engine.runner.profile = False
                ms = statistics.median(times)
                kv_read = batch * (a.context + 16) * kv_token
                row = {"mode": mode, "decode": decode, "batch": batch, "context": a.context, **summary_ms(times),
                       "draft_ms": round(1e3 * phase["draft_s"] / max(phase["steps"], 1), 3),
                       "verify_ms": round(1e3 * phase["verify_s"] / max(phase["steps"], 1), 3),
                       "tokens_per_s": round(1e3 * phase["tokens"] / max(sum(times), 1e-9), 1),
                       "gb_per_s": round((weights + (head if decode == "eagle" else 0) + kv_read) / ms / 1e6, 1)}
                rows.append(row)
                report.write("step", shape=shape, **row)
        launches.append({"mode": mode, **count_launches(engine, device, a)})
        counted = []
        decode_steps(engine, prompts_of(engine, 2, 32), 1, True, measure=lambda: _Kept(count_host_reads(), counted))
        reads.append({"mode": mode, "per_step": counted[0].count, "sites": counted[0].by_site()})
        shapes_seen |= engine_shapes(engine, a)
        memory.append({"mode": mode, "peak_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1)
                       if device.type == "cuda" else None,
                       "pool_growth_mib": round((torch.cuda.memory_reserved() - pool_before) / 2**20, 1)
                       if device.type == "cuda" else None})
        if mode == "graphs":   # every decode pass replayed a graph: eager ones are the skips
            graphs = engine.target.graphs
            memory[-1].update(graphs=len(graphs.graphs), replays=graphs.replays, eager_decode_passes=graphs.skipped,
                              draft_graphs=len(engine.runner.draft_graphs.graphs),
                              draft_replays=engine.runner.draft_graphs.replays)
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report.write("step_times", shape=shape, rows=rows, weights_gb=round(weights / 1e9, 3))
    report.write("launches", shape=shape, rows=launches)
    report.write("host_reads", shape=shape, rows=reads)
    report.write("memory", shape=shape, rows=memory)
    report.write("shapes", shape=shape, distinct=len(shapes_seen), shapes=sorted(shapes_seen)[:64])
    from eagle_ray.model import kernels
    report.write("fused_ops", shape=shape, status=dict(kernels.compiled_status))   # compiled, or why eager
    return {"rows": rows}


class _PhaseTimes:
    """Adds one step's draft and verify seconds (CUDA events where the runner profiles) and emitted tokens."""

    def __init__(self, engine, acc: dict):
        self.engine, self.acc = engine, acc

    def __enter__(self):
        self.before = sum(len(s.output_ids) for s in self.engine.scheduler.running)
        return self

    def __exit__(self, *exc):
        t = self.engine.runner.times
        self.acc["draft_s"] += t.draft_s
        self.acc["verify_s"] += t.verify_s
        self.acc["steps"] += 1
        self.acc["tokens"] += sum(len(s.output_ids) for s in self.engine.scheduler.running) - self.before
        return False


def count_launches(engine, device, a) -> dict:
    """Kernels per decode step at batch 1 (torch.profiler over 3 steps): device kernels on CUDA, operators on CPU."""
    import torch
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    out = {}
    for decode in ("plain", "eagle"):
        profiled = []
        decode_steps(engine, prompts_of(engine, 1, 32), 3, decode == "eagle",
                     span=lambda: _Kept(torch.profiler.profile(activities=activities), profiled))
        events = profiled[0].events()
        if device.type == "cuda":
            kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        else:
            kernels = [e for e in events if e.name.startswith("aten::") and e.cpu_parent is None]
        out[decode] = round(len(kernels) / 3, 1)
    out["unit"] = "CUDA kernels per step" if device.type == "cuda" else "top-level aten operators per step"
    return out


class _Kept:
    """A context manager that also keeps what it yields in ``into`` (for factories passed to ``decode_steps``)."""

    def __init__(self, inner, into: list):
        self.inner, self.into = inner, into

    def __enter__(self):
        self.into.append(self.inner.__enter__())
        return self.into[-1]

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


@contextlib.contextmanager
def decode_shapes(engine):
    """Collects (batch, tokens, key length) of the target's forwards while no prompt is prefilling."""
    seen, run_block = set(), engine.target.run_block

    def recording(tokens, depth, meta, capture=False):
        if not engine.scheduler.prefilling:
            seen.add((tokens.shape[0], tokens.shape[1], meta.kv_len))
        return run_block(tokens, depth, meta, capture)

    engine.target.run_block = recording
    try:
        yield seen
    finally:
        engine.target.run_block = run_block


def engine_shapes(engine, a) -> set:
    """(batch, tokens, key length) of the target's decode forwards over a plain run of ``a.steps * 4`` tokens."""
    with decode_shapes(engine) as seen:
        decode_steps(engine, prompts_of(engine, 1, 24), a.steps * 4, speculative=False)
    return seen


def fidelity(report: Report, device, a) -> None:
    """fp32 greedy equality on random prompts: EAGLE against plain, fused layers against the modules' layers."""
    import torch

    from eagle_ray.config import SamplingParams
    shape = "tiny" if "tiny" in a.shapes else "llama-3.2-1b"
    hf = random_target(shape, device, torch.float32)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, hf.config.vocab_size, (16 + 8 * (i % 5),), generator=g).tolist()
               for i in range(a.prompts)]
    params = SamplingParams(max_new_tokens=a.tokens, ignore_eos=True)
    modules = build_engine(hf, device, torch.float32, 8, a.max_model_len, fused=False)
    plain = [o.token_ids for o in modules.generate(prompts, params, speculative=False)]
    eagle = [o.token_ids for o in modules.generate(prompts, params)]
    del modules
    fused = build_engine(hf, device, torch.float32, 8, a.max_model_len, fused=True)
    fused_eagle = [o.token_ids for o in fused.generate(prompts, params)]
    del fused
    flex = build_engine(hf, device, torch.float32, 8, a.max_model_len, fused=True, tree_attention="flex")
    flex_eagle = [o.token_ids for o in flex.generate(prompts, params)]
    del flex
    from eagle_ray.model.graphs import DecodeGraphs
    graphed = build_engine(hf, device, torch.float32, 8, a.max_model_len, fused=True)
    from eagle_ray.engine.draft_graphs import DraftGraphs
    backend = "cuda" if device.type == "cuda" else "replay"
    graphed.target.graphs = DecodeGraphs(graphed.target, 8, backend=backend)
    graphed.runner.draft_graphs = DraftGraphs(graphed.draft, 8, graphed.runner.context_vocab, backend=backend)
    graphs_eagle = [o.token_ids for o in graphed.generate(prompts, params)]
    graphs_plain = [o.token_ids for o in graphed.generate(prompts, params, speculative=False)]
    report.write("fidelity", shape=shape, prompts=len(prompts), tokens=a.tokens,
                 eagle_equals_plain=sum(x == y for x, y in zip(eagle, plain)),
                 fused_equals_modules=sum(x == y for x, y in zip(fused_eagle, plain)),
                 flex_equals_modules=sum(x == y for x, y in zip(flex_eagle, plain)),
                 graphs_equal_eager=min(sum(x == y for x, y in zip(graphs_eagle, plain)),
                                        sum(x == y for x, y in zip(graphs_plain, plain))),
                 graph_replays=graphed.target.graphs.replays)
    if a.embedded_gguf:
        embedded_against_generate(report, device, a)


def embedded_against_generate(report: Report, device, a) -> None:
    """The embedded pair (its GGUF carried to this machine) against transformers ``generate()``, fp32 greedy."""
    import torch

    from eagle_ray.config import SamplingParams
    from eagle_ray.engine.engine import EagleEngine
    if not Path(a.embedded_gguf).is_file():
        report.write("embedded", skipped=f"{a.embedded_gguf} is not a file")
        return
    engine = EagleEngine.from_pretrained(a.embedded_gguf, dtype="float32", device=str(device), max_batch_size=8)
    hf = engine.reference_model()
    prompts = [[{"role": "user", "content": f"Write a short note about topic number {i}."}] for i in range(8)]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=64))
    same = 0
    for o in outs:
        ids = torch.tensor([o.prompt_token_ids], device=device)
        ref = hf.generate(ids, max_new_tokens=64, do_sample=False)[0, ids.shape[1]:].tolist()
        same += ref[: len(o.token_ids)] == o.token_ids
    report.write("embedded", prompts=len(outs), equal=same,
                 tau=round(sum(o.stats.tau for o in outs) / len(outs), 3))


def verdicts(report: Report, device) -> None:
    """PASS / FAIL for the GPU step's targets, from the lines written so far."""
    from eagle_ray.model.device import device_name
    name = device_name(device)
    gpu = next((g for g in TARGETS_MS if g in name), None)
    steps = [line for line in report.lines if line["section"] == "step" and line.get("shape") == "llama-3.1-8b"]
    lines = []

    def median(mode, decode, batch):
        row = next((r for r in steps if (r["mode"], r["decode"], r["batch"]) == (mode, decode, batch)), None)
        return None if row is None else row["median_ms"]

    if gpu:
        for decode in ("plain", "eagle"):
            best = min((m for m in (median(mode, decode, 1) for mode in ("eager-fused", "graphs")) if m), default=None)
            target = TARGETS_MS[gpu][decode]
            lines.append(f"{'PASS' if best is not None and best <= target else 'FAIL'} 8B {decode} step at batch 1: "
                         f"{best} ms (target <= {target} ms on an {gpu})")
        eager, graphs = median("eager-fused", "plain", 1), median("graphs", "plain", 1)
        left = next((r.get("eager_decode_passes") for line in report.lines if line["section"] == "memory"
                     and line.get("shape") == "llama-3.1-8b" for r in line["rows"] if r["mode"] == "graphs"), None)
        ok = eager and graphs and eager / graphs >= 3 and left == 0
        lines.append(f"{'PASS' if ok else 'FAIL'} graphs >= 3x eager at batch 1 (8B): {eager} / {graphs} ms, "
                     f"decode passes left eager: {left}")
        wide = next((r for r in steps if (r["decode"], r["batch"]) == ("plain", 64)), None)
        if wide:
            share = wide["gb_per_s"] / BANDWIDTH_GBS[gpu]
            lines.append(f"{'PASS' if share >= 0.6 else 'FAIL'} plain batch 64 at 1k context: {wide['gb_per_s']} "
                         f"GB/s = {share:.0%} of {BANDWIDTH_GBS[gpu]} GB/s")
    fid = next((line for line in report.lines if line["section"] == "fidelity"), None)
    if fid:
        ok = fid["eagle_equals_plain"] == fid["fused_equals_modules"] == fid["flex_equals_modules"] == \
            fid["graphs_equal_eager"] == fid["prompts"]
        lines.append(f"{'PASS' if ok else 'FAIL'} fp32 greedy equality: EAGLE = plain {fid['eagle_equals_plain']}/"
                     f"{fid['prompts']}, fused = modules {fid['fused_equals_modules']}/{fid['prompts']}, flex = "
                     f"modules {fid['flex_equals_modules']}/{fid['prompts']}, graphs (EAGLE and plain) = eager "
                     f"{fid['graphs_equal_eager']}/{fid['prompts']}")
    report.write("verdicts", device=name, lines=lines)


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="llama-3.2-1b,llama-3.1-8b", help=f"comma list of {sorted(SHAPES)}")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens before the timed decode steps")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per row")
    p.add_argument("--probe-steps", type=int, default=12)
    p.add_argument("--prompts", type=int, default=16, help="fidelity: prompts")
    p.add_argument("--tokens", type=int, default=32, help="fidelity: new tokens per prompt")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--section-seconds", type=float, default=150, help="step times per shape stop after this")
    p.add_argument("--graphs", default=",".join(SHAPES), help="shapes that also run the CUDA-graph mode; '' for none")
    p.add_argument("--embedded-gguf", default=None, help="the embedded target's GGUF, carried to this machine")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    try:
        a.batches = [int(x) for x in a.batches.split(",")]
    except ValueError as e:
        p.error(f"--batches is a comma list of whole numbers ({e})")
    a.shapes, a.graphs = a.shapes.split(","), [g for g in a.graphs.split(",") if g]
    unknown = sorted(set(a.shapes) - set(SHAPES))
    if unknown:
        p.error(f"--shapes: unknown {unknown}; choose from {sorted(SHAPES)}")
    a.max_model_len = max(a.max_model_len, a.context + 64)

    import torch
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    report = Report(Path(a.out), "bench/gpu_step.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    versions(report, device)
    for shape in a.shapes:
        sdpa_choice(report, device, dtype, shape)
    biggest = a.shapes[-1]
    hf = random_target(biggest, device, dtype)
    probe(report, hf, device, dtype, a)
    joined_step(report, hf, biggest, device, dtype, a)
    for shape in a.shapes[::-1]:
        hf = hf if shape == biggest else random_target(shape, device, dtype)
        step_times(report, hf, shape, device, dtype, a)
        del hf
        hf = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    fidelity(report, device, a)
    verdicts(report, device)
    return report.out


if __name__ == "__main__":
    main()
