"""Bad input and hard load lose nothing: each case here once crashed a job, a replica or every request in flight.

Engine, request parser, row reader and Serve body parser on tiny models; no Ray cluster (the job- and Serve-level
versions of these cases are in test_job.py and test_serve.py, slow tier).
"""
import asyncio
import json
import re
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import repo_scripts
import torch
from test_engine import greedy_after_each, reference_greedy
from tiny import save_target, text_after, tiny_engine

from eagle_ray.config import SamplingParams, TreeConfig
from eagle_ray.batch.rows import INVALID_JSON, INVALID_ROW, read_input, to_table
from eagle_ray.engine.request import parse_row
from eagle_ray.errors import ConfigError, EngineDeadError, InvalidRequestError, PromptTooLongError


@pytest.fixture(scope="module")
def long_ctx(tmp_path_factory):
    """A tiny target whose context is 2,048 positions, and a transformers copy for the reference."""
    from transformers import AutoModelForCausalLM
    path = save_target(tmp_path_factory.mktemp("long-ctx"), max_positions=2048)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def random_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- long prompts joining running sequences ---------------------------------------------------------------------
def test_long_prompts_joining_deep_sequences_stay_inside_the_draft_cache(long_ctx, tiny_head):
    """Two ~1,070-token prompts join a sequence deep in its slot (the shape that overflowed the draft cache:
    every row's catch-up pass was padded to the longest pending list, so the deep row wrote past its slot)."""
    path, hf = long_ctx
    engine = tiny_engine(path, tiny_head, TreeConfig(total_tokens=8, depth=2, top_k=3), max_batch_size=2,
                         max_model_len=2048)
    prompts = [random_prompt(211, 1), random_prompt(1066, 2), random_prompt(1066, 3)]
    lengths = [5, 60, 20]   # the third joins when the first ends, beside a row 1,070 deep
    outs = engine.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths])
    for out, prompt, n in zip(outs, prompts, lengths):
        assert out.token_ids == reference_greedy(hf, prompt, n)


def test_prompts_of_100_to_1900_tokens_arrive_while_others_run_near_the_context_end(long_ctx, tiny_head):
    """Mixed lengths with continuous batching: sequences that fill their slot to the end share steps with
    prompts arriving in bounded chunks; every output equals the target's greedy output."""
    path, hf = long_ctx
    engine = tiny_engine(path, tiny_head, TreeConfig(total_tokens=8, depth=2, top_k=3), max_batch_size=3,
                         max_model_len=2048)
    engine.scheduler.step_budget = engine.runner.extend_budget = 512
    sizes = [1900, 100, 1400, 700, 1850, 300, 1000]
    prompts = [random_prompt(n, 10 + i) for i, n in enumerate(sizes)]
    params = [SamplingParams(max_new_tokens=2048, ignore_eos=True) if n in (1900, 1850)
              else SamplingParams(max_new_tokens=40, ignore_eos=True) for n in sizes]
    outs = engine.generate(prompts, params)
    for out, prompt, n in zip(outs, prompts, sizes):
        if n in (1900, 1850):  # ran to the end of the context
            # where its next tree might not fit, a sequence decodes plainly to the last position of its slot
            assert out.finish_reason == "length"
            assert len(prompt) + len(out.token_ids) == 2048 + 1
        assert out.token_ids == greedy_after_each(hf, prompt, out.token_ids)


# ---- sampling ---------------------------------------------------------------------------------------------------
def test_a_seeded_request_gives_the_same_text_alone_in_a_batch_with_or_without_speculation(tiny_dir, tiny_head):
    engine = tiny_engine(tiny_dir, tiny_head, max_batch_size=4)
    prompt = random_prompt(9, 4)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=30, seed=1234, ignore_eos=True)
    alone = engine.generate([prompt], seeded)[0].token_ids
    others = [random_prompt(n, 5 + n) for n in (3, 17, 8)]
    mixed = engine.generate([others[0], prompt, others[1], others[2]],
                            [SamplingParams(temperature=1.0, max_new_tokens=7, ignore_eos=True), seeded,
                             SamplingParams(temperature=0.5, max_new_tokens=25), SamplingParams(max_new_tokens=12)])
    plain = engine.generate([prompt], seeded, speculative=False)[0].token_ids
    assert mixed[1].token_ids == alone == plain
    other_seed = engine.generate([prompt], seeded.model_copy(update={"seed": 99}))[0].token_ids
    assert other_seed != alone


# ---- text ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_head_that_outputs_nan_or_inf_costs_acceptance_never_output(tmp_path, bad):
    """Floored draft scores keep every tree connected: a head whose every weight is NaN (or inf) drafts junk the
    target rejects. Its broken trees used to link children to the wrong parents and emit tokens never verified,
    on a target whose argmax is one of the ids a NaN row's top-k returns. (The context-token path's floor:
    ``test_tree.py``.)"""
    from transformers import AutoModelForCausalLM

    from eagle_ray.model.draft_head import DraftHead
    nan_ids = torch.full((64,), float("nan")).log_softmax(-1).topk(3).indices.tolist()
    target_dir = save_target(tmp_path / "t")
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    with torch.no_grad():
        hf.lm_head.weight.zero_()
        hf.lm_head.weight[nan_ids[0], 0], hf.lm_head.weight[nan_ids[1], 0] = 5.0, -5.0
    hf.save_pretrained(target_dir)
    head = DraftHead.for_target(hf.config)
    with torch.no_grad():
        for name, w in head.named_parameters():
            if name != "embed_tokens.weight":
                w.fill_(bad)
        head.embed_tokens.weight.copy_(hf.model.embed_tokens.weight)
    engine = tiny_engine(target_dir, head, TreeConfig(total_tokens=12, depth=3, top_k=3), max_batch_size=2)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [20, 21, 22, 23]]
    for params in (SamplingParams(max_new_tokens=24, ignore_eos=True),
                   SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=1.0, seed=3)):
        plain = [o.token_ids for o in engine.generate(prompts, params, speculative=False)]
        assert [o.token_ids for o in engine.generate(prompts, params)] == plain


def test_a_prompt_holding_a_token_the_model_cannot_embed_is_refused_and_the_engine_runs_on(tmp_path):
    """A fine-tune that added a tokenizer token without growing the embedding: text spelling that token must be the
    request's error, not an index error that kills the engine for every request."""
    from transformers import AutoTokenizer

    from eagle_ray.engine.queue import RequestQueue
    save_target(tmp_path)                                    # 64 embedding rows, 64 tokens
    tok = AutoTokenizer.from_pretrained(tmp_path)
    tok.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})    # id 64
    tok.save_pretrained(tmp_path)
    queue = RequestQueue(tiny_engine(tmp_path, max_model_len=128))
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    with pytest.raises(InvalidRequestError, match=r"token id 64, outside the model's vocabulary \[0, 64\)"):
        queue.submit("w1 <|extra|>", params).result(timeout=60)
    assert len(queue.submit("w1 w2 w3", params).result(timeout=60).token_ids) == 8 and queue.healthy
    queue.shutdown()


