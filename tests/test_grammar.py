"""Structured output on the tiny models: the grammar masks every choice and prunes the draft trees.

The tiny tokenizer's tokens are words (``w0`` .. ``w56``), which xgrammar reads as raw bytes, so the grammars here
are written over their concatenation (``w5w6``). Greedy constrained speculation equals constrained plain decoding
and an independent reference (a full forward per token, masked by a fresh matcher); no draft node the grammar
forbids is ever verified, and they are counted; a finished grammar ends the sequence; grammars compile once.
"""
import threading

import pytest
import torch
from tiny import tiny_engine

from eagle_ray.config import SamplingParams, TreeConfig
from eagle_ray.errors import InvalidRequestError

TREE = TreeConfig(total_tokens=12, depth=3, top_k=3)
W = {f"w{i}": 7 + i for i in range(57)}          # the tiny tokenizer's word ids

GRAMMARS = {   # each with forbidden tokens the unconstrained target would pick, and room to accept drafts
    "regex of a token class": dict(guided_regex="(w[0-9]|w[1-3][0-9]){3,24}"),
    "ebnf with paths": dict(guided_grammar='root ::= "w5" ("w6" | "w7" "w8" | "w2" | "w3")* "w9"'),
    "choice": dict(guided_choice=["w5w6w7w8w9", "w5w6w2", "w3"]),
    "structural tag": dict(guided_structural_tag={   # free text; after each w29 (which the target writes), w1x
        "type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["w29"], "tags": [
            {"type": "tag", "begin": "w29", "content": {"type": "regex", "pattern": "(w1[0-9]){1,4}"}, "end": "w2"}]}}),
}


def constrained_reference(hf, engine, prompt: list[int], n: int, **guided) -> list[int]:
    """A full forward per token, its logits masked by a fresh matcher's allowed tokens, argmax."""
    import xgrammar as xgr
    guide = engine.grammars.guide(SamplingParams(**guided))
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1]
            mask = torch.zeros(1, (logits.shape[0] + 31) // 32, dtype=torch.int32)
            guide.matcher.fill_next_token_bitmask(mask, 0)
            xgr.apply_token_bitmask_inplace(logits[None], mask)
            tok = int(logits.argmax())
            out.append(tok)
            ids.append(tok)
            if not guide.accept(tok) or tok in engine.eos_ids or guide.finished():
                break
    return out


def prompts(n: int, seed: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 64, (int(k),), generator=g).tolist() for k in torch.randint(2, 12, (n,), generator=g)]


@pytest.mark.parametrize("grammar", list(GRAMMARS))
def test_greedy_constrained_speculation_equals_constrained_plain_decoding(tiny_dir, tiny_hf, tiny_head, grammar):
    engine = tiny_engine(tiny_dir, tiny_head, TREE, max_batch_size=3)
    ps = prompts(4)
    params = SamplingParams(max_new_tokens=30, **GRAMMARS[grammar])
    spec = engine.generate(ps, params)
    plain = engine.generate(ps, params, speculative=False)
    for s, p, prompt in zip(spec, plain, ps):
        assert s.token_ids == p.token_ids == constrained_reference(tiny_hf, engine, prompt, 30, **GRAMMARS[grammar])
        assert s.finish_reason == p.finish_reason
    if grammar != "choice":   # a choice is forced after its first token: nothing left to draft against
        assert sum(sum(o.stats.accepted_per_depth) for o in spec) > 0


OPEN, CLOSE = 32, 36   # w25 and w29 renamed <think> and </think>: tokens the tiny target's greedy outputs hold,
                      # w25 first for some prompts, w29 some tokens in


def marked_dir(tiny_dir, tmp_path_factory, opening: str, closing: str):
    import shutil

    from tiny import make_tokenizer
    path = tmp_path_factory.mktemp("tiny-thinking")
    shutil.copytree(tiny_dir, path, dirs_exist_ok=True)
    make_tokenizer(64, {OPEN: opening, CLOSE: closing}).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def thinking_dir(tiny_dir, tmp_path_factory):
    """The tiny target with a vocabulary whose thinking markers are one token each (as Qwen3's and DeepSeek-R1's)."""
    return marked_dir(tiny_dir, tmp_path_factory, "<think>", "</think>")


@pytest.fixture(scope="module")
def magistral_dir(tiny_dir, tmp_path_factory):
    """The same with Magistral's markers."""
    return marked_dir(tiny_dir, tmp_path_factory, "[THINK]", "[/THINK]")


