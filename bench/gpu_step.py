"""The GPU step, measured in one command inside a budget (``--budget-s``, 540 s from the script's start by default: a
minute under a device machine's 10-minute cap). Nothing is downloaded and nothing installed: run from the repository
root (``bench/device/run.sh`` is the device command, docs/benchmarks.md "How to run the GPU script").

Builds random-weight targets of Llama-3.2-1B and Llama-3.1-8B shape on the device (the last of ``--shapes`` is the
main shape), one random EAGLE-2 head per shape and dtype (on the device, in the run's dtype, reused by every engine),
and writes one JSON line per measurement to ``--out`` as it goes. Sections run in priority order, each followed by a
``verdicts`` line with what can be read so far, so a run cut short still says what it found:

1. ``versions``: torch, CUDA, cuDNN, Triton, the device;
2. ``bandwidth``: a device-to-device copy, timed (bytes read + bytes written per second): the bandwidth verdicts
   read this, not a data sheet;
3. ``key_steps``: the main shape at the smallest and the largest batch in graphs (the fused target's decode passes
   and the head's draft loop as CUDA graphs captured by hand, ``model/graphs.py``, ``model/draft_graphs.py``; on a
   CPU their replay stand-in) and fused eager, and eager with the modules' layers at the smallest batch: ``step``
   lines with median, p90 and first step ms, draft and verify ms (CUDA events), tokens/s, achieved GB/s = (weights +
   K/V read) / step time; an ``engine`` line per engine (build seconds, peak memory, graph pool, graphs captured,
   replays, decode passes left eager, memory left after the engine is dropped);
4. ``fidelity``: fp32 greedy equality at the first shape (EAGLE = plain, fused = modules, graphs = eager for EAGLE
   and for plain decoding), and with ``--embedded-gguf`` the embedded pair's EAGLE against transformers
   ``generate()``;
5. ``probe``: which SDPA kernel torch picks at the engine's attention shapes (``sdpa_choice``), then batch-1 plain
   decode steps of the main shape with the device table as it is against torch's own SDPA choice (cuDNN allowed)
   with every key length new, the same shapes again, and key lengths in buckets: is a slow step a per-shape build?
6. ``rest``: every other batch and mode of the main shape, each mode's ``launches`` (host-side kernel launches per
   decode step from the profiler's CPU events: a replayed graph is one launch), ``host_reads`` and ``shapes``; the
   ``joined_step`` (a prompt chunk arriving while sequences decode: in their target pass or in one of its own);
   ``compiles`` (the fused operations' and Inductor's compile reports); the other shapes;
7. ``flex``: fused layers with flex tree attention (each row reads its own slot only) at every shape and batch, and
   its fp32 equality.

Every section checks the budget before each engine, batch and mode it starts (estimates: 1.5x what the same work
took earlier in the run, else ``COST_S``); what would start past the budget is written as skipped, with the reason.

    bash bench/device/run.sh                                           # the device command (output under $OUT)
    python bench/gpu_step.py --device cpu --shapes tiny --dtype float32 --out /tmp/gpu_step.jsonl   # the CPU smoke run

Copy the file to ``bench/results/<gpu>/gpu_step.jsonl`` and commit it. ``bench/costs.py`` holds the CPU's cost tables.
"""
from __future__ import annotations

import time

START = time.monotonic()   # the budget counts from the script's start, before torch loads

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

import repo_root  # noqa: E402,F401 - the repository root on the import path: nothing is installed on a device machine

SHAPES = {  # the published configurations' sizes
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False),
}
EAGLE_TREE = dict(total_tokens=16, depth=3, top_k=4, lookup=0)   # depth 3, a 16-token verify
TARGETS_MS = {"H200": {"plain": 5.0, "eagle": 8.0}, "H100": {"plain": 6.5, "eagle": 10.0}}   # 8B bf16, batch 1
GRAPHS_OVER_MODULES = 3.0   # graphs' batch-1 step at least this many times faster than eager modules'
BANDWIDTH_SHARE = 0.6       # plain decoding at the largest batch reads at least this share of the measured bandwidth
MODES = ("graphs", "eager-fused", "eager-modules")   # the flex mode runs in its own section, last
DEFAULT_BUDGET_S = 540.0
# Seconds a piece of work is assumed to take before the run has timed one like it (then 1.5x the time it took),
# set on the high side for an H100/H200 (the 1B and 8B shapes) and a 2-core CPU (the tiny one).
COST_S = {
    "llama-3.1-8b": {"target": 40, "engine": 30, "graphs": 60, "flex": 120, "row": 30, "extras": 40, "probe": 40,
                     "fidelity": 120, "joined": 60},
    "llama-3.2-1b": {"target": 15, "engine": 15, "graphs": 40, "flex": 90, "row": 15, "extras": 25, "probe": 20,
                     "fidelity": 60, "joined": 30},
    "tiny": {"target": 2, "engine": 2, "graphs": 4, "flex": 10, "row": 5, "extras": 10, "probe": 10, "fidelity": 30,
             "joined": 10},
}


def cost_s(shape: str, what: str) -> float:
    return COST_S.get(shape, COST_S["llama-3.1-8b"])[what]


