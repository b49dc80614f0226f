"""Drafter training resumes exactly; feature extraction writes every conversation exactly once across restarts."""
import json
from dataclasses import replace

import pytest
import repo_scripts
import torch
from tiny import self_distilled_convs

from eagle_ray.model.draft_head import DraftHead
from eagle_ray.train import extract
from eagle_ray.train.data import iter_json_array
from eagle_ray.train.trainer import TrainConfig, TrainingDataError, train

CFG = TrainConfig(lr=1e-3, warmup_steps=5, epochs=2, tokens_per_step=128, checkpoint_every=4, eval_fraction=0.1,
                  ce_fraction=0.5)


def fresh_head(hf):
    torch.manual_seed(0)
    head = DraftHead.for_target(hf.config)
    head.embed_tokens.weight.data.copy_(hf.model.embed_tokens.weight)
    return head


def test_training_killed_mid_epoch_resumes_to_the_same_weights(tiny_hf, tmp_path):
    convs = self_distilled_convs(tiny_hf, n=32, new_tokens=20)
    lm = tiny_hf.lm_head.weight.detach()
    straight = fresh_head(tiny_hf)
    s1 = train(convs, straight, lm, tmp_path / "a", CFG, log=lambda *_: None)

    interrupted = fresh_head(tiny_hf)
    train(convs, interrupted, lm, tmp_path / "b", CFG, max_steps=7, log=lambda *_: None)  # "killed" after step 7
    resumed = fresh_head(tiny_hf)                                                        # a new process
    s2 = train(convs, resumed, lm, tmp_path / "b", CFG, log=lambda *_: None)             # restarts from step 4
    assert s1["step"] == s2["step"] and s1["step"] > 8
    for (k, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), k
    assert s1["history"] == s2["history"] and "eval_top1" in s1["history"][-1]


def test_a_checkpoint_resumes_only_the_run_that_wrote_it(tiny_hf, tmp_path):
    """Resuming with other settings, other data or another caller's run description would train on from someone
    else's weights and write a card describing a run that never was: it fails, naming each difference; a damaged
    checkpoint fails naming the file."""
    from eagle_ray.errors import CheckpointError

    convs = self_distilled_convs(tiny_hf, n=32, new_tokens=20)
    lm = tiny_hf.lm_head.weight.detach()
    quiet = dict(log=lambda *_: None)
    train(convs, fresh_head(tiny_hf), lm, tmp_path / "run", CFG, max_steps=4, run={"init": None}, **quiet)
    with pytest.raises(CheckpointError, match=r"another run \(lr: 0.001 there, 0.01 now; tokens_per_step: 128 there"):
        train(convs, fresh_head(tiny_hf), lm, tmp_path / "run", TrainConfig(**{**CFG.identity(), "lr": 1e-2,
              "tokens_per_step": 256}), run={"init": None}, **quiet)
    with pytest.raises(CheckpointError, match="conversations: 32 there, 31 now"):
        train(convs[:31], fresh_head(tiny_hf), lm, tmp_path / "run", CFG, run={"init": None}, **quiet)
    with pytest.raises(CheckpointError, match="init: None there, 'other/head' now"):
        train(convs, fresh_head(tiny_hf), lm, tmp_path / "run", CFG, run={"init": "other/head"}, **quiet)
    # the same run resumes under another time budget (refitted from each start's clock, the schedule kept in the
    # checkpoint); the device is not part of a run's identity either
    state = train(convs, fresh_head(tiny_hf), lm, tmp_path / "run", replace(CFG, time_budget_s=3600.0),
                  run={"init": None}, **quiet)
    assert state["finished"] and state["step"] > 4 and "device" not in CFG.identity()
    (tmp_path / "run" / "checkpoint.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="checkpoint.pt cannot be read"):
        train(convs, fresh_head(tiny_hf), lm, tmp_path / "run", CFG, **quiet)


def test_held_out_conversations_are_never_trained_on_even_when_a_source_repeats_them(tiny_hf):
    """Two sets can hold the same text under different ids: a training conversation equal to a held-out one is
    left out, so held-out accuracy is measured on unseen text only."""
    from eagle_ray.train.trainer import split_held_out

    convs = self_distilled_convs(tiny_hf, n=10, new_tokens=8)
    held, rest = split_held_out(convs + [dict(convs[0]), dict(convs[5])], 0.1)
    assert held == [convs[0]] and len(rest) == 10 and all(c is not convs[0] for c in rest)
    assert sum(torch.equal(c["input_ids"], convs[5]["input_ids"]) for c in rest) == 2


def test_training_settings_no_run_can_use_fail_naming_the_field(tiny_hf, tmp_path):
    for field, value in (("warmup_steps", 0), ("checkpoint_every", 0), ("unroll_steps", 0), ("lr", -1.0),
                         ("epochs", 0), ("max_len", 1), ("eval_fraction", 1.0), ("tokens_per_step", 0)):
        with pytest.raises(ValueError, match=f"{field}={value!r}"):
            TrainConfig(**{field: value})
    with pytest.raises(TrainingDataError, match="no conversations to train on"):
        train([], fresh_head(tiny_hf), tiny_hf.lm_head.weight.detach(), tmp_path, CFG)


def test_extraction_killed_and_restarted_writes_each_conversation_once(tiny_dir, tmp_path, monkeypatch):
    src = tmp_path / "convs.jsonl"
    with open(src, "w") as f:
        for i in range(23):
            msgs = [{"role": "user", "content": f"w{i} w1"}, {"role": "assistant", "content": f"w{i + 2} w3 w4"}]
            if i == 7:
                msgs = [{"role": "user", "content": "no answer"}]  # nothing to learn: skipped, never an error
            f.write(json.dumps({"messages": msgs}) + "\n")
    out = tmp_path / "features"
    real = extract.extract_features
    calls = {"n": 0}

    def crash_after_two(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("killed")
        return real(*a, **kw)
    monkeypatch.setattr(extract, "extract_features", crash_after_two)
    args = dict(out_dir=str(out), target=str(tiny_dir), source=str(src), max_conversations=100, shard_size=5,
                max_len=64, dtype="float32", threads=1)
    with pytest.raises(KeyboardInterrupt):
        extract.run_local(**args)
    assert len(list(out.glob("shard-*"))) == 2
    monkeypatch.setattr(extract, "extract_features", real)
    extract.run_local(**args)
    seen = [c["conv_index"] for s in sorted(out.glob("shard-*.safetensors")) for c in extract.read_shard(s)]
    assert sorted(seen) == [i for i in range(23) if i != 7]


def test_extraction_refuses_to_mix_shards_made_otherwise_into_one_directory(tiny_dir, tmp_path):
    src = tmp_path / "convs.jsonl"
    src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"w{i}"},
                                                    {"role": "assistant", "content": f"w{i + 1}"}]}) + "\n"
                           for i in range(4)))
    kw = dict(target=str(tiny_dir), source=str(src), max_conversations=4, dtype="float32", threads=1)
    extract.run_local(out_dir=str(tmp_path / "f"), shard_size=2, max_len=64, **kw)
    extract.run_local(out_dir=str(tmp_path / "f"), shard_size=2, max_len=64, **kw)     # the same run: resumes
    with pytest.raises(SystemExit, match="max_len: 64 there, 32 now; shard_size: 2 there, 4 now"):
        extract.run_local(out_dir=str(tmp_path / "f"), shard_size=4, max_len=32, **kw)
    with pytest.raises(SystemExit, match="max_conversations >= shard_size"):
        extract.run_local(out_dir=str(tmp_path / "g"), shard_size=8, max_len=64, **kw)


