"""What the pieces of a step cost on this machine, and what an engine needs in memory: the tables the tree tuner
and the kernel choices rest on.

    python bench/costs.py SUBCOMMAND --help

``forwards``
    One target forward (logits included) of B sequences x T new tokens on a cached context, per dtype and kernel
    mode (``fp32``, ``bf16``, ``bf16-exact``: fp32 activations and row-invariant kernels), optionally through
    ``torch.compile`` (``--compile inductor``) and at another KV cache size (``--max-model-len``), with each cost
    over the one-token cost: with a head's tau at T verify tokens, ``tau / (cost(B, T) / cost(B, 1))`` bounds a
    step's speedup. ``--draft-tree D/K`` adds the head's cost of growing a (depth D, top-k K) tree.

        python bench/costs.py forwards --out bench/results/<hardware>/row_cost.json
        python bench/costs.py forwards --modes fp32 --compile inductor --max-model-len 256 --out ...

``linears``
    Which CPU layout for the target's linears (``model/linears.py``: native, input-major, packed), layouts
    interleaved: one linear of each of the target's shapes for 1-64 rows, and the whole verify pass of B x T tokens
    with the target's linears in each layout (packed: as the engine packs, fp32 weights under the device table's
    ``packed_min_weights`` input-major), in ``--dtype`` (fp32; bf16 or fp16 at the default precision, with the layouts
    this CPU runs: oneDNN packs low precision only where the CPU has native low-precision products).

``attention``
    Masked attention on CPU: grouped-query heads folded into query rows against SDPA's ``enable_gqa``, at the
    embedded target's head layout (9 query heads over 3 kv heads, head dim 64), fp32, one-row decode and 8-token
    tree blocks at batch 1, 8 and 32, the two forms alternating.

``tuner``
    Why the tuner chose what it chose at a batch size: its estimate for plain decoding, for every tree and for every
    verify cap on the best tree, from the cached costs of this machine (tuning again if none) and the traced trees
    the tuner reads.

        python bench/costs.py tuner --batch 8 --out bench/results/<hardware>/tuner_table_b8.json

``memory``
    docs/memory.md's table: what one engine needs for published Llama shapes, from ``plan_memory`` on meta tensors
    (nothing loaded; the same on any machine): bf16 on CUDA, an EAGLE-2 head shaped for the target,
    ``tree_policy: auto``, the CUDA step budget. Rewrites the table between its markers in ``--doc``.

``gpu``
    The device side of these costs (a GPU's verify and draft tables, kernel launches, CUDA graphs, host reads,
    peak memory, fidelity): ``bench/gpu_step.py``, the one script a GPU session runs first; its flags follow.

        python bench/costs.py gpu --out bench/results/<gpu>/gpu_step.jsonl

Every subcommand writes JSON naming the hardware, torch version, threads and command line (``harness.py``).
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from harness import median_seconds, run_entry, subcommand, timed, write_result

SCRIPT = "bench/costs.py"
ROOT = Path(__file__).resolve().parent.parent


# ---- forwards -----------------------------------------------------------------------------------------------------
MODES = {  # name -> (dtype, fp32_activations, batch_invariant)
    "fp32": ("float32", False, False),
    "bf16": ("bfloat16", False, False),
    "bf16-exact": ("bfloat16", True, True),
}


def forward_rows(engine, mode: str, a) -> list[dict]:
    """Verify (and draft) milliseconds of every batch size and token count for one engine."""
    from eagle_ray.engine.tuning import draft_seconds, verify_seconds
    rows = []
    for b in a.batch_sizes:
        base = None
        for t in a.tokens:
            ms = 1e3 * verify_seconds(engine, b, t, context=a.context, repeats=a.reps)
            base = ms if base is None else base
            rows.append({"mode": mode, "compile": a.compile, "batch": b, "tokens": t, "ms": round(ms, 3),
                         "vs_first_tokens": round(ms / base, 3)})
            print(json.dumps(rows[-1]), flush=True)
        if a.draft_tree:
            depth, top_k = (int(x) for x in a.draft_tree.split("/"))
            ms = 1e3 * draft_seconds(engine, b, depth, top_k, context=a.context, repeats=a.reps)
            rows.append({"mode": mode, "compile": a.compile, "batch": b, "draft_tree": a.draft_tree,
                         "ms": round(ms, 3)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def cmd_forwards(a) -> int:
    from eagle_ray.engine.engine import EagleEngine
    rows, cache_mib = [], {}
    for mode in a.modes:
        dtype, fp32_act, invariant = MODES[mode]
        engine = EagleEngine.from_pretrained(draft=None if a.draft_tree else "none", dtype=dtype,
                                             max_batch_size=max(a.batch_sizes), max_model_len=a.max_model_len,
                                             threads=a.threads, fp32_activations=fp32_act, batch_invariant=invariant,
                                             compile=a.compile)
        cache_mib[mode] = engine.target.cache.nbytes() / 2**20
        rows += forward_rows(engine, mode, a)
        del engine
        torch._dynamo.reset()
    write_result(a.out, {"context": a.context, "max_model_len": a.max_model_len, "kv_cache_mib": cache_mib,
                         "rows": rows}, a.command)
    return 0


# ---- linears ------------------------------------------------------------------------------------------------------
LAYOUTS = ("native", "input_major", "packed")
TARGET_LINEARS = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]   # SmolLM2-135M's shapes


def linear_table(shapes, rows, reps: int, dtype=torch.float32, layouts=LAYOUTS) -> list[dict]:
    from eagle_ray.model.linears import InputMajorLinear, PackedLinear
    make = {"native": lambda w: (lambda x: F.linear(x, w)), "input_major": lambda w: InputMajorLinear(w, None),
            "packed": lambda w: PackedLinear(w, None)}
    warmup = 3 if reps >= 10 else 1
    out = []
    for d_in, d_out in shapes:
        w = torch.randn(d_out, d_in).to(dtype)
        impl = {k: make[k](w) for k in layouts}
        for m in rows:
            x = torch.randn(m, d_in).to(dtype)
            us = {k: 1e6 * median_seconds(lambda f=f: f(x), reps, warmup) for k, f in impl.items()}
            out.append({"in": d_in, "out": d_out, "rows": m, **{f"{k}_us": round(v, 1) for k, v in us.items()}})
            print(json.dumps(out[-1]), flush=True)
    return out


def verify_table(blocks, reps: int, rounds: int, threads: int, dtype: str = "float32",
                 layouts=LAYOUTS) -> list[dict]:
    from eagle_ray.config import EngineConfig
    from eagle_ray.engine.engine import EagleEngine
    from eagle_ray.engine.tuning import verify_seconds
    engines = {k: EagleEngine.from_config(EngineConfig(dtype=dtype, max_batch_size=max(b for b, _ in blocks),
                                                       threads=threads, cpu_linears=k)) for k in layouts}
    out = []
    for b, t in blocks:
        ms = {k: [] for k in layouts}
        for _ in range(rounds):                       # interleaved: drift hits every layout alike
            for k, e in engines.items():
                ms[k].append(verify_seconds(e, b, t, repeats=reps) * 1e3)
        row = {"batch": b, "tokens": t, **{f"{k}_ms": round(statistics.median(v), 1) for k, v in ms.items()}}
        for k in layouts[1:]:
            row[f"{k}_vs_native"] = round(row[f"{k}_ms"] / row["native_ms"], 3)
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def cmd_linears(a) -> int:
    from eagle_ray.errors import ConfigError
    from eagle_ray.model.device import packed_available
    from eagle_ray.model.numerics import cpu_linears_for
    torch.set_num_threads(a.threads)
    if not packed_available():
        raise ConfigError("this torch build has no oneDNN linear kernel")
    dtype = getattr(torch, a.dtype)
    packs = cpu_linears_for(torch.device("cpu"), dtype) == "packed"   # the engine's own rule for this CPU
    layouts = LAYOUTS if packs else LAYOUTS[:2]   # oneDNN refuses to pack what the CPU only emulates
    blocks = [(1, 1), (1, 2), (1, 4), (1, 8), (1, 12), (1, 16), (1, 32), (8, 1), (8, 4)]
    reps = 20 if packs else 3    # emulated products take up to seconds a call
    write_result(a.out, {"dtype": a.dtype, "linears": linear_table(TARGET_LINEARS, [1, 2, 4, 8, 16, 32, 64], reps=reps,
                                                                   dtype=dtype, layouts=layouts),
                         "verify": verify_table(blocks, reps=3, rounds=3, threads=a.threads, dtype=a.dtype,
                                                layouts=layouts)}, a.command)
    return 0


# ---- attention ----------------------------------------------------------------------------------------------------
def folded(q, k, v, mask):
    """GQA as one kv head per group of query heads, the group's heads folded into query rows."""
    B, H, T, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    rep = H // Hkv
    m = mask.unsqueeze(2).expand(B, 1, rep, T, L).reshape(B, 1, rep * T, L)
    return F.scaled_dot_product_attention(q.reshape(B, Hkv, rep * T, D), k, v, attn_mask=m).view(B, H, T, D)


