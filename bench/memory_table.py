"""docs/memory.md's table: what one engine needs for published Llama shapes, from ``plan_memory`` on meta tensors.

Nothing is loaded or allocated: each target is built from its config on the ``meta`` device, so the table is the
same on any machine. bf16 on CUDA, an EAGLE-2 head shaped for the target (``DraftHead.for_target``: embedding, fc
and one decoder layer with the target's widths), ``tree_policy: auto`` (the tuner's largest trees), the CUDA step
budget, default precision (no fp32 copies on CUDA).

    .venv/bin/python bench/memory_table.py     # rewrites the table in docs/memory.md + bench/results/memory_table.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from transformers import LlamaConfig

from eagle_ray.config import EngineConfig
from eagle_ray.engine.sizing import tree_demand
from eagle_ray.model.memory import GiB, MemoryPlan, gpu_usable_bytes, plan_memory
from eagle_ray.model.numerics import step_tokens

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "memory.md"
BEGIN, END = "<!-- memory-table:begin -->", "<!-- memory-table:end -->"
GPUS = {"24 GB (A10G, L4)": "A10G", "40 GB (A100)": "A100-40GB", "48 GB (L40S)": "L40S",
        "80 GB (A100, H100)": "H100-80GB"}  # each column's smaller card
BATCHES = (1, 8, 32)


def llama(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, tied: bool) -> LlamaConfig:
    """A Llama-3 shape (128256-token vocabulary, 128k positions)."""
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


def plan_for(target_config, engine: EngineConfig, device_type: str = "cuda") -> MemoryPlan:
    """The plan of an engine config's cache and trees for a target shape with an EAGLE-2 head of that shape."""
    verify, room, rows = tree_demand(engine.speculation)
    dtype = "bfloat16" if engine.model.dtype == "auto" else engine.model.dtype
    return plan_memory(target_config, "eagle2", None, dtype, device_type, engine.cache.max_model_len, verify,
                       draft_room=room, top_k=rows, precision=engine.precision,
                       step_tokens=step_tokens(engine.cache.max_step_tokens, device_type))


def gib(n: int) -> str:
    return f"{n / GiB:.1f}"


def slots_on(plan: MemoryPlan, gpu: str) -> int:
    """What ``max_batch_size: auto`` would pick on this GPU (0: the weights alone do not fit)."""
    from eagle_ray.model.numerics import defaults_for
    return min(plan.max_slots(gpu_usable_bytes(gpu)), defaults_for("cuda").auto_max_slots)


def table(targets: dict) -> tuple[str, list[dict]]:
    head = ["target", "max_model_len", "weights (target + head)", "workspace", "per slot (KV + draft KV + logits + pending head inputs)",
            *[f"total @ {b}" for b in BATCHES], *[f"slots on {g}" for g in GPUS]]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    rows = []
    for name, cfg in targets.items():
        for max_len in (4096, 2048):
            plan = plan_for(cfg, EngineConfig(dtype="bfloat16", max_model_len=max_len, tree_policy="auto"))
            slots = {g: slots_on(plan, gpu) for g, gpu in GPUS.items()}
            cells = [name, str(max_len), f"{gib(plan.target_weights)} + {gib(plan.draft_weights)}",
                     gib(plan.workspace),
                     f"{plan.per_slot / 2**20:.0f} MiB ({plan.kv_per_slot / 2**20:.0f} + "
                     f"{plan.draft_kv_per_slot / 2**20:.0f} + {plan.logits_per_slot / 2**20:.0f} + "
                     f"{plan.pending_per_slot / 2**20:.0f})",
                     *[gib(plan.total(b)) for b in BATCHES],
                     *[str(n) if n else "no" for n in slots.values()]]
            lines.append("| " + " | ".join(cells) + " |")
            rows.append({"target": name, "max_model_len": max_len, "plan": plan.as_dict(*BATCHES),
                         "slots": {GPUS[g]: n for g, n in slots.items()}})
    return "\n".join(lines), rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "memory_table.json"))
    ap.add_argument("--doc", default=str(DOC))
    a = ap.parse_args()
    targets = {"SmolLM2-135M": smollm2_135m(), "Llama-3.2-1B": LLAMA_3_2_1B, "Llama-3.1-8B": LLAMA_3_1_8B,
               "Llama-3.1-70B": LLAMA_3_1_70B}
    text, rows = table(targets)
    print(text)
    gpus = {gpu: gpu_usable_bytes(gpu) for gpu in GPUS.values()}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"device": "cuda", "dtype": "bfloat16", "head": "eagle2 (for_target)",
                                       "tree_policy": "auto", "usable_bytes": gpus, "rows": rows}, indent=1))
    doc = Path(a.doc)
    if doc.exists() and BEGIN in doc.read_text():
        before, rest = doc.read_text().split(BEGIN, 1)
        doc.write_text(before + BEGIN + "\n" + text + "\n" + END + rest.split(END, 1)[1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