# ---- the budget and the report ------------------------------------------------------------------------------------
class Budget:
    """Seconds left of the run by ``clock`` (injected: the tests' clock is fake), and what each kind of work took,
    so the next one like it is estimated from the run itself."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic, start: float | None = None):
        self.seconds, self.clock = seconds, clock
        self.start = clock() if start is None else start
        self.took: dict[str, float] = {}

    def spent(self) -> float:
        return self.clock() - self.start

    def left(self) -> float:
        return self.seconds - self.spent()

    def estimate(self, kind: str, default: float) -> float:
        return 1.5 * self.took[kind] if kind in self.took else default

    def refuse(self, kind: str, default: float) -> str | None:
        """Why ``kind`` of work must not start now (it would end past the budget), or None."""
        need, left = self.estimate(kind, default), self.left()
        if need <= left:
            return None
        return f"budget: {max(left, 0):.0f} s of {self.seconds:.0f} s left, {kind} needs about {need:.0f} s"

    @contextlib.contextmanager
    def timing(self, kind: str):
        t = self.clock()
        yield
        self.took[kind] = max(self.took.get(kind, 0.0), self.clock() - t)


class Report:
    """JSON lines to ``out`` (flushed after each) and a short line each to stdout; each line has ``at_s``, the
    budget's seconds spent when it was written."""

    def __init__(self, out: Path, command: str, budget: Budget | None = None):
        self.out = out
        self.command = command
        self.budget = budget
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("")
        self.lines: list[dict] = []

    def write(self, section: str, **fields) -> dict:
        line = {"section": section, **fields}
        if self.budget is not None:
            line["at_s"] = round(self.budget.spent(), 1)
        self.lines.append(line)
        with self.out.open("a") as f:
            f.write(json.dumps(line, default=str) + "\n")
        print(json.dumps(line, default=str)[:400], flush=True)
        return line

    def find(self, section: str, **match) -> list[dict]:
        return [line for line in self.lines if line["section"] == section
                and all(line.get(k) == v for k, v in match.items())]


@dataclasses.dataclass
class Run:
    """What every section reads: the report, the budget, the arguments, the device, the models built so far."""
    report: Report
    budget: Budget
    a: argparse.Namespace
    device: object
    dtype: object
    models: "Models"
    state: dict = dataclasses.field(default_factory=dict)   # results a later section reuses

    @property
    def main_shape(self) -> str:
        return self.a.shapes[-1]


# ---- building ----------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def word_tokenizer(vocab_size: int):
    """A word-level tokenizer of ``vocab_size`` ids, one per vocabulary for the whole run (outputs are detokenised;
    no tokenizer is downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ["<unk>", "</s>", "<s>"] + [f"w{i}" for i in range(vocab_size - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>", bos_token="<s>")


@contextlib.contextmanager
def on_device(device, dtype):
    """Modules made inside are made on ``device`` in ``dtype`` (no fp32 copy on the host first: 3 GB for an 8B
    head, 32 GB for an 8B target)."""
    import torch
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(default)


def random_target(shape: str, device, dtype, logit_scale: float = 8.0):
    """A transformers Llama of ``shape``'s sizes, random weights made on the device in its dtype; its logits scaled
    up so that greedy near-ties are rare."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=2,
                      eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    with on_device(device, dtype):
        hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(logit_scale)
    return hf


def random_head(hf, device, dtype):
    """A random EAGLE-2 head for ``hf``, made on the device in ``dtype``, its embedding the target's."""
    import torch

    from eagle_ray.model.draft_head import DraftHead
    torch.manual_seed(1)
    with on_device(device, dtype):
        head = DraftHead.for_target(hf.config)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(hf.model.embed_tokens.weight)
    return head.to(device=device, dtype=dtype).eval()


class Models:
    """One random target and one random head per (shape, dtype), built when first asked for and kept until dropped:
    every engine of the run reuses them (an engine rebinds the head and gives it a fresh draft cache)."""

    def __init__(self, device):
        self.device = device
        self.targets: dict[tuple, object] = {}
        self.heads: dict[tuple, object] = {}

    def target(self, shape: str, dtype):
        key = (shape, dtype)
        if key not in self.targets:
            self.targets[key] = random_target(shape, self.device, dtype)
        return self.targets[key]

    def head(self, shape: str, dtype):
        key = (shape, dtype)
        if key not in self.heads:
            self.heads[key] = random_head(self.target(shape, dtype), self.device, dtype)
        return self.heads[key]

    def has(self, shape: str, dtype) -> bool:
        return (shape, dtype) in self.targets

    def drop(self, shape: str, dtype) -> None:
        self.targets.pop((shape, dtype), None)
        self.heads.pop((shape, dtype), None)
        release(self.device)


def release(device) -> float | None:
    """Collect what was dropped (engines hold reference cycles) and return the allocator's cached blocks; the MiB
    still allocated after that (None on a CPU)."""
    import torch
    gc.collect()
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    return round(torch.cuda.memory_allocated() / 2**20, 1)


def build_engine(run: Run, shape: str, dtype, max_batch_size: int, fused="auto", tree=None, tree_attention="sdpa",
                 graphs: bool = False):
    """An engine over the run's ``shape`` target and head (the target's layers fused at most once: a fused model
    keeps its merged weights); with ``graphs``, its decode passes and draft loop replayed as graphs (CUDA graphs on
    a GPU, the replay stand-in on a CPU)."""
    from eagle_ray.config import EngineConfig, TreeConfig
    from eagle_ray.engine.engine import EagleEngine
    from eagle_ray.model.target import TargetModel
    device, hf = run.device, run.models.target(shape, dtype)
    config = EngineConfig(dtype=str(dtype).replace("torch.", ""), device=str(device), max_batch_size=max_batch_size,
                          max_model_len=run.a.max_model_len, tree=TreeConfig(**(tree or EAGLE_TREE)),
                          fused_layers=fused, cpu_linears="native",   # the GPU's layout; on a CPU the smoke run
                          tree_attention=tree_attention)              # keeps ``hf`` as built
    target = TargetModel(hf, max_batch_size, run.a.max_model_len, **config.precision.model_dump())
    head = run.models.head(shape, dtype)
    head.cache = None   # the previous engine's draft cache: this engine allocates its own
    engine = EagleEngine(target, head, word_tokenizer(hf.config.vocab_size), config)
    if graphs:   # captured by hand (model/graphs.py) when a step first needs each; on a CPU the replay stand-in
        from eagle_ray.model.draft_graphs import DraftGraphs
        from eagle_ray.model.graphs import DecodeGraphs
        backend = "cuda" if device.type == "cuda" else "replay"
        engine.target.graphs = DecodeGraphs(engine.target, engine.target.cache.num_slots, backend=backend)
        engine.runner.draft_graphs = DraftGraphs(engine.draft, engine.target.cache.num_slots,
                                                 engine.runner.context_vocab, backend=backend)
    return engine