def test_an_oversized_prompt_is_refused_before_it_is_tokenised(tiny_dir, tiny_head):
    engine = tiny_engine(tiny_dir, tiny_head, max_model_len=64)
    calls = []
    real = engine.codec._tokenize
    engine.codec._tokenize = lambda p: calls.append(p) or real(p)
    with pytest.raises(PromptTooLongError, match="bytes"):
        engine.make_sequence("w1 " * 5_000_000)
    with pytest.raises(PromptTooLongError, match="bytes"):
        engine.make_sequence([{"role": "user", "content": "w2 " * 1_000_000}])
    assert calls == []
    with pytest.raises(PromptTooLongError, match="tokens"):  # under the byte bound, over the token room
        engine.make_sequence("w1 " * 60)
    assert len(calls) == 1


def test_text_is_decoded_incrementally_and_is_what_the_output_adds_to_the_prompt(tiny_dir, tiny_head):
    """As a completion reads after its prompt (vLLM's text too): this word-level tokenizer joins words with a space,
    so the output's text starts with one."""
    engine = tiny_engine(tiny_dir, tiny_head)
    out = engine.generate([random_prompt(6, 8)], SamplingParams(max_new_tokens=40, ignore_eos=True))[0]
    decode = lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=True)   # noqa: E731
    assert decode(out.prompt_token_ids) + out.text == decode(out.prompt_token_ids + out.token_ids)
    assert out.text == " " + decode(out.token_ids)


def test_a_sentencepiece_output_keeps_the_space_its_first_token_carries():
    """Llama-2 / Mistral-style decoders strip the space of the first token they decode: decoded alone, ``▁Paris``
    is "Paris". After the prompt's last tokens it is " Paris", and a stop string can match that space."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from eagle_ray.engine.text import Detokenizer
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁The": 3, "▁capital": 4, "▁is": 5, "▁Paris": 6, ".": 7}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    prompt = fast("The capital is")["input_ids"]
    assert fast.decode([6, 7]) == "Paris."
    d = Detokenizer(fast, prompt)
    assert [d.add([6]), d.add([7])] == [" Paris", "."] and d.text == " Paris."
    assert d.tokens_reaching(0) == 1 and d.tokens_reaching(6) == 2     # " Paris" is 6 characters
    assert Detokenizer(fast).add([6, 7]) == "Paris."                  # no prompt: as decoded alone


def test_embedded_style_tokenizer_streams_the_same_text_it_decodes_at_once():
    """Byte-level BPE with multi-byte characters: the incremental text holds back half characters and ends
    equal to the one-shot decode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from eagle_ray.engine.text import Detokenizer
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # one token per byte: characters span tokens
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    text = "naïve café — 東京 🙂 ok"
    ids = fast(text)["input_ids"]
    d = Detokenizer(fast)
    pieces = [d.add([i]) for i in ids]
    assert "".join(pieces) == d.text == fast.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)

    # steps of several tokens that each end inside a character (speculative steps do): the text before the
    # broken character comes at once, so a request that ends there loses only that character
    d = Detokenizer(fast)
    e, tokyo = fast("東")["input_ids"], fast("東京")["input_ids"]
    steps = [fast("a ")["input_ids"] + e[:1], e[1:2], e[2:] + fast(" b")["input_ids"] + tokyo[3:5]]
    assert [d.add(s) for s in steps] == ["a ", "", "東 b"]
    assert d.text == "a 東 b" and fast.decode(sum(steps, [])) == "a 東 b\ufffd"
    assert d.add(tokyo[5:]) == "京" and d.text == "a 東 b京"


