"""Log-probabilities, scoring and n samples, exact under speculation.

Every value is held to one plain transformers forward over the same tokens (fp32, 1e-5): an output token's raw
log-probability and its top alternatives come from the verify pass that accepted it, with speculation on or off, at
batch 1 and 4, greedy or sampled; a prompt's (echo) and a continuation's (scoring) from its prefill. A row's
continuations and a request's samples prefill their shared prompt once (counted), and seeded sample ``i`` is the
same whatever ``n`` and whatever shares its batch.
"""
import pytest
import torch
from tiny import tiny_engine

from eagle_ray.config import SamplingParams, TreeConfig
from eagle_ray.engine.host_reads import count_host_reads
from eagle_ray.engine.samples import sample_seed
from eagle_ray.engine.scoring import encode_pair
from eagle_ray.speculative.logprobs import TokenLogprobs

PROMPTS = [[5, 9, 10, 11], [7, 8], [20, 21, 22, 23, 24, 25], [3, 4, 5]]
TREE = TreeConfig(total_tokens=12, depth=3, top_k=3)


@pytest.fixture(scope="module")
def engine(tiny_dir, tiny_head):
    return tiny_engine(tiny_dir, tiny_head, TREE, max_batch_size=8)


def log_softmax_rows(hf, ids: list[int]) -> torch.Tensor:
    """``[len(ids), V]``: row ``p`` is the target's log-distribution of the token after position ``p``."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def prefilled_tokens(engine) -> list[int]:
    """Counts the prompt tokens every target pass runs (appended per prefill block) from now on."""
    runner, counted = engine.runner, []
    block = runner.prefill_block

    def counting(chunks):
        out = block(chunks)
        counted.append(sum(out.n))
        return out
    runner.prefill_block = counting
    return counted


@pytest.mark.parametrize("speculative", [True, False], ids=["eagle", "plain"])
@pytest.mark.parametrize("batch", [1, 4])
def test_output_logprobs_are_the_targets_log_softmax_over_the_same_tokens(engine, tiny_hf, speculative, batch):
    params = [SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=5, temperature=t, seed=i)
              for i, t in enumerate([0.0, 0.8, 0.0, 1.0][:batch])]
    outs = engine.generate(PROMPTS[:batch], params, speculative=speculative)
    for out in outs:
        rows = log_softmax_rows(tiny_hf, out.prompt_token_ids + out.token_ids)[len(out.prompt_token_ids) - 1:-1]
        assert len(out.logprobs) == len(out.token_ids) == 24
        want = rows.gather(-1, torch.tensor(out.token_ids).view(-1, 1))[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs.values), want, atol=1e-5, rtol=0)
        values, ids = rows.topk(5)
        assert [[t for t, _ in top] for top in out.logprobs.top] == ids.tolist()
        got = torch.tensor([[v for _, v in top] for top in out.logprobs.top])
        torch.testing.assert_close(got, values, atol=1e-5, rtol=0)
        assert all(top == sorted(top, key=lambda e: -e[1]) for top in out.logprobs.top)
    if speculative:
        assert outs[0].stats.tau > 1.5   # the greedy rows accept drafts: values come from tree rows
    if batch == 1:   # greedy: the chosen token is the most probable one, with its exact value
        assert all(v == top[0][1] for v, top in zip(outs[0].logprobs.values, outs[0].logprobs.top))


def test_logprobs_follow_the_output_when_a_stop_string_or_token_cuts_it(engine):
    full = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=20, ignore_eos=True, logprobs=0))[0]
    stop = engine.tokenizer.decode(full.token_ids[6:8])
    cut = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=20, ignore_eos=True, logprobs=2,
                                                      stop=[stop]))[0]
    assert cut.finish_reason == "stop" and len(cut.token_ids) < 20
    assert len(cut.logprobs) == len(cut.token_ids) and cut.logprobs.values == full.logprobs.values[:len(cut.token_ids)]
    assert full.logprobs.top[0] == [] and len(cut.logprobs.top[0]) == 2
    plain = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=4))[0]
    assert plain.logprobs is None


def test_a_speculative_step_with_logprobs_still_reads_the_device_once(engine):
    for i in range(4):
        engine.add_request(PROMPTS[i], SamplingParams(max_new_tokens=64, ignore_eos=True, logprobs=3, seed=i,
                                                      temperature=0.7 * (i % 2)))
    while engine.scheduler.prefilling:
        engine.step()
    engine.step()
    with count_host_reads() as reads:
        engine.step()
    assert reads.sites == ["engine/model_runner.py:accept tolist"]
    for seq in list(engine.scheduler.running):
        engine.abort(seq.request_id)


def test_prompt_logprobs_equal_one_forward(engine, tiny_hf):
    """Echo's values: from the second prompt token on, over a prompt long enough to take several chunks."""
    prompt = [(5 + 7 * i) % 60 + 3 for i in range(200)]
    budget, engine.scheduler.step_budget = engine.scheduler.step_budget, 64
    seq = engine.make_sequence(prompt, SamplingParams(max_new_tokens=1))
    seq.prompt_only, seq.prompt_logprobs, seq.prompt_logprobs_k = True, TokenLogprobs(), 3
    engine.add_request(seq)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    engine.scheduler.step_budget = budget
    out = engine.output(seq)
    assert out.token_ids == [] and out.finish_reason == "length" and len(out.prompt_logprobs) == 199 and steps >= 4
    rows = log_softmax_rows(tiny_hf, prompt)[:-1]
    want = rows.gather(-1, torch.tensor(prompt[1:]).view(-1, 1))[:, 0]
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs.values), want, atol=1e-5, rtol=0)
    assert [[t for t, _ in top] for top in out.prompt_logprobs.top] == rows.topk(3).indices.tolist()
    assert out.prompt_logprobs.ranks == (rows >= want[:, None]).sum(-1).tolist()   # vLLM's rank: 1 + those above