def mode_options(mode: str) -> dict:
    return {"fused": mode != "eager-modules", "graphs": mode == "graphs",
            "tree_attention": "flex" if mode.endswith("flex") else "sdpa"}


def with_engine(run: Run, shape: str, mode: str, max_batch: int, work: Callable, dtype=None, part: str = "") -> bool:
    """Build an engine (if the budget allows), run ``work(engine)``, drop it: an ``engine`` line with its build
    seconds and memory (peak, graph pool growth, graph counts; what stays allocated after the drop, read after
    ``gc.collect`` and ``empty_cache``). False where the budget refused the build (``work`` did not run)."""
    import torch
    dtype = dtype or run.dtype
    device = run.device
    building = "graphs" if mode == "graphs" else "flex" if mode.endswith("flex") else "engine"
    kinds = [f"{building} {shape} {mode}"] + ([] if run.models.has(shape, dtype) else [f"target {shape}"])
    need = sum(run.budget.estimate(k, cost_s(shape, k.split()[0])) for k in kinds)
    reason = run.budget.refuse(" + ".join(kinds), need)
    if reason:
        run.report.write("engine", part=part, shape=shape, mode=mode, skipped=reason)
        return False
    facts = {}
    with run.budget.timing(f"target {shape}"):
        run.models.target(shape, dtype)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        pool_before = torch.cuda.memory_reserved()
    t = time.perf_counter()
    with run.budget.timing(kinds[0]):
        engine = build_engine(run, shape, dtype, max_batch, **mode_options(mode))
    facts["build_s"] = round(time.perf_counter() - t, 2)
    try:
        work(engine)
    finally:
        if device.type == "cuda":
            facts.update(peak_mib=round(torch.cuda.max_memory_allocated() / 2**20, 1),
                         pool_growth_mib=round((torch.cuda.memory_reserved() - pool_before) / 2**20, 1))
        if mode == "graphs":   # every decode pass replayed a graph: eager ones are the skips
            graphs, draft = engine.target.graphs, engine.runner.draft_graphs
            facts.update(graphs=len(graphs.graphs), replays=graphs.replays, eager_decode_passes=graphs.skipped,
                         draft_graphs=len(draft.graphs), draft_replays=draft.replays)
        del engine
        facts["allocated_after_drop_mib"] = release(device)
        run.report.write("engine", part=part, shape=shape, mode=mode, dtype=str(dtype), max_batch=max_batch, **facts)
    return True


# ---- measuring ---------------------------------------------------------------------------------------------------
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


class _Kept:
    """A context manager that also keeps what it yields in ``into`` (for factories passed to ``decode_steps``)."""

    def __init__(self, inner, into: list):
        self.inner, self.into = inner, into

    def __enter__(self):
        self.into.append(self.inner.__enter__())
        return self.into[-1]

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


def step_rows(run: Run, engine, shape: str, mode: str, batches, part: str) -> None:
    """A ``step`` line per (batch, decoding) on ``engine``, smallest batch first, each started only if the budget
    allows it (else the line says why it was skipped)."""
    a = run.a
    weights = weight_bytes(engine.target.hf)
    head = weight_bytes(engine.draft)
    kv_token = engine.target.cache.k[:, :1, :, :1].numel() * engine.target.cache.k.element_size() * 2
    for batch in batches:
        for decode in ("plain", "eagle"):
            where = dict(part=part, shape=shape, mode=mode, decode=decode, batch=batch)
            reason = run.budget.refuse(f"row {shape} {mode} {decode} {batch}", cost_s(shape, "row"))
            if reason:
                run.report.write("step", **where, skipped=reason)
                continue
            with run.budget.timing(f"row {shape} {mode} {decode} {batch}"):
                engine.runner.profile = True
                phase = {"draft_s": 0.0, "verify_s": 0.0, "steps": 0, "tokens": 0}
                times = decode_steps(engine, prompts_of(engine, batch, a.context, seed=batch), a.steps,
                                     decode == "eagle", lambda: _PhaseTimes(engine, phase))
                engine.runner.profile = False
            ms = statistics.median(times)
            kv_read = batch * (a.context + 16) * kv_token
            run.report.write("step", **where, context=a.context, **summary_ms(times),
                             draft_ms=round(1e3 * phase["draft_s"] / max(phase["steps"], 1), 3),
                             verify_ms=round(1e3 * phase["verify_s"] / max(phase["steps"], 1), 3),
                             tokens_per_s=round(1e3 * phase["tokens"] / max(sum(times), 1e-9), 1),
                             gb_per_s=round((weights + (head if decode == "eagle" else 0) + kv_read) / ms / 1e6, 1))


# Host-side calls that launch work on a CUDA device, as the profiler names them (runtime and driver API; a CUDA graph's
# replay is one ``cudaGraphLaunch`` however many kernels it holds). Some versions add an API version suffix (``_v7000``).
LAUNCH_CALLS = frozenset({
    "cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel", "cudaLaunchCooperativeKernelMultiDevice",
    "cuLaunchKernel", "cuLaunchKernelEx", "cuLaunchCooperativeKernel", "cuLaunchGrid", "cuLaunchGridAsync",
    "cudaGraphLaunch", "cuGraphLaunch"})
GRAPH_LAUNCH_CALLS = frozenset({"cudaGraphLaunch", "cuGraphLaunch"})


def host_launches(events) -> dict:
    """Launches the host made among profiler ``events``: every launch call (kernel or graph), the graph launches
    among them, and the kernels that ran on the device (a replayed graph's kernels are counted there, not above)."""
    import torch
    launches = graphs = kernels = 0
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels += 1
            continue
        call = re.sub(r"_v\d+$", "", e.name)
        launches += call in LAUNCH_CALLS
        graphs += call in GRAPH_LAUNCH_CALLS
    return {"launches": launches, "graph_launches": graphs, "device_kernels": kernels}