def test_self_distilled_conversations_come_from_a_job_output(tmp_path):
    """jobs/batch.py output -> (prompt messages + the target's answer) in input order; error rows skipped."""
    import json

    import pyarrow.parquet as pq

    from eagle_ray.batch.rows import empty_row, to_table
    from eagle_ray.train.extract import iter_conversations

    rows = []
    for i, (inp, out, err) in enumerate([({"messages": [{"role": "user", "content": "hi"}]}, "hello", None),
                                         ({"prompt": "bad"}, None, "InvalidRequestError: x"),
                                         ({"prompt": "2+2?"}, "4", None)]):
        r = empty_row({"id": f"r{i}", "row_index": i, "payload": json.dumps(inp)})
        r.update(output=out, error=err)
        rows.append(r)
    pq.write_table(to_table(rows[1:]), tmp_path / "part-b-00000.parquet")
    pq.write_table(to_table(rows[:1]), tmp_path / "part-a-00000.parquet")
    convs = list(iter_conversations(str(tmp_path)))
    assert convs == [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], None,
                     [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]]


@pytest.mark.slow
def test_ray_extraction_resumes_on_s3_and_matches_local(ray_local, s3, tiny_dir, tmp_path):
    """jobs/extract_features.py: conversations from S3 to shards on S3 through a Ray actor pool; a second run with
    a larger limit writes only the missing shards; the features equal the single-process extractor's."""
    from safetensors.torch import load as load_bytes

    fs, opts = s3
    lines = [json.dumps({"messages": [{"role": "user", "content": f"w{i} w1"},
                                      {"role": "assistant", "content": f"w{i + 2} w3 w4"}]}) for i in range(13)]
    src = tmp_path / "convs.jsonl"
    src.write_text("\n".join(lines) + "\n")
    fs.put(str(src), "models/convs.jsonl")
    args = dict(out="s3://models/features", target=str(tiny_dir), source="s3://models/convs.jsonl", shard_size=5,
                max_len=64, dtype="float32", num_actors=1, num_cpus=1, num_gpus=0, storage_options=opts,
                log=lambda m: None)
    first = extract.run_ray(max_conversations=10, **args)
    assert (first["written"], first["skipped"]) == (2, 0)
    second = extract.run_ray(max_conversations=100, **args)
    assert (second["written"], second["skipped"]) == (1, 2)
    assert extract.run_ray(max_conversations=100, **args)["written"] == 0
    extract.run_local(str(tmp_path / "local"), str(tiny_dir), str(src), 100, 5, 64, "float32", 1)
    seen = []
    for k in range(3):
        remote = load_bytes(fs.cat(f"models/features/shard-{k:05d}.safetensors"))
        local = extract.load_file(str(tmp_path / "local" / f"shard-{k:05d}.safetensors"))
        assert remote.keys() == local.keys() and all(torch.equal(remote[n], local[n]) for n in local)
        seen += remote["conv_index"].tolist()
    assert seen == list(range(13))


