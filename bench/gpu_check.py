"""How the engine behaves on a GPU, in one command that downloads nothing.

Builds random-weight targets of Llama-3.2-1B and Llama-3.1-8B shape on the device (and a random EAGLE-2 head for
each), then reports per shape:

- the verify cost table: one target pass over batch 1/8/32 x 1-64 tree tokens on a 256-token prefix (ms);
- the draft cost of a tree per depth (draft extend plus ``depth + 1`` head levels, top-k 8), batch 1/8/32 (ms);
- host reads in one decode step at batch 1 and 8 (``engine/host_reads.py``; the budget is 2);
- non-forward time: the share of decode-step time outside target and head forwards, at batch 1 and 8;
- peak device memory;
- greedy equality of EAGLE (random head) with plain decoding on 16 prompts x 64 tokens, with the logit gap where
  an output first differs (bf16 near-ties can flip; a random target's logits are scaled up to make ties rare).

    python bench/gpu_check.py --out bench/results/<gpu>/gpu_check.json            # on a machine with a GPU
    python bench/gpu_check.py --shapes tiny --device cpu --out /tmp/gpu_check.json  # the CPU smoke run (tests)
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {  # the published configurations' sizes
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False),
}
BATCHES, WIDTHS, DEPTHS = (1, 8, 32), (1, 2, 4, 8, 16, 32, 64), (0, 1, 2, 3, 5)


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer of ``vocab_size`` ids (outputs are detokenised; no tokenizer is downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ["<unk>", "</s>", "<s>"] + [f"w{i}" for i in range(vocab_size - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>", bos_token="<s>")


def build_engine(shape: str, device, dtype, max_batch_size: int, max_model_len: int, logit_scale: float = 8.0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle_ray.config import EngineConfig
    from eagle_ray.engine.engine import EagleEngine
    from eagle_ray.model.draft_head import DraftHead
    from eagle_ray.model.target import TargetModel

    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=max(4096, max_model_len), rms_norm_eps=1e-5,
                      bos_token_id=2, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)                     # initialised in the target dtype: no fp32 copy of 8B
    try:
        with torch.device(device):
            hf = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        hf.lm_head.weight.mul_(logit_scale)   # random logits are flat: scaled, greedy near-ties become rare
    config = EngineConfig(dtype=str(dtype).replace("torch.", ""), device=str(device), max_batch_size=max_batch_size,
                          max_model_len=max_model_len)
    target = TargetModel(hf, max_batch_size, max_model_len, **config.precision.model_dump())
    head = DraftHead.for_target(cfg)
    head.embed_tokens.weight.data.copy_(hf.model.embed_tokens.weight)
    head = head.to(device=device, dtype=dtype).eval()
    return EagleEngine(target, head, word_tokenizer(cfg.vocab_size), config)


def decode_step_probe(engine, batch: int, profile: bool = False) -> dict:
    """Host reads and the non-forward share of decode-only steps at ``batch`` (random prompts, 16 steps); with
    ``profile``, torch.profiler's table of those steps (top operators by device time, then by host time)."""
    import contextlib

    import torch

    from eagle_ray.config import SamplingParams
    from eagle_ray.engine.host_reads import count_host_reads
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        ids = torch.randint(3, engine.target.vocab_size, (32,), generator=g).tolist()
        engine.add_request(ids, SamplingParams(max_new_tokens=24, ignore_eos=True))
    while engine.scheduler.prefilling:
        engine.step()
    engine.step()
    with count_host_reads() as reads:
        engine.step()
    for k in ("decode_step_s", "decode_forward_s"):
        engine.counters[k] = 0.0
    engine.runner.profile = True     # synchronised phase times (on CUDA), for this probe only
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with (torch.profiler.profile(activities=activities) if profile else contextlib.nullcontext()) as prof:
        for _ in range(16):
            engine.step()
    engine.runner.profile = False
    while engine.has_unfinished():
        engine.step()
    c = engine.counters
    out = {"host_reads": reads.count, "read_sites": reads.by_site(),
           "step_ms": 1e3 * c["decode_step_s"] / 16,
           "non_forward_fraction": 1 - c["decode_forward_s"] / c["decode_step_s"] if c["decode_step_s"] else 0.0}
    if profile:
        table = prof.key_averages()
        out["profile"] = {key: table.table(sort_by=key, row_limit=25).splitlines()
                          for key in (["self_cuda_time_total"] if engine.device.type == "cuda" else [])
                          + ["self_cpu_time_total"]}
    return out