def test_a_stop_string_cuts_tokens_and_text_once(tiny_dir, tiny_head):
    engine = tiny_engine(tiny_dir, tiny_head)
    prompt = random_prompt(5, 9)
    full = engine.generate([prompt], SamplingParams(max_new_tokens=30, ignore_eos=True))[0]
    words = full.text.split(" ")
    stop = " ".join(words[4:6])
    out = engine.generate([prompt], SamplingParams(max_new_tokens=30, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]
    assert text_after(engine.tokenizer, out.prompt_token_ids, out.token_ids).startswith(out.text)


# ---- the engine thread --------------------------------------------------------------------------------------------
def test_a_failing_engine_fails_its_requests_refuses_new_ones_and_reports_unhealthy(tiny_dir, tiny_head):
    from eagle_ray.engine.queue import RequestQueue
    engine = tiny_engine(tiny_dir, tiny_head)
    q = RequestQueue(engine)
    assert q.generate(random_prompt(5, 1), SamplingParams(max_new_tokens=3)).token_ids
    steps, all_submitted = [], threading.Event()

    def broken():
        all_submitted.wait(30)   # the three requests are in flight when the device fails
        steps.append(1)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    engine.step = broken
    futures = [q.submit(random_prompt(5, i), SamplingParams(max_new_tokens=8)) for i in range(3)]
    all_submitted.set()
    for f in futures:
        with pytest.raises(EngineDeadError, match="illegal memory access"):
            f.result(timeout=30)
    assert not q.healthy and len(steps) == 1  # it stopped stepping at the first failure
    with pytest.raises(EngineDeadError):
        q.submit("w1 w2", SamplingParams(max_new_tokens=3))
    q.shutdown(timeout=10)


def test_tokenising_happens_on_the_callers_thread(tiny_dir, tiny_head):
    import threading

    from eagle_ray.engine.queue import RequestQueue
    engine = tiny_engine(tiny_dir, tiny_head)
    threads = []
    real = engine.codec._tokenize
    engine.codec._tokenize = lambda p: threads.append(threading.current_thread().name) or real(p)
    q = RequestQueue(engine)
    q.generate("w1 w2 w3", SamplingParams(max_new_tokens=3))
    asyncio.run(q.agenerate("w4 w5", SamplingParams(max_new_tokens=3)))
    q.shutdown()
    assert threads[0] == threading.current_thread().name and "eagle-ray-engine" not in threads


# ---- rows ---------------------------------------------------------------------------------------------------------
def write_lines(tmp_path, lines: list[bytes], name="in.jsonl"):
    path = tmp_path / name
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


def local_rows(path):
    from fsspec.implementations.local import LocalFileSystem
    return read_input(path, LocalFileSystem())


def test_bad_lines_become_error_rows_that_name_their_kind(tmp_path):
    lines = [b'\xef\xbb\xbf{"id": "bom", "prompt": "hello"}',       # a UTF-8 byte order mark: not an error
             b"null", b"[1, 2]", b"42", b"{broken",
             b"[" * 100_000 + b"]" * 100_000,                       # nested far too deep
             json.dumps({"id": "deep", "prompt": "x", "meta": [[[[[[[[1]]]]]]]] * 1}).encode(),
             json.dumps({"id": "deeper", "prompt": "x", "meta": json.loads("[" * 80 + "]" * 80)}).encode(),
             b'{"id": "big", "prompt": "x", "sampling_params": {"seed": ' + b"9" * 5000 + b"}}"]  # over 4,300 digits
    rows = local_rows(write_lines(tmp_path, lines))
    got = [(r.id, r.kind) for r in rows]
    assert got == [("bom", ""), ("row-1", INVALID_ROW), ("row-2", INVALID_ROW), ("row-3", INVALID_ROW),
                   ("row-4", INVALID_JSON), ("row-5", INVALID_ROW), ("deep", ""), ("row-7", INVALID_ROW),
                   ("row-8", INVALID_JSON)]
    assert "got null" in rows[1].error and "4300 digits" in rows[8].error


def test_a_lone_surrogate_is_one_error_row_and_every_row_stays_storable(tmp_path):
    lines = [b'{"id": "p", "prompt": "lone \\ud800 x"}', b'{"id": "q\\udfff", "prompt": "fine"}',
             b'{"id": "ok", "prompt": "fine"}']
    rows = local_rows(write_lines(tmp_path, lines))
    assert [r.kind for r in rows] == ["", "", ""]
    with pytest.raises(InvalidRequestError, match="lone surrogate"):
        parse_row(json.loads(rows[0].payload), SamplingParams())
    parse_row(json.loads(rows[1].payload), SamplingParams())  # a strange id is still an id
    table = to_table([{"id": r.id, "row_index": r.row_index, "input": r.payload,
                       "error": "prompt: 'lone \ud800 x'"} for r in rows])
    assert table.num_rows == 3 and table["id"].to_pylist()[1] == "q\\udfff"


def test_a_stop_string_given_alone_is_checked_like_one_in_a_list():
    for stop in ("\ud800", ["\ud800"]):
        with pytest.raises(InvalidRequestError, match="stop\\[0\\] is not valid Unicode"):
            parse_row({"prompt": "w1", "sampling_params": {"stop": stop}}, SamplingParams())
    assert parse_row({"prompt": "w1", "sampling_params": {"stop": "w2"}}, SamplingParams()).params.stop == ["w2"]


def test_an_earlier_answer_may_be_empty_but_a_question_may_not():
    """A turn can end before its first character (a stop string at its start): the next turn still runs."""
    turns = [{"role": "user", "content": "w1"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "w2"}]
    assert parse_row({"messages": turns}, SamplingParams()).prompt.value[1] == {"role": "assistant", "content": ""}
    turns[1]["content"] = [{"type": "text", "text": ""}]
    assert parse_row({"messages": turns}, SamplingParams()).prompt.value[1] == {"role": "assistant", "content": ""}
    with pytest.raises(InvalidRequestError, match="messages\\[0\\].content must be a non-empty string"):
        parse_row({"messages": [{"role": "user", "content": ""}]}, SamplingParams())


def test_the_serve_parser_reads_null_as_unset_and_refuses_what_it_would_ignore():
    from eagle_ray.serve.openai_api import ApiError, parse_body

    def parse(body, kind="completion"):
        return parse_body(body if isinstance(body, bytes) else json.dumps(body).encode(), kind, "m", 100, 16)
    nulls = {k: None for k in ("temperature", "top_p", "top_k", "n", "stream", "seed", "stop", "max_tokens",
                                 "presence_penalty", "frequency_penalty", "logprobs", "echo", "logit_bias")}
    got = parse({"model": "m", "prompt": "w1", **nulls})
    assert (got.params.temperature, got.params.top_p, got.params.max_new_tokens, got.stream) == (1.0, 1.0, 16, False)
    for field, value in [("best_of", 2), ("suffix", "w9"), ("functions", [{"name": "f"}])]:
        with pytest.raises(ApiError, match=f"{field} is not supported") as e:
            parse({"model": "m", "messages": [{"role": "user", "content": "w1"}], field: value}, "chat")
        assert e.value.status == 400 and e.value.param == field
    assert parse({"model": "m", "prompt": "w1", "echo": False, "logit_bias": {}, "best_of": 1}).params
    with pytest.raises(ApiError, match="^prompt: Input should be a valid string") as e:  # null, not "missing"
        parse({"model": "m", "prompt": None})
    assert e.value.param == "prompt"
    with pytest.raises(ApiError, match="not valid JSON: Exceeds the limit \\(4300 digits\\)") as e:
        parse(b'{"model": "m", "prompt": "w1", "seed": ' + b"9" * 5000 + b"}")
    assert e.value.status == 400


def test_null_means_absent_in_parquet_columns_and_structs(tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({
        "id": ["a", "b", "c"], "prompt": ["hi", None, None],
        "messages": [None, [{"role": "user", "content": "yo"}], None],
        "turns": [None, None, ["one", "two"]],
        "sampling_params": [{"temperature": None, "max_tokens": 5, "seed": None},
                            {"temperature": 0.5, "max_tokens": None, "seed": 3}, None]}), path)
    reqs = [parse_row(json.loads(r.payload), SamplingParams(max_new_tokens=9)) for r in local_rows(str(path))]
    assert [r.kind for r in reqs] == ["prompt", "messages", "turns"]
    assert [(r.params.temperature, r.params.max_new_tokens, r.params.seed) for r in reqs] == \
        [(0.0, 5, None), (0.5, 9, 3), (0.0, 9, None)]


def test_the_serve_parser_refuses_vllm_fields_it_would_ignore_and_reads_types_strictly():
    """vLLM's clients send its extra sampling fields in the same body: ignoring one would quietly generate
    something else, so each is refused unless it holds the value that changes nothing. Lax parsing would read
    ``"stream": "yes"`` as true and ``"max_tokens": true`` as 1: refused too, naming the field as written."""
    from eagle_ray.serve.openai_api import ApiError, parse_body

    def parse(body, kind="completion"):
        return parse_body(json.dumps({"model": "m", "prompt": "w1", **body}).encode(), kind, "m", 100, 16)
    for field, value in [("length_penalty", 2.0),
                         ("function_call", "required"), ("logits_processors", ["x"]),
                         ("use_beam_search", True), ("best_of", True)]:
        with pytest.raises(ApiError, match=f"^{field} is not supported") as e:
            parse({field: value})
        assert e.value.status == 400 and e.value.param == field
    with pytest.raises(ApiError, match="^top_logprobs is a chat field") as e:   # completions count with logprobs
        parse({"top_logprobs": 2})
    assert e.value.status == 400 and e.value.param == "top_logprobs"
    for field, value in [("chat_template_kwargs", {"enable_thinking": False}), ("continue_final_message", True),
                         ("add_generation_prompt", False), ("chat_template", "{{ x }}")]:   # chat takes them
        with pytest.raises(ApiError, match=f"^{field} is a chat field") as e:
            parse({field: value})
        assert e.value.status == 400 and e.value.param == field
    harmless = parse({"repetition_penalty": 1.0, "min_tokens": 0, "min_p": 0, "tool_choice": "auto",
                      "skip_special_tokens": True, "best_of": 1, "bad_words": [], "include_stop_str_in_output": False,
                      "continue_final_message": False, "add_generation_prompt": True, "chat_template_kwargs": {}})
    assert harmless.params == parse({}).params
    for body, reason, param in [({"stream": "yes"}, "stream: Input should be a valid boolean", "stream"),
                                ({"max_tokens": True}, "max_tokens: a number is required, not true", "max_tokens"),
                                ({"n": True}, "n: a number is required", "n"),
                                ({"stream": True, "stream_options": {"include_usage": "false"}},
                                 "stream_options.include_usage: Input should be a valid boolean",
                                 "stream_options.include_usage"),
                                ({"stream_options": {"include_usage": True}}, "only allowed when stream is true",
                                 "stream_options"),
                                ({"messages": [{"role": "user", "content": "w1"}], "max_completion_tokens": "10"},
                                 "max_completion_tokens: Input should be a valid integer", "max_completion_tokens"),
                                ({"stop": ["a", 5]}, "stop: Input should be a valid string", "stop"),
                                ({"stop_token_ids": [1, "2"]}, "stop_token_ids.1: Input should be a valid integer",
                                 "stop_token_ids.1"),
                                ({"prompt": [[1]] * 65}, "at most 64 prompts per request", "prompt")]:
        with pytest.raises(ApiError, match=reason) as e:
            parse(body, "chat" if "messages" in body else "completion")
        assert e.value.status == 400 and e.value.param == param, (body, e.value.param)
    assert parse({"stop_token_ids": [7, 9]}).params.stop_token_ids == [7, 9]
    assert parse({"stream_options": {}}).params == parse({}).params   # empty options: nothing asked of a stream
    assert parse({"prompt": [[5, 6, 7]]}).prompt == parse({"prompt": [5, 6, 7]}).prompt


def test_the_serve_parser_takes_vllms_further_sampling_fields_strictly():
    """``min_p``, ``min_tokens``, ``allowed_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens`` and
    ``truncate_prompt_tokens`` reach the engine's sampling as sent; a wrong type or an inconsistent value is a 400
    naming the field."""
    from eagle_ray.serve.openai_api import ApiError, parse_body

    def parse(body, kind="completion"):
        return parse_body(json.dumps({"model": "m", "prompt": "w1", **body}).encode(), kind, "m", 100, 16)
    fields = {"min_p": 0.05, "min_tokens": 3, "allowed_token_ids": [4, 5, 6], "include_stop_str_in_output": True,
              "skip_special_tokens": False, "truncate_prompt_tokens": 12, "bad_words": ["w1 w2", "w3"]}
    params = parse(fields).params
    assert {k: getattr(params, k) for k in fields} == fields
    chat = parse_body(json.dumps({"model": "m", "messages": [{"role": "user", "content": "w1"}], **fields}).encode(),
                      "chat", "m", 100, 16).params
    assert {k: getattr(chat, k) for k in fields} == fields
    for body, reason, param in [({"min_tokens": True}, "min_tokens: a number is required, not true", "min_tokens"),
                                ({"min_p": 2}, "min_p: Input should be less than or equal to 1", "min_p"),
                                ({"include_stop_str_in_output": "yes"}, "valid boolean",
                                 "include_stop_str_in_output"),
                                ({"allowed_token_ids": [1, "2"]}, "allowed_token_ids.1: Input should be a valid "
                                 "integer", "allowed_token_ids.1"),
                                ({"min_tokens": 20, "max_tokens": 10}, "min_tokens \\(20\\) is more than the output "
                                 "may hold", "min_tokens"),
                                ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens: 0 would keep no prompt",
                                 "truncate_prompt_tokens")]:
        with pytest.raises(ApiError, match=reason) as e:
            parse(body)
        assert e.value.status == 400 and e.value.param == param, (body, e.value.param)


