"""Online adaptation (train/online.py): the head trains on the engine's own pairs while the engine runs; the
output never changes, a candidate that scores worse never replaces the live head, and the buffers stay bounded."""
import torch
from test_engine import mixed_prompts, reference_greedy
from tiny import tiny_engine

from eagle_ray.config import AdaptationConfig, SamplingParams


def own(head):
    """A copy of the shared test head: adaptation changes the live head's weights in place."""
    import copy
    return copy.deepcopy(head)


def adapting(engine, **cfg):
    """An adapter; without a ``time_share``, one that trains after every engine step however long its steps take
    against the engine's (above the config's bound: the rounds and swaps counted do not depend on the machine)."""
    from eagle_ray.train.online import Adapter
    engine.adapter = Adapter(engine.draft, engine.target.lm_head_weight, AdaptationConfig(enabled=True, **cfg))
    if "time_share" not in cfg:
        engine.adapter.cfg = engine.adapter.cfg.model_copy(update={"time_share": 1e9})
    return engine.adapter


def run(engine, prompts, params):
    seqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return seqs


def swaps_every_round(adapter) -> None:
    """A gate that lets every candidate through (the swapping path, whatever the candidates are worth)."""
    adapter.hits = lambda head, real=adapter.hits: torch.zeros_like(real(head)) | (head is adapter.candidate)


def test_swapping_heads_every_round_leaves_every_token_the_targets(tiny_dir, tiny_hf, tiny_head, monkeypatch):
    """Every candidate replaces the live head, several times over the run."""
    monkeypatch.setattr("eagle_ray.train.online.MIN_SCORED", 0)
    engine = tiny_engine(tiny_dir, own(tiny_head), max_batch_size=4)
    adapter = adapting(engine, round_steps=2, batch_tokens=64, hold_back=2, lr=1e-3)
    swaps_every_round(adapter)
    prompts = mixed_prompts(24, seed=13)
    seqs = run(engine, prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert [list(s.output_ids) for s in seqs] == [reference_greedy(tiny_hf, p, 24) for p in prompts]
    assert adapter.state.version >= 5 and len(adapter.state.swaps) == adapter.state.version
    versions = {s.stats.head_version for s in seqs}   # each request says which head it finished with
    assert len(versions) >= 3 and max(versions) <= adapter.state.version
    assert adapter.state.train_steps >= 10


def test_seeded_sampling_through_swaps_is_the_same_as_without(tiny_dir, tiny_head, monkeypatch):
    monkeypatch.setattr("eagle_ray.train.online.MIN_SCORED", 0)
    prompts = mixed_prompts(12, seed=21)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.8, seed=5)
    plain = tiny_engine(tiny_dir, own(tiny_head), max_batch_size=4)
    want = [list(s.output_ids) for s in run(plain, prompts, params)]
    engine = tiny_engine(tiny_dir, own(tiny_head), max_batch_size=4)
    adapter = adapting(engine, round_steps=2, batch_tokens=64, hold_back=2, lr=1e-3)
    swaps_every_round(adapter)
    assert [list(s.output_ids) for s in run(engine, prompts, params)] == want
    assert adapter.state.version >= 2