def gqa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def attention_row(B: int, T: int, L: int, calls: int) -> dict:
    g = torch.Generator().manual_seed(B * 100 + T)
    q, k, v = (torch.randn(B, h, n, 64, generator=g) for h, n in ((9, T), (3, L), (3, L)))
    mask = torch.rand(B, 1, T, L, generator=g) > 0.1
    times = {"enable_gqa": [], "folded": []}
    for _ in range(calls):                                           # the two forms alternate
        for name, fn in (("enable_gqa", gqa), ("folded", folded)):
            times[name].append(timed(fn, q, k, v, mask)[1])
    return {"batch": B, "block": T, "keys": L, **{f"{n}_us": 1e6 * statistics.median(t) for n, t in times.items()},
            "max_abs_diff": float((folded(q, k, v, mask) - gqa(q, k, v, mask)).abs().max())}


def cmd_attention(a) -> int:
    torch.set_num_threads(a.threads)
    rows = []
    for B, T, L in [(1, 1, 512), (1, 8, 512), (8, 1, 1024), (8, 8, 1024), (32, 8, 1024)]:
        rows.append(attention_row(B, T, L, a.calls))
        print(rows[-1], flush=True)
    write_result(a.out, {"dtype": "float32", "rows": rows}, a.command)
    return 0