def test_a_chat_reads_as_vllm_reads_it():
    """Both output limits set: OpenAI's ``max_completion_tokens`` (which deprecates ``max_tokens``) wins. A
    message's text parts are joined by a newline. A user message making tool calls is refused, not dropped."""
    from eagle_ray.serve.openai_api import ApiError, parse_body

    def chat(body):
        return parse_body(json.dumps({"model": "m", **body}).encode(), "chat", "m", 100, 16)
    user = [{"role": "user", "content": [{"type": "text", "text": "w1"}, {"type": "text", "text": "w2"}]}]
    got = chat({"messages": user, "max_tokens": 50, "max_completion_tokens": 5})
    assert got.params.max_new_tokens == 5 and got.prompt.value == [{"role": "user", "content": "w1\nw2"}]
    assert chat({"messages": user, "max_tokens": 50}).params.max_new_tokens == 50
    with pytest.raises(ApiError, match="max_completion_tokens") as e:   # the limit named as the client set it
        chat({"messages": user, "max_tokens": 50, "max_completion_tokens": 500})
    assert e.value.status == 400
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    with pytest.raises(ApiError, match=r"messages\[0\].tool_calls: only an assistant message makes tool calls"):
        chat({"messages": [user[0] | {"tool_calls": [call]}]})
    row = parse_row({"messages": user, "sampling_params": {"max_tokens": 50, "max_completion_tokens": 5}},
                    SamplingParams())
    assert row.params.max_new_tokens == 5 and row.prompt.value[0]["content"] == "w1\nw2"


def test_a_mounted_api_key_is_read_without_its_trailing_newline(monkeypatch):
    """A secret mounted from a file usually ends in a newline, which no client sends: every request was a 401."""
    from eagle_ray.serve.config import ServeConfig
    from eagle_ray.serve.app import api_key_from_env
    from eagle_ray.serve.openai_api import authorized
    monkeypatch.setenv("EAGLE_RAY_KEY_UNDER_TEST", "sekret\n")
    key = api_key_from_env(ServeConfig(api_key_env="EAGLE_RAY_KEY_UNDER_TEST"))
    assert key == "sekret" and authorized("Bearer sekret", key) and not authorized("Bearer sekret2", key)
    monkeypatch.setenv("EAGLE_RAY_KEY_UNDER_TEST", " \n")
    with pytest.raises(RuntimeError, match="empty or missing"):
        api_key_from_env(ServeConfig(api_key_env="EAGLE_RAY_KEY_UNDER_TEST"))