def api_calls(events, steps: int) -> dict:
    """CUDA runtime and driver calls per step by name (``cuda*``, ``cu*``): where a launch call is named otherwise
    than :data:`LAUNCH_CALLS` says, it shows here."""
    import torch
    seen: dict[str, int] = {}
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA and re.match(r"cu[A-Z]|cuda[A-Z]", e.name):
            seen[e.name] = seen.get(e.name, 0) + 1
    return {k: round(v / steps, 1) for k, v in sorted(seen.items(), key=lambda kv: -kv[1])}


def count_launches(engine, device, steps: int = 3) -> dict:
    """Launches per decode step at batch 1 (torch.profiler over ``steps`` steps): on CUDA the host's launch calls
    (:func:`host_launches`); on a CPU, which launches nothing, the top-level aten operators."""
    import torch
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    out = {}
    for decode in ("plain", "eagle"):
        profiled = []
        decode_steps(engine, prompts_of(engine, 1, 32), steps, decode == "eagle",
                     span=lambda: _Kept(torch.profiler.profile(activities=activities), profiled))
        events = profiled[0].events()
        if cuda:
            counts = host_launches(events)
            out[decode] = round(counts["launches"] / steps, 1)
            out[f"{decode}_graph_launches"] = round(counts["graph_launches"] / steps, 1)
            out[f"{decode}_device_kernels"] = round(counts["device_kernels"] / steps, 1)
            out[f"{decode}_api_calls"] = api_calls(events, steps)
        else:
            out[decode] = round(sum(e.name.startswith("aten::") and e.cpu_parent is None for e in events) / steps, 1)
    out["unit"] = ("host-side launch calls per decode step (cudaLaunchKernel, cuLaunchKernel, cudaGraphLaunch...; "
                   "a replayed graph is one)" if cuda else
                   "top-level aten operators per decode step (a CPU launches no kernels)")
    return out


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


def engine_shapes(engine, steps: int) -> set:
    """(batch, tokens, key length) of the target's decode forwards over a plain run of ``steps`` tokens."""
    with decode_shapes(engine) as seen:
        decode_steps(engine, prompts_of(engine, 1, 24), steps, speculative=False)
    return seen


def mode_extras(run: Run, engine, shape: str, mode: str, part: str) -> None:
    """A mode's ``launches``, ``host_reads`` and ``shapes`` lines (if the budget allows)."""
    from eagle_ray.engine.host_reads import count_host_reads
    reason = run.budget.refuse(f"extras {shape} {mode}", cost_s(shape, "extras"))
    if reason:
        run.report.write("launches", part=part, shape=shape, mode=mode, skipped=reason)
        return
    with run.budget.timing(f"extras {shape} {mode}"):
        run.report.write("launches", part=part, shape=shape, mode=mode,
                         **count_launches(engine, run.device, min(3, run.a.steps)))
        counted = []
        decode_steps(engine, prompts_of(engine, 2, 32), 1, True, measure=lambda: _Kept(count_host_reads(), counted))
        run.report.write("host_reads", part=part, shape=shape, mode=mode, per_step=counted[0].count,
                         sites=counted[0].by_site())
        seen = engine_shapes(engine, run.a.steps * 4)
        run.report.write("shapes", part=part, shape=shape, mode=mode, distinct=len(seen), shapes=sorted(seen)[:64])


def compile_report() -> dict:
    """What the model side says of its compiled kernels (the fused operations' status, and whatever else it reports:
    per-op compile counts, fallbacks), beside Inductor's own counters. The one place the bench reads them."""
    from eagle_ray.model import guarded_compile, kernels
    out = {"fused_ops": {name: dict(status) for name, status in kernels.compiled_status.items()},
           "compiles": guarded_compile.compile_report()}   # per function and key: status and compile count
    try:
        from torch._dynamo.utils import counters
        out["dynamo"] = {group: dict(counters[group]) for group in ("stats", "recompiles", "graph_break")
                         if counters.get(group)}
    except Exception as e:  # noqa: BLE001 - private API: its absence is reported, not fatal
        out["dynamo"] = f"unreadable: {type(e).__name__}"
    return out


@contextlib.contextmanager
def device_table(kind: str, **changes):
    """``model/numerics.py`` ``DEVICE_DEFAULTS[kind]`` with ``changes`` inside the block: engines built and run in
    it see the changed row (the engine itself is not edited)."""
    from eagle_ray.model import numerics
    old = numerics.DEVICE_DEFAULTS[kind]
    numerics.DEVICE_DEFAULTS[kind] = dataclasses.replace(old, **changes)
    try:
        yield numerics.DEVICE_DEFAULTS[kind]
    finally:
        numerics.DEVICE_DEFAULTS[kind] = old


def cuda_defaults_on_cpu() -> dict:
    """The CUDA row's fields where they mean something on a CPU (all but the slot cap): key-length buckets, step
    sizes, fused layers, restricted SDPA, native linears, no exactness switches."""
    from eagle_ray.model.numerics import DEVICE_DEFAULTS
    cuda = dataclasses.asdict(DEVICE_DEFAULTS["cuda"])
    cuda.pop("auto_max_slots")
    return cuda


# ---- sections, in priority order ----------------------------------------------------------------------------------
def versions(run: Run) -> None:
    import torch
    import transformers

    from eagle_ray.model.device import cpu_model, device_name
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    run.report.write("versions", command=run.report.command, device=device_name(run.device), cpu=cpu_model(),
                     python=platform.python_version(), torch=torch.__version__,
                     transformers=transformers.__version__, triton=triton_version, cuda=torch.version.cuda,
                     cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                     dtype=str(run.dtype), budget_s=run.budget.seconds,
                     cuda_defaults_on_cpu=run.a.cuda_defaults_on_cpu)


