"""Memory planning: the plan equals what an engine allocates, "auto" takes the most slots that fit, and a config that
does not fit fails before anything is allocated, naming what it needs and what is free."""
from pathlib import Path

import pytest
import repo_scripts
import torch
from tiny import make_target, make_tokenizer
from transformers import AutoModelForCausalLM, LlamaConfig

from eagle_ray.config import EngineConfig, TreeConfig
from eagle_ray.batch.config import JobConfig
from eagle_ray.serve.config import ServeConfig
from eagle_ray.engine.engine import EagleEngine
from eagle_ray.engine.budgets import tree_demand
from eagle_ray.errors import ConfigError, InsufficientMemoryError
from eagle_ray.model.draft_head import DraftHead
from eagle_ray.model.eagle3_head import Eagle3Head
from eagle_ray.model.numerics import DEVICE_DEFAULTS, cpu_linears_for
from eagle_ray.model.kv_cache import KVCache
from eagle_ray.model.device import packed_available
from eagle_ray.model.sizing import plan_engine
from eagle_ray.model.memory import (GiB, MemoryPlan, copies_for, fit_slots, free_memory,
                                    gpu_usable_bytes, module_bytes, plan_memory)
from eagle_ray.model.target import TargetModel


def memory_table():
    return repo_scripts.load("bench/costs.py")


def held_bytes(*roots) -> int:
    """Bytes of every distinct tensor storage reachable from ``roots`` (modules, eagle-ray objects, containers),
    KV caches excepted."""
    storages, seen = {}, set()

    def visit(x):
        if id(x) in seen or isinstance(x, KVCache):
            return
        seen.add(id(x))
        if isinstance(x, torch.Tensor) and x.is_mkldnn:   # oneDNN's opaque layout: its elements
            storages[id(x)] = x.numel() * x.element_size()
        elif isinstance(x, torch.Tensor):
            storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)
        elif isinstance(x, torch.nn.Module) or type(x).__module__.startswith("eagle_ray"):
            for v in vars(x).values():
                visit(v)
    for r in roots:
        visit(r)
    return sum(storages.values())


def engine_for(hf, head, dtype, path, slots=3, max_len=100, tree=TreeConfig(total_tokens=12, depth=3, top_k=3)):
    """An engine built the way from_config builds one: the target loaded from a checkpoint in ``dtype``, the head
    cast to it, the lm_head bound."""
    hf.save_pretrained(path)
    cfg = EngineConfig(tree=tree, max_batch_size=slots, max_model_len=max_len)
    target = TargetModel.load(path, dtype, "cpu", slots, max_len)
    return EagleEngine(target, head.to(dtype).eval(), make_tokenizer(hf.config.vocab_size), cfg)


def plan_of(engine, kind, draft_vocab=None) -> MemoryPlan:
    verify, room, rows = tree_demand(engine.config.speculation)
    return plan_memory(engine.target.config, kind, None, engine.target.dtype, "cpu",
                       engine.config.cache.max_model_len, verify, draft_room=room, top_k=rows,
                       draft_vocab=draft_vocab)


def bf16_packed() -> bool:
    """Whether this CPU lays out bf16 linears packed (the rule itself is tested in test_linears)."""
    return cpu_linears_for(torch.device("cpu"), torch.bfloat16) == "packed"