def test_a_chat_of_more_messages_than_the_context_has_tokens_is_refused_before_templating(tiny_dir):
    """Each message takes at least one token, so 100,000 empty messages cannot fit: refused at once instead of
    templating them (seconds of CPU holding the GIL), and the same for a single request as for a server's."""
    engine = tiny_engine(tiny_dir, max_model_len=64)
    room = engine.prompt_room()
    with pytest.raises(PromptTooLongError, match=f"the chat has {room + 1} messages: more than the {room} tokens"):
        engine.encode([{"role": "assistant", "content": ""}] * room + [{"role": "user", "content": "w1"}])
    assert engine.encode([{"role": "user", "content": "w1"}])


def test_a_request_generates_up_to_the_context_plus_the_token_it_returns_uncached(tiny_dir):
    """What ``max_new_tokens_for`` promises (Serve refuses a larger ``max_tokens`` up front) is what a request
    gets: prompt plus output is the context and the last token, which is returned but never cached."""
    engine = tiny_engine(tiny_dir, max_model_len=64)
    for n in (1, 30, engine.prompt_room()):
        for speculative in (True, False):
            out = engine.generate([[5] * n], SamplingParams(max_new_tokens=1000, ignore_eos=True),
                                  speculative=speculative)[0]
            assert (len(out.token_ids), out.finish_reason) == (engine.max_new_tokens_for(n), "length") == (65 - n,
                                                                                                             "length")


def test_a_parquet_map_column_is_the_object_it_stands_for(tmp_path):
    """Spark and other writers store a dict as a Parquet map (Arrow reads it as (key, value) pairs): its entries
    are the request's fields, binary keys and values are text, and a map holding a key twice is an error row."""
    path = tmp_path / "in.parquet"
    params = pa.array([[("temperature", 0.5), ("max_tokens", 7.0)], [(b"max_tokens", 3.0)],
                       [("max_tokens", 2.0), ("max_tokens", 4.0)], None],
                      type=pa.map_(pa.binary(), pa.float64()))
    meta = pa.array([[("k", b"v")], [], None, [("x", b"\xff")]], type=pa.map_(pa.string(), pa.binary()))
    pq.write_table(pa.table({"id": ["a", "b", "c", "d"], "prompt": ["hi"] * 4, "sampling_params": params,
                             "meta": meta}), path)
    rows = local_rows(str(path))
    payloads = [json.loads(r.payload) for r in rows]
    assert [p["sampling_params"] for p in payloads] == [{"temperature": 0.5, "max_tokens": 7.0}, {"max_tokens": 3.0},
                                                        [["max_tokens", 2.0], ["max_tokens", 4.0]], None]
    assert [p["meta"] for p in payloads] == [{"k": "v"}, {}, None, {"x": "b'\\xff'"}]
    assert [r.kind for r in rows] == ["", "", "", ""]   # a hash that is not text is written as it is
    reqs = [parse_row(p, SamplingParams(max_new_tokens=9)) for p in payloads[:2]]
    assert [(r.params.temperature, r.params.max_new_tokens) for r in reqs] == [(0.5, 7), (0.0, 3)]
    with pytest.raises(InvalidRequestError, match="sampling_params"):
        parse_row(payloads[2], SamplingParams())


def test_every_row_keeps_an_id_no_other_row_has(tmp_path):
    """Ids key exactly-once re-runs, so two rows sharing one would lose one: a duplicate's new name never takes a
    real row's id, and a row's own id wins over the ``row-<index>`` given to a row without one."""
    lines = [b'{"id": "q1", "prompt": "a"}', b'{"id": "q1@row2", "prompt": "b"}', b'{"id": "q1", "prompt": "c"}',
             b'{"prompt": "d"}', b'{"id": "row-3", "prompt": "e"}']
    rows = local_rows(write_lines(tmp_path, lines))
    assert [(r.id, r.kind) for r in rows] == [("q1", ""), ("q1@row2", ""), ("q1@row2#2", "duplicate_id"),
                                              ("row-3@row3", ""), ("row-3", "")]
    assert len({r.id for r in rows}) == len(rows)


def test_a_json_array_file_and_binary_parquet_prompts_are_read_as_what_they_hold(tmp_path):
    """A ``.json`` file may hold one array of rows (one row a line still works); a Parquet ``binary`` column holds
    UTF-8 text, which is the prompt (never its Python repr), and bytes that are not UTF-8 make an error row."""
    (tmp_path / "a.json").write_text(json.dumps([{"id": "x", "prompt": "hi"}, {"prompt": "yo"}, 3], indent=2))
    rows = local_rows(str(tmp_path / "a.json"))
    assert [(r.id, r.kind, r.payload) for r in rows] == [("x", "", '{"id": "x", "prompt": "hi"}'),
                                                         ("row-1", "", '{"prompt": "yo"}'), ("row-2", INVALID_ROW, "3")]
    (tmp_path / "b.json").write_text('{"prompt": "one"}\n{"prompt": "two"}\n')
    assert [json.loads(r.payload)["prompt"] for r in local_rows(str(tmp_path / "b.json"))] == ["one", "two"]
    pq.write_table(pa.table({"id": [b"k", b"l"], "prompt": [b"The capital of France is", b"\xff\xfe"]}),
                   tmp_path / "c.parquet")
    rows = local_rows(str(tmp_path / "c.parquet"))
    assert json.loads(rows[0].payload) == {"id": "k", "prompt": "The capital of France is"} and rows[0].id == "k"
    assert rows[1].kind == "invalid_utf8" and "not UTF-8" in rows[1].error and rows[1].id == "l"


def test_a_binary_column_the_job_does_not_read_never_spoils_a_row(tmp_path):
    """Only the fields a request is read from must be text: a non-UTF-8 hash beside the prompt leaves the row a
    good row with its own id, and a non-UTF-8 id makes an error row keyed by its index."""
    meta = [{"h": b"\xff", "note": b"hello"}, {"h": b"ok", "note": b"there"}]
    pq.write_table(pa.table({"id": [b"k", b"\xff"], "prompt": ["hi", "yo"], "sha": [b"\x8a\x00\xfe", b"ok"],
                             "meta": meta}), tmp_path / "c.parquet")
    rows = local_rows(str(tmp_path / "c.parquet"))
    assert [(r.id, r.kind) for r in rows] == [("k", ""), ("row-1", "invalid_utf8")]
    assert json.loads(rows[0].payload) == {"id": "k", "prompt": "hi", "sha": "b'\\x8a\\x00\\xfe'",
                                           "meta": {"h": "b'\\xff'", "note": "hello"}}
    assert "column 'id' is not UTF-8" in rows[1].error


