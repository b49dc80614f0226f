"""A target's config.json and tokenizer are read as transformers reads them (every field the decoder, the heads and
the memory plan use, with each model type's defaults), without transformers' config classes and their imports; a
config the decoder cannot run fails naming the field."""
import json

import pytest
from tiny import make_tokenizer
from transformers import AutoConfig, AutoTokenizer

from eagle_ray.errors import CheckpointError
from eagle_ray.model.decoder_config import read_decoder_config
from eagle_ray.model.loading import read_tokenizer, target_config_and_tokenizer

FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps", "pad_token_id",
          "bos_token_id", "eos_token_id", "tie_word_embeddings", "attention_bias", "mlp_bias", "rope_parameters")
ABSENT = object()

CONFIGS = {
    "defaults": {},
    "sized": dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  rms_norm_eps=1e-5, pad_token_id=0, eos_token_id=[1, 5],
                  tie_word_embeddings=True, max_position_embeddings=512),
    "own head width": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "legacy rope keys": dict(rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0}),
    "theta beside rope_parameters": dict(rope_theta=123.0, rope_parameters={"rope_type": "default"}),
    "llama3 rope": dict(max_position_embeddings=4096, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0}),
    "yarn": dict(original_max_position_embeddings=1024, rope_parameters={
        "rope_type": "yarn", "factor": 4.0}),
}


def write(tmp_path, fields: dict):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(fields))
    return tmp_path


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_field_is_transformers_value(tmp_path, model_type, name):
    folder = write(tmp_path, {"model_type": model_type, **CONFIGS[name]})
    ours, theirs = read_decoder_config(folder), AutoConfig.from_pretrained(folder)
    for field in FIELDS:
        assert getattr(ours, field, ABSENT) == getattr(theirs, field, ABSENT), field


@pytest.mark.parametrize("fields,reason", [
    ({}, "names no model_type"),
    ({"model_type": "llama", "hidden_size": "64"}, "hidden_size must be a positive integer, got '64'"),
    ({"model_type": "llama", "num_hidden_layers": 0}, "num_hidden_layers must be a positive integer, got 0"),
    ({"model_type": "qwen2", "tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
    ({"model_type": "llama", "eos_token_id": [1, "2"]}, "eos_token_id must be an integer, a list of integers"),
    ({"model_type": "llama", "hidden_size": 66, "num_attention_heads": 4}, "66 is not a multiple of num_attention"),
    ({"model_type": "llama", "hidden_act": "gelu"}, "hidden_act must be 'silu'"),
    ({"model_type": "llama", "rope_parameters": {"full_attention": {"rope_type": "default"}}}, "per layer type"),
    ({"model_type": "llama", "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),
])
def test_a_config_the_decoder_cannot_run_fails_naming_the_field(tmp_path, fields, reason):
    folder = write(tmp_path, fields)
    with pytest.raises(CheckpointError, match=f"target config {folder / 'config.json'} cannot be read: .*{reason}"):
        target_config_and_tokenizer(folder)


def test_a_model_type_outside_the_llama_family_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="cannot be read: model_type 'gpt2' is not supported; eagle-ray runs"):
        target_config_and_tokenizer(write(tmp_path, {"model_type": "gpt2"}))


@pytest.mark.parametrize("named", ["TokenizersBackend", "PreTrainedTokenizerFast"])
def test_the_tokenizer_is_the_one_autotokenizer_gives(tmp_path, named):
    make_tokenizer(64).save_pretrained(tmp_path)
    settings = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**settings, "tokenizer_class": named}))
    ours, theirs = read_tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    assert type(ours) is type(theirs)
    assert ours.init_kwargs == theirs.init_kwargs and len(ours) == len(theirs) == 64
    chat = [{"role": "user", "content": "w1 w2"}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True) == \
        theirs.apply_chat_template(chat, add_generation_prompt=True)
    assert ours("w3 </s> w9 nope").input_ids == theirs("w3 </s> w9 nope").input_ids == [10, 1, 16, 0]
