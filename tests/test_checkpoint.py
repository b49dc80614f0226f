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