def test_a_broken_candidate_never_replaces_the_live_head(tiny_dir, tiny_head):
    """A candidate whose input projection is noise after every training step scores worse each round and is
    discarded; the live head's weights stay as loaded. (Training on shuffled tokens or random features is not
    bad enough on a 64-token random target: even noise teaches which tokens its lm_head favours.)"""
    engine = tiny_engine(tiny_dir, own(tiny_head), max_batch_size=4)
    adapter = adapting(engine, round_steps=4, batch_tokens=128, hold_back=2)
    step, g = adapter.train_step, torch.Generator().manual_seed(0)

    def breaks_it():
        step()
        with torch.no_grad():
            adapter.candidate.fc.weight.copy_(torch.randn(adapter.candidate.fc.weight.shape, generator=g))
    adapter.train_step = breaks_it
    before = [p.detach().clone() for p in engine.draft.parameters()]
    run(engine, mixed_prompts(32, seed=3), SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert adapter.state.rounds >= 3 and adapter.state.version == 0 and adapter.state.rejected == adapter.state.rounds
    assert all(torch.equal(a, b) for a, b in zip(before, engine.draft.parameters()))


def test_a_candidate_level_with_the_live_head_trains_on_and_one_behind_it_is_discarded(tiny_dir, tiny_head):
    from eagle_ray.train.online import fresh_copy
    engine = tiny_engine(tiny_dir, own(tiny_head), max_batch_size=4)
    adapter = adapting(engine)
    adapter.candidate, adapter.opt = fresh_copy(adapter.live), object()
    candidate = adapter.candidate
    live_hits = torch.tensor([True, False] * 64)
    adapter.hits = lambda head: live_hits if head is adapter.live else live_hits.roll(1)   # level: as many hits
    assert not adapter.score_round()
    assert adapter.candidate is candidate and (adapter.state.trained_on, adapter.state.rejected) == (1, 0)
    adapter.hits = lambda head: live_hits if head is adapter.live else live_hits & (torch.arange(128) > 8)   # behind
    assert not adapter.score_round()
    assert adapter.candidate is None and (adapter.state.trained_on, adapter.state.rejected) == (1, 1)
    assert adapter.state.version == 0


def test_the_buffers_stay_within_the_configured_pairs(tiny_dir, tiny_head):
    engine = tiny_engine(tiny_dir, own(tiny_head), max_batch_size=4)
    adapter = adapting(engine, buffer_tokens=256, time_share=0.01)
    longest = 0
    for _ in range(3):
        run(engine, mixed_prompts(16, seed=4), SamplingParams(max_new_tokens=32, ignore_eos=True))
        longest = max(len(c["input_ids"]) for c in list(adapter.train_set) + list(adapter.held_back))
        assert adapter.train_pairs <= 256 + longest and adapter.held_pairs <= 64 + longest
        assert adapter.train_pairs == sum(len(c["input_ids"]) for c in adapter.train_set)
    assert adapter.state.pairs_seen > 3 * 256


def test_the_memory_plan_holds_what_adaptation_keeps(tiny_dir, tiny_head):
    """The engine's memory plan counts online adaptation: the adapter's tensors (its fp32 lm_head, the candidate and
    its optimizer state, the buffered pairs) within its fixed part, and every running sequence's pairs, kept until
    it finishes, within the per-slot part."""
    from eagle_ray.engine.budgets import tree_demand
    from eagle_ray.model.sizing import plan_engine
    engine = tiny_engine(tiny_dir, own(tiny_head), max_batch_size=4)
    adapter = adapting(engine, buffer_tokens=256, time_share=1.0, round_steps=2)
    off = engine.config.replace(draft="random")   # the plan of the head this engine holds
    plan, off = (plan_engine(c, engine.target.config, None, engine.device, engine.target.dtype,
                             tree_demand(c.speculation))
                 for c in (off.model_copy(update={"adaptation": adapter.cfg}), off))
    assert plan.adaptation > 0 and plan.total(4) - off.total(4) == plan.adaptation + 4 * plan.adaptation_per_slot
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in mixed_prompts(12, seed=6)]
    kept_peak = held_peak = 0
    while engine.has_unfinished():
        engine.step()
        kept_peak = max([kept_peak] + [sum(f.nbytes for _, f in s.pending.kept) for s in seqs if s.pending.kept])
        held_peak = max(held_peak, adapter_bytes(adapter))
    assert 0 < kept_peak <= plan.adaptation_per_slot
    assert adapter.state.train_steps and 0 < held_peak <= plan.adaptation


def adapter_bytes(adapter) -> int:
    """What an adapter holds: its fp32 lm_head, the candidate and its optimizer state, the buffered features."""
    tensors = [adapter.lm_weight]
    if adapter.candidate is not None:
        tensors += list(adapter.candidate.parameters())
        tensors += [p.grad for p in adapter.candidate.parameters() if p.grad is not None]
        tensors += [t for state in adapter.opt.state.values() for t in state.values() if torch.is_tensor(t)]
    tensors += [c[k] for c in list(adapter.train_set) + list(adapter.held_back) for k in ("hidden", "aux") if k in c]
    return sum(t.nbytes for t in tensors)


def test_a_job_actor_writes_its_adapted_head_with_a_model_card_and_rows_say_their_head(tiny_dir, tmp_path,
                                                                                      monkeypatch):
    import asyncio
    import json

    from test_batch_faults import batch_of

    from eagle_ray.batch.config import JobConfig
    from eagle_ray.batch.stage import GenerateStage
    from eagle_ray.model.draft_head import DraftHead
    monkeypatch.setattr("eagle_ray.train.online.MIN_SCORED", 0)
    cfg = JobConfig(engine={"target": str(tiny_dir), "draft": "random", "dtype": "float32", "max_batch_size": 4,
                            "max_model_len": 128, "adaptation": {"enabled": True, "save": True, "time_share": 1.0,
                                                                 "round_steps": 2, "batch_tokens": 64,
                                                                 "hold_back": 2}},
                    sampling={"max_new_tokens": 16, "ignore_eos": True},
                    input={"uri": str(tmp_path / "in.jsonl")}, output={"uri": str(tmp_path / "out")})
    assert cfg.engine.adaptation.save_dir == str(tmp_path / "out") + "/head"
    stage = GenerateStage(cfg.model_dump_json())
    adapter = stage.engine.adapter
    adapter.cfg = adapter.cfg.model_copy(update={"time_share": 1e9})   # a training step after every engine step,
    swaps_every_round(adapter)                                          # however long the first ones take
    try:
        rows = asyncio.run(stage(batch_of(24))).to_pylist()
    finally:
        stage.queue.shutdown(drain=False, timeout=10)
    version = stage.engine.adapter.state.version
    assert version >= 2 and {r["head_version"] for r in rows} <= set(range(version + 1))
    (saved,) = (tmp_path / "out" / "head").iterdir()
    card = json.loads((saved / "model_card.json").read_text())
    assert card["version"] == version and card["swaps"][-1]["version"] == version and card["pairs_seen"] > 0
    head = DraftHead.load(saved)
    assert torch.equal(head.fc.weight, stage.engine.draft.fc.weight)