# ---- tuner --------------------------------------------------------------------------------------------------------
def cmd_tuner(a) -> int:
    from eagle_ray.config import EngineConfig
    from eagle_ray.engine.engine import EagleEngine
    from eagle_ray.engine.tuning import autotune, choose_trees, collect_trace, trace_prompts
    engine = EagleEngine.from_config(EngineConfig(dtype=a.dtype, draft=a.draft, max_batch_size=a.max_batch_size,
                                                  threads=a.threads))
    tuning = autotune(engine)                              # the cached result (its costs)
    trace = collect_trace(engine, trace_prompts(4), 48)    # autotune's defaults
    verify = {int(b): {int(n): s for n, s in c.items()} for b, c in tuning.costs["verify"].items()}
    draft = {int(b): c for b, c in tuning.costs["draft"].items()}
    tree = engine.config.speculation.tree
    choices, table = choose_trees(trace, {a.batch: verify[a.batch]}, {a.batch: draft[a.batch]}, tree.lookup,
                                  tree.lookup_ngram)
    rows = sorted(table, key=lambda r: -r["tok_s"])
    result = {"batch": a.batch, "choice": choices[a.batch].__dict__,
              "plain": next(r for r in rows if r["total_tokens"] == 1),
              "best_trees": [r for r in rows if "verify_cap" not in r and r["total_tokens"] > 1][: a.top],
              "caps_on_best_tree": [r for r in table if "verify_cap" in r]}
    print(json.dumps(write_result(a.out, result, a.command, engine.device), indent=1))
    return 0