def test_vllms_prompt_logprobs_are_answered_as_vllm_shapes_them(engine, tiny_hf):
    """A completions choice carries ``prompt_logprobs`` (a chat response beside its choices): null for the first
    token, then the token and its k most probable alternatives by id, each with its logprob, rank and text; k is
    the request's own even where echo's logprobs ask for more. Streamed, it is refused, as vLLM refuses it."""
    import json

    from eagle_ray.serve.choices import ChoiceShape, prepare
    from eagle_ray.serve.logprobs import TokenText
    from eagle_ray.serve.openai_api import ApiError, parse_body
    prompt_ids = [5, 9, 10, 11, 40]
    for kind, body in [("completion", {"prompt": prompt_ids, "prompt_logprobs": 2, "echo": True, "logprobs": 4}),
                       ("chat", {"messages": [{"role": "user", "content": "w1 w2"}], "prompt_logprobs": 2})]:
        parsed = parse_body(json.dumps({"model": "m", "max_tokens": 3, **body}).encode(), kind, "m", 100, 16)
        prompt, = prepare(engine, parsed, "r", True)
        for seq in prompt.seqs:
            engine.add_request(seq)
        while engine.has_unfinished():
            engine.step()
        shape = ChoiceShape(kind, kind == "completion", parsed.body.top(), TokenText(engine.tokenizer),
                            prompt_k=parsed.body.prompt_logprobs)
        got = shape.prompt_logprobs(prompt)
        if kind == "completion":
            assert shape.choice(0, prompt, engine.output(prompt.seqs[0]), "length")["prompt_logprobs"] == got
        ids = prompt.prompt_ids
        rows = log_softmax_rows(tiny_hf, ids)[:-1]
        assert got[0] is None and len(got) == len(ids)
        for p, (token, entry) in enumerate(zip(ids[1:], got[1:])):
            top = rows[p].topk(2)
            want = {token: (float(rows[p, token]), int((rows[p] >= rows[p, token]).sum()))}
            for place, (i, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
                want[i] = (v, place)   # the token among them: its place (vLLM's)
            assert list(entry) == [str(t) for t in want]
            for t, (v, rank) in want.items():
                assert entry[str(t)]["logprob"] == pytest.approx(v, abs=1e-5)
                assert (entry[str(t)]["rank"], entry[str(t)]["decoded_token"]) == (rank, engine.tokenizer.decode([t]))
    for bad, message in [({"prompt_logprobs": 2, "stream": True}, "not available when stream is true"),
                         ({"prompt_logprobs": 21}, "less than or equal to 20"),
                         ({"prompt_logprobs": -1}, "greater than or equal to 0"),
                         ({"prompt_logprobs": True}, "a number is required")]:
        with pytest.raises(ApiError, match=message) as e:
            parse_body(json.dumps({"model": "m", "prompt": "w1", **bad}).encode(), "completion", "m", 100, 16)
        assert e.value.param == "prompt_logprobs"


def test_scoring_equals_transformers_and_runs_the_context_once(engine, tiny_hf):
    """lm-evaluation-harness's loglikelihood: each continuation's summed log-probability after the context, its
    token count, and whether every token is the target's argmax; the context runs once for all of them."""
    context = " ".join(f"w{i}" for i in range(3, 40))
    greedy = engine.generate(engine.encode(context), SamplingParams(max_new_tokens=3))[0]
    continuations = [" w4 w5", " " + engine.tokenizer.decode(greedy.token_ids), " w7 w8 w9 w10", " w11"]
    counted = prefilled_tokens(engine)
    scores = engine.score([(context, continuations)])[0]
    ctx = engine.encode(context)
    conts = [encode_pair(engine.tokenizer, context, c)[1] for c in continuations]
    assert sum(counted) == len(ctx) + len(conts[0]) + sum(1 + len(c) for c in conts[1:])   # context once
    for score, cont in zip(scores, conts):
        rows = log_softmax_rows(tiny_hf, ctx + cont)[len(ctx) - 1:-1]
        picked = rows.gather(-1, torch.tensor(cont).view(-1, 1))[:, 0]
        assert score.tokens == len(cont)
        assert score.logprob == pytest.approx(float(picked.sum()), abs=1e-4)
        assert score.greedy == bool((rows.argmax(-1) == torch.tensor(cont)).all())
    assert [s.greedy for s in scores] == [False, True, False, False]


def test_lm_eval_tokenisation_moves_the_contexts_trailing_space_to_the_continuation(engine):
    ctx, cont = encode_pair(engine.tokenizer, "w3 w4 ", "w5 w6")
    assert (ctx, cont) == (engine.encode("w3 w4"), engine.encode("w5 w6"))


def test_n_samples_prefill_their_prompt_once_and_seeded_samples_do_not_depend_on_n(engine):
    prompt = [(3 + 5 * i) % 60 + 3 for i in range(40)]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=1.0, seed=11, logprobs=1)
    counted = prefilled_tokens(engine)
    eight = engine.generate(prompt, params.model_copy(update={"n": 8}))
    assert sum(counted) == len(prompt) + 7   # the prompt once, its last token once more per other sample
    assert [o.sample_index for o in eight] == list(range(8))
    assert len({tuple(o.token_ids) for o in eight}) == 8 and all(len(o.logprobs) == 16 for o in eight)
    two = engine.generate(prompt, params.model_copy(update={"n": 2}))
    assert [o.token_ids for o in two] == [o.token_ids for o in eight[:2]]
    crowded = engine.generate([PROMPTS[1], prompt, PROMPTS[2]], [params, params.model_copy(update={"n": 3}), params])
    assert [o.token_ids for o in crowded[1:4]] == [o.token_ids for o in eight[:3]]
    alone = engine.generate(prompt, params.model_copy(update={"seed": sample_seed(11, 5)}), speculative=False)
    assert alone[0].token_ids == eight[5].token_ids   # sample 5 is the request seeded with its seed


