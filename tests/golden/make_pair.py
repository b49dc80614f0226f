r"""The golden pair: a tiny fixed Llama target and EAGLE-2 / EAGLE-3 heads trained on its own greedy outputs until
they accept a lot, small enough to run against the SafeAILab reference's traces in every test run.

    python tests/golden/make_pair.py target     # the target, its tokenizer and the prompts (seconds)
    python tests/golden/make_pair.py answers    # its greedy answers to the training prompts (jobs/selfdistill.py)
    python tests/golden/make_pair.py heads      # both heads (jobs/train_drafter.py), then their tau
    python tests/golden/make_pair.py tau        # tau of both heads, default tree, on the golden prompts

The target is not trained. Its weights are random (seeded) except two: the embedding is a random table and the
lm_head scores, from a state near a token's embedding, the token a fixed random permutation of the word ids puts
after it. The layers' small random weights perturb that state with the context, so greedy output walks long cycles
of the permutation with context-dependent turns (about 4% of tokens): diverse text that a one-layer head can learn
to predict, with top-2 logit margins far above fp32 rounding (so two fp32 implementations pick the same tokens).
Special tokens (``<unk> </s> <s> user assistant system :``) are never a successor, so answers run to their length.

The heads come from the project's own pipeline, unchanged: ``jobs/selfdistill.py`` answers the training prompts
(plain greedy, fp32) into a token-id answer set, ``jobs/train_drafter.py --answers`` trains on the target's states
of those answers. The EAGLE-2 head drafts over the whole vocabulary (as the reference does for EAGLE-1/2 heads);
the EAGLE-3 head over a draft vocabulary of 240 of the 256 ids, so the reference's d2t/t2d mapping is exercised.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PAIR = HERE / "pair"
TARGET, EAGLE2, EAGLE3 = PAIR / "target", PAIR / "eagle2", PAIR / "eagle3"
ANSWERS = PAIR / "answers"
TRAIN_PROMPTS = PAIR / "train_prompts.parquet"
PROMPTS = HERE / "prompts.json"           # the golden prompts: what the reference traces and the tests run

VOCAB, HIDDEN, LAYERS = 256, 64, 8        # 8 layers: an EAGLE-3 head reads the inputs of layers 2, 4 and 5
SPECIALS = 7                               # <unk> </s> <s> user assistant system :
LAYER_STD, LOGIT_SCALE = 0.1, 3.0          # context perturbs ~4% of greedy steps; margins >= 0.02
SEED = 0
TRAIN_PROMPT_COUNT, GOLDEN_PROMPT_COUNT = 512, 10
ANSWER_TOKENS = 128


def tokenizer():
    """A word-level tokenizer over ``<unk> </s> <s> user assistant system : w0 .. w248`` with a chat template."""
    sys.path.insert(0, str(REPO / "tests"))
    from tiny import make_tokenizer
    return make_tokenizer(VOCAB)


def build_target():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(SEED)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, eos_token_id=1,
                      bos_token_id=2, pad_token_id=0, tie_word_embeddings=False, rms_norm_eps=1e-6,
                      initializer_range=LAYER_STD)
    model = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        embed = torch.randn(VOCAB, HIDDEN, generator=g)
        words = torch.arange(SPECIALS, VOCAB)
        order = words[torch.randperm(len(words), generator=g)]
        successor = torch.empty(VOCAB, dtype=torch.long)
        successor[:SPECIALS] = order[:SPECIALS]
        successor[words] = order
        scorer = torch.zeros(VOCAB, HIDDEN).index_add_(0, successor, embed)
        model.model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(scorer * LOGIT_SCALE / HIDDEN ** 0.5)
    return model


def save_target(path: Path) -> None:
    """The target in the Hugging Face layout, readable by transformers 5 (eagle-ray) and 4.53 (the reference: it
    wants a top-level ``rope_theta`` and a safetensors index)."""
    model = build_target()
    model.save_pretrained(path)
    tokenizer().save_pretrained(path)
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"     # transformers 5 names a class 4.x lacks
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")
    cfg = json.loads((path / "config.json").read_text())
    cfg.setdefault("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    cfg.setdefault("rope_scaling", None)
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    from safetensors import safe_open
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = sorted(f.keys())
    index = {"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")


def chat_ids(tok, words: list[str]) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": " ".join(words)}], add_generation_prompt=True,
                                  tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def make_prompts(count: int, seed: int, lo: int, hi: int) -> list[list[int]]:
    """Chat prompts of ``lo..hi`` random words each."""
    tok, g = tokenizer(), torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(lo, hi + 1, (1,), generator=g))
        words = [f"w{int(i)}" for i in torch.randint(0, VOCAB - SPECIALS, (n,), generator=g)]
        out.append(chat_ids(tok, words))
    return out


def cmd_target(_) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    TARGET.mkdir(parents=True, exist_ok=True)
    save_target(TARGET)
    train = make_prompts(TRAIN_PROMPT_COUNT, seed=11, lo=4, hi=80)
    pq.write_table(pa.table({"id": [f"train-{i}" for i in range(len(train))],
                             "prompt_ids": pa.array(train, pa.list_(pa.int32()))}), TRAIN_PROMPTS)
    golden = make_prompts(GOLDEN_PROMPT_COUNT, seed=12, lo=3, hi=120)   # another seed: never trained on
    PROMPTS.write_text(json.dumps({"about": "the golden prompts: chat-templated token ids of random words "
                                           "(tests/golden/make_pair.py)",
                                   "prompts": [{"id": f"golden-{i}", "prompt_ids": p} for i, p in enumerate(golden)]},
                                  indent=None) + "\n")
    print(f"target in {TARGET}; {len(train)} training prompts, {len(golden)} golden prompts "
          f"({min(map(len, golden))}..{max(map(len, golden))} tokens)")


def run(args: list[str]) -> None:
    print("+ " + " ".join(args), flush=True)
    subprocess.run([sys.executable, *args], cwd=REPO, check=True)


def cmd_answers(_) -> None:
    run(["jobs/selfdistill.py", "--source", "prompt-file", "--prompt-file", str(TRAIN_PROMPTS.relative_to(REPO)),
         "--target", str(TARGET.relative_to(REPO)), "--set-dir", str(ANSWERS.relative_to(REPO)),
         "--skip-sets", str(ANSWERS.relative_to(REPO)), "--max-new-tokens", str(ANSWER_TOKENS),
         "--batch-size", "32", "--shard-rows", "512"])


def cmd_heads(a) -> None:
    common = ["--answers", str(ANSWERS.relative_to(REPO)), "--target", str(TARGET.relative_to(REPO)),
              "--lr", "3e-3", "--warmup-steps", "20", "--tokens-per-step", "4096", "--noise", "0",
              "--eval-fraction", "0.05", "--checkpoint-every", "1000000", "--epochs", str(a.epochs)]
    for kind, out, extra in (("eagle2", EAGLE2, ["--token-map-size", "0"]),
                             ("eagle3", EAGLE3, ["--token-map-size", "240", "--unroll-steps", "3"])):
        work = Path(a.work) / kind
        shutil.rmtree(work, ignore_errors=True)      # a fresh run, never a resumed one
        run(["jobs/train_drafter.py", "--head-type", kind, "--out", str(work), *common, *extra])
        out.mkdir(parents=True, exist_ok=True)
        for f in (work / "head").iterdir():
            (out / f.name).write_bytes(f.read_bytes())
    cmd_tau(a)


def tau_of(head: Path, tree=None, batch: int = 1) -> tuple[float, list[list[int]]]:
    """Tau of ``head`` on the golden prompts (fp32, greedy, no prompt lookup), and the outputs."""
    sys.path.insert(0, str(REPO))
    from eagle_ray.config import SamplingParams, TreeConfig
    from eagle_ray.engine.engine import EagleEngine
    engine = EagleEngine.from_pretrained(str(TARGET), str(head), dtype="float32", max_batch_size=batch,
                                         max_model_len=512, tree=tree or TreeConfig(lookup=0), draft_vocab_size=0,
                                         context_vocab=0)
    prompts = [p["prompt_ids"] for p in json.loads(PROMPTS.read_text())["prompts"]]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=ANSWER_TOKENS))
    steps = sum(o.stats.verify_steps for o in outs)
    return sum(o.stats.step_tokens for o in outs) / max(steps, 1), [o.token_ids for o in outs]


def cmd_tau(_) -> None:
    for name, head in (("eagle2", EAGLE2), ("eagle3", EAGLE3)):
        tau, _ = tau_of(head)
        print(f"{name}: tau {tau:.3f} (default tree 8/2/3, lookup off, fp32, {GOLDEN_PROMPT_COUNT} golden prompts x "
              f"{ANSWER_TOKENS})", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("target").set_defaults(func=cmd_target)
    sub.add_parser("answers").set_defaults(func=cmd_answers)
    h = sub.add_parser("heads")
    h.add_argument("--work", default="/tmp/golden-heads", help="training runs (checkpoints) go here")
    h.add_argument("--epochs", type=int, default=40)
    h.set_defaults(func=cmd_heads)
    sub.add_parser("tau").set_defaults(func=cmd_tau)
    a = p.parse_args(argv)
    a.func(a)


if __name__ == "__main__":
    main()
