"""The ``make-random-eagle3`` subcommand: a randomly initialised EAGLE-3 head built with the reference's own class
and training conventions, saved as the reference loads it, then checked by loading it into the reference and
decoding, so that eagle-ray's EAGLE-3 path can be compared with a head the reference itself made."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .checkout import git_commit, import_reference
from .prompts import chat_prompt_ids


def read_token_ranking(path: str) -> list[int]:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        tensors = load_file(path)
        if len(tensors) != 1:
            raise SystemExit(f"{path}: expected one tensor, found {list(tensors)}")
        return [int(t) for t in next(iter(tensors.values())).view(-1).tolist()]
    with open(path) as f:
        return [int(t) for t in json.load(f)]


def build_d2t_t2d(vocab_size: int, draft_vocab_size: int, ranking: list[int] | None):
    """The reference's convention (eagle/traineagle3/cnets.py scandata): used = the N most frequent ids, sorted
    ascending; d2t[i] = used[i] - i (so target = draft + d2t[draft]); t2d[v] = v in used."""
    if ranking is None:
        used = list(range(draft_vocab_size))
    else:
        seen, used = set(), []
        for t in ranking:
            if 0 <= t < vocab_size and t not in seen:
                seen.add(t)
                used.append(t)
            if len(used) == draft_vocab_size:
                break
        if len(used) < draft_vocab_size:
            raise SystemExit(
                f"token ranking has only {len(used)} distinct valid ids, need {draft_vocab_size}"
            )
    used.sort()
    d2t = torch.tensor([used[i] - i for i in range(draft_vocab_size)], dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.tensor(used)] = True
    return d2t, t2d


def eagle3_config(tcfg: dict, draft_vocab: int) -> dict:
    """The field set of the reference's EAGLE-3 training config (eagle/traineagle3/config.json), filled from the
    target's config."""
    rope_theta = tcfg.get(
        "rope_theta", (tcfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "bos_token_id": tcfg.get("bos_token_id"),
        "eos_token_id": tcfg.get("eos_token_id"),
        "pad_token_id": tcfg.get("pad_token_id", 0),
        "hidden_act": tcfg.get("hidden_act", "silu"),
        "hidden_size": tcfg["hidden_size"],
        "initializer_range": tcfg.get("initializer_range", 0.02),
        "intermediate_size": tcfg["intermediate_size"],
        "max_position_embeddings": tcfg["max_position_embeddings"],
        "num_attention_heads": tcfg["num_attention_heads"],
        "num_key_value_heads": tcfg.get(
            "num_key_value_heads", tcfg["num_attention_heads"]
        ),
        "num_hidden_layers": 1,
        "rms_norm_eps": tcfg["rms_norm_eps"],
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": int(tcfg["vocab_size"]),
        "draft_vocab_size": draft_vocab,
    }


def random_head_state(args, out: Path, vocab_size: int, draft_vocab: int) -> dict:
    """The reference's ``cnets.Model`` seeded and built (embedding: the target's, not saved), its d2t/t2d set,
    as fp32 tensors; without d2t/t2d when the draft vocabulary is the full one (the reference deletes them then)."""
    from eagle.model.cnets import Model as Eagle3Model
    from eagle.model.configs import EConfig

    config = EConfig.from_pretrained(str(out))
    torch.manual_seed(args.seed)
    head = Eagle3Model(
        config, load_emb=True, path=args.target
    )  # embedding: the target's (not saved)
    ranking = read_token_ranking(args.token_ids) if args.token_ids else None
    d2t, t2d = build_d2t_t2d(vocab_size, draft_vocab, ranking)
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
    state = {
        k: v.detach()
        .to(torch.float32 if v.is_floating_point() else v.dtype)
        .contiguous()
        .clone()
        for k, v in head.state_dict().items()
        if not k.startswith("embed_tokens.")
    }
    if (
        draft_vocab == vocab_size
    ):  # the reference deletes d2t/t2d in that case; do not save them
        state.pop("d2t", None)
        state.pop("t2d", None)
    return state


def save_head(state: dict, out: Path, args, draft_vocab: int) -> None:
    """``pytorch_model.bin`` and/or ``model.safetensors`` (identical tensors) and ``head_info.json``."""
    if args.format in ("bin", "both"):
        torch.save(state, out / "pytorch_model.bin")
    if args.format in ("safetensors", "both"):
        from safetensors.torch import save_file

        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    info = {
        "created_by": "bench/fidelity.py make-random-eagle3",
        "reference_commit": git_commit(args.eagle_dir),
        "class": "eagle/model/cnets.py:Model",
        "seed": args.seed,
        "draft_vocab_size": draft_vocab,
        "token_ranking": args.token_ids
        or "identity over the first draft_vocab_size ids",
        "keys": {k: [list(v.shape), str(v.dtype)] for k, v in state.items()},
    }
    with open(out / "head_info.json", "w") as f:
        json.dump(info, f, indent=1)
    for k, v in state.items():
        print(f"  {k:48s} {tuple(v.shape)} {v.dtype}")


def check_reference_loads(ea_model_mod, args, out: Path, state: dict):
    """The reference loads every saved tensor (its load_state_dict is non-strict: compared key by key) and takes
    the embedding from the target; returns the loaded model."""
    model = ea_model_mod.EaModel.from_pretrained(
        use_eagle3=True,
        base_model_path=args.target,
        ea_model_path=str(out),
        total_token=8,
        depth=2,
        top_k=3,
        torch_dtype=torch.float32,
    )
    model.eval()
    loaded = model.ea_layer.state_dict()
    problems = [
        k
        for k in state
        if k not in loaded or not torch.equal(loaded[k].cpu(), state[k])
    ]
    problems += [
        k for k in loaded if k not in state and not k.startswith("embed_tokens.")
    ]
    if not torch.equal(
        loaded["embed_tokens.weight"],
        model.base_model.model.embed_tokens.weight.detach(),
    ):
        problems.append("embed_tokens.weight != target embedding")
    if problems:
        raise SystemExit(f"reference did not load the head as saved: {problems}")
    return model


def check_speculation_is_greedy(model, args, n_tensors: int) -> None:
    """A short ``eagenerate`` with the head equals ``naivegenerate``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.target)
    ids = torch.tensor([chat_prompt_ids(tok, "Write a haiku about the sea.")])
    spec = model.eagenerate(ids, temperature=0.0, max_new_tokens=24)
    plain = model.naivegenerate(ids, temperature=0.0, max_new_tokens=24)
    m = min(spec.shape[1], plain.shape[1])
    same = torch.equal(spec[0, :m], plain[0, :m])
    print(
        f"loaded by EaModel.from_pretrained(use_eagle3=True): all {n_tensors} tensors match, embedding is the "
        f"target's; eagenerate == naivegenerate on a short prompt: {same}"
    )
    if not same:
        raise SystemExit("speculative output differs from greedy")


def cmd_make_random_eagle3(args) -> None:
    torch.set_num_threads(args.threads)
    ea_model_mod = import_reference(args.eagle_dir)
    import eagle.model.cnets  # noqa: F401 - the head's classes, imported before anything is written
    import eagle.model.configs  # noqa: F401

    with open(os.path.join(args.target, "config.json")) as f:
        tcfg = json.load(f)
    vocab_size = int(tcfg["vocab_size"])
    draft_vocab = int(args.draft_vocab_size)
    if not 0 < draft_vocab <= vocab_size:
        raise SystemExit(f"--draft-vocab-size must be in 1..{vocab_size}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "config.json", "w") as f:
        json.dump(eagle3_config(tcfg, draft_vocab), f, indent=2)
    state = random_head_state(args, out, vocab_size, draft_vocab)
    save_head(state, out, args, draft_vocab)
    model = check_reference_loads(ea_model_mod, args, out, state)
    check_speculation_is_greedy(model, args, len(state))