def test_train_job_fine_tunes_an_existing_head_over_several_feature_dirs(tiny_dir, tiny_hf, tmp_path):
    """jobs/train_drafter.py --init HEAD --features A B: starts from HEAD's weights and reads both directories;
    with --keep-token-map it keeps HEAD's draft vocabulary."""
    import runpy
    from pathlib import Path

    dirs = []
    for part in range(2):
        src = tmp_path / f"convs{part}.jsonl"
        src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"w{i} w{part}"},
                                                        {"role": "assistant", "content": f"w{i + 2} w3"}]}) + "\n"
                               for i in range(3 + part)))
        dirs.append(str(tmp_path / f"features{part}"))
        extract.run_local(out_dir=dirs[-1], target=str(tiny_dir), source=str(src), max_conversations=100,
                          shard_size=4, max_len=64, dtype="float32", threads=1)
    init = fresh_head(tiny_hf)
    torch.nn.init.normal_(init.fc.weight, std=0.5)
    init.save(tmp_path / "init", dtype=torch.bfloat16, include_embedding=False)
    main = runpy.run_path(str(Path(__file__).parents[1] / "jobs" / "train_drafter.py"))["main"]
    out = tmp_path / "run"
    assert main(["--features", *dirs, "--out", str(out), "--target", str(tiny_dir), "--init", str(tmp_path / "init"),
                 "--max-steps", "0", "--token-map-size", "0"]) == 0
    card = json.loads((out / "head" / "training.json").read_text())
    assert card["conversations"] == 3 + 4 and card["init"] == str(tmp_path / "init") and card["steps"] == 0
    embed = tiny_hf.model.embed_tokens.weight
    started = DraftHead.load(out / "head", tiny_hf.config, embed).state_dict()
    for k, v in DraftHead.load(tmp_path / "init", tiny_hf.config, embed).state_dict().items():
        assert torch.equal(started[k], v), k
    # --keep-token-map: the draft vocabulary stays the init head's, not one chosen from these features
    init.token_map = torch.arange(40, 8, -1)
    init.save(tmp_path / "init_map", dtype=torch.bfloat16, include_embedding=False)
    assert main(["--features", *dirs, "--out", str(tmp_path / "kept"), "--target", str(tiny_dir), "--init",
                 str(tmp_path / "init_map"), "--max-steps", "0", "--keep-token-map"]) == 0
    kept = DraftHead.load(tmp_path / "kept" / "head", tiny_hf.config, embed)
    assert torch.equal(kept.token_map, torch.arange(40, 8, -1))
    # what no run can use fails before any step, naming the argument
    base = ["--out", str(tmp_path / "bad"), "--target", str(tiny_dir)]
    for args, reason in ((["--features", str(tmp_path / "nothing")], "no feature shards"),
                         (["--features", dirs[0], dirs[0]], "a source is given twice"),
                         (["--features", dirs[0], "--warmup-steps", "0"], "warmup_steps=0"),
                         (["--features", dirs[0], "--token-map-size", "-5"], "--token-map-size must be >= 0"),
                         (["--features", dirs[0], "--head-type", "eagle3"], "needs features extracted with")):
        with pytest.raises(SystemExit, match=reason):
            main(args + base)
    # a checkpoint of another run is refused, not trained on: here another draft vocabulary and start point
    assert main(["--features", *dirs, "--out", str(tmp_path / "r"), "--target", str(tiny_dir), "--epochs", "1",
                 "--token-map-size", "0", "--tokens-per-step", "64", "--warmup-steps", "1"]) == 0
    with pytest.raises(SystemExit, match="belongs to another run .*init: None there"):
        main(["--features", *dirs, "--out", str(tmp_path / "r"), "--target", str(tiny_dir), "--init",
              str(tmp_path / "init"), "--token-map-size", "0", "--tokens-per-step", "64", "--warmup-steps", "1"])


def test_cross_entropy_runs_over_the_draft_vocabulary_the_engine_will_use(tiny_hf):
    """A map holding the whole vocabulary (any order) changes nothing; a map without the target's choices leaves
    the head nothing right in evaluation, however it ranks the rest (its top-1 is read through the map)."""
    from eagle_ray.train.trainer import collate, losses

    convs = self_distilled_convs(tiny_hf, n=4, new_tokens=8)
    lm = tiny_hf.lm_head.weight.detach()
    head = fresh_head(tiny_hf).eval()
    batch = collate(convs, [0, 1, 2, 3], 64)
    cfg = TrainConfig(noise=0.0)
    with torch.no_grad():
        full = losses(head, lm, *batch, cfg, None, False)
        shuffled = losses(head, lm, *batch, cfg, None, False, vocab=torch.randperm(lm.shape[0]))
        tokens, feats, target, mask = batch
        chosen = (target @ lm.T).argmax(-1)[mask.bool()].unique()
        without = torch.tensor([t for t in range(lm.shape[0]) if t not in set(chosen.tolist())])
        missing = losses(head, lm, *batch, cfg, None, False, vocab=without)
    assert full[0] == shuffled[0] and full[2] == shuffled[2] and full[3] == shuffled[3] == int(mask.sum())
    assert torch.allclose(full[1], shuffled[1], atol=1e-5)
    assert 0 < full[2] and missing[2] == 0.0


