"""Draft heads in the SafeAILab EAGLE-1/2 layout: exact keys and shapes, bit-exact round trip, reference files load,
mismatches fail at load naming both numbers."""
import json

import pytest
import torch
from transformers import LlamaConfig

from eagle_ray.errors import CheckpointError
from eagle_ray.model.draft_head import DraftHead

REFERENCE_KEYS = {
    "embed_tokens.weight": ("V", "d"), "fc.weight": ("d", "2d"), "fc.bias": ("d",),
    "layers.0.self_attn.q_proj.weight": ("d", "d"), "layers.0.self_attn.k_proj.weight": ("kv", "d"),
    "layers.0.self_attn.v_proj.weight": ("kv", "d"), "layers.0.self_attn.o_proj.weight": ("d", "d"),
    "layers.0.mlp.gate_proj.weight": ("i", "d"), "layers.0.mlp.up_proj.weight": ("i", "d"),
    "layers.0.mlp.down_proj.weight": ("d", "i"), "layers.0.post_attention_layernorm.weight": ("d",),
}


def target_config(**kw):
    base = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256)
    base.update(kw)
    return LlamaConfig(**base)


def test_saved_head_has_exactly_the_reference_keys_and_shapes(tmp_path):
    cfg = target_config()
    head = DraftHead.for_target(cfg)
    head.save(tmp_path)
    from safetensors.torch import load_file
    sd = load_file(str(tmp_path / "model.safetensors"))
    dims = {"V": 96, "d": 32, "2d": 64, "kv": 16, "i": 48}
    assert {k: tuple(v.shape) for k, v in sd.items()} == {k: tuple(dims[x] for x in s) for k, s in REFERENCE_KEYS.items()}
    saved_cfg = json.loads((tmp_path / "config.json").read_text())
    assert saved_cfg["num_hidden_layers"] == 1 and saved_cfg["architectures"] == ["LlamaForCausalLM"]
    assert saved_cfg["bias"] is True and saved_cfg["hidden_size"] == 32 and saved_cfg["vocab_size"] == 96


def test_round_trip_is_bit_exact(tmp_path):
    head = DraftHead.for_target(target_config())
    head.save(tmp_path)
    again = DraftHead.load(tmp_path, target_config())
    for (k, a), (k2, b) in zip(head.state_dict().items(), again.state_dict().items()):
        assert k == k2 and torch.equal(a, b)


def test_a_head_in_the_reference_layout_loads(tmp_path):
    """Built the way SafeAILab ships heads: config.json + pytorch_model.bin, fc without bias ("bias": false, as the
    LLaMA3 heads), no embedding (taken from the target)."""
    cfg = target_config()
    g = torch.Generator().manual_seed(0)
    shapes = {"d": 32, "2d": 64, "kv": 16, "i": 48}
    sd = {k: torch.randn(*(shapes[x] for x in s), generator=g) for k, s in REFERENCE_KEYS.items()
          if k not in ("embed_tokens.weight", "fc.bias")}
    torch.save(sd, tmp_path / "pytorch_model.bin")
    conf = {k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                                         "num_key_value_heads", "max_position_embeddings", "rms_norm_eps")}
    conf.update(num_hidden_layers=1, hidden_act="silu", architectures=["LlamaForCausalLM"], bias=False,
                rope_theta=10000.0)
    (tmp_path / "config.json").write_text(json.dumps(conf))
    embed = torch.randn(96, 32, generator=g)
    head = DraftHead.load(tmp_path, cfg, target_embed=embed)
    assert head.fc.bias is None
    assert torch.equal(head.fc.weight, sd["fc.weight"]) and torch.equal(head.embed_tokens.weight, embed)
    assert torch.equal(head.layers[0].mlp.down_proj.weight, sd["layers.0.mlp.down_proj.weight"])


@pytest.mark.parametrize("key,value", [("hidden_size", 64), ("vocab_size", 100)])
def test_mismatched_head_fails_at_load_naming_both_numbers(tmp_path, key, value):
    DraftHead.for_target(target_config(**{key: value}) if key != "hidden_size" else
                         target_config(hidden_size=64, num_attention_heads=4)).save(tmp_path)
    with pytest.raises(CheckpointError) as e:
        DraftHead.load(tmp_path, target_config())
    expected = {"hidden_size": 32, "vocab_size": 96}[key]
    assert f"head {key}={value}" in str(e.value) and f"target {key}={expected}" in str(e.value)