def test_a_date_python_cannot_hold_never_spoils_a_row(tmp_path):
    """A timestamp of 2**62 microseconds (a common "never") or a date past year 9999, in a column the job does not
    read: every row stays a good row; that column's dates and times are then kept as text."""
    never = pa.array([0, 2**62], pa.int64()).cast(pa.timestamp("us"))
    far = pa.array([0, 3_000_000], pa.int32()).cast(pa.date32())          # days: past 9999-12-31
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["hi", "yo"], "created": never,
                             "meta": pa.StructArray.from_arrays([far], ["due"])}), tmp_path / "t.parquet")
    rows = local_rows(str(tmp_path / "t.parquet"))
    assert [(r.id, r.kind) for r in rows] == [("a", ""), ("b", "")]
    assert json.loads(rows[1].payload) == {"id": "b", "prompt": "yo",
                                           "created": "<value out of range: 4611686018427387904>",
                                           "meta": {"due": "10183-09-21"}}
    assert json.loads(rows[0].payload)["created"] == "1970-01-01 00:00:00.000000"


def test_gzipped_json_lines_are_read_and_a_glob_takes_only_data_files(tmp_path):
    """``.jsonl.gz`` and ``.json.gz`` are read as what they hold (read as text, every line was an invalid_utf8
    row). A glob such as ``dir/*`` skips what a directory walk skips: hidden checksum files, ``_SUCCESS`` and
    other names, whose lines would be rows and shift every later row's index. Another compression is refused."""
    import gzip
    lines = "".join(json.dumps({"id": f"q{i}", "prompt": f"w{i}"}) + "\n" for i in range(3)).encode()
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(lines))
    (tmp_path / "b.json.gz").write_bytes(gzip.compress(json.dumps([{"id": "r0", "prompt": "w9"}]).encode()))
    (tmp_path / ".a.jsonl.gz.crc").write_bytes(b"\x00\x01crc")
    (tmp_path / "_SUCCESS").write_bytes(b"")
    (tmp_path / "README.md").write_text("# prompts\n")
    for uri in (str(tmp_path), str(tmp_path / "*")):
        rows = local_rows(uri)
        assert [(r.id, r.kind) for r in rows] == [("q0", ""), ("q1", ""), ("q2", ""), ("r0", "")], uri
        assert json.loads(rows[3].payload) == {"id": "r0", "prompt": "w9"}
    (tmp_path / "c.jsonl.bz2").write_bytes(b"BZh9")
    with pytest.raises(ConfigError, match="compressed in a way the job does not read"):
        local_rows(str(tmp_path / "c.jsonl.bz2"))
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(lines)[:20])
    with pytest.raises(ConfigError, match="cut.jsonl.gz is not readable gzip"):
        local_rows(str(tmp_path / "cut.jsonl.gz"))


def test_a_json_array_that_does_not_parse_is_one_error_row_not_a_row_per_line(tmp_path):
    """Read line by line, a broken pretty-printed array would become rows it never held ("[", "{", ...), numbered
    so that every later file's rows moved; it is one ``invalid_json`` row saying where. A ``.json`` file of JSON
    lines whose first line is an array is still read a row a line."""
    (tmp_path / "a.json").write_text('[\n  {"prompt": "hi"},\n  {"prompt": "yo",}\n]\n')
    (tmp_path / "b.jsonl").write_text('{"prompt": "next"}\n')
    rows = local_rows(str(tmp_path))
    assert [(r.id, r.kind) for r in rows] == [("row-0", INVALID_JSON), ("row-1", "")]
    assert rows[0].error.endswith("a.json: invalid JSON array (Expecting property name enclosed in double quotes "
                                  "at line 3 column 19)")
    (tmp_path / "c.json").write_text('[1, 2]\n{"prompt": "x"}\n{"prompt": \n')
    assert [(r.id, r.kind) for r in local_rows(str(tmp_path / "c.json"))] == [
        ("row-0", INVALID_ROW), ("row-1", ""), ("row-2", INVALID_JSON)]
    (tmp_path / "d.json").write_text('[\n  {"prompt": "x", "n": ' + "9" * 5000 + '}\n]\n')   # over 4,300 digits
    [row] = local_rows(str(tmp_path / "d.json"))
    assert row.kind == INVALID_JSON and "d.json: invalid JSON array (Exceeds the limit (4300 digits)" in row.error


def test_configs_that_could_only_fail_later_fail_at_load(tiny_dir, tiny_head):
    from eagle_ray.batch.config import JobConfig
    from eagle_ray.serve.config import ServeConfig
    with pytest.raises(ConfigError, match="max_model_len 16 leaves no room for a prompt next to the largest tree's "
                                          "verify budget"):
        tiny_engine(tiny_dir, tiny_head, TreeConfig(total_tokens=32, depth=4, top_k=8), max_model_len=16)
    with pytest.raises(ConfigError, match="default_max_tokens 100 is above max_tokens_cap 16"):
        ServeConfig(max_tokens_cap=16, default_max_tokens=100)
    for out in ("data/out", "data", "./data/"):
        with pytest.raises(ConfigError, match="lies inside input.uri"):
            JobConfig(input={"uri": "data"}, output={"uri": out})
    for inp, out in (("data/*", "data/out"), ("data/**", "data/a/out"), ("data/*/*.json", "data/out"),
                     ("data/**/*.parquet", "data"),   # ``**`` spans no folder too: data/part-*.parquet
                     ("s3://b/in/*", "s3://b/in/out")):   # a glob reads a matching directory whole
        with pytest.raises(ConfigError, match="lies inside input.uri"):
            JobConfig(input={"uri": inp}, output={"uri": out})
    for inp, out in (("data/*.jsonl", "data2/out"), ("data/*.jsonl", "data/out"), ("s3://b/in/*", "s3://b/out")):
        JobConfig(input={"uri": inp}, output={"uri": out})


def test_a_nested_engine_override_wins_over_the_files_flat_key_and_both_in_one_file_are_refused():
    """The shipped YAML writes engine keys flat (``engine.max_model_len``); ``--set engine.cache.max_model_len=..``
    used to be overwritten by the file's flat value, silently."""
    from eagle_ray.batch.config import JobConfig
    cfg = JobConfig.from_yaml(ROOT / "configs" / "embedded.yaml", {"engine.cache.max_model_len": 512})
    assert cfg.engine.cache.max_model_len == 512
    with pytest.raises(ConfigError, match="max_model_len is given twice"):
        JobConfig(input={"uri": "a"}, output={"uri": "b"}, engine={"max_model_len": 16, "cache": {"max_model_len": 32}})
    with pytest.raises(ConfigError, match="engine.cache: Input should be a valid dictionary"):   # never dropped
        JobConfig.from_yaml(ROOT / "configs" / "embedded.yaml", {"engine.cache": 5})