@pytest.mark.parametrize("steps", [2, 3])
def test_unrolled_steps_are_the_head_run_along_its_own_draft_chain(tiny_hf, steps):
    """Step s at position i is what the draft computes s levels below a root at i - s: true features up to the
    root, then the head's own predictions (recomputed here one chain at a time with the plain causal forward)."""
    from eagle_ray.train.trainer import head_forward_train, head_forward_unrolled

    torch.manual_seed(0)
    head = fresh_head(tiny_hf).eval()
    T, d = 9, tiny_hf.config.hidden_size
    tokens, feats = torch.randint(0, tiny_hf.config.vocab_size, (2, T)), torch.randn(2, T, d)
    with torch.no_grad():
        preds = head_forward_unrolled(head, tokens, feats, steps)
        assert torch.equal(preds[0], head_forward_train(head, tokens, feats))
        for s in range(1, steps):
            for i in range(s, T):
                root = i - s
                chain = [feats[:, : root + 1]] + [preds[r][:, root + r: root + r + 1] for r in range(s)]
                want = head_forward_train(head, tokens[:, : i + 1], torch.cat(chain, 1))[:, -1]
                assert torch.allclose(preds[s][:, i], want, atol=1e-5), (s, i)


def test_unrolled_training_reports_every_step_and_keeps_step_zero_exact(tiny_hf):
    """With one step the loss is the EAGLE-1/2 loss; more steps add theirs, and evaluation reports each step."""
    from eagle_ray.train.trainer import collate, evaluate, losses

    convs = self_distilled_convs(tiny_hf, n=4, new_tokens=8)
    lm = tiny_hf.lm_head.weight.detach()
    head = fresh_head(tiny_hf).eval()
    batch = collate(convs, [0, 1, 2, 3], 64)
    with torch.no_grad():
        one = losses(head, lm, *batch, TrainConfig(noise=0.0), None, False)
        three = losses(head, lm, *batch, TrainConfig(noise=0.0, unroll_steps=3, unroll_weight=0.5), None, False)
    assert len(one[4]) == 1 and len(three[4]) == 3
    assert one[2] == three[2] and one[3] == three[3] and one[4][0] == three[4][0]
    steps = three[4]
    assert torch.allclose(three[0], torch.tensor(sum(0.5 ** s * st["vloss"] for s, st in enumerate(steps))))
    assert steps[0]["scored"] >= steps[2]["scored"] > 0
    metrics = evaluate(head, lm, convs, TrainConfig(eval_steps=2))
    assert len(metrics["eval_top1_by_step"]) == 2 and metrics["eval_top1_by_step"][0] == metrics["eval_top1"]


def test_repeated_tokens_are_the_ones_that_continue_an_earlier_span():
    """A token is repeated when the n-gram it ends was written before: the loop's first lap counts as new text."""
    from eagle_ray.train.data import repeated_tokens

    loop = [7, 8, 9, 5, 7, 8, 9, 5, 7, 8, 1]
    assert repeated_tokens(loop, 3) == [False] * 6 + [True, True, True, True, False]
    assert repeated_tokens(loop, 5) == [False] * 8 + [True, True, False]
    assert not any(repeated_tokens(list(range(50)), 2))


def test_thinning_repeats_drops_only_the_predictions_of_repeated_tokens():
    """Mask position p scores the prediction of token p + 1: keep=0 clears exactly the positions before repeated
    tokens, keep=1 changes nothing, and a fraction is a fixed choice (the same on every call)."""
    from eagle_ray.train.data import repeated_tokens, thin_repeats

    ids = torch.tensor([3, 4, 5, 6] * 40 + [1, 2])
    mask = torch.ones(len(ids), dtype=torch.uint8)
    mask[:5] = 0   # a prompt
    rep = repeated_tokens(ids.tolist(), 4)
    none = thin_repeats(ids, mask, 0.0, 4)
    assert none.tolist() == [0 if (p < 5 or (p + 1 < len(ids) and rep[p + 1])) else 1 for p in range(len(ids))]
    assert torch.equal(thin_repeats(ids, mask, 1.0, 4), mask)
    some = thin_repeats(ids, mask, 0.5, 4, seed=3)
    assert torch.equal(some, thin_repeats(ids, mask, 0.5, 4, seed=3))
    assert int(none.sum()) < int(some.sum()) < int(mask.sum())


