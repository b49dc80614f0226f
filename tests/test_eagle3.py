"""EAGLE-3 heads: they load from the SafeAILab layout, read three of the target's layer inputs from the same forward,
and drive the same trees, batching and acceptance as EAGLE-2 heads: greedy output is the target's own."""
import json

import pytest
import torch
from test_engine import TREES, greedy_after_each, mixed_prompts, reference_greedy
from tiny import save_target

from eagle_ray.config import SamplingParams
from eagle_ray.engine.engine import EagleEngine
from eagle_ray.errors import CheckpointError
from eagle_ray.model.eagle3_head import Eagle3Head, capture_layers


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A tiny target with 8 layers (an EAGLE-3 head reads layers 2, 4 and 5)."""
    from transformers import AutoModelForCausalLM
    path = save_target(tmp_path_factory.mktemp("deep"), layers=8, seed=3)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def engine_for(path, draft, tree="dynamic", batch=3):
    return EagleEngine.from_pretrained(str(path), str(draft), dtype="float32", max_batch_size=batch,
                                       max_model_len=256, tree=TREES[tree])


def test_the_target_returns_the_inputs_of_the_three_layers_from_the_same_pass(deep):
    path, hf = deep
    engine = EagleEngine.from_pretrained(str(path), "random-eagle3", dtype="float32", max_batch_size=1)
    ids = mixed_prompts(1, seed=1)[0]
    assert engine.draft.feature_layers == capture_layers(8) == (2, 4, 5)
    T = len(ids)
    idx = torch.arange(T)
    with torch.inference_mode():
        hidden, feats = engine.target.forward(torch.tensor([ids]), [0], idx.view(1, -1),
                                              (idx.view(-1, 1) >= idx.view(1, -1)).unsqueeze(0), capture=(2, 4, 5))
        ref = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states  # [i] = input of layer i
    torch.testing.assert_close(feats, torch.cat([ref[2], ref[4], ref[5]], -1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden, ref[-1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tree", ["dynamic", "dynamic-wide", "static", "chain"])
@pytest.mark.parametrize("batch", [1, 3])
def test_an_eagle3_head_keeps_greedy_output_exact(deep, tmp_path, tree, batch):
    path, hf = deep
    torch.manual_seed(0)
    head = Eagle3Head.for_target(hf.config, draft_vocab=torch.arange(63, 15, -1))   # 48 of 64 ids
    head.embed_tokens.weight.data.copy_(hf.model.embed_tokens.weight)
    head.save(tmp_path / "head")
    engine = engine_for(path, tmp_path / "head", tree, batch)
    assert engine.draft.kind == "eagle3"
    prompts = mixed_prompts(5, seed=7)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=30, ignore_eos=True))
    for out, prompt in zip(outs, prompts):
        assert out.token_ids == reference_greedy(hf, prompt, 30)


def test_drafts_come_from_the_draft_vocabulary_mapped_to_target_ids(deep):
    _, hf = deep
    head = Eagle3Head.for_target(hf.config, draft_vocab=torch.tensor([9, 4, 33, 60]))
    head.bind_lm_head(None, None)
    assert head.d2t.tolist() == [4, 8, 31, 57] and head.t2d.nonzero().flatten().tolist() == [4, 9, 33, 60]  # ascending
    logp, tok = head.topk(torch.randn(5, head.config.hidden_size), 3)
    assert set(tok.flatten().tolist()) <= {9, 4, 33, 60} and logp.shape == (5, 3)


def test_the_layout_on_disk_is_safailabs(deep, tmp_path):
    _, hf = deep
    head = Eagle3Head.for_target(hf.config)
    head.save(tmp_path / "h")
    from safetensors.torch import load_file
    keys = set(load_file(str(tmp_path / "h" / "model.safetensors")))
    assert keys == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
                    "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
                    "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
                    "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
                    "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
                    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight"}
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 64 and cfg["num_hidden_layers"] == 1
    assert "target_hidden_size" not in cfg  # as the reference writes it: the embedding then comes from the target
    assert cfg["rope_theta"] == hf.config.rope_parameters["rope_theta"]   # read by transformers 4.x readers
    sd = load_file(str(tmp_path / "h" / "model.safetensors"))
    assert sd["fc.weight"].shape == (32, 96) and sd["midlayer.self_attn.q_proj.weight"].shape[1] == 64


def test_a_head_for_another_target_fails_at_load_naming_the_mismatch(deep, tmp_path, tiny_dir):
    path, hf = deep
    Eagle3Head.for_target(hf.config).save(tmp_path / "h")
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    (tmp_path / "wide").mkdir()
    (tmp_path / "wide" / "config.json").write_text(json.dumps(cfg | {"target_hidden_size": 4096}))
    with pytest.raises(CheckpointError, match="target_hidden_size=4096, target hidden_size=32"):
        engine_for(path, tmp_path / "wide")
    (tmp_path / "wide" / "config.json").write_text(json.dumps(cfg | {"hidden_size": 96, "target_hidden_size": 32}))
    with pytest.raises(CheckpointError, match="hidden_size=96 is three times the target's hidden_size=32"):
        engine_for(path, tmp_path / "wide")
    with pytest.raises(CheckpointError, match="at least 7 layers"):   # the 2-layer tiny target
        engine_for(tiny_dir, tmp_path / "h")
    (tmp_path / "h" / "config.json").write_text(json.dumps(cfg | {"vocab_size": 128}))
    with pytest.raises(CheckpointError, match="vocab_size=128, target vocab_size=64"):
        engine_for(path, tmp_path / "h")


def test_specforge_configs_load_too(deep, tmp_path):
    """SpecForge writes ``architectures: [LlamaForCausalLMEagle3]``; the kind is read from the checkpoint."""
    path, hf = deep
    head = Eagle3Head.for_target(hf.config)
    head.save(tmp_path / "h")
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert engine_for(path, tmp_path / "h").draft.kind == "eagle3"


# ---- training ----------------------------------------------------------------------------------------------------
def eagle3_cfg(**kw):
    from eagle_ray.train.trainer import TrainConfig
    return TrainConfig(**{"lr": 3e-3, "warmup_steps": 5, "epochs": 2, "tokens_per_step": 128, "checkpoint_every": 4,
                          "eval_fraction": 0.1, "unroll_steps": 3, "unroll_weight": 0.8, "noise": 0.0} | kw)


def fresh_eagle3(hf):
    torch.manual_seed(0)
    head = Eagle3Head.for_target(hf.config, draft_vocab=torch.arange(64))
    head.embed_tokens.weight.data.copy_(hf.model.embed_tokens.weight)
    return head


def test_eagle3_training_killed_mid_epoch_resumes_to_the_same_weights(deep, tmp_path):
    from tiny import self_distilled_convs

    from eagle_ray.train.trainer import train
    _, hf = deep
    convs = self_distilled_convs(hf, n=24, new_tokens=16, capture=(2, 4, 5))
    lm = hf.lm_head.weight.detach()
    cfg = eagle3_cfg()
    straight = fresh_eagle3(hf)
    s1 = train(convs, straight, lm, tmp_path / "a", cfg, log=lambda *_: None)
    interrupted = fresh_eagle3(hf)
    train(convs, interrupted, lm, tmp_path / "b", cfg, max_steps=5, log=lambda *_: None)   # "killed" at step 5
    resumed = fresh_eagle3(hf)                                                            # a new process
    s2 = train(convs, resumed, lm, tmp_path / "b", cfg, log=lambda *_: None)              # restarts from step 4
    assert s1["step"] == s2["step"] > 6
    for (k, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), k
    assert s1["history"] == s2["history"] and len(s1["history"][-1]["eval_top1_by_step"]) == 3


def test_a_trained_eagle3_head_drafts_what_the_target_accepts(deep, tmp_path):
    """Trained a few seconds with the training-time test on the target's own continuations, the head gets drafts
    accepted beyond the first tree level (an untrained head gets tau 1.0 here), and output stays the target's."""
    from tiny import self_distilled_convs

    from eagle_ray.train.trainer import train
    path, hf = deep
    convs = self_distilled_convs(hf, n=64, new_tokens=40, capture=(2, 4, 5))
    head = fresh_eagle3(hf)
    train(convs, head, hf.lm_head.weight.detach(), tmp_path / "run", eagle3_cfg(epochs=1000, eval_fraction=0.0),
          max_steps=150, log=lambda *_: None)
    head.save(tmp_path / "head")
    engine = engine_for(path, tmp_path / "head", "dynamic", 4)
    prompts = [c["input_ids"][:6].tolist() for c in self_distilled_convs(hf, n=8, new_tokens=1, seed=9)]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=30, ignore_eos=True))
    for out, prompt in zip(outs, prompts):
        assert out.token_ids == reference_greedy(hf, prompt, 30)
    per_depth = [sum(o.stats.accepted_per_depth[d] for o in outs if len(o.stats.accepted_per_depth) > d)
                 for d in range(3)]
    assert sum(o.stats.tau for o in outs) / len(outs) > 1.2 and per_depth[0] > 0 and per_depth[1] > 0, per_depth