def greedy_equality(engine, n: int, tokens: int) -> dict:
    """EAGLE against plain greedy decoding on ``n`` random prompts; where they differ, the plain target's top-2
    logit gap at the first difference."""
    import torch

    from eagle_ray.config import SamplingParams
    from eagle_ray.measure import divergence
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, engine.target.vocab_size, (int(16 + 8 * (i % 5)),), generator=g).tolist()
               for i in range(n)]
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    spec = engine.generate(prompts, params)
    plain = engine.generate(prompts, params, speculative=False)
    diffs = []
    for s, p in zip(spec, plain):
        if s.token_ids != p.token_ids:
            diffs.append(divergence(engine.target.next_token_logits, s.prompt_token_ids, p.token_ids, s.token_ids))
    return {"prompts": n, "tokens": tokens, "equal": n - len(diffs), "differences": diffs,
            "tau": sum(o.stats.tau for o in spec) / n}


def check_shape(shape: str, device, dtype, a) -> dict:
    import torch

    from eagle_ray.engine.tuning import draft_seconds, verify_seconds
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    engine = build_engine(shape, device, dtype, max(a.batches), a.max_model_len)
    out = {"build_s": time.perf_counter() - t0, "numerics": asdict(engine.target.numerics)}
    out["verify_ms"] = {b: {w: 1e3 * verify_seconds(engine, b, w) for w in a.widths} for b in a.batches}
    out["draft_tree_ms"] = {b: {d: 1e3 * draft_seconds(engine, b, d, 8) for d in a.depths} for b in a.batches}
    out["decode_step"] = {b: decode_step_probe(engine, b, a.profile) for b in (1, 8) if b <= max(a.batches)}
    out["greedy"] = greedy_equality(engine, a.prompts, a.tokens)
    if device.type == "cuda":
        out["peak_memory_mib"] = torch.cuda.max_memory_allocated() / 2**20
    else:
        out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="llama-3.2-1b,llama-3.1-8b", help=f"comma list of {sorted(SHAPES)}")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--widths", default=",".join(map(str, WIDTHS)))
    p.add_argument("--depths", default=",".join(map(str, DEPTHS)))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--profile", action="store_true", help="add torch.profiler tables of the decode-step probe")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    try:
        a.batches, a.widths, a.depths = ([int(x) for x in v.split(",")] for v in (a.batches, a.widths, a.depths))
    except ValueError as e:
        p.error(f"--batches, --widths and --depths are comma lists of whole numbers ({e})")
    unknown = sorted(set(a.shapes.split(",")) - set(SHAPES))
    if unknown:
        p.error(f"--shapes: unknown {unknown}; choose from {sorted(SHAPES)}")

    import torch
    import transformers

    from eagle_ray.model.device import cpu_model, device_name
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    result = {"command": "bench/gpu_check.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "device": device_name(device), "cpu": cpu_model(),
              "torch": torch.__version__, "transformers": transformers.__version__, "dtype": a.dtype, "shapes": {}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    for shape in a.shapes.split(","):
        result["shapes"][shape] = check_shape(shape, device, dtype, a)
        print(shape, json.dumps({k: v for k, v in result["shapes"][shape].items() if k != "verify_ms"}), flush=True)
        Path(a.out).write_text(json.dumps(result, indent=2))   # after every shape: a run cut short keeps its shapes
    return result


if __name__ == "__main__":
    main()
