"""The decoder's own modules (model/decoder.py) hold the tensors transformers' Llama, Mistral, Qwen2 and Qwen3 models
hold, under the same names, and compute what they compute, bit for bit in fp32; a checkpoint missing a tensor, or a
RoPE whose table changes with the sequence, is refused at load."""
import pytest
import torch
from tiny import make_target
from transformers import LlamaConfig

from eagle_ray.errors import CheckpointError
from eagle_ray.model import decoder
from eagle_ray.model.decoder_config import decoder_config, read_decoder_config
from eagle_ray.model.target import TargetModel

MODEL_TYPES = ["llama", "qwen2", "qwen3", "mistral"]


def hidden_and_logits(model, ids: list[int]):
    target = TargetModel(model, 1, 64, fp32_logits=False)
    T = len(ids)
    idx = torch.arange(T)
    hidden = target.forward(torch.tensor([ids]), [0], idx.view(1, -1), (idx.view(-1, 1) >= idx.view(1, -1))[None])
    return hidden, target.logits(hidden)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_a_loaded_target_holds_transformers_tensors_and_computes_the_same_states(tmp_path, model_type):
    hf = make_target(model_type=model_type)
    hf.save_pretrained(tmp_path)
    ours = decoder.load(tmp_path, read_decoder_config(tmp_path), torch.float32, "cpu")
    theirs, mine = hf.state_dict(), ours.state_dict()
    assert list(mine) == list(theirs)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert torch.equal(ours.model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq)
    ids = torch.randint(3, 64, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    for a, b in zip(hidden_and_logits(hf, ids), hidden_and_logits(ours, ids)):
        assert torch.equal(a, b)


def test_a_tied_head_is_the_embedding_and_the_eos_comes_from_the_generation_config(tmp_path):
    torch.manual_seed(0)
    from transformers import LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True, eos_token_id=1)
    hf = LlamaForCausalLM(cfg)
    hf.generation_config.eos_token_id = [1, 5]
    hf.save_pretrained(tmp_path)
    ours = decoder.load(tmp_path, cfg, torch.bfloat16, "cpu")
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert torch.equal(ours.lm_head.weight, hf.lm_head.weight.to(torch.bfloat16))
    assert ours.generation_config.eos_token_id == [1, 5]
    assert ours.model.rotary_emb.inv_freq.dtype == torch.float32   # the angles stay fp32 in a bf16 model


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_a_seeded_layer_draws_the_weights_transformers_layer_draws(model_type):
    """Fresh draft heads are seeded in the tests and benchmarks: the same seed gives the same head as before."""
    model = make_target(model_type=model_type)
    cfg, layer_class = model.config, type(model.model.layers[0])
    torch.manual_seed(3)
    theirs = layer_class(cfg, 0).state_dict()
    torch.manual_seed(3)
    ours = decoder.DecoderLayer(cfg).state_dict()
    assert list(ours) == list(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)


@pytest.mark.parametrize("rope", [{"rope_type": "default", "rope_theta": 500000.0},
                                  {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64},
                                  {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
                                  {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}])
def test_rotary_tables_are_transformers_tables(rope):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    fields = dict(hidden_size=64, num_attention_heads=4, max_position_embeddings=4096, rope_parameters=rope)
    positions = torch.arange(3000).view(2, -1)
    x = torch.zeros(1, dtype=torch.bfloat16)
    theirs = LlamaRotaryEmbedding(LlamaConfig(**fields))(x, positions)
    for config in (decoder_config(fields, "llama"), LlamaConfig(**fields)):
        for a, b in zip(decoder.RotaryEmbedding(config)(x, positions), theirs):
            assert a.dtype == torch.bfloat16 and torch.equal(a, b)


def test_a_rope_that_grows_with_the_sequence_and_an_incomplete_checkpoint_are_refused(tmp_path):
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4,
                      rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(CheckpointError, match="RoPE type 'dynamic' changes its frequencies"):
        decoder.RotaryEmbedding(cfg)
    hf = make_target()
    hf.save_pretrained(tmp_path)
    more = make_target(layers=3).config
    with pytest.raises(CheckpointError, match=r"lacks 9 of the model's tensors .*\(model.layers.2.input_layernorm"):
        decoder.load(tmp_path, more, torch.float32, "cpu")