def test_a_widened_head_computes_what_the_trained_head_computes(tiny_hf):
    """Growing the MLP keeps the function (new units start with zero output weights) and every trained weight."""
    from eagle_ray.train.trainer import head_forward_train, widen_mlp

    head = fresh_head(tiny_hf).eval()
    head.token_map = torch.arange(10)
    n = head.layers[0].mlp.gate_proj.out_features
    wide = widen_mlp(head, 3 * n).eval()
    assert wide.layers[0].mlp.gate_proj.out_features == 3 * n == wide.config.intermediate_size
    assert torch.equal(wide.layers[0].mlp.up_proj.weight[:n], head.layers[0].mlp.up_proj.weight)
    assert torch.equal(wide.token_map, head.token_map)
    tokens = torch.randint(0, tiny_hf.config.vocab_size, (2, 7))
    feats = torch.randn(2, 7, tiny_hf.config.hidden_size)
    with torch.no_grad():
        assert torch.allclose(head_forward_train(wide, tokens, feats), head_forward_train(head, tokens, feats),
                              atol=1e-6)
    with pytest.raises(ValueError, match="below"):
        widen_mlp(head, n - 1)


def test_second_turns_follow_every_first_turn_with_the_first_exchange_as_context(tmp_path):
    """Second turns come after all first turns, each with its record's first user turn and recorded answer; records
    without a second user turn (or with one over the size limit) give none."""
    from eagle_ray.train.selfdistill import sharegpt_prompts

    def conv(*turns):
        return {"conversations": [{"from": "human" if i % 2 == 0 else "gpt", "value": t} for i, t in enumerate(turns)]}
    records = [conv("a?", "A.", "b?", "B."), conv("c?", "C."), conv("d?", "D.", "x" * 50, "E.")]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(records))
    got = [(p.id, [m["content"] for m in p.messages]) for p in sharegpt_prompts(40, str(path), second_turns=True)]
    assert got == [("sharegpt-0", ["a?"]), ("sharegpt-1", ["c?"]), ("sharegpt-2", ["d?"]),
                   ("sharegpt-0-turn2", ["a?", "A.", "b?"])]
    assert [p.id for p in sharegpt_prompts(40, str(path))] == ["sharegpt-0", "sharegpt-1", "sharegpt-2"]


def test_code_prompts_are_documented_functions_with_their_bodies_left_out(tmp_path):
    """A public function or method with a docstring of 40-1,500 characters and a real body becomes a completion
    request (def line and docstring, dedented, after an instruction); private, undocumented, stub-only and test
    code gives none. Ids name the root, the file and the qualified name, and the same tree gives the same prompts."""
    from eagle_ray.train.selfdistill import CODE_INSTRUCTIONS, python_function_prompts

    doc = "Return the sum of the squares of the numbers in xs, or zero for an empty list."
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(
        f'def squares(xs):\n    """{doc}"""\n    return sum(x * x for x in xs)\n\n'
        f'def _private(xs):\n    """{doc}"""\n    return 0\n\n'
        f'def stub(xs):\n    """{doc}"""\n\n'
        f'def short(xs):\n    """Too short."""\n    return 1\n\n'
        f'class Box:\n    def area(self):\n        """{doc}"""\n        return self.w * self.h\n')
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "helpers.py").write_text(f'def helper(x):\n    """{doc}"""\n    return x\n')
    (tmp_path / "pkg" / "broken.py").write_text("def (:\n")
    got = list(python_function_prompts({"lib": tmp_path}))
    assert [p.id for p in got] == ["py-lib/pkg/mod.py:squares", "py-lib/pkg/mod.py:Box.area"]
    text = got[1].messages[0]["content"]
    instruction, code = text.split("\n\n", 1)
    assert instruction in CODE_INSTRUCTIONS and got[1].messages[0]["role"] == "user"
    assert code == f'def area(self):\n    """{doc}"""\n'
    assert [p.messages for p in python_function_prompts({"lib": tmp_path})] == [p.messages for p in got]


def test_a_name_defined_twice_in_a_file_gives_two_prompts_with_distinct_ids(tmp_path):
    """A property and its setter share a qualified name; each is its own prompt, the second suffixed ``#2``, so a set
    never holds one id twice."""
    from eagle_ray.train.selfdistill import python_function_prompts

    get_doc, set_doc = "Return the expression of the series, as given by the user.", "Set the expression of the series."
    (tmp_path / "series.py").write_text(
        f'class Series:\n    @property\n    def expr(self):\n        """{get_doc}"""\n        x = self._e\n'
        f'        return x\n\n    @expr.setter\n    def expr(self, e):\n        """{set_doc} It must be sympified."""\n'
        f'        e = sympify(e)\n        self._e = e\n')
    got = list(python_function_prompts({"lib": tmp_path}))
    assert [p.id for p in got] == ["py-lib/series.py:Series.expr", "py-lib/series.py:Series.expr#2"]
    assert get_doc in got[0].messages[0]["content"] and set_doc in got[1].messages[0]["content"]


def test_conversations_of_different_lengths_run_together_get_the_states_each_gets_alone(tiny_hf):
    """Extraction batches conversations by length (right-padded); causal attention keeps every conversation's
    final states and EAGLE-3 layer inputs those of a forward of its own, and each comes back in input order."""
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, tiny_hf.config.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 9, 3, 17, 11)]
    alone = extract.target_states(tiny_hf, seqs, capture=(0, 1), batch_tokens=0)
    together = extract.target_states(tiny_hf, seqs, capture=(0, 1), batch_tokens=40)
    assert extract.length_batches([len(s) for s in seqs], 40) == [[3, 0, 2], [5, 1], [4]]
    for s, (h1, a1), (h2, a2) in zip(seqs, alone, together):
        assert h1.shape == (len(s), tiny_hf.config.hidden_size) and a1.shape == (len(s), 2 * tiny_hf.config.hidden_size)
        torch.testing.assert_close(h2, h1, rtol=1e-2, atol=1e-2)  # bf16 storage: at most one unit apart
        torch.testing.assert_close(a2, a1, rtol=1e-2, atol=1e-2)