def test_missing_files_and_wrong_shapes_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        DraftHead.load(tmp_path, target_config())
    DraftHead.for_target(target_config()).save(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors nor pytorch_model.bin"):
        DraftHead.load(tmp_path, target_config())
    head = DraftHead.for_target(target_config())
    sd = head.state_dict()
    sd["fc.weight"] = torch.zeros(32, 10)
    torch.save(sd, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"fc.weight has shape \(32, 10\)"):
        DraftHead.load(tmp_path, target_config())


def test_qwen2_heads_carry_qkv_bias(tmp_path):
    from transformers import Qwen2Config
    cfg = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    head = DraftHead.for_target(cfg)
    head.save(tmp_path)
    keys = set(DraftHead.load(tmp_path, cfg).state_dict())
    assert {"layers.0.self_attn.q_proj.bias", "layers.0.self_attn.k_proj.bias", "layers.0.self_attn.v_proj.bias"} <= keys
    assert "layers.0.self_attn.o_proj.bias" not in keys
    assert json.loads((tmp_path / "config.json").read_text())["qkv_bias"] is True


@pytest.mark.parametrize("edit, reason", [
    ({"intermediate_size": -1}, "intermediate_size must be a positive integer, got -1"),
    ({"intermediate_size": "48"}, "intermediate_size must be a positive integer, got '48'"),
    ({"vocab_size": 96.0}, "vocab_size must be a positive integer, got 96.0"),
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
    ({"intermediate_size": 10**30}, "intermediate_size must be a positive integer"),
    ({"num_key_value_heads": 3}, "num_key_value_heads 3 does not divide num_attention_heads 4"),
    ({"bias": "false"}, "bias must be true or false, got 'false'"),
    ({"bias": None, "qkv_bias": None}, None),   # null: the defaults, as before
    ({"hidden_act": "foo"}, "does not describe a head this engine can build: ValueError: hidden_act must be 'silu'"),
    ({"rope_scaling": {"type": "linear"}}, "does not describe a head this engine can build"),
])
def test_a_head_config_that_cannot_build_a_head_fails_before_the_target_loads(tmp_path, edit, reason):
    """Each of these used to escape as a torch or transformers error (negative dimension, ZeroDivisionError,
    KeyError...) from deep in loading; ``check_head`` reads them before the target's weights."""
    from eagle_ray.model.heads import check_head
    DraftHead.for_target(target_config()).save(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | edit))
    if reason is None:
        assert check_head(tmp_path, target_config()).kind == "eagle2"
        assert DraftHead.load(tmp_path, target_config()).fc.bias is not None
        return
    with pytest.raises(CheckpointError, match=reason):
        check_head(tmp_path, target_config())


def test_a_head_with_nan_or_infinite_or_integer_weights_is_refused_at_load(tmp_path):
    """A diverged head makes every draft junk (and used to break its trees): refused, naming the tensor."""
    from safetensors.torch import load_file, save_file
    for key, value, reason in (("fc.weight", float("nan"), "fc.weight holds NaN or infinite values"),
                               ("layers.0.mlp.up_proj.weight", float("inf"), "up_proj.weight holds NaN or infinite"),
                               ("fc.bias", None, "fc.bias is int64, the layout holds floating-point values"),
                               ("fc.weight", "fp8", "fc.weight holds NaN or infinite values")):
        DraftHead.for_target(target_config()).save(tmp_path)
        sd = load_file(str(tmp_path / "model.safetensors"))
        if value == "fp8":   # no isfinite of its own
            sd[key] = sd[key].fill_(float("nan")).to(torch.float8_e4m3fn)
        else:
            sd[key] = sd[key].long() if value is None else sd[key].fill_(value)
        save_file(sd, str(tmp_path / "model.safetensors"))
        with pytest.raises(CheckpointError, match=reason):
            DraftHead.load(tmp_path, target_config())