# ---- memory -------------------------------------------------------------------------------------------------------
DOC = ROOT / "docs" / "memory.md"
BEGIN, END = "<!-- memory-table:begin -->", "<!-- memory-table:end -->"
GPUS = {"24 GB (A10G, L4)": "A10G", "40 GB (A100)": "A100-40GB", "48 GB (L40S)": "L40S",
        "80 GB (A100, H100)": "H100-80GB"}  # each column's smaller card
BATCHES = (1, 8, 32)


def llama(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, tied: bool):
    """A Llama-3 shape (128256-token vocabulary, 128k positions)."""
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, intermediate_size=intermediate, vocab_size=128256,
                       tie_word_embeddings=tied, max_position_embeddings=131072, rms_norm_eps=1e-5)


# the published config.json sizes
LLAMA_3_2_1B = llama(2048, 16, 32, 8, 8192, tied=True)
LLAMA_3_1_8B = llama(4096, 32, 32, 8, 14336, tied=False)
LLAMA_3_1_70B = llama(8192, 80, 64, 8, 28672, tied=False)


def smollm2_135m():
    """The embedded target's own config (converted from its GGUF file on first use)."""
    from transformers import AutoConfig

    from eagle_ray.model.loading import resolve_target
    return AutoConfig.from_pretrained(str(resolve_target(None)))


def plan_for(target_config, engine, device_type: str = "cuda"):
    """The plan of an engine config's cache and trees for a target shape with an EAGLE-2 head of that shape (rank
    0's, where ``model.tensor_parallel`` splits the target)."""
    from eagle_ray.engine.budgets import tree_demand
    from eagle_ray.model.memory import plan_memory
    from eagle_ray.model.numerics import step_tokens
    verify, room, rows = tree_demand(engine.speculation)
    dtype = "bfloat16" if engine.model.dtype == "auto" else engine.model.dtype
    return plan_memory(target_config, "eagle2", None, dtype, device_type, engine.cache.max_model_len, verify,
                       draft_room=room, top_k=rows, precision=engine.precision,
                       step_tokens=step_tokens(engine.cache.max_step_tokens, device_type),
                       tensor_parallel=engine.model.tensor_parallel)


def gib(n: int) -> str:
    from eagle_ray.model.memory import GiB
    return f"{n / GiB:.1f}"


def slots_on(plan, gpu: str) -> int:
    """What ``max_batch_size: auto`` would pick on this GPU (0: the weights alone do not fit)."""
    from eagle_ray.model.memory import gpu_usable_bytes
    from eagle_ray.model.numerics import defaults_for
    return min(plan.max_slots(gpu_usable_bytes(gpu)), defaults_for("cuda").auto_max_slots)


def plan_cells(name: str, tp: int, max_len: int, plan, slots: dict) -> list[str]:
    return [name, str(tp), str(max_len), f"{gib(plan.target_weights)} + {gib(plan.draft_weights)}", gib(plan.workspace),
            f"{plan.per_slot / 2**20:.0f} MiB ({plan.kv_per_slot / 2**20:.0f} + {plan.draft_kv_per_slot / 2**20:.0f}"
            f" + {plan.logits_per_slot / 2**20:.0f} + {plan.pending_per_slot / 2**20:.0f})",
            *[gib(plan.total(b)) for b in BATCHES], *[str(n) if n else "no" for n in slots.values()]]