def test_a_head_started_from_the_target_scores_the_target_state_as_the_target_does(deep):
    """--lm-head-init target: the head's norm and lm_head are the target's, restricted to the draft vocabulary, so a
    state equal to the target's last (pre-norm) hidden state gets the target's own logits over those ids."""
    _, hf = deep
    head = Eagle3Head.for_target(hf.config, draft_vocab=torch.tensor([7, 3, 50, 11, 2]))
    head.init_scorer_from_target(hf.lm_head.weight.detach(), hf.model.norm.weight.detach())
    state = torch.randn(2, 4, hf.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert head.draft_to_target.tolist() == [2, 3, 7, 11, 50]
        assert torch.equal(head.norm(state), hf.model.norm(state))
        target = hf.lm_head(hf.model.norm(state))[..., [2, 3, 7, 11, 50]]
        torch.testing.assert_close(head.lm_head(head.norm(state)), target, rtol=0, atol=1e-5)  # 5-row product rounds


def adapting_eagle3(deep, tmp_path, monkeypatch, **cfg):
    """An engine on the deep target whose untrained EAGLE-3 head adapts online (every candidate scored from the
    first held-back position on)."""
    from eagle_ray.config import AdaptationConfig
    from eagle_ray.train.online import Adapter
    monkeypatch.setattr("eagle_ray.train.online.MIN_SCORED", 0)
    path, hf = deep
    fresh_eagle3(hf).save(tmp_path / "head")
    engine = engine_for(path, tmp_path / "head", "dynamic", 4)
    engine.adapter = Adapter(engine.draft, engine.target.lm_head_weight,
                             AdaptationConfig(enabled=True, time_share=1.0, hold_back=2, **cfg))
    return engine, engine.adapter


def test_an_eagle3_head_adapts_online_on_its_own_output_and_output_stays_the_targets(deep, tmp_path, monkeypatch):
    """Its pairs carry the fused states and the emitted tokens: the candidate learns the tokens (the target's greedy
    choices), wins on held-back sequences, and is swapped in; every token is still the target's."""
    engine, adapter = adapting_eagle3(deep, tmp_path, monkeypatch, round_steps=8, batch_tokens=256, lr=3e-3)
    prompts = mixed_prompts(48, seed=17)
    before = [p.detach().clone() for p in engine.draft.parameters()]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=30, ignore_eos=True))
    assert [o.token_ids for o in outs] == [greedy_after_each(deep[1], p, o.token_ids) for p, o in zip(prompts, outs)]
    assert adapter.state.version >= 1 and all(s.candidate_top1 > s.live_top1 for s in adapter.state.swaps)
    assert not all(torch.equal(a, b) for a, b in zip(before, engine.draft.parameters()))
    later = engine.generate(mixed_prompts(8, seed=18), SamplingParams(max_new_tokens=30, ignore_eos=True))
    assert max(o.stats.head_version for o in later) == adapter.state.version