def test_greedy_samples_are_all_the_greedy_answer(engine):
    outs = engine.generate(PROMPTS[2], SamplingParams(max_new_tokens=12, n=3))
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
    assert outs[0].token_ids == engine.generate(PROMPTS[2], SamplingParams(max_new_tokens=12))[0].token_ids


def test_more_samples_than_slots_still_share_the_prompt(tiny_dir, tiny_head):
    """With 2 slots, 5 samples run in turns: each later one copies the prompt from a running sample."""
    engine = tiny_engine(tiny_dir, tiny_head, TREE, max_batch_size=2)
    prompt = list(range(3, 33))
    counted = prefilled_tokens(engine)
    outs = engine.generate(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=1.0, seed=3, n=5))
    assert sum(counted) == len(prompt) + 4
    ref = tiny_engine(tiny_dir, tiny_head, TREE, max_batch_size=8)
    again = ref.generate(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=1.0, seed=3, n=5))
    assert [o.token_ids for o in outs] == [o.token_ids for o in again]


@pytest.mark.parametrize("body,kind,param,reason", [
    ({"prompt": "w1", "n": 17}, "completion", "n", "above this server's cap of 16"),
    ({"prompt": "w1", "logprobs": 21}, "completion", "logprobs", "less than or equal to 20"),
    ({"prompt": "w1", "logprobs": True}, "completion", "logprobs", "an integer 0-20 is required"),
    ({"prompt": "w1", "logprobs": "3"}, "completion", "logprobs", "valid integer"),
    ({"prompt": "w1", "top_logprobs": 2}, "completion", "top_logprobs", "chat field"),
    ({"prompt": "w1", "max_tokens": 0}, "completion", "max_tokens", "only with echo"),
    ({"prompt": "w1", "echo": "yes"}, "completion", "echo", "valid boolean"),
    ({"top_logprobs": 21, "logprobs": True}, "chat", "top_logprobs", "less than or equal to 20"),
    ({"top_logprobs": 3}, "chat", "top_logprobs", "logprobs must be true"),
    ({"logprobs": 3}, "chat", "logprobs", "valid boolean"),
    ({"echo": "yes"}, "chat", "echo", "valid boolean"),
    ({"max_tokens": 0}, "chat", "max_tokens", "at least 1 token"),
    ({"n": 0}, "chat", "n", "greater than or equal to 1"),
])
def test_bad_logprobs_n_and_echo_fields_are_a_400_naming_the_field(body, kind, param, reason):
    import json

    from eagle_ray.serve.openai_api import ApiError, parse_body
    if kind == "chat":
        body = {"messages": [{"role": "user", "content": "w1"}], **body}
    with pytest.raises(ApiError) as e:
        parse_body(json.dumps({"model": "m", **body}).encode(), kind, "m", 100, 16, 16)
    assert (e.value.status, e.value.param) == (400, param) and reason in e.value.message, e.value.message