@pytest.mark.parametrize("engine, key, value, expect", [
    ({"cache": {"max_model_len": 1024}}, "engine.max_model_len", 512, ("cache", "max_model_len", 512)),
    ({"max_model_len": 1024}, "engine.cache.max_model_len", 512, ("cache", "max_model_len", 512)),
    ({"max_model_len": 1024, "cache": {"max_model_len": 1024}}, "engine.max_model_len", 512,
     ("cache", "max_model_len", 512)),
    ({"tree": {"total_tokens": 40, "depth": 5, "top_k": 8}}, "engine.speculation.tree.depth", 4,
     ("speculation", "tree", TreeConfig(total_tokens=40, depth=4, top_k=8))),
    ({"speculation": {"tree": {"total_tokens": 40, "depth": 5, "top_k": 8}}}, "engine.tree.depth", 4,
     ("speculation", "tree", TreeConfig(total_tokens=40, depth=4, top_k=8))),
    ({"max_model_len": 1024, "max_batch_size": 2}, "engine.cache", {"max_model_len": 512},   # a whole part
     ("cache", "max_batch_size", 8)),
    ({"max_model_len": 1024, "cache": None}, "engine.max_model_len", 512, ("cache", "max_model_len", 512)),
    ({"max_model_len": 1024, "cache": None}, "engine.cache.max_batch_size", 4, ("cache", "max_batch_size", 4)),
])
def test_an_engine_override_lands_on_the_files_setting_whichever_way_each_spells_it(tmp_path, engine, key, value,
                                                                                   expect):
    """``engine.max_model_len`` and ``engine.cache.max_model_len`` are one setting: ``--set`` in one spelling over a
    file in the other replaces it (or the part of it the key names), never clashes with it or loses to it."""
    from eagle_ray.batch.config import JobConfig
    (tmp_path / "job.yaml").write_text(json.dumps({"input": {"uri": "a"}, "output": {"uri": "b"}, "engine": engine}))
    cfg = JobConfig.from_yaml(tmp_path / "job.yaml", {key: value})
    part, name, want = expect
    assert getattr(getattr(cfg.engine, part), name) == want


def test_bad_sampling_values_are_request_errors_naming_the_field():
    with pytest.raises(InvalidRequestError, match="stop strings must be non-empty"):
        parse_row({"prompt": "x", "sampling_params": {"stop": [""]}}, SamplingParams())
    with pytest.raises(InvalidRequestError, match="sampling_params.seed"):
        parse_row({"prompt": "x", "sampling_params": {"seed": -1}}, SamplingParams())
    with pytest.raises(InvalidRequestError, match="unknown field"):
        parse_row({"prompt": "x", "sampling_params": {"temprature": 1}}, SamplingParams())
    with pytest.raises(InvalidRequestError, match="exactly one of"):
        parse_row({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, SamplingParams())


@pytest.mark.parametrize("sampling, reason", [
    ({"max_tokens": True}, "sampling_params.max_tokens: an integer is required, got bool"),
    ({"top_k": True}, "sampling_params.top_k: an integer is required, got bool"),
    ({"ignore_eos": "yes"}, "sampling_params.ignore_eos: true or false is required, got str"),
    ({"max_new_tokens": "10"}, "sampling_params.max_new_tokens: an integer is required, got str"),
    ({"seed": 3.5}, "sampling_params.seed: an integer is required, got float"),
    ({"temperature": "0.5"}, "sampling_params.temperature: a number is required, got str"),
    ({"stop_token_ids": [2, True]}, "sampling_params.stop_token_ids: a list of integers is required"),
    ({"stop": 5}, "sampling_params.stop: a string or a list of strings is required, got int")])
def test_a_rows_sampling_values_are_read_as_strictly_as_the_serve_apis(sampling, reason):
    """Read laxly, ``"max_tokens": true`` would be a 1-token answer and ``"top_k": true`` greedy decoding: an
    error row names the field instead. A whole float is an integer (pandas writes integer columns with nulls so)."""
    with pytest.raises(InvalidRequestError, match=re.escape(reason)):
        parse_row({"prompt": "x", "sampling_params": sampling}, SamplingParams())
    got = parse_row({"prompt": "x", "sampling_params": {"seed": 3.0, "max_tokens": 7.0, "temperature": 1}},
                    SamplingParams()).params
    assert (got.seed, got.max_new_tokens, got.temperature) == (3, 7, 1.0)


def test_input_paths_that_hold_nothing_to_read_are_config_errors(tmp_path):
    from fsspec.implementations.local import LocalFileSystem
    fs = LocalFileSystem()
    (tmp_path / "empty").mkdir()
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.jsonl").write_text('{"prompt": "x"}\n')
    with pytest.raises(ConfigError, match="does not exist"):
        read_input(str(tmp_path / "missing.jsonl"), fs)
    with pytest.raises(ConfigError, match="no .jsonl"):
        read_input(str(tmp_path / "empty"), fs)
    assert len(read_input(str(tmp_path / "s*"), fs)) == 1  # a glob matching a directory reads what is in it
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(ConfigError, match="blank.jsonl holds no rows"):
        read_input(str(tmp_path / "blank.jsonl"), fs)


# ---- the job's command line and its tuning cache ------------------------------------------------------------------
ROOT = repo_scripts.ROOT


def generate_main(args: list[str]) -> int:
    return repo_scripts.load("jobs/batch.py").main(args)


def test_the_job_cli_answers_bad_paths_with_one_line_and_status_2(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text('{"prompt": "w1"}\n')
    (tmp_path / "empty").mkdir()
    (tmp_path / "file-out").write_text("x")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "part-x-00000.parquet").write_bytes(b"PAR1\x00\x00truncated")
    cases = {
        "does not exist": ["--input", str(tmp_path / "nope.jsonl"), "--output", str(tmp_path / "o")],
        "no .jsonl": ["--input", str(tmp_path / "empty"), "--output", str(tmp_path / "o")],
        "is a file": ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "file-out")],
        "not a section": ["--set", "input.uri.x=1"],
        "is not a YAML value": ["--set", "sampling.stop=[unclosed"],
        "max_model_len 16 leaves no room for a prompt": ["--set", "engine.cache.max_model_len=16", "--set",
                                                         "engine.speculation.tree={total_tokens: 32, depth: 4}"],
        "lies inside input.uri": ["--input", str(tmp_path), "--output", str(tmp_path / "o")],
        "output.openai_batch_file": ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o"),
                                     "--openai-output", str(tmp_path / "in.jsonl")],
        "part-x-00000.parquet is not readable Parquet": ["--input", str(tmp_path / "in.jsonl"), "--output",
                                                          str(tmp_path / "out")],
    }
    for reason, args in cases.items():
        assert generate_main(["--config", str(ROOT / "configs" / "embedded.yaml"), *args]) == 2
        err = capsys.readouterr().err
        assert reason in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_the_tuning_cache_key_follows_the_files_not_their_path_or_mtime(tiny_dir, tiny_head, tmp_path):
    import os
    import shutil

    from eagle_ray.engine.tuning import cache_key
    engine = tiny_engine(tiny_dir, tiny_head)
    tiny_head.save(tmp_path / "a")
    engine.target_dir, engine.draft_dir = tiny_dir, tmp_path / "a"
    key = cache_key(engine)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    for f in (tmp_path / "b").iterdir():
        os.utime(f, (1e9, 1e9))
    engine.draft_dir = tmp_path / "b"
    assert cache_key(engine) == key
    (tmp_path / "b" / "config.json").write_text((tmp_path / "b" / "config.json").read_text() + " ")
    assert cache_key(engine) != key