def gated_reference(hf, engine, prompt: list[int], n: int, mode: str, **guided) -> list[int]:
    """A full forward per token; free while thinking (``until_close``: from the start; ``if_opened``: where the
    first token is <think>), masked by a fresh matcher once </think> has closed it (or from the first token not
    opening one), argmax."""
    import xgrammar as xgr
    guide = engine.grammars.guide(SamplingParams(**guided))
    thinking, undecided = mode == "until_close", mode == "if_opened"
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1]
            if not thinking:
                mask = torch.zeros(1, 2, dtype=torch.int32)
                guide.matcher.fill_next_token_bitmask(mask, 0)
                mask[0, OPEN // 32] |= (1 << (OPEN % 32)) if undecided else 0
                xgr.apply_token_bitmask_inplace(logits[None], mask)
            tok = int(logits.argmax())
            out.append(tok)
            ids.append(tok)
            if tok in engine.eos_ids:
                break
            if thinking:
                thinking = tok != CLOSE
            elif undecided and tok == OPEN:
                thinking = True
            elif not guide.accept(tok) or guide.finished():
                break
            undecided = False
    return out


@pytest.mark.parametrize("parser, mode", [("deepseek_r1", "until_close"), ("qwen3", "if_opened"),
                                          ("mistral", "if_opened")])
def test_a_reasoning_models_answer_alone_is_held_to_the_grammar(request, tiny_hf, tiny_head, parser, mode):
    """vLLM's rule: structured output waits for the thinking to close. Greedy gated speculation equals gated plain
    decoding and the reference; the thinking holds tokens the grammar forbids, the answer none."""
    from eagle_ray.engine.reasoning import mode_for
    marked = request.getfixturevalue("magistral_dir" if parser == "mistral" else "thinking_dir")
    engine = tiny_engine(marked, tiny_head, TREE, max_batch_size=3)
    engine.reasoning_parser = parser
    guided = dict(guided_regex="(w[0-9]|w1[0-9]){1,12}")   # w0 .. w19: ids 7 .. 26
    ps = [[t for t in p if t not in (OPEN, CLOSE)] or [5] for p in prompts(8)]   # no marker in a prompt
    assert {mode_for(parser, engine.tokenizer, p, constrained=True) for p in ps} == {mode}
    params = SamplingParams(max_new_tokens=40, **guided)
    spec = engine.generate(ps, params)
    plain = engine.generate(ps, params, speculative=False)
    closed = 0
    for s, p, prompt in zip(spec, plain, ps):
        assert s.token_ids == p.token_ids == gated_reference(tiny_hf, engine, prompt, 40, mode, **guided)
        assert s.finish_reason == p.finish_reason
        ids = s.token_ids
        answer = (ids[ids.index(CLOSE) + 1:] if CLOSE in ids else
                  ids if mode == "if_opened" and ids[0] != OPEN else [])   # an unclosed thinking: no answer
        assert all(7 <= t <= 26 for t in answer if t not in engine.eos_ids), ids
        closed += CLOSE in ids
    assert closed >= 2, [s.token_ids for s in spec]
    assert any(not 7 <= t <= 26 for s in spec if CLOSE in s.token_ids
               for t in s.token_ids[:s.token_ids.index(CLOSE)]), "the thinking was held to the grammar"
    assert sum(sum(o.stats.accepted_per_depth) for o in spec) > 0
    if mode == "if_opened":
        assert {s.token_ids[0] == OPEN for s in spec} == {True, False}   # some think, some answer at once
    twice = engine.generate(ps[:4], params.model_copy(update={"n": 2}))   # each sample's guide gated from the start
    assert [o.token_ids for o in twice] == [s.token_ids for s in spec[:4] for _ in range(2)]


def test_a_jobs_structured_rows_think_before_their_answer(thinking_dir, tmp_path):
    """The job hands its reasoning parser to the engine: a guided row's thinking lands in ``reasoning`` and the
    answer alone, held to the grammar, in ``output``."""
    from test_job_output import run_rows

    from eagle_ray.batch.config import JobConfig
    from eagle_ray.batch.stage import GenerateStage
    cfg = JobConfig(engine={"target": str(thinking_dir), "draft": "random", "dtype": "float32", "max_batch_size": 8,
                            "max_model_len": 128, "tree": {"total_tokens": 6, "depth": 2, "top_k": 2}},
                    sampling={"max_new_tokens": 40, "guided_regex": "(w[0-9]|w1[0-9]){1,12}"},
                    reasoning_parser="deepseek_r1",
                    input={"uri": str(tmp_path / "in.jsonl")}, output={"uri": str(tmp_path / "out")})
    ps = [[t for t in p if t not in (OPEN, CLOSE)] or [5] for p in prompts(8)]
    stage = GenerateStage(cfg.model_dump_json())
    rows = run_rows(stage, [{"prompt": stage.engine.tokenizer.decode(p)} for p in ps])   # words: the same ids
    answered = [r for r in rows if CLOSE in r["output_token_ids"]]
    assert len(answered) >= 2 and all(r["error"] is None for r in rows)
    for r in answered:
        ids = r["output_token_ids"]
        assert all(7 <= t <= 26 for t in ids[ids.index(CLOSE) + 1:] if t != 1), ids
        assert r["reasoning"] and r["output"] and "</think>" not in r["output"] + r["reasoning"]


def test_a_finished_choice_ends_the_sequence_without_an_end_token(tiny_dir):
    engine = tiny_engine(tiny_dir, None, TREE)
    out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=30, guided_choice=["w5w6w7w8w9", "w3"]))[0]
    assert out.token_ids in ([W[f"w{i}"] for i in range(5, 10)], [W["w3"]])
    assert out.finish_reason == "stop"