def bandwidth(run: Run) -> None:
    """A device-to-device copy, timed: bytes read plus bytes written per second (what the plain batch verdict is
    read against; a data sheet's figure is not reached by any copy)."""
    import torch
    cuda = run.device.type == "cuda"
    size = (2 << 30) if cuda else (64 << 20)
    copies = 10 if cuda else 5
    src = torch.empty(size, dtype=torch.uint8, device=run.device).fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(run.device)
    if cuda:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(copies):
            dst.copy_(src)
        end.record()
        end.synchronize()
        ms = begin.elapsed_time(end) / copies
    else:
        t = time.perf_counter()
        for _ in range(copies):
            dst.copy_(src)
        ms = 1e3 * (time.perf_counter() - t) / copies
    del src, dst
    release(run.device)
    run.report.write("bandwidth", gb_per_s=round(2 * size / ms / 1e6, 1), bytes_per_copy=size, copies=copies,
                     ms_per_copy=round(ms, 4), counted="bytes read + bytes written, torch copy_ on the device")


def key_steps(run: Run) -> None:
    """The main shape at the smallest and largest batch in graphs and fused eager, and eager modules at the
    smallest: the figures the targets are read from."""
    shape, batches = run.main_shape, run.a.batches
    small, large = min(batches), max(batches)
    plan = [(m, [small, large] if m != "eager-modules" else [small]) for m in MODES
            if m != "graphs" or shape in run.a.graphs]
    done = run.state.setdefault("rows_done", set())
    for mode, wanted in plan:
        wanted = sorted(set(wanted))
        if not with_engine(run, shape, mode, large, lambda engine: step_rows(run, engine, shape, mode, wanted,
                                                                             "key_steps"), part="key_steps"):
            for b in wanted:
                for decode in ("plain", "eagle"):
                    run.report.write("step", part="key_steps", shape=shape, mode=mode, decode=decode, batch=b,
                                     skipped="engine not built (budget)")
        done |= {(shape, mode, b) for b in wanted}


def fidelity(run: Run) -> None:
    """fp32 greedy equality on random prompts at the first shape: EAGLE against plain, fused against the modules'
    layers, graphs against eager (EAGLE and plain decoding)."""
    import torch

    from eagle_ray.config import SamplingParams
    a, shape = run.a, run.a.shapes[0]
    reason = run.budget.refuse(f"fidelity {shape}", cost_s(shape, "fidelity"))
    if reason:
        run.report.write("fidelity", shape=shape, skipped=reason)
        return
    g = torch.Generator().manual_seed(7)
    vocab = SHAPES[shape]["vocab_size"]
    prompts = [torch.randint(3, vocab, (16 + 8 * (i % 5),), generator=g).tolist() for i in range(a.prompts)]
    params = SamplingParams(max_new_tokens=a.tokens, ignore_eos=True)
    out: dict[str, list] = {}

    def generate(engine, *names):
        for name in names:
            out[name] = [o.token_ids for o in engine.generate(prompts, params, speculative=name.endswith("eagle"))]

    with run.budget.timing(f"fidelity {shape}"):
        with_engine(run, shape, "eager-modules", 8, lambda e: generate(e, "plain", "eagle"), torch.float32,
                    part="fidelity")
        with_engine(run, shape, "eager-fused", 8, lambda e: generate(e, "fused eagle"), torch.float32,
                    part="fidelity")
        with_engine(run, shape, "graphs", 8, lambda e: generate(e, "graphs eagle", "graphs plain"), torch.float32,
                    part="fidelity")
    run.state["fidelity"] = {"prompts": prompts, "params": params, "plain": out.get("plain")}
    plain = out.get("plain")

    def equal(name):
        if plain is None or name not in out:
            return None
        return sum(x == y for x, y in zip(out[name], plain))

    run.report.write("fidelity", shape=shape, prompts=len(prompts), tokens=a.tokens,
                     eagle_equals_plain=equal("eagle"), fused_equals_modules=equal("fused eagle"),
                     graphs_eagle_equal_eager=equal("graphs eagle"), graphs_plain_equal_eager=equal("graphs plain"))
    run.models.drop(shape, torch.float32)
    if a.embedded_gguf:
        embedded_against_generate(run)


def embedded_against_generate(run: Run) -> None:
    """The embedded pair (its GGUF carried to this machine) against transformers ``generate()``, fp32 greedy."""
    import torch

    from eagle_ray.config import SamplingParams
    from eagle_ray.engine.engine import EagleEngine
    a, device = run.a, run.device
    if not Path(a.embedded_gguf).is_file():
        run.report.write("embedded", skipped=f"{a.embedded_gguf} is not a file")
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
    run.report.write("embedded", prompts=len(outs), equal=same,
                     tau=round(sum(o.stats.tau for o in outs) / len(outs), 3))
    del engine, hf
    release(device)


def sdpa_choice(run: Run, shape: str) -> dict:
    """The kernel torch picks for the engine's folded grouped-query attention (codes: torch's SDPBackend), left to
    itself and under the device table's kernel choice; returns torch's own pick by (batch x tokens x keys)."""
    import torch
    from torch.nn.attention import SDPBackend

    from eagle_ray.model.numerics import attention_kernels
    cfg = SHAPES[shape]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d, rep = cfg["hidden_size"] // heads, heads // kv
    rows = []
    for batch, tokens, keys in ((1, 1, 300), (1, 16, 300), (32, 16, 1100)):
        q = torch.randn(batch, kv, rep * tokens, d, device=run.device, dtype=run.dtype)
        k = torch.randn(batch, kv, keys, d, device=run.device, dtype=run.dtype)
        mask = torch.ones(batch, 1, rep * tokens, keys, device=run.device, dtype=torch.bool)
        left = int(torch._fused_sdp_choice(q, k, k, mask))
        with attention_kernels(run.device):
            chosen = int(torch._fused_sdp_choice(q, k, k, mask))
        rows.append({"batch": batch, "tokens": tokens, "keys": keys, "torch": left, "engine": chosen})
    names = {int(getattr(SDPBackend, n)): n for n in dir(SDPBackend) if n.isupper()}
    run.report.write("sdpa_choice", shape=shape, rows=rows, backends=names)
    return {f"{r['batch']}x{r['tokens']}x{r['keys']}": names.get(r["torch"], r["torch"]) for r in rows}