def test_scoring_and_sampling_fields_are_read_from_a_body():
    import json

    from eagle_ray.serve.openai_api import parse_body
    req = parse_body(json.dumps({"model": "m", "prompt": [[5, 6], [7]], "echo": True, "max_tokens": 0, "logprobs": 1,
                                 "n": 2}).encode(), "completion", "m", 100, 16, 16)
    assert (len(req.prompts), req.prompt_only, req.body.top(), req.params.n, req.params.logprobs) == (2, True, 1, 2, 1)
    chat = parse_body(json.dumps({"model": "m", "messages": [{"role": "user", "content": "w1"}], "logprobs": True,
                                  "top_logprobs": 4}).encode(), "chat", "m", 100, 16, 16)
    assert (chat.body.top(), chat.params.logprobs) == (4, 4)


def test_lm_evaluation_harness_reads_echo_responses_as_transformers_scores(engine, tiny_hf):
    """The body lm-evaluation-harness's ``local-completions`` model sends for a loglikelihood request (the context
    and continuation tokens, ``echo``, ``max_tokens: 1``, ``logprobs: 1``), answered as the Serve app answers it,
    read by lm-evaluation-harness's own parser: the continuation's log-likelihood and greediness equal a
    transformers computation. (tests/test_serve_eval.py runs the whole task over HTTP.)"""
    import json

    lm_eval_api = pytest.importorskip("lm_eval.models.openai_completions")
    from eagle_ray.serve.choices import ChoiceShape, prepare
    from eagle_ray.serve.logprobs import TokenText
    from eagle_ray.serve.openai_api import parse_body
    shape_text = TokenText(engine.tokenizer)
    greedy = engine.generate(engine.encode("w3 w9 w4"), SamplingParams(max_new_tokens=2))[0].token_ids
    for question, choice in [("w3 w9 w4", " w10"), ("w3 w9 w4", " " + engine.tokenizer.decode(greedy)),
                             ("w5 w6", " w20 w21")]:
        ctx, cont = encode_pair(engine.tokenizer, question, choice)
        body = {"model": "m", "prompt": [ctx + cont], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
                "echo": True}
        parsed = parse_body(json.dumps(body).encode(), "completion", "m", 100, 16)
        prompt, = prepare(engine, parsed, "cmpl-1", True)
        for seq in prompt.seqs:
            engine.add_request(seq)
        while engine.has_unfinished():
            engine.step()
        outs = [engine.output(s) for s in prompt.seqs]
        shape = ChoiceShape("completion", True, 1, shape_text)
        response = {"choices": [shape.choice(0, prompt, outs[0], "length")]}
        (logprob, is_greedy), = lm_eval_api.LocalCompletionsAPI.parse_logprobs(response, ctxlens=[len(ctx)])
        rows = log_softmax_rows(tiny_hf, ctx + cont)[len(ctx) - 1:-1]
        assert logprob == pytest.approx(float(rows.gather(-1, torch.tensor(cont).view(-1, 1)).sum()), abs=1e-4)
        assert is_greedy == bool((rows.argmax(-1) == torch.tensor(cont)).all())