def test_a_dead_end_of_the_vocabulary_ends_the_sequence_before_the_refused_token(tiny_dir):
    """``w1`` may start ``w1`` + a digit, but no tiny token starts with a digit: every logit after it is masked,
    and the sequence ends there, speculative or not, instead of failing the engine."""
    engine = tiny_engine(tiny_dir, None, TREE)
    params = SamplingParams(max_new_tokens=8, guided_regex="w1[0-9]", logit_bias={W["w1"]: 100.0})
    for speculative in (True, False):
        out = engine.generate([[5, 6]], params, speculative=speculative)[0]
        assert (out.token_ids, out.finish_reason) == ([W["w1"]], "stop")


def test_a_forbidden_draft_node_is_never_verified(tiny_dir):
    """A cycle w5 -> w6 -> w7 -> w5: every verified node's token follows its parent's; drafts that do not are
    dropped before the pass (counted), and output is the cycle."""
    engine = tiny_engine(tiny_dir, None, TreeConfig(total_tokens=16, depth=3, top_k=4), max_batch_size=4)
    verified = []
    target_pass = engine.runner.target_pass

    def recording(prefill, blocks):
        verified.extend(block.tree for block in blocks)
        return target_pass(prefill, blocks)
    engine.runner.target_pass = recording
    params = SamplingParams(max_new_tokens=40, guided_regex="w5(w6w7w5)*", logit_bias={1: -100})   # no end token
    seqs = [engine.add_request(p, params) for p in prompts(4, seed=9)]
    while engine.has_unfinished():
        engine.step()
    nxt = {W["w5"]: W["w6"], W["w6"]: W["w7"], W["w7"]: W["w5"]}
    checked = 0
    for tree in verified:
        tokens, parents, valid = tree.tokens.tolist(), tree.parents.tolist(), tree.valid.tolist()
        for b in range(len(tokens)):
            for i in range(1, len(tokens[b])):
                if valid[b][i]:   # padding nodes are never accepted
                    assert nxt[tokens[b][parents[b][i]]] == tokens[b][i]
                    checked += 1
    assert checked > 0 and sum(s.guide.pruned for s in seqs) > 0, (checked, [s.output_ids for s in seqs])
    cycle = [W["w5"], W["w6"], W["w7"]] * 14
    for s in seqs:   # the cycle, up to the length or an end token where a w5 closes it
        text = s.output_ids[:-1] if s.output_ids[-1] in engine.eos_ids else s.output_ids
        assert text == cycle[:len(text)] and len(text) % 3 == 1 or len(text) == 40


def test_schemas_whose_properties_differ_in_order_are_two_grammars(tiny_dir):
    """A schema's properties are written in its own order: a cache keyed on sorted keys would hand the second
    request the first one's order."""
    engine = tiny_engine(tiny_dir, None, TREE)
    first = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}
    second = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    assert engine.grammars.compile("guided_json", first) is not engine.grammars.compile("guided_json", second)
    assert engine.grammars.compiled == 2