PROBE_RUNS = ("default", "cudnn allowed, every key length new", "cudnn allowed, the same shapes again",
              "cudnn allowed, key lengths in buckets")


def probe(run: Run) -> None:
    """Batch-1 plain decode steps of the main shape (eager modules, as when 224-254 ms steps were seen): the device
    table as it is (cuDNN left out of SDPA, key lengths in buckets), against torch's own SDPA choice (cuDNN allowed)
    with every key length new (buckets of 1), the same key lengths again, and key lengths in the CUDA row's
    buckets. A per-shape build is slow on new shapes only, and buckets end it."""
    from eagle_ray.model.numerics import DEVICE_DEFAULTS
    shape, kind = run.main_shape, run.device.type
    picks = sdpa_choice(run, shape)
    bucket = DEVICE_DEFAULTS["cuda"].kv_bucket
    runs: dict[str, list[float]] = {}
    skipped: dict[str, str] = {}

    def timed(label):
        def work(engine):
            prompt = prompts_of(engine, 1, 32)
            runs[label] = [round(t, 2) for t in decode_steps(engine, prompt, run.a.probe_steps, speculative=False)]
            if label == PROBE_RUNS[1]:   # the same engine, the same prompt: every key length is seen again
                runs[PROBE_RUNS[2]] = [round(t, 2) for t in
                                       decode_steps(engine, prompt, run.a.probe_steps, speculative=False)]
        return work

    for label, table in ((PROBE_RUNS[0], {}), (PROBE_RUNS[1], {"sdpa_backends": None, "kv_bucket": 1}),
                         (PROBE_RUNS[3], {"sdpa_backends": None, "kv_bucket": bucket})):
        reason = run.budget.refuse(f"probe {shape}", cost_s(shape, "probe"))
        if reason:
            skipped[label] = reason
            continue
        with run.budget.timing(f"probe {shape}"), device_table(kind, **table):
            if not with_engine(run, shape, "eager-modules", 1, timed(label), part="probe"):
                skipped[label] = "engine not built (budget)"
    medians = {k: round(statistics.median(v), 3) for k, v in runs.items()}
    run.report.write("probe", shape=shape, steps=run.a.probe_steps, steps_ms=runs, median_ms=medians,
                     runs_skipped=skipped, torch_picks=picks, cause=probe_cause(medians))


def probe_cause(medians: dict) -> str:
    """The probe's reading: is a slow decode step a per-shape build (cuDNN's graph per key length)?"""
    default, new, again, bucketed = (medians.get(k) for k in PROBE_RUNS)
    if default is None or new is None:
        return "not measured"
    said = f"default {default} ms, cuDNN allowed with new key lengths {new} ms"
    if new <= 2 * default:
        return f"no slow step with cuDNN allowed ({said}): the old 224-254 ms is not reproduced"
    if again is not None and again <= 0.5 * new and (bucketed is None or bucketed <= 0.5 * new):
        return (f"a build per new shape (cuDNN attention): {said}, the same shapes again {again} ms, "
                f"key lengths in buckets {bucketed} ms")
    if again is not None and again > 0.5 * new:
        return f"not a per-shape build: {said}, and the same shapes again are as slow ({again} ms)"
    return f"unclear: {said}, the same shapes again {again} ms, key lengths in buckets {bucketed} ms"