def test_a_time_budget_fits_the_schedule_to_the_pace_and_a_resumed_run_keeps_it(tiny_hf, tmp_path):
    """time_budget_s: twenty steps are timed from the tenth, the total is fitted to the budget (95% of it, less the
    held-out evaluations' share) and kept in the checkpoint; killed and resumed, the run ends at the same weights."""
    convs = self_distilled_convs(tiny_hf, n=32, new_tokens=20)
    lm = tiny_hf.lm_head.weight.detach()
    import math

    from eagle_ray.train.trainer import make_batches
    cfg = TrainConfig(lr=1e-3, warmup_steps=5, epochs=20, tokens_per_step=128, checkpoint_every=4,
                      eval_fraction=0.1, time_budget_s=100.0)

    def clock():  # one second a call; train calls it once at its start and once a step while it times
        clock.now += 1.0
        return clock.now

    clock.now = 0.0
    straight = fresh_head(tiny_hf)
    s1 = train(convs, straight, lm, tmp_path / "a", cfg, log=lambda *_: None, clock=clock)
    # at step 30, 21 s after the start, steps 10..30 took 20 s: 1 s a step; 95 s - 21 s leaves 74 s, less half a
    # step for each of the 3 held-out conversations at each epoch's end
    per_epoch = len(make_batches([len(c["input_ids"]) for c in convs[3:]], 128, 0, 0))
    total = 30 + int(74 - (1 + math.ceil(74 / per_epoch)) * 3 * 0.5)
    assert s1["total"] == s1["step"] == total and 50 < total < per_epoch * 20 and s1["finished"]
    assert s1["history"][-1]["step"] == total and "eval_top1" in s1["history"][-1]
    clock.now = 0.0
    interrupted = fresh_head(tiny_hf)
    train(convs, interrupted, lm, tmp_path / "b", cfg, max_steps=45, log=lambda *_: None, clock=clock)
    resumed = fresh_head(tiny_hf)
    s2 = train(convs, resumed, lm, tmp_path / "b", cfg, log=lambda *_: None, clock=clock)  # from step 44
    assert s2["total"] == s2["step"] == total and s1["history"] == s2["history"]
    for (k, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), k


def test_a_wall_budget_leaves_training_what_loading_and_states_did_not_use():
    from eagle_ray.train.drafter_job import training_budget
    assert training_budget(540, 225) == 300
    assert training_budget(540, 225, reserve_s=40) == 275
    with pytest.raises(SystemExit, match="500 s went to loading and the target's states, 25 s would be left"):
        training_budget(540, 500)


def test_train_job_computes_the_target_states_of_answer_sets_in_memory(tiny_dir, tiny_hf, tmp_path):
    """jobs/train_drafter.py --answers SET: no feature files; the conversations are the set's prompt + answer ids
    with the answer scored, and the head trains on them as on extracted features."""
    import runpy
    from pathlib import Path

    from eagle_ray.train.selfdistill import ShardWriter

    g = torch.Generator().manual_seed(3)
    rows = [{"id": f"p{i}", "prompt_ids": torch.randint(3, 60, (4 + i % 3,), generator=g).tolist(),
             "answer_ids": torch.randint(3, 60, (6 + i % 5,), generator=g).tolist(), "eos": False} for i in range(20)]
    ShardWriter(tmp_path / "set", {"what": "test answers"}).write(rows)
    main = runpy.run_path(str(Path(__file__).parents[1] / "jobs" / "train_drafter.py"))["main"]
    out = tmp_path / "run"
    assert main(["--answers", str(tmp_path / "set"), "--out", str(out), "--target", str(tiny_dir), "--epochs", "1",
                 "--token-map-size", "0", "--tokens-per-step", "64", "--eval-fraction", "0.1",
                 "--batch-tokens", "64", "--wall-budget-s", "3600"]) == 0
    card = json.loads((out / "head" / "training.json").read_text())
    assert card["conversations"] == 20 and card["finished"] and card["device"] == "cpu"
    # the wall budget became a training budget of what loading and the states left, less the saving reserve
    assert 3600 - 15 - 60 < card["train_config"]["time_budget_s"] < 3600 - 15
    assert card["tokens"] == sum(len(r["prompt_ids"]) + len(r["answer_ids"]) for r in rows)
    assert card["assistant_tokens"] == sum(len(r["answer_ids"]) for r in rows)
    assert card["history"][-1]["eval_tokens"] == sum(len(r["answer_ids"]) for r in rows[:2])
    DraftHead.load(out / "head", tiny_hf.config, tiny_hf.model.embed_tokens.weight)
    # bench/acceptance.py top1 --answers scores a head on exactly the conversations its run held out
    acceptance = repo_scripts.load("bench/acceptance.py")
    assert acceptance.main(["top1", "--answers", str(tmp_path / "set"), "--first", "2", "--heads",
                            str(out / "head"), "--target", str(tiny_dir), "--out", str(tmp_path / "eval.json")]) == 0
    scored = json.loads((tmp_path / "eval.json").read_text())
    assert scored["conversations"] == {"held_out": 2}
    assert scored["results"][str(out / "head")]["eval_tokens"] == card["history"][-1]["eval_tokens"]