def test_a_grammar_compiles_once_for_every_request_that_asks_for_it(tiny_dir):
    engine = tiny_engine(tiny_dir, None, TREE)
    schema = {"enum": ["w5w6", "w7"]}
    threads = [threading.Thread(target=engine.grammars.compile, args=("guided_json", dict(schema)))
               for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine.generate([[5], [6]], SamplingParams(max_new_tokens=8, guided_json={"enum": ["w5w6", "w7"]}))
    assert engine.grammars.compiled == 1


@pytest.mark.parametrize("guided, message", [
    (dict(guided_regex="(w5"), "guided_regex: the grammar engine cannot compile it: Regex parsing error"),
    (dict(guided_grammar='root ::= w5'), "guided_grammar: the grammar engine cannot compile it"),
    (dict(guided_json={"properties": {"a": {"$ref": "#/nowhere"}}}), "guided_json: the grammar engine cannot"),
    (dict(guided_structural_tag={"type": "structural_tag", "triggers": ["w5"]}),
     "guided_structural_tag: the grammar engine cannot compile it: a structural tag needs format"),
    (dict(guided_structural_tag={"type": "structural_tag", "format": {"type": "nonsense"}}),
     "guided_structural_tag: the grammar engine cannot compile it")])
def test_a_grammar_that_fails_to_compile_refuses_the_request_and_nothing_else(tiny_dir, guided, message):
    engine = tiny_engine(tiny_dir, None, TREE)
    with pytest.raises(InvalidRequestError, match=message):
        engine.make_sequence([5, 6], SamplingParams(**guided))
    assert engine.generate([[5, 6]], SamplingParams(max_new_tokens=4, ignore_eos=True))[0].token_ids


@pytest.mark.parametrize("fields, message", [
    (dict(guided_json={"type": "nonsense"}), "guided_json: Value error, not a valid JSON schema"),
    (dict(guided_json="{not json"), "guided_json: Value error, not valid JSON"),
    (dict(guided_json={"type": "object"}, guided_choice=["a"]), "guided_choice: Value error, guided_json is given"),
    (dict(guided_choice=[]), "guided_choice: List should have at least 1 item"),
    (dict(frequency_penalty=2.5), "frequency_penalty: Input should be less than or equal to 2"),
    (dict(presence_penalty=-3), "presence_penalty: Input should be greater than or equal to -2"),
    (dict(repetition_penalty=0), "repetition_penalty: Input should be greater than 0"),
    (dict(logit_bias={"5": 101}), r"logit_bias.5: Input should be less than or equal to 100"),
    (dict(logit_bias={"-3": 1}), "logit_bias: Value error, keys must be token ids"),
])
def test_a_bad_field_is_refused_naming_it(fields, message):
    from eagle_ray.engine.request import sampling_params
    with pytest.raises(InvalidRequestError, match=message):
        sampling_params(fields)


def test_a_rows_structured_output_replaces_the_jobs_and_serve_reads_vllms_field_alike():
    import json

    from eagle_ray.engine.request import sampling_params
    from eagle_ray.serve.openai_api import ApiError, parse_body
    job = SamplingParams(guided_json={"type": "object"}, max_new_tokens=5)
    assert sampling_params({"guided_regex": "w5"}, job).guided == ("guided_regex", "w5")
    assert sampling_params({"structured_outputs": {"json_object": True}}, job).guided == ("guided_json",
                                                                                          {"type": "object"})
    assert sampling_params({"temperature": 0.5}, job).guided == job.guided   # no structured output of its own
    for two, message in [({"structured_outputs": {"regex": "w"}, "guided_decoding": {"regex": "w"}},
                           "guided_decoding is given too"),
                          ({"structured_outputs": {"regex": "w"}, "guided_choice": ["w"]}, "guided_choice is given"),
                          ({"structured_outputs": {"json_object": "yes"}}, "json_object: true or false"),
                          ({"structured_outputs": {"json_object": 1}}, "json_object: true or false"),
                          ({"structured_outputs": {"structural_tag": "[" * 100 + "]" * 100}},
                           "structural_tag: a JSON object nested at most 64 deep")]:
        with pytest.raises(InvalidRequestError, match=message):
            sampling_params(two, job)

    def body(**fields):
        return json.dumps({"model": "m", "prompt": "w1", **fields}).encode()
    assert parse_body(body(structured_outputs={"choice": ["w3"]}), "completion", "m", 100, 16).params.guided == (
        "guided_choice", ["w3"])
    with pytest.raises(ApiError, match="structured_outputs: \\['grammar', 'json'\\] are given: one of them"):
        parse_body(body(structured_outputs={"json": {}, "grammar": "x"}), "completion", "m", 100, 16)
    tag = GRAMMARS["structural tag"]["guided_structural_tag"]   # vLLM's structural tag, both ways it is sent
    assert parse_body(body(response_format=tag), "completion", "m", 100, 16).params.guided == (
        "guided_structural_tag", tag)
    assert parse_body(body(structured_outputs={"structural_tag": json.dumps(tag)}), "completion", "m", 100,
                      16).params.guided == ("guided_structural_tag", tag)


def test_job_rows_take_guided_fields_and_a_bad_one_is_an_invalid_request_row(tiny_dir):
    import asyncio
    import json

    from eagle_ray.batch.config import JobConfig
    from eagle_ray.batch.rows import rows_from_lines
    from eagle_ray.batch.stage import GenerateStage
    from eagle_ray.engine.queue import RequestQueue
    stage = GenerateStage.__new__(GenerateStage)
    stage.cfg = JobConfig(input={"uri": "x"}, output={"uri": "y"}, sampling={"max_new_tokens": 8})
    stage.engine = tiny_engine(tiny_dir, None, TREE)
    stage.queue = RequestQueue(stage.engine)
    stage.target_name, stage.draft_name, stage.worker_id = "t", "d", "w"
    rows = [{"id": "cycle", "prompt": "w1 w2", "sampling_params": {"guided_regex": "w5(w6w7w5)*", "max_tokens": 7,
                                                                      "logit_bias": {"1": -100}}},
            {"id": "choice", "prompt": "w1", "sampling_params": {"guided_choice": ["w5w6w7w8w9", "w3"]}},
            {"id": "schema", "prompt": "w1", "sampling_params": {"guided_json": {"type": "nonsense"}}},
            {"id": "regex", "prompt": "w1", "sampling_params": {"guided_regex": "(w5"}},
            {"id": "two", "prompt": "w1", "sampling_params": {"guided_regex": "w5", "guided_choice": ["w5"]}},
            {"id": "bias", "prompt": "w1", "sampling_params": {"logit_bias": {"99": 1}}},
            {"id": "penalty", "prompt": "w1", "sampling_params": {"presence_penalty": 2.5}},
            # vLLM's structured_outputs (and guided_decoding, its older name), as Ray Data LLM rows send them
            {"id": "vllm", "prompt": "w1", "sampling_params": {"structured_outputs": {"choice": ["w3"]}}},
            {"id": "vllm-old", "prompt": "w1", "sampling_params": {"guided_decoding": {"regex": "w4w4",
                                                                                      "backend": "xgrammar"}}},
            {"id": "vllm-two", "prompt": "w1", "sampling_params": {"structured_outputs": {"json": {}, "regex": "w"}}},
            {"id": "vllm-tag", "prompt": "w1", "sampling_params": {"structured_outputs": {"structural_tag": "x"}}}]
    items = [r.as_item() for r in rows_from_lines([json.dumps(r).encode() for r in rows], "in.jsonl")]

    async def run():
        return await asyncio.gather(*(stage.process(item) for item in items))
    try:
        out = {r["id"]: r for r in asyncio.run(run())}
    finally:
        stage.queue.shutdown()
    assert out["cycle"]["output_token_ids"] == [W["w5"], W["w6"], W["w7"]] * 2 + [W["w5"]]
    assert out["choice"]["finish_reason"] == "stop" and out["choice"]["error"] is None
    assert json.loads(out["cycle"]["sampling_params"])["guided_regex"] == "w5(w6w7w5)*"
    assert out["vllm"]["output_token_ids"] == [W["w3"]] and out["vllm-old"]["output_token_ids"] == [W["w4"]] * 2
    for rid, field in [("schema", "guided_json"), ("regex", "guided_regex"), ("two", "guided_choice"),
                       ("bias", "logit_bias"), ("penalty", "presence_penalty"),
                       ("vllm-two", "sampling_params.structured_outputs: ['json', 'regex'] are given"),
                       ("vllm-tag", "structured_outputs.structural_tag: not valid JSON")]:
        assert out[rid]["error_kind"] == "invalid_request" and field in out[rid]["error"], out[rid]["error"]