def joined_step(run: Run, shape: str, chunk: int = 512) -> None:
    """Steps in which a ``chunk``-token prompt arrives while ``batch`` sequences decode with EAGLE: the chunk joins
    the decode rows' target pass (``StepPlan.one_pass``) or runs in a pass of its own first (medians over
    ``min(4, --steps)`` arrivals)."""
    a, device = run.a, run.device
    arrivals = min(4, a.steps)
    batches = sorted({min(a.batches), max([b for b in a.batches if b <= 32] or [min(a.batches)])})
    rows = []

    def work(engine):
        for batch in batches:
            for one_pass in (True, False):
                reason = run.budget.refuse(f"joined {shape} {batch}", cost_s(shape, "joined"))
                if reason:
                    rows.append({"batch": batch, "one_pass": one_pass, "skipped": reason})
                    continue
                with run.budget.timing(f"joined {shape} {batch}"):
                    rows.append(joined_row(engine, batch, one_pass, chunk, arrivals, a.context // 4, device))
        engine.scheduler.one_pass = True

    with_engine(run, shape, "eager-fused", batches[-1] + 1, work, part="rest")
    run.report.write("joined_step", shape=shape, chunk=chunk, rows=rows)


def joined_row(engine, batch: int, one_pass: bool, chunk: int, arrivals: int, context: int, device) -> dict:
    from eagle_ray.config import SamplingParams
    engine.scheduler.one_pass = one_pass
    params = SamplingParams(max_new_tokens=10**6, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts_of(engine, batch, context)]
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
    return {"batch": batch, "one_pass": one_pass, "step_with_chunk_ms": round(statistics.median(joined), 3),
            "decode_step_ms": round(statistics.median(alone), 3)}


def rest(run: Run) -> None:
    """Every batch and mode not measured yet with each mode's launches, host reads and shapes, the joined step and
    the compile report at the main shape; then the other shapes, largest first."""
    done = run.state.setdefault("rows_done", set())
    for shape in run.a.shapes[::-1]:
        for mode in MODES:
            if mode == "graphs" and shape not in run.a.graphs:
                continue
            batches = [b for b in run.a.batches if (shape, mode, b) not in done]

            def work(engine, shape=shape, mode=mode, batches=batches):
                step_rows(run, engine, shape, mode, batches, "rest")
                mode_extras(run, engine, shape, mode, "rest")

            with_engine(run, shape, mode, max(run.a.batches), work, part="rest")
            done |= {(shape, mode, b) for b in batches}
        if shape == run.main_shape:
            joined_step(run, shape)
            run.report.write("compiles", part="rest", **compile_report())


def flex(run: Run) -> None:
    """Fused layers with flex tree attention at every shape (main first) and batch, then its fp32 equality against
    the modules' plain decoding."""
    import torch

    from eagle_ray.config import SamplingParams
    for shape in run.a.shapes[::-1]:
        with_engine(run, shape, "eager-fused-flex", max(run.a.batches),
                    lambda engine, shape=shape: step_rows(run, engine, shape, "eager-fused-flex", run.a.batches,
                                                          "flex"), part="flex")
    shape = run.a.shapes[0]
    reason = run.budget.refuse(f"fidelity {shape}", cost_s(shape, "fidelity"))
    if reason:
        run.report.write("fidelity_flex", shape=shape, skipped=reason)
    else:
        kept = run.state.get("fidelity") or {}
        g = torch.Generator().manual_seed(7)
        prompts = kept.get("prompts") or [torch.randint(3, SHAPES[shape]["vocab_size"], (16 + 8 * (i % 5),),
                                                        generator=g).tolist() for i in range(run.a.prompts)]
        params = kept.get("params") or SamplingParams(max_new_tokens=run.a.tokens, ignore_eos=True)
        out = {"plain": kept.get("plain")}

        def generate(engine, name, speculative):
            out[name] = [o.token_ids for o in engine.generate(prompts, params, speculative=speculative)]

        with run.budget.timing(f"fidelity {shape}"):
            if out["plain"] is None:
                with_engine(run, shape, "eager-modules", 8, lambda e: generate(e, "plain", False), torch.float32,
                            part="flex")
            with_engine(run, shape, "eager-fused-flex", 8, lambda e: generate(e, "flex eagle", True), torch.float32,
                        part="flex")
        same = None if out["plain"] is None or "flex eagle" not in out else sum(
            x == y for x, y in zip(out["flex eagle"], out["plain"]))
        run.report.write("fidelity_flex", shape=shape, prompts=len(prompts), tokens=run.a.tokens,
                         flex_equals_modules=same)
        run.models.drop(shape, torch.float32)
    run.report.write("compiles", part="flex", **compile_report())


SECTIONS = (("versions", versions), ("bandwidth", bandwidth), ("key_steps", key_steps), ("fidelity", fidelity),
            ("probe", probe), ("rest", rest), ("flex", flex))


# ---- verdicts ------------------------------------------------------------------------------------------------------
def row_name(r: dict) -> str:
    return f"step {r['shape']} {r['mode']} {r['decode']} batch {r['batch']}: median {r['median_ms']} ms"


def verdicts(report: Report, device_name: str, main_shape: str) -> list[dict]:
    """PASS / FAIL for the GPU step's targets from the lines written so far, each naming the line it read; NOT
    MEASURED where that line is missing, INFO for a reading without a target (the speed targets on a device that is
    not an H100 or H200, the graphs' gain over fused eager, the probe's cause)."""
    checks = []

    def check(name, status, text):
        checks.append({"check": name, "status": status, "text": f"{status} {name}: {text}"})

    speed_checks(report, device_name, main_shape, check)
    fidelity_checks(report, check)
    pr = next((p for p in report.find("probe") if "cause" in p), None)
    check("the probe's cause", "NOT MEASURED" if pr is None or pr["cause"] == "not measured" else "INFO",
          "no probe line" if pr is None else f"{pr['cause']} (read probe {pr['shape']})")
    return checks


def speed_checks(report: Report, device_name: str, main_shape: str, check) -> None:
    """The step times against an H100's or H200's targets, the graphs' gain over eager, and the largest batch's
    share of the measured bandwidth, each passed to ``check(name, status, text)``."""
    gpu = next((g for g in TARGETS_MS if g in device_name), None)
    rows = [r for r in report.find("step", shape=main_shape) if "median_ms" in r]

    def judged(ok: bool) -> str:   # the speed targets are an H100's and an H200's: elsewhere a reading, not a verdict
        return ("PASS" if ok else "FAIL") if gpu else "INFO"

    def best(decode, batch):
        found = [r for r in rows if (r["decode"], r["batch"]) == (decode, batch)]
        return min(found, key=lambda r: r["median_ms"]) if found else None

    def row(mode, decode, batch):
        return next((r for r in rows if (r["mode"], r["decode"], r["batch"]) == (mode, decode, batch)), None)

    batches = sorted({r["batch"] for r in report.find("step", shape=main_shape)})
    small, large = (batches[0], batches[-1]) if batches else (1, 64)
    for decode in ("plain", "eagle"):
        name = f"{main_shape} {decode} step at batch {small} (best mode)"
        r = best(decode, small)
        if r is None:
            check(name, "NOT MEASURED", "no step line")
        elif gpu is None:
            check(name, "INFO", f"no target on {device_name}; read {row_name(r)}")
        else:
            target = TARGETS_MS[gpu][decode]
            check(name, "PASS" if r["median_ms"] <= target else "FAIL",
                  f"read {row_name(r)} (target <= {target} ms on an {gpu})")
    graphs, modules, fused = (row(m, "plain", small) for m in ("graphs", "eager-modules", "eager-fused"))
    name = f"graphs >= {GRAPHS_OVER_MODULES:g}x eager modules at batch {small}"
    engine = next((e for e in report.find("engine", shape=main_shape, mode="graphs", part="key_steps")
                   if "eager_decode_passes" in e), None)
    left = None if engine is None else engine["eager_decode_passes"]
    if graphs is None or modules is None:
        check(name, "NOT MEASURED", f"graphs row {'found' if graphs else 'missing'}, eager-modules row "
                                    f"{'found' if modules else 'missing'}")
    else:
        ratio = modules["median_ms"] / graphs["median_ms"]
        check(name, judged(ratio >= GRAPHS_OVER_MODULES and left == 0),
              f"{ratio:.2f}x, read {row_name(modules)} / {row_name(graphs)}; decode passes left eager: {left}")
    name = f"graphs against fused eager at batch {small}"
    if graphs is None or fused is None:
        check(name, "NOT MEASURED", "graphs or eager-fused row missing")
    else:
        check(name, "INFO", f"{fused['median_ms'] / graphs['median_ms']:.2f}x, read {row_name(fused)} / "
                            f"{row_name(graphs)}")
    name = f"plain batch {large} >= {BANDWIDTH_SHARE:.0%} of the measured bandwidth (best mode)"
    copy = next(iter(report.find("bandwidth")), None)
    r = best("plain", large)
    if r is None or copy is None:
        check(name, "NOT MEASURED", f"step line {'found' if r else 'missing'}, bandwidth line "
                                    f"{'found' if copy else 'missing'}")
    else:
        share = r["gb_per_s"] / copy["gb_per_s"]
        check(name, judged(share >= BANDWIDTH_SHARE),
              f"{r['gb_per_s']} GB/s = {share:.0%} of {copy['gb_per_s']} GB/s (bandwidth line: a timed device copy); "
              f"read {row_name(r)}")


def fidelity_checks(report: Report, check) -> None:
    """fp32 greedy equality (EAGLE = plain, fused = modules, graphs = eager), and flex's where it ran."""
    fid = next((f for f in report.find("fidelity") if "prompts" in f), None)
    name = "fp32 greedy equality"
    keys = ("eagle_equals_plain", "fused_equals_modules", "graphs_eagle_equal_eager", "graphs_plain_equal_eager")
    if fid is None:
        check(name, "NOT MEASURED", "no fidelity line")
    elif any(fid[k] is None for k in keys):
        check(name, "NOT MEASURED", ", ".join(f"{k} {fid[k]}" for k in keys) + f" (read fidelity {fid['shape']})")
    else:
        ok = all(fid[k] == fid["prompts"] for k in keys)
        check(name, "PASS" if ok else "FAIL", ", ".join(f"{k} {fid[k]}/{fid['prompts']}" for k in keys)
              + f" (read fidelity {fid['shape']})")
    flex_fid = next((f for f in report.find("fidelity_flex") if "prompts" in f), None)
    if flex_fid is not None and flex_fid["flex_equals_modules"] is not None:
        ok = flex_fid["flex_equals_modules"] == flex_fid["prompts"]
        check("fp32 greedy equality, flex", "PASS" if ok else "FAIL",
              f"flex_equals_modules {flex_fid['flex_equals_modules']}/{flex_fid['prompts']}")


# ---- the run -------------------------------------------------------------------------------------------------------
def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="llama-3.2-1b,llama-3.1-8b",
                   help=f"comma list of {sorted(SHAPES)}; the last is the main shape, the first the fidelity shape")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens before the timed decode steps")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per row")
    p.add_argument("--probe-steps", type=int, default=12)
    p.add_argument("--prompts", type=int, default=16, help="fidelity: prompts")
    p.add_argument("--tokens", type=int, default=32, help="fidelity: new tokens per prompt")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help="seconds from the script's start: nothing starts that would end past them")
    p.add_argument("--graphs", default=",".join(SHAPES), help="shapes that also run the CUDA-graph mode; '' for none")
    p.add_argument("--cuda-defaults-on-cpu", action="store_true",
                   help="on a CPU, run with the CUDA row of model/numerics.py DEVICE_DEFAULTS (key-length buckets, "
                        "step sizes, fused layers, restricted SDPA, native linears, no exactness switches)")
    p.add_argument("--embedded-gguf", default=None, help="the embedded target's GGUF, carried to this machine")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    try:
        a.batches = sorted({int(x) for x in a.batches.split(",")})
    except ValueError as e:
        p.error(f"--batches is a comma list of whole numbers ({e})")
    a.shapes, a.graphs = a.shapes.split(","), [g for g in a.graphs.split(",") if g]
    unknown = sorted(set(a.shapes) - set(SHAPES))
    if unknown:
        p.error(f"--shapes: unknown {unknown}; choose from {sorted(SHAPES)}")
    a.max_model_len = max(a.max_model_len, a.context + 64)
    return a