def tied_target():
    """A tiny Llama whose lm_head is its embedding."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, eos_token_id=1, bos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval()


# ---- the plan is what the engine allocates ----------------------------------------------------------------------
@pytest.mark.parametrize("case", ["fp32", "fp32-large-vocab", "bf16-tied", "bf16-token-map", "eagle3"])
def test_plan_equals_the_bytes_a_tiny_engine_allocates(case, tmp_path):
    vocab = 8192 if case == "fp32-large-vocab" else 64
    hf = tied_target() if case == "bf16-tied" else make_target(vocab, layers=8 if case == "eagle3" else 2)
    dtype = torch.float32 if case.startswith("fp32") else torch.bfloat16
    kind = "eagle3" if case == "eagle3" else "eagle2"
    torch.manual_seed(1)
    head = (Eagle3Head if kind == "eagle3" else DraftHead).for_target(hf.config)
    draft_vocab = None
    if case == "bf16-token-map":
        head.token_map, draft_vocab = torch.arange(40, 0, -1), 40
    engine = engine_for(hf, head, dtype, tmp_path)
    plan = plan_of(engine, kind, draft_vocab)

    assert plan.draft_weights == module_bytes(engine.draft)
    assert plan.weights == held_bytes(engine.target, engine.draft)  # target, head, lm_head copies, each tensor once
    assert plan.kv_per_slot * 3 == engine.target.cache.nbytes()
    assert plan.draft_kv_per_slot * 3 == engine.draft.cache.nbytes()
    # fp32 on CPU: an lm_head of the CPU's packed_min_weights (2^18) or more is packed beside its dense weight; a
    # smaller one is input-major (tests/test_linears.py), its dense weight a view of that
    packed = 8192 * 32 * 4 if packed_available() else 0
    # bf16: the fp32 copy, plus the packed lm_head beside its dense weight (which RefinedLogits reads) where the
    # CPU packs bf16; elsewhere the lm_head stays nn.Linear's, which RefinedLogits reads as it is, tied or not
    dense = 2 if bf16_packed() else 0
    expected_copies = {"fp32": 0, "fp32-large-vocab": packed, "bf16-tied": 64 * 32 * (4 + dense),
                       "bf16-token-map": 64 * 32 * (4 + dense) + 40 * (32 * 2 + 8),  # + the gathered rows and map
                       "eagle3": 64 * 32 * (4 + dense) + 64 * 8}                      # + its draft-to-target ids
    assert plan.lm_head_copies == expected_copies[case]


def test_weights_come_from_the_config_built_on_meta():
    """Published shapes (bench/costs.py memory): parameter counts as published, bf16 bytes, tied counted once."""
    t = memory_table()
    for cfg, params in ((t.LLAMA_3_2_1B, 1_235_814_400), (t.LLAMA_3_1_8B, 8_030_261_248),
                        (t.LLAMA_3_1_70B, 70_553_706_496)):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        assert sum(p.numel() for p in model.parameters()) == params
        plan = plan_memory(cfg, None, None, "bfloat16", "cuda", 4096, 1)
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        assert plan.target_weights == params * 2 + (head_dim // 2) * 4  # + the rotary inv_freq buffer (fp32)
        assert plan.kv_per_slot == cfg.num_hidden_layers * 2 * 8 * 4097 * head_dim * 2
        assert plan.lm_head_copies == 0 and plan.draft_weights == 0


def test_copies_rule():
    assert copies_for("cuda", torch.bfloat16) == copies_for("cuda", torch.bfloat16, {"fp32_logits": "auto"})
    assert copies_for("cuda", torch.bfloat16).__dict__ == {"fp32_lm_head": False, "out_major_lm_head": False,
                                                           "input_major": False, "packed": False}
    assert copies_for("cpu", torch.bfloat16).__dict__ == {"fp32_lm_head": True, "out_major_lm_head": False,
                                                          "input_major": bf16_packed(), "packed": bf16_packed()}
    assert copies_for("cpu", torch.float16).__dict__ == {"fp32_lm_head": True, "out_major_lm_head": False,
                                                         "input_major": False, "packed": False}
    assert copies_for("cpu", torch.float16, {"cpu_linears": "input_major"}).__dict__ == {
        "fp32_lm_head": True, "out_major_lm_head": True, "input_major": True, "packed": False}
    assert copies_for("cpu", torch.bfloat16, {"fp32_logits": False}).fp32_lm_head is False
    assert copies_for("cpu", torch.float32).fp32_lm_head is False
    assert copies_for("cpu", torch.float32).packed is packed_available()
    assert copies_for("cuda", torch.bfloat16, {"fp32_logits": True}).__dict__ == {
        "fp32_lm_head": True, "out_major_lm_head": False, "input_major": False, "packed": False}


def test_tree_demand_covers_the_tuner():
    # verify tokens: the tree and its 5 lookup tokens; the head's draft-cache room and rows do not count lookups
    assert tree_demand(EngineConfig(tree=TreeConfig(total_tokens=12, depth=3, top_k=3)).speculation) == (17, 9, 3)
    assert tree_demand(EngineConfig(tree=TreeConfig(total_tokens=12, depth=3, top_k=3, lookup=0)).speculation) == \
        (12, 9, 3)
    assert tree_demand(EngineConfig(tree_policy="auto").speculation) == (53, 40, 8)


def test_free_memory_of_the_host():
    kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
              if line.startswith("MemAvailable:"))
    assert 0 < free_memory("cpu") <= kb * 1024 * 1.1  # MemAvailable moves a little between the two reads


# ---- deciding the slot count --------------------------------------------------------------------------------------
PLAN = MemoryPlan("cuda", "bfloat16", 4096, target_weights=15 * GiB, draft_weights=GiB, lm_head_copies=0,
                  workspace=GiB, kv_per_slot=GiB // 2, draft_kv_per_slot=0, logits_per_slot=0)


def test_auto_takes_the_most_slots_that_fit():
    assert fit_slots(PLAN, "auto", PLAN.total(5)) == 5
    assert fit_slots(PLAN, "auto", PLAN.total(6) - 1) == 5
    assert fit_slots(PLAN, "auto", 10**15) == DEVICE_DEFAULTS["cuda"].auto_max_slots == 256
    assert fit_slots(PLAN, 5, PLAN.total(5)) == 5


def test_an_int_that_does_not_fit_names_both_numbers():
    with pytest.raises(InsufficientMemoryError) as e:
        fit_slots(PLAN, 8, 20 * GiB)
    msg = str(e.value)
    assert isinstance(e.value, ConfigError)
    assert msg.startswith("max_batch_size=8 does not fit one GPU: needs 21.00 GiB = target weights 15.00 GiB + draft "
                          "head 1.00 GiB + lm_head copies 0.00 GiB + workspace 1.00 GiB + 8 slots x 0.50 GiB")
    assert "but 20.00 GiB is free (max_batch_size <= 6 fits)" in msg
    assert msg.endswith("lower max_batch_size or max_model_len, or set max_batch_size: auto")


def test_auto_without_room_for_one_slot():
    with pytest.raises(InsufficientMemoryError, match="not even one KV slot fits: needs 17.50 GiB"):
        fit_slots(PLAN, "auto", 17 * GiB + 1)


def test_from_config_resolves_auto_before_allocating(tiny_dir, monkeypatch):
    cfg = EngineConfig(target=str(tiny_dir), draft="random", dtype="float32", device="cpu", max_model_len=128,
                       max_batch_size="auto")
    tiny = AutoModelForCausalLM.from_pretrained(tiny_dir).config
    plan = plan_engine(cfg, tiny, None, torch.device("cpu"), torch.float32, tree_demand(cfg.speculation))
    shares = []
    monkeypatch.setattr("eagle_ray.model.sizing.free_memory",
                        lambda device, share=None: shares.append(share) or plan.total(7) + plan.per_slot // 2)
    engine = EagleEngine.from_config(cfg.for_ray_worker(num_cpus=1, num_gpus=0.5))   # half a GPU: plans from half
    assert engine.config.cache.max_batch_size == 7 and shares == [0.5]
    assert engine.target.cache.num_slots == engine.draft.cache.num_slots == len(engine.scheduler.free) == 7
    assert plan.kv_per_slot * 7 == engine.target.cache.nbytes()


def test_from_config_fails_before_loading_when_an_int_does_not_fit(tiny_dir, monkeypatch):
    monkeypatch.setattr("eagle_ray.model.sizing.free_memory", lambda device, share=None: 600 * 2**20)
    monkeypatch.setattr(TargetModel, "load", lambda *a, **k: pytest.fail("the target was loaded"))
    with pytest.raises(InsufficientMemoryError, match=r"max_batch_size=1024 does not fit this cpu device: needs "
                                                      r"\d+\.\d\d GiB = .* but 0\.59 GiB is free"):
        EagleEngine.from_pretrained(str(tiny_dir), "random", dtype="float32", device="cpu", max_model_len=1024,
                                    max_batch_size=1024)


# ---- targets bigger than one GPU ----------------------------------------------------------------------------------
def test_a_target_larger_than_one_gpu_is_refused():
    plan = plan_memory(memory_table().LLAMA_3_1_70B, "eagle2", None, "bfloat16", "cuda", 2048, 48)
    with pytest.raises(InsufficientMemoryError) as e:
        fit_slots(plan, "auto", gpu_usable_bytes("H100-80GB"))
    assert plan.weights > gpu_usable_bytes("H100-80GB")  # 131.4 GiB target + 3.8 GiB head
    assert str(e.value) == (f"the target does not fit one GPU: weights alone need {plan.weights / GiB:.2f} GiB (plus "
                            f"0.50 GiB workspace) but {gpu_usable_bytes('H100-80GB') / GiB:.2f} GiB is free. Split "
                            "the target over more GPUs (model.tensor_parallel: each GPU then holds its share of the "
                            "layers; docs/memory.md), or use a GPU with more memory.")


@pytest.mark.parametrize("ranks, fits", [(1, False), (2, True), (4, True), (8, True)])
def test_a_70b_target_split_over_ranks_fits_each_gpu(ranks, fits):
    """Rank 0 holds its slices of the layers and KV heads, the replicated embedding and lm_head, and the head."""
    t = memory_table()
    one = plan_memory(t.LLAMA_3_1_70B, "eagle2", None, "bfloat16", "cuda", 2048, 48)
    plan = plan_memory(t.LLAMA_3_1_70B, "eagle2", None, "bfloat16", "cuda", 2048, 48, tensor_parallel=ranks)
    split = 80 * (2 * 8192 * 8192 + 2 * 1024 * 8192 + 3 * 28672 * 8192) * 2   # q, o, k, v, gate, up, down (bf16)
    assert plan.target_weights == one.target_weights - split + split // ranks   # the rest on every rank
    assert plan.kv_per_slot == one.kv_per_slot // ranks
    assert (plan.fixed < gpu_usable_bytes("H100-80GB")) == fits


@pytest.mark.parametrize("make, more", [
    (lambda: ServeConfig(num_gpus=2), "num_replicas"),
    (lambda: JobConfig(input={"uri": "in"}, output={"uri": "out"}, actors={"num_gpus": 2}), "num_actors"),
    (lambda: JobConfig(input={"uri": "in"}, output={"uri": "out"}, actors={"num_gpus": 1},
                       engine={"tensor_parallel": 2}), "num_actors")])
def test_gpus_per_engine_other_than_its_ranks_are_refused(make, more):
    with pytest.raises(ConfigError, match=f"does not match model.tensor_parallel .*more {more} for more engines"):
        make()
    assert ServeConfig(num_gpus=2, engine={"tensor_parallel": 2}).num_gpus == 2
    with pytest.raises(ConfigError, match="must be a whole number"):
        JobConfig(input={"uri": "in"}, output={"uri": "out"}, actors={"num_gpus": 1.5})
    assert ServeConfig(num_gpus=1).num_gpus == 1 and JobConfig(input={"uri": "i"}, output={"uri": "o"},
                                                                 actors={"num_gpus": 0.5}).actors.num_gpus == 0.5