def adapting_stage(tiny_dir, tmp_path, out: str, **adaptation):
    from eagle_ray.batch.config import JobConfig
    from eagle_ray.batch.stage import GenerateStage
    cfg = JobConfig(engine={"target": str(tiny_dir), "draft": "random", "dtype": "float32", "max_batch_size": 4,
                            "max_model_len": 128, "adaptation": {"enabled": True, "save": True, "time_share": 1.0,
                                                                 "round_steps": 2, "batch_tokens": 64, "hold_back": 2,
                                                                 **adaptation}},
                    sampling={"max_new_tokens": 16, "ignore_eos": True},
                    input={"uri": str(tmp_path / "in.jsonl")}, output={"uri": out})
    stage = GenerateStage(cfg.model_dump_json())
    adapter = stage.engine.adapter
    adapter.cfg = adapter.cfg.model_copy(update={"time_share": 1e9})   # a training step after every engine step
    swaps_every_round(adapter)
    return stage


def run_batch(stage, batch) -> list[dict]:
    import asyncio
    return asyncio.run(stage(batch)).to_pylist()


def test_an_adapted_head_that_cannot_be_written_costs_no_row_and_the_next_swap_writes_it(tiny_dir, tmp_path,
                                                                                         monkeypatch):
    """The head folder is writable when the actor starts, then is not (a file took its place, as a full disk or a
    lost mount would fail it): every row is answered, the swaps count, no head counts as saved; once the folder
    can be written again, the next swap writes the live head."""
    import json
    import shutil

    import pyarrow as pa
    from test_batch_faults import batch_of

    monkeypatch.setattr("eagle_ray.train.online.MIN_SCORED", 0)
    stage = adapting_stage(tiny_dir, tmp_path, str(tmp_path / "out"))
    heads = tmp_path / "out" / "head"
    shutil.rmtree(heads, ignore_errors=True)
    heads.parent.mkdir(exist_ok=True)
    heads.write_text("not a folder")
    st = stage.engine.adapter.state
    try:
        rows = run_batch(stage, batch_of(16))
        assert [r["error_kind"] for r in rows] == [None] * 16
        assert st.version >= 1 and st.save_failures == st.version and st.saved_version is None
        assert max(r["head_version"] for r in rows) <= st.version
        heads.unlink()
        more = batch_of(32).slice(16)   # other ids
        swapped = st.version
        rows = run_batch(stage, more)
        assert [r["error_kind"] for r in rows] == [None] * 16 and isinstance(more, pa.Table)
    finally:
        stage.queue.shutdown(drain=False, timeout=10)
    assert st.version > swapped and st.saved_version == st.version
    (saved,) = heads.iterdir()
    card = json.loads((saved / "model_card.json").read_text())
    assert card["version"] == card["saved_version"] == st.version and card["save_failures"] == st.save_failures


def test_a_head_folder_the_actor_cannot_write_fails_it_before_the_model_loads(tiny_dir, tmp_path, monkeypatch):
    import pytest

    from eagle_ray.errors import ConfigError

    (tmp_path / "taken").write_text("a file where the head folder would go")

    def no_load(*a, **k):
        raise AssertionError("the model loaded before the head folder was checked")
    monkeypatch.setattr("eagle_ray.engine.engine.EagleEngine.from_config", no_load)
    with pytest.raises(ConfigError, match=r"engine.adaptation.save_dir .*taken/head: adapted heads cannot be written"):
        adapting_stage(tiny_dir, tmp_path, str(tmp_path / "taken"))


def test_an_adapted_head_goes_to_the_path_as_written(tiny_dir, tiny_head, tmp_path):
    """``a::b`` and ``[x]`` are folder names, as in the job's output (fsspec would read ``::`` as a chain of
    filesystems)."""
    from eagle_ray.model.draft_head import DraftHead
    engine = tiny_engine(tiny_dir, own(tiny_head))
    adapter = adapting(engine)
    where = tmp_path / "runs::v2" / "[final]" / "head"
    adapter.save(str(where), base="tiny")
    assert sorted(p.name for p in where.iterdir()) == ["config.json", "model.safetensors", "model_card.json"]
    assert torch.equal(DraftHead.load(where).fc.weight, engine.draft.fc.weight)
    assert [p.name for p in tmp_path.iterdir()] == ["runs::v2"]