def test_a_torch_archive_or_token_map_of_the_wrong_kind_is_refused_naming_the_file(tmp_path):
    from safetensors.torch import save_file
    DraftHead.for_target(target_config()).save(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    for content, reason in (([torch.zeros(2)], "got list"), (torch.zeros(2), "got Tensor"),
                            ({"state_dict": {"fc.weight": torch.zeros(2)}}, "'state_dict' holds a dict")):
        torch.save(content, tmp_path / "pytorch_model.bin")
        with pytest.raises(CheckpointError, match=f"pytorch_model.bin must hold a mapping of names to .*{reason}"):
            DraftHead.load(tmp_path, target_config())
    DraftHead.for_target(target_config()).save(tmp_path)
    save_file({"token_map": torch.ones(8, dtype=torch.bool)}, str(tmp_path / "token_map.safetensors"))
    with pytest.raises(CheckpointError, match="one 1-D integer tensor"):
        DraftHead.load(tmp_path, target_config())
    save_file({"token_map": torch.zeros(0, dtype=torch.long)}, str(tmp_path / "token_map.safetensors"))
    with pytest.raises(CheckpointError, match="token_map is empty"):
        DraftHead.load(tmp_path, target_config())
    from eagle_ray.model.sizing import draft_vocab_for
    from eagle_ray.model.checkpoint import HeadCheckpoint
    for content, reason in ((b"garbage", "token_map.safetensors cannot be read"),
                            (None, "must hold one 1-D integer tensor 'token_map', got None")):
        if content is None:
            save_file({"other": torch.arange(8)}, str(tmp_path / "token_map.safetensors"))
        else:
            (tmp_path / "token_map.safetensors").write_bytes(content)
        with pytest.raises(CheckpointError, match=reason):   # read while planning memory, before any weights
            draft_vocab_for("eagle2", HeadCheckpoint(tmp_path, {}), None)


def test_a_damaged_target_fails_at_load_naming_what_is_wrong(tiny_dir, tmp_path):
    """transformers fills a tensor the files lack with random values and only logs it: such a target used to
    load and generate garbage. Bad configs, tokenizers, weights and GGUF files used to escape as its raw errors."""
    import shutil

    from safetensors.torch import load_file, save_file

    from eagle_ray.engine.engine import EagleEngine

    def broken(name, edit):
        path = tmp_path / name
        shutil.copytree(tiny_dir, path)
        edit(path)
        return path

    def drop(key):
        def edit(path):
            sd = load_file(str(path / "model.safetensors"))
            sd.pop(key)
            save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
        return edit

    def reshape(path):
        sd = load_file(str(path / "model.safetensors"))
        sd["model.norm.weight"] = torch.ones(7)
        save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})

    cases = [
        (broken("no-lm-head", drop("lm_head.weight")), "lacks 1 of the model's tensors .*lm_head.weight"),
        (broken("no-norm", drop("model.norm.weight")), "model.norm.weight"),
        (broken("reshaped", reshape), r"in another shape \(model.norm.weight\)"),
        (broken("bad-json", lambda p: (p / "config.json").write_text("{")), "config.json cannot be read"),
        (broken("no-type", lambda p: (p / "config.json").write_text("{}")), "config.json cannot be read"),
        (broken("gpt2", lambda p: (p / "config.json").write_text('{"model_type": "gpt2"}')),
         "model_type 'gpt2' is not supported"),
        (broken("no-tokenizer", lambda p: [f.unlink() for f in p.glob("tokenizer*")]), "no readable tokenizer"),
        (broken("truncated", lambda p: (p / "model.safetensors").write_bytes(b"\x08\x00")), "cannot load target"),
    ]
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    (tmp_path / "dir.gguf").mkdir()
    cases += [(tmp_path / "junk.gguf", "is not a readable GGUF model"), (tmp_path / "dir.gguf", "not a file")]
    for target, reason in cases:
        with pytest.raises(CheckpointError, match=reason) as e:
            EagleEngine.from_pretrained(str(target), "none", dtype="float32", max_batch_size=1, max_model_len=64)
        assert "\n" not in str(e.value), str(e.value)


def test_a_draft_vocabulary_smaller_than_top_k_is_refused_at_build(tiny_dir, tiny_head, tmp_path):
    """With fewer draft tokens than a node's children, top-k picked padding ids and the engine broke for good."""
    from eagle_ray.config import ConfigError, TreeConfig
    from eagle_ray.engine.engine import EagleEngine
    tiny_head.save(tmp_path)
    from safetensors.torch import save_file
    save_file({"token_map": torch.arange(2)}, str(tmp_path / "token_map.safetensors"))
    with pytest.raises(ConfigError, match="proposes from 2 tokens, fewer than the 3 children"):
        EagleEngine.from_pretrained(str(tiny_dir), str(tmp_path), dtype="float32", max_batch_size=1,
                                    max_model_len=64, tree={"total_tokens": 8, "depth": 2, "top_k": 3})
    engine = EagleEngine.from_pretrained(str(tiny_dir), str(tmp_path), dtype="float32", max_batch_size=1,
                                         max_model_len=64, tree={"total_tokens": 4, "depth": 2, "top_k": 2})
    with pytest.raises(ConfigError, match="fewer than the 4 children"):
        engine.set_trees(TreeConfig(total_tokens=8, depth=2, top_k=4))
    assert len(engine.generate([[5, 6]])[0].token_ids) > 0