def memory_table(targets: dict) -> tuple[str, list[dict]]:
    from eagle_ray.config import EngineConfig
    head = ["target", "GPUs (tensor_parallel)", "max_model_len", "weights (target + head)", "workspace",
            "per slot (KV + draft KV + logits + pending head inputs)",
            *[f"total @ {b}" for b in BATCHES], *[f"slots on {g}" for g in GPUS]]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    rows = []
    for name, (cfg, tps) in targets.items():
        for tp in tps:
            for max_len in (4096, 2048):
                plan = plan_for(cfg, EngineConfig(dtype="bfloat16", max_model_len=max_len, tree_policy="auto",
                                                  tensor_parallel=tp))
                slots = {g: slots_on(plan, gpu) for g, gpu in GPUS.items()}
                lines.append("| " + " | ".join(plan_cells(name, tp, max_len, plan, slots)) + " |")
                rows.append({"target": name, "tensor_parallel": tp, "max_model_len": max_len,
                             "plan": plan.as_dict(*BATCHES), "slots": {GPUS[g]: n for g, n in slots.items()}})
    return "\n".join(lines), rows


def cmd_memory(a) -> int:
    from eagle_ray.model.memory import gpu_usable_bytes
    targets = {"SmolLM2-135M": (smollm2_135m(), (1,)), "Llama-3.2-1B": (LLAMA_3_2_1B, (1,)),
               "Llama-3.1-8B": (LLAMA_3_1_8B, (1, 2)), "Llama-3.1-70B": (LLAMA_3_1_70B, (1, 2, 4, 8))}
    text, rows = memory_table(targets)
    print(text)
    write_result(a.out, {"device": "cuda", "dtype": "bfloat16", "head": "eagle2 (for_target)", "tree_policy": "auto",
                         "usable_bytes": {gpu: gpu_usable_bytes(gpu) for gpu in GPUS.values()}, "rows": rows},
                 a.command)
    doc = Path(a.doc)
    if doc.exists() and BEGIN in doc.read_text():
        before, rest = doc.read_text().split(BEGIN, 1)
        doc.write_text(before + BEGIN + "\n" + text + "\n" + END + rest.split(END, 1)[1])
    return 0


# ---- the command line ---------------------------------------------------------------------------------------------
def add_forwards(sub) -> None:
    p = subcommand(sub, "forwards", cmd_forwards, "one target forward of B x T tokens per dtype and kernel mode")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    p.add_argument("--context", type=int, default=300, help="cached tokens per sequence")
    p.add_argument("--max-model-len", type=int, default=2048, help="KV cache positions per slot")
    p.add_argument("--compile", default="off", choices=["off", "inductor"])
    p.add_argument("--draft-tree", default=None, metavar="D/K", help="also the head's cost of a depth-D top-K tree")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--threads", type=int, default=None)


def add_kernels(sub) -> None:
    p = subcommand(sub, "linears", cmd_linears, "CPU layouts of the target's linears, per row count and verify pass")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p = subcommand(sub, "attention", cmd_attention, "GQA folded into query rows against SDPA's enable_gqa, on CPU",
                   out_required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=200)


def add_tuner(sub) -> None:
    p = subcommand(sub, "tuner", cmd_tuner, "the tuner's estimates at one batch size: plain, trees, caps")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-batch-size", type=int, default=64, help="the engine whose tuning is read")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--draft", default=None, help="EAGLE head dir (default: the embedded head)")
    p.add_argument("--top", type=int, default=8, help="trees listed besides plain and the caps")
    p.add_argument("--threads", type=int, default=2)


def add_memory(sub) -> None:
    p = subcommand(sub, "memory", cmd_memory, "docs/memory.md's table: engine memory for published Llama shapes")
    p.set_defaults(out=str(ROOT / "bench" / "results" / "memory_table.json"))
    p.add_argument("--doc", default=str(DOC))


def add_gpu(sub) -> None:
    sub.add_parser("gpu", help="the GPU step checks: bench/gpu_step.py with the flags that follow", add_help=False)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["gpu"]:   # the device's one-call script keeps its own flags
        import gpu_step
        gpu_step.main(argv[1:])
        return 0
    return run_entry(__doc__, SCRIPT, (add_forwards, add_kernels, add_tuner, add_memory, add_gpu), argv)


if __name__ == "__main__":
    raise SystemExit(main())