@pytest.mark.parametrize("phase", ["starting Ray", "loading the model", "serving"])
def test_ctrl_c_stops_eagle_ray_serve_with_one_line_at_any_point(monkeypatch, capsys, phase):
    """``eagle-ray serve`` is a foreground command: Ctrl-C while Ray starts, while the model loads or while it
    serves shuts Serve down (where Ray is up) and returns, with one line instead of a traceback."""
    import ray
    from ray import serve

    from eagle_ray import cluster
    from eagle_ray.serve.config import ServeConfig
    from eagle_ray.serve import app

    def interrupt(*a, **k):
        raise KeyboardInterrupt
    calls = []
    monkeypatch.setattr(cluster, "ensure_ray", interrupt if phase == "starting Ray" else lambda: None)
    monkeypatch.setattr(ray, "is_initialized", lambda: phase != "starting Ray")
    monkeypatch.setattr(serve, "start", lambda **k: calls.append("start"))
    monkeypatch.setattr(serve, "run", interrupt if phase == "loading the model" else lambda *a, **k: None)
    monkeypatch.setattr(app, "build_app", lambda args: None)
    monkeypatch.setattr(app.time, "sleep", interrupt)
    monkeypatch.setattr(serve, "shutdown", lambda: calls.append("shutdown"))
    app.run(ServeConfig())
    assert capsys.readouterr().out.splitlines()[-1] == "eagle-ray: interrupted, shutting Serve down"
    assert calls == {"starting Ray": [], "loading the model": ["start", "shutdown"],
                     "serving": ["start", "shutdown"]}[phase]


def test_a_serve_replica_without_its_api_key_fails_before_loading_the_model(monkeypatch):
    from eagle_ray.serve.config import ServeConfig
    from eagle_ray.engine import engine as engine_module
    from eagle_ray.serve.app import EagleServer
    monkeypatch.delenv("EAGLE_RAY_NO_SUCH_KEY", raising=False)
    monkeypatch.setattr(engine_module.EagleEngine, "from_config",
                        classmethod(lambda *a, **k: pytest.fail("the model loaded before the key was checked")))
    cfg = ServeConfig(api_key_env="EAGLE_RAY_NO_SUCH_KEY")
    cls = EagleServer.func_or_class
    with pytest.raises(RuntimeError, match="EAGLE_RAY_NO_SUCH_KEY"):
        asyncio.run(cls.__init__(cls.__new__(cls), cfg.model_dump_json()))  # Serve's ingress __init__ is async


def test_the_bearer_scheme_is_case_insensitive():
    from eagle_ray.serve.openai_api import authorized
    assert authorized("Bearer k", "k") and authorized("bearer k", "k") and authorized("BEARER  k ", "k")
    assert not authorized("Basic k", "k") and not authorized(None, "k") and not authorized("Bearer x", "k")
    assert authorized(None, None)


def test_the_engine_failing_ends_the_job_actor_and_fails_serve_health(tiny_dir, tiny_head):
    from eagle_ray.batch.config import JobConfig
    from eagle_ray.batch.stage import GenerateStage
    from eagle_ray.engine.queue import RequestQueue, StallBound
    stage = GenerateStage.__new__(GenerateStage)
    stage.cfg = JobConfig(input={"uri": "x"}, output={"uri": "y"})
    stage.engine = tiny_engine(tiny_dir, tiny_head)
    stage.queue = RequestQueue(stage.engine)
    stage.target_name, stage.draft_name, stage.worker_id = "t", "d", "w"
    stage.stall, stage.isolating, stage.metrics = StallBound(), asyncio.Lock(), None
    died = []
    stage.die = lambda: died.append(True)

    def broken():
        raise RuntimeError("device lost")
    stage.engine.step = broken
    batch = pa.table({"row_index": [0, 1], "id": ["a", "b"], "payload": ['{"prompt": "w1"}', '{"prompt": "w2"}'],
                      "error": ["", ""], "error_kind": ["", ""]})
    out = asyncio.run(stage(batch)).to_pylist()   # every row breaks the engine, alone too: the actor ends
    assert [r["error_kind"] for r in out] == ["engine_failed", "engine_failed"] and died[:1] == [True]

    stage.queue.shutdown(drain=False, timeout=10)   # one queue steps an engine at a time
    from eagle_ray.serve.app import EagleServer
    server = EagleServer.func_or_class.__new__(EagleServer.func_or_class)
    server.queue = RequestQueue(stage.engine)
    with pytest.raises(EngineDeadError):
        server.queue.submit("w1", SamplingParams(max_new_tokens=2)).result(timeout=30)
    with pytest.raises(RuntimeError, match="device lost"):
        server.check_health()
    server.queue.shutdown(drain=False, timeout=10)   # no engine thread outlives the test


def test_api_misuse_is_refused_naming_the_argument_and_the_engine_runs_on(tiny_dir, tiny_head):
    """A prompt that encodes to no tokens, a Sequence queued twice, a single chat message dict or a dict of
    params used to be accepted and then failed deep in the engine, some leaving it broken for every later request
    (or ran the dict's keys as prompts). Each is refused up front; the next valid request gives the same tokens
    as before, and no slot is left taken. One prompt's token ids are one prompt."""
    engine = tiny_engine(tiny_dir, tiny_head)
    ids = [5, 9, 12, 20, 7]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    before = engine.generate([ids], params)[0].token_ids
    with pytest.raises(InvalidRequestError, match="the prompt encodes to no tokens"):
        engine.generate("   ", params)   # the tiny tokenizer splits on whitespace
    seq = engine.add_request(ids, params)
    with pytest.raises(InvalidRequestError, match="was already added"):
        engine.add_request(seq)
    while engine.has_unfinished():
        engine.step()
    with pytest.raises(InvalidRequestError, match="was already added"):
        engine.add_request(seq)   # finished: a new sequence runs it again
    with pytest.raises(TypeError, match="prompts must be a prompt"):
        engine.generate({"role": "user", "content": "w1 w2"}, params)
    with pytest.raises(TypeError, match="params must be a SamplingParams, got dict"):
        engine.generate([ids], {"max_new_tokens": 4})
    assert engine.generate(ids, params)[0].token_ids == before == seq.output_ids
    assert not engine.scheduler.running and len(engine.scheduler.free) == 4   # max_batch_size