def test_answer_states_can_be_kept_apart_from_the_device_that_computes_them(tmp_path, capsys):
    """--states-device: the target computes on --device, its states land where they are asked to (host memory
    when a GPU has no room for an EAGLE-3 head's three layer inputs). 'meta' stands in for a second device here."""
    from eagle_ray.model.eagle3_head import capture_layers
    from eagle_ray.train.conversations import states_in_memory
    from eagle_ray.train.selfdistill import ShardWriter
    from tiny import save_target

    deep = save_target(tmp_path / "deep", layers=8, seed=3)   # an EAGLE-3 head reads layers 2, 4 and 5
    rows = [{"id": f"p{i}", "prompt_ids": [5 + i, 6, 7], "answer_ids": [8, 9 + i, 10, 11], "eos": False}
            for i in range(3)]
    ShardWriter(tmp_path / "set", {"what": "test answers"}).write(rows)
    target, convs = states_in_memory([str(tmp_path / "set")], str(deep), "float32", None, "cpu", 64, True, 64,
                                     None, states_device="meta")
    d, layers = target.config.hidden_size, len(capture_layers(target.config.num_hidden_layers))
    assert [c["hidden"].shape for c in convs] == [(7, d)] * 3
    assert [c["aux"].shape for c in convs] == [(7, layers * d)] * 3
    assert {c["hidden"].device.type for c in convs} == {c["aux"].device.type for c in convs} == {"meta"}
    assert next(target.parameters()).device.type == "cpu"
    size = 3 * 7 * (1 + layers) * d * 2   # bf16
    assert f"{size / 2**30:.2f} GiB on meta" in capsys.readouterr().out


def test_an_answer_set_whose_manifest_no_longer_describes_it_fails_naming_the_file(tmp_path):
    from eagle_ray.train.selfdistill import MANIFEST, ShardWriter, load_answers

    rows = [{"id": f"p{i}", "prompt_ids": [5, 6], "answer_ids": [7, 8, 9], "eos": False} for i in range(3)]
    ShardWriter(tmp_path / "set", {"what": "test answers"}).write(rows)
    assert load_answers(tmp_path / "set").num_rows == 3
    path = tmp_path / "set" / MANIFEST
    good = json.loads(path.read_text())
    for damage, reason in (("{broken", "cannot be read as JSON"),
                           (json.dumps({k: v for k, v in good.items() if k != "rows"}), "lacks rows"),
                           (json.dumps({**good, "shards": [{"file": "answers-00000.parquet"}]}),
                            "lacks shards\\[0\\].rows, shards\\[0\\].answer_tokens"),
                           (json.dumps({**good, "shards": [{**good["shards"][0], "file": "gone.parquet"}]}),
                            "gone.parquet: listed in the manifest but not readable")):
        path.write_text(damage)
        with pytest.raises(ValueError, match=reason):
            load_answers(tmp_path / "set")