def main(argv=None, clock: Callable[[], float] | None = None) -> Path:
    """Run every section in order within the budget (``clock``: the tests' fake clock; by default the budget counts
    from the script's start)."""
    a = parse(argv)
    import torch

    from eagle_ray.model.device import device_name
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    budget = Budget(a.budget_s, clock) if clock is not None else Budget(a.budget_s, start=START)
    report = Report(Path(a.out), "bench/gpu_step.py " + " ".join(argv if argv is not None else sys.argv[1:]), budget)
    run = Run(report, budget, a, device, dtype, Models(device))
    name = device_name(device)
    with contextlib.ExitStack() as stack:
        if a.cuda_defaults_on_cpu and device.type == "cpu":
            stack.enter_context(device_table("cpu", **cuda_defaults_on_cpu()))
        for section, fn in SECTIONS:
            if budget.left() <= 0:
                report.write(section, skipped=f"budget: {budget.seconds:.0f} s spent")
            else:
                try:
                    fn(run)
                except Exception as e:  # noqa: BLE001 - one section's failure must not cost the others
                    report.write(section, error=f"{type(e).__name__}: {e}"[:2000],
                                 traceback=traceback.format_exc()[-4000:])
                    release(device)
            checks = verdicts(report, name, run.main_shape)
            report.write("verdicts", after=section, device=name, lines=[c["text"] for c in checks], checks=checks)
    report.write("done", seconds=round(budget.spent(), 1), budget_s=a.budget_s)
    return report.out


if __name__ == "__main__":
    main()