def test_a_byte_level_tokens_bytes_are_its_own_even_inside_a_character():
    """OpenAI's ``bytes`` of a chat logprob are the token's own bytes: a byte-level token holding half a character
    gives that byte, not the replacement character its decoded text shows, so a token's bytes join to the text's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from eagle_ray.serve.logprobs import TokenText, chat_logprobs
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # one token per byte
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    ids = fast(" naïve 東京")["input_ids"]
    content = chat_logprobs(TokenLogprobs([-1.0] * len(ids), [[] for _ in ids]), ids, 0, TokenText(fast))["content"]
    assert [e["bytes"] for e in content] == [[b] for b in " naïve 東京".encode()]


def test_completions_token_texts_join_to_the_choice_text_and_offsets_index_it():
    """A completions token's text is what it adds after the tokens before it, as the engine detokenizes the
    output: joined they are the text (a word-level tokenizer's spaces, a byte-level one's half characters), each
    ``text_offset`` is where its token starts, and a streamed chunk's tokens read the same as the whole."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from eagle_ray.engine.text import Detokenizer
    from eagle_ray.serve.logprobs import TokenText, completion_logprobs
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # one token per byte: characters span tokens
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    prompt, ids = fast("say:")["input_ids"], fast(" naïve café 東京 ok")["input_ids"]
    d = Detokenizer(fast, prompt)
    d.add(ids)
    lp = TokenLogprobs([-1.0] * len(ids), [[(t, -1.0)] for t in ids])
    whole = completion_logprobs(lp, ids, 1, TokenText(fast), 0, (), prompt)
    assert "".join(whole["tokens"]) == d.text == " naïve café 東京 ok"
    assert whole["text_offset"] == [len("".join(whole["tokens"][:i])) for i in range(len(ids))]
    cut = 8   # inside "ï": the chunk after it starts by completing the character
    head = completion_logprobs(lp.slice(0, cut), ids[:cut], 1, TokenText(fast), 0, (), prompt)
    tail = completion_logprobs(lp.slice(cut, len(ids)), ids[cut:], 1, TokenText(fast), 0, ids[:cut], prompt)
    assert head["tokens"] + tail["tokens"] == whole["tokens"]