def test_an_answer_set_with_counts_or_files_of_the_wrong_kind_fails_naming_them(tmp_path):
    """Hand-edited manifests and shards written by other tools fail naming what is wrong, never with a raw
    TypeError; an empty shard is a shard, and a set that is not there is an error, not an empty table."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle_ray.train.selfdistill import MANIFEST, AnswerSetError, ShardWriter, load_answers

    rows = [{"id": f"p{i}", "prompt_ids": [5, 6], "answer_ids": [7, 8, 9], "eos": False} for i in range(3)]
    writer = ShardWriter(tmp_path / "set", {"what": "test answers"})
    writer.write(rows)
    writer.write([])
    assert load_answers(tmp_path / "set").num_rows == 3
    path = tmp_path / "set" / MANIFEST
    good = json.loads(path.read_text())
    for damage, reason in (({**good, "shards": 5}, "shards is 5, not a list"),
                           ({**good, "rows": "3"}, "lacks rows"),
                           ({**good, "shards": [{**good["shards"][0], "file": 7}]}, "lacks shards\\[0\\].file")):
        path.write_text(json.dumps(damage))
        with pytest.raises(AnswerSetError, match=reason):
            load_answers(tmp_path / "set")
    path.write_text(json.dumps(good))
    pq.write_table(pa.table({"id": ["p0"], "prompt_ids": [["x"]], "answer_ids": [[7]]}),
                   tmp_path / "set" / "answers-00000.parquet")
    with pytest.raises(AnswerSetError, match="answers-00000.parquet: listed in the manifest but not readable as "):
        load_answers(tmp_path / "set")
    with pytest.raises(AnswerSetError, match="does not exist"):
        load_answers(tmp_path / "no-such-set")


def test_a_set_takes_new_shards_after_its_last_and_only_answers_made_its_way(tmp_path):
    """A new shard never replaces one the manifest lists, even when the list has a gap; a writer whose answers
    would differ may not add to the set (where it runs may differ); flags no run can use fail before loading."""
    from eagle_ray.errors import ConfigError
    from eagle_ray.train.selfdistill import MANIFEST, AnswerSetError, ShardWriter, answer_prompts, load_answers

    def rows(k):
        return [{"id": f"{k}-{i}", "prompt_ids": [5], "answer_ids": [7, 8], "eos": True} for i in range(2)]
    writer = ShardWriter(tmp_path / "set", {"what": "test answers"})
    for k in range(3):
        writer.write(rows(k))
    man = json.loads((tmp_path / "set" / MANIFEST).read_text())
    dropped = man["shards"].pop(1)
    man.update(rows=4, answer_tokens=8)
    (tmp_path / "set" / MANIFEST).write_text(json.dumps(man))
    (tmp_path / "set" / dropped["file"]).unlink()
    assert ShardWriter(tmp_path / "set", {"what": "test answers"}).write(rows(3)).name == "answers-00003.parquet"
    assert sorted(load_answers(tmp_path / "set")["id"].to_pylist()) == ["0-0", "0-1", "2-0", "2-1", "3-0", "3-1"]
    with pytest.raises(AnswerSetError, match="made otherwise \\(what: 'test answers' there, 'other' now\\)"):
        ShardWriter(tmp_path / "set", {"what": "other", "cpu": "another machine"})
    ShardWriter(tmp_path / "set", {"what": "test answers", "cpu": "another machine"})   # where it ran may differ
    with pytest.raises(ConfigError, match="shard_rows, window and limit must be >= 1"):
        answer_prompts(tmp_path / "set2", shard_rows=0)
    with pytest.raises(AnswerSetError, match="does not exist"):
        answer_prompts(tmp_path / "set2", skip_sets=tmp_path / "typo")


def test_a_mistyped_source_fails_before_a_feature_directory_records_it(tmp_path):
    """The record of how a directory was made is written only for a source that can be read: a typo used to
    leave a record of the typo behind, and the directory then refused the corrected command."""
    (tmp_path / "notarray.json").write_text('{"conversations": []}')
    (tmp_path / "set").mkdir()
    (tmp_path / "set" / "manifest.json").write_text('{"rows": 1, "answer_tokens": 2, "shards": 5}')
    for source, reason in ((str(tmp_path / "typo"), "does not exist"),
                           (str(tmp_path / "notarray.json"), "does not hold a JSON array"),
                           (str(tmp_path / "set"), "shards is 5, not a list")):
        with pytest.raises(SystemExit, match=reason):
            extract.run_local(str(tmp_path / "f"), None, source, 4, 2, 64, "float32", 1)
        assert not (tmp_path / "f" / "extraction.json").exists()
    (tmp_path / "bom.json").write_bytes(b'\xef\xbb\xbf[{"conversations": []}]')   # as some editors save it
    extract.check_source(str(tmp_path / "bom.json"))
    assert list(iter_json_array(tmp_path / "bom.json")) == [{"conversations": []}]
    (tmp_path / "blank.json").write_bytes(b"\n" * 5000 + b'[{"conversations": []}]')   # past the first read
    extract.check_source(str(tmp_path / "blank.json"))
    assert list(iter_json_array(tmp_path / "blank.json")) == [{"conversations": []}]
    (tmp_path / "blanks.json").write_bytes(b"\xef\xbb\xbf" + b" " * 9000)
    with pytest.raises(SystemExit, match="does not hold a JSON array"):
        extract.check_source(str(tmp_path / "blanks.json"))


@pytest.mark.parametrize("set_name, command", [
    ("exact-fp32", {}),
    ("sharegpt-turn2-fp32", {"second_turns": True, "stop_repeat_ngram": 32}),
    ("python-functions-fp32", {"source": "python-functions", "stop_repeat_ngram": 32}),
])
def test_a_committed_set_resumes_under_its_command_and_refuses_another_before_loading(set_name, command, tmp_path,
                                                                                     monkeypatch):
    """The check compares what defines the answers (source, target, length cap, repeat stop, dtype), not how a
    manifest words its prompts or where it ran: each committed set takes more answers from the command that made
    it, and a run with another length cap, repeat stop or prompt cap is refused before the target loads."""
    import shutil

    from eagle_ray.engine.engine import EagleEngine
    from eagle_ray.train.selfdistill import REPO_DATA, AnswerSetError, answer_prompts

    def loading(*args, **kwargs):
        raise RuntimeError("the target loads")
    monkeypatch.setattr(EagleEngine, "from_pretrained", loading)
    shutil.copytree(REPO_DATA / set_name, tmp_path / set_name)
    with pytest.raises(RuntimeError, match="the target loads"):
        answer_prompts(tmp_path / set_name, **command)
    for other in ({"max_new_tokens": 100}, {"stop_repeat_ngram": 16}, {"max_prompt_tokens": 3000}):
        with pytest.raises(AnswerSetError, match="holds answers made otherwise"):
            answer_prompts(tmp_path / set_name, **{**command, **other})
