"""vLLM's further sampling and output fields: ``min_p``, ``min_tokens``, ``allowed_token_ids``,
``include_stop_str_in_output``, ``skip_special_tokens`` and ``truncate_prompt_tokens``.

The fields that change which token is chosen are lossless under speculation: greedy speculative output equals greedy
plain decoding under the same field and an independent reference (a full forward per token with the rule written
out), token for token; min-p's sampled output has the distribution transformers' own min-p warper gives. The text
fields are exact strings on the tiny word-level tokenizer.
"""
import collections
from types import SimpleNamespace

import pytest
import torch
from test_sampling_lossless import PROMPT, V, chi_square_p, draws_engine, exact_joint, small_vocab  # noqa: F401
from tiny import decode_step_costs, text_after, tiny_engine
from transformers.generation.logits_process import MinPLogitsWarper, TemperatureLogitsWarper

from eagle_ray.config import SamplingParams, TreeConfig
from eagle_ray.errors import ConfigError, InvalidRequestError, PromptTooLongError
from eagle_ray.speculative.token_masks import TokenMaskBatch, apply_token_masks

TREE = TreeConfig(total_tokens=12, depth=3, top_k=3)


def prompts(n: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 64, (int(k),), generator=g).tolist() for k in torch.randint(2, 16, (n,), generator=g)]


EOS = 1   # the tiny target's


def masked_reference(hf, prompt: list[int], n: int, allowed=None, stop_ids=(), min_tokens=0) -> list[int]:
    """A full forward per token: only ``allowed`` tokens, and ``stop_ids`` and EOS barred before ``min_tokens``
    outputs (EOS though it is ignored, as vLLM bars it); ends after a stop token once it may be chosen."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1].clone()
            if allowed is not None:
                keep = torch.full_like(logits, float("-inf"))
                keep[allowed] = 0.0
                logits += keep
            if len(ids) - len(prompt) < min_tokens:
                logits[list(stop_ids) + [EOS]] = float("-inf")
            ids.append(int(logits.argmax()))
            if ids[-1] in stop_ids:
                break
    return ids[len(prompt):]


def frequent_tokens(outputs, k: int) -> list[int]:
    """The ``k`` tokens the free outputs choose most: stop ids that would end them early."""
    return [t for t, _ in collections.Counter(t for o in outputs for t in o.token_ids[:6]).most_common(k)]


# ---- min_tokens ---------------------------------------------------------------------------------------------------
def test_min_tokens_bars_stop_tokens_at_every_node_and_stays_lossless(tiny_dir, tiny_hf, tiny_head):
    """Stop ids the outputs choose often, so that with trees accepted a stop falls at a deep node right after the
    ``min_tokens`` bound (a node is barred by its own depth, not its root's)."""
    engine = tiny_engine(tiny_dir, tiny_head, TREE, max_batch_size=8)
    ps = prompts(8)
    free = engine.generate(ps, SamplingParams(max_new_tokens=20, ignore_eos=True))
    stops = frequent_tokens(free, 4)
    early = engine.generate(ps, SamplingParams(max_new_tokens=20, ignore_eos=True, stop_token_ids=stops))
    assert min(len(o.token_ids) for o in early) < 3                    # without min_tokens, stops come soon
    for m in (3, 6, 9):
        params = SamplingParams(max_new_tokens=20, ignore_eos=True, stop_token_ids=stops, min_tokens=m)
        spec = engine.generate(ps, params)
        plain = engine.generate(ps, params, speculative=False)
        for s, p, prompt in zip(spec, plain, ps):
            assert s.token_ids == p.token_ids == masked_reference(tiny_hf, prompt, 20, stop_ids=stops, min_tokens=m)
            assert len(s.token_ids) >= m and not set(s.token_ids[:m - 1]) & set(stops)
        assert sum(sum(o.stats.accepted_per_depth) for o in spec) > 0     # trees are accepted under it


def test_min_tokens_bars_each_node_by_its_depth():
    """The ids barred are the sequence's (``min_barred``: its stop ids and EOS, as the engine makes them)."""
    class Seq:
        def __init__(self, output_ids, barred, bad_words=(), **kw):
            self.params, self.output_ids, self.min_barred = SamplingParams(**kw), output_ids, frozenset(barred)
            self.bad_words = bad_words
    seqs = [Seq([4, 4], {1, 6}, min_tokens=4), Seq([], set(), min_tokens=4), Seq([5], {1}, allowed_token_ids=[2, 3])]
    batch = TokenMaskBatch.of(seqs, 8, "cpu")
    assert batch.rows.tolist() == [0, 2]           # the second has no stop id to bar: no mask
    tree = SimpleNamespace(depth=torch.tensor([[0, 1, 2, 1]] * 3))
    out = apply_token_masks(torch.zeros(3, 4, 8), batch, tree)
    barred = out == float("-inf")
    # two output tokens of four: nodes at depth 0 and 1 choose the third and fourth, depth 2 the fifth
    assert barred[0, :, 1].tolist() == barred[0, :, 6].tolist() == [True, True, False, True]
    assert barred[0].sum() == 6 and not barred[1].any()
    assert barred[2].tolist() == [[t not in (2, 3) for t in range(8)]] * 4


def test_stop_strings_ending_in_the_first_min_tokens_tokens_do_not_count(tiny_dir, tiny_head):
    """As vLLM's: a stop string ending inside the text of the first ``min_tokens`` tokens is passed over; the
    first one ending after it stops the output."""
    engine = tiny_engine(tiny_dir, tiny_head)
    prompt = prompts(1, seed=5)[0]
    full = engine.generate([prompt], SamplingParams(max_new_tokens=30, ignore_eos=True))[0]
    words = full.text.split(" ")[1:]          # the text starts with the space before its first word
    stop = words[1]
    assert words.count(stop) >= 2, "the tiny model repeats its words: pick a prompt where it does"
    first, second = [i for i, w in enumerate(words) if w == stop][:2]
    out = engine.generate([prompt], SamplingParams(max_new_tokens=30, ignore_eos=True, stop=[stop],
                                                   min_tokens=first + 1))[0]
    assert out.finish_reason == "stop"
    assert out.text == " " + " ".join(words[:second]) + " "
    plain = engine.generate([prompt], SamplingParams(max_new_tokens=30, ignore_eos=True, stop=[stop]))[0]
    assert plain.text == " " + " ".join(words[:first]) + " "


# ---- include_stop_str_in_output, skip_special_tokens ---------------------------------------------------------------
def test_a_stop_string_stays_in_the_text_when_asked(tiny_dir, tiny_head):
    engine = tiny_engine(tiny_dir, tiny_head)
    prompt = prompts(1, seed=9)[0]
    full = engine.generate([prompt], SamplingParams(max_new_tokens=30, ignore_eos=True))[0]
    words = full.text.split(" ")
    stop = " ".join(words[4:6])
    cut = engine.generate([prompt], SamplingParams(max_new_tokens=30, ignore_eos=True, stop=[stop]))[0]
    kept = engine.generate([prompt], SamplingParams(max_new_tokens=30, ignore_eos=True, stop=[stop],
                                                    include_stop_str_in_output=True))[0]
    assert cut.text + stop == kept.text == full.text[: full.text.index(stop) + len(stop)]
    assert kept.finish_reason == "stop" and len(kept.token_ids) == len(cut.token_ids) + 1   # the stop's 2nd word
    assert text_after(engine.tokenizer, kept.prompt_token_ids, kept.token_ids) == kept.text


def test_special_tokens_text_and_a_stop_tokens_text_when_asked(tiny_dir, tiny_head):
    """The tiny tokenizer's ``<s>`` (id 2) is special: skipped from the text unless asked; a stop token's text is
    left out unless ``include_stop_str_in_output``."""
    engine = tiny_engine(tiny_dir, tiny_head)
    only_bos = dict(max_new_tokens=3, ignore_eos=True, allowed_token_ids=[2])
    assert engine.generate([[5, 6]], SamplingParams(**only_bos))[0].text == ""
    out = engine.generate([[5, 6]], SamplingParams(**only_bos, skip_special_tokens=False))[0]
    assert (out.token_ids, out.text) == ([2, 2, 2], " <s> <s> <s>")
    word = dict(max_new_tokens=3, allowed_token_ids=[9], stop_token_ids=[9])    # w2, chosen and stopping at once
    assert engine.generate([[5, 6]], SamplingParams(**word))[0].text == ""
    assert engine.generate([[5, 6]], SamplingParams(**word, include_stop_str_in_output=True))[0].text == " w2"


# ---- allowed_token_ids ----------------------------------------------------------------------------------------------
def test_allowed_token_ids_restrict_every_choice_and_stay_lossless(tiny_dir, tiny_hf, tiny_head):
    engine = tiny_engine(tiny_dir, tiny_head, TREE, max_batch_size=4)
    ps = prompts(4, seed=8)
    free = engine.generate(ps, SamplingParams(max_new_tokens=16, ignore_eos=True))
    allowed = sorted(set(frequent_tokens(free, 6)) | {20, 31})
    kinds = [dict(allowed_token_ids=allowed), {}, dict(allowed_token_ids=allowed[:2]), dict(min_tokens=4)]
    params = [SamplingParams(max_new_tokens=16, ignore_eos=True, **k) for k in kinds]
    spec = engine.generate(ps, params)
    plain = engine.generate(ps, params, speculative=False)
    for s, p, prompt, k in zip(spec, plain, ps, kinds):
        assert s.token_ids == p.token_ids == masked_reference(tiny_hf, prompt, 16, k.get("allowed_token_ids"))
    assert set(spec[0].token_ids) <= set(allowed) and set(spec[2].token_ids) <= set(allowed[:2])
    assert spec[0].token_ids != free[0].token_ids or spec[2].token_ids != free[2].token_ids


def test_a_masked_step_still_reads_once_and_copies_once(tiny_dir, tiny_head):
    engine = tiny_engine(tiny_dir, tiny_head, TREE, max_batch_size=4)
    for i, k in enumerate([dict(allowed_token_ids=[7, 8, 9, 10]), dict(min_tokens=30, stop_token_ids=[4]), {},
                           dict(bad_words=["w7 w8", "w9"])]):
        engine.add_request([5 + i, 9, 10, 11], SamplingParams(max_new_tokens=40, **k))
    assert decode_step_costs(engine) == (1, 1, 0)


# ---- min_p --------------------------------------------------------------------------------------------------------
def exact_min_p_joint(hf, temperature: float, min_p: float) -> dict[tuple, float]:
    """The exact joint of the first three tokens with transformers' temperature and min-p warpers."""
    def probs(prefixes):
        with torch.no_grad():
            logits = hf(torch.tensor(prefixes)).logits[:, -1]
        logits = MinPLogitsWarper(min_p)(None, TemperatureLogitsWarper(temperature)(None, logits))
        return logits.double().softmax(-1)
    p1 = probs([PROMPT])[0]
    p2 = probs([PROMPT + [a] for a in range(V)])
    p3 = probs([PROMPT + [a, b] for a in range(V) for b in range(V)]).view(V, V, V)
    return {(a, b, c): float(p1[a] * p2[a, b] * p3[a, b, c]) for a in range(V) for b in range(V) for c in range(V)}


def test_sampled_speculation_has_the_min_p_distribution(small_vocab):  # noqa: F811 - the fixture
    """On an 8-token target: 4,000 seeded sequences of 3 tokens at T=1.3, min_p=0.3, drafted with trees, against
    the exact joint (and told apart from the joint without min-p)."""
    path, hf = small_vocab
    engine = draws_engine(path)
    outs = engine.generate([PROMPT] * 4000, [SamplingParams(temperature=1.3, min_p=0.3, max_new_tokens=3,
                                                            ignore_eos=True, seed=i) for i in range(4000)])
    assert max(o.stats.tau for o in outs) > 1
    draws = [tuple(o.token_ids) for o in outs]
    assert chi_square_p(draws, exact_min_p_joint(hf, 1.3, 0.3)) > 0.01
    assert chi_square_p(draws, exact_joint(hf, temperature=1.3)) < 1e-6


def test_a_seeded_min_p_sample_is_the_same_with_and_without_speculation(tiny_dir, tiny_head):
    engine = tiny_engine(tiny_dir, tiny_head, TREE, max_batch_size=3)
    params = [SamplingParams(temperature=0.9, min_p=0.1, top_p=0.95, max_new_tokens=20, ignore_eos=True, seed=s)
              for s in range(3)]
    ps = prompts(3, seed=4)
    assert [o.token_ids for o in engine.generate(ps, params)] == \
        [o.token_ids for o in engine.generate(ps, params, speculative=False)]


# ---- truncate_prompt_tokens ---------------------------------------------------------------------------------------
def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(tiny_dir, tiny_head):
    engine = tiny_engine(tiny_dir, tiny_head, max_model_len=64)
    long = prompts(1, seed=2)[0] * 20
    cut = engine.generate([long], SamplingParams(max_new_tokens=5, truncate_prompt_tokens=6))[0]
    alone = engine.generate([long[-6:]], SamplingParams(max_new_tokens=5))[0]
    assert cut.prompt_token_ids == long[-6:] and cut.token_ids == alone.token_ids
    words = " ".join(f"w{i}" for i in range(3, 40))   # text: tokenised first, then cut
    assert engine.generate([words], SamplingParams(max_new_tokens=2, truncate_prompt_tokens=3))[0] \
        .prompt_token_ids == engine.codec.encode(words)[-3:]
    room = engine.prompt_room()
    most = engine.generate([long], SamplingParams(max_new_tokens=2, truncate_prompt_tokens=-1))[0]
    assert most.prompt_token_ids == long[-room:]
    with pytest.raises(PromptTooLongError, match="prompt has 80 tokens"):   # without it, the same prompt does not fit
        engine.generate([long], SamplingParams(max_new_tokens=2))


# ---- what is refused ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, message", [
    (dict(min_tokens=10, max_new_tokens=5), "min_tokens \\(10\\) is more than the output may hold"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
    (dict(min_p=1.5), "min_p"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens: 0 would keep no prompt"),
    (dict(allowed_token_ids=[3], guided_regex="a+"), "allowed_token_ids and guided_regex"),
    (dict(min_tokens=2, guided_choice=["a", "b"]), "min_tokens and guided_choice"),
])
def test_inconsistent_fields_are_refused_naming_them(fields, message):
    with pytest.raises(ConfigError, match=message):
        SamplingParams(**fields)


def test_an_allowed_token_outside_the_vocabulary_is_refused(tiny_dir, tiny_head):
    engine = tiny_engine(tiny_dir, tiny_head, TREE)
    with pytest.raises(InvalidRequestError, match="allowed_token_ids: token id 64 is not in the vocabulary"):
        engine.generate([[5, 6]], SamplingParams(allowed_token_ids=[3, 64]))


def test_a_job_rows_sampling_params_take_the_fields_as_strictly_as_serve():
    """A row's ``sampling_params`` (JSON or Parquet: a whole float counts as an integer, as pandas writes integers
    with nulls; a null is absent)."""
    from eagle_ray.engine.request import sampling_params
    params = sampling_params({"min_tokens": 2.0, "allowed_token_ids": [3, 4], "min_p": 0.1, "seed": None,
                              "include_stop_str_in_output": True, "truncate_prompt_tokens": 8,
                              "skip_special_tokens": False})
    assert (params.min_tokens, params.allowed_token_ids, params.min_p, params.include_stop_str_in_output,
            params.skip_special_tokens, params.truncate_prompt_tokens) == (2, [3, 4], 0.1, True, False, 8)
    for row, message in [({"min_tokens": True}, "sampling_params.min_tokens: an integer is required"),
                         ({"allowed_token_ids": [1, "2"]}, "sampling_params.allowed_token_ids: a list of integers"),
                         ({"skip_special_tokens": 0}, "sampling_params.skip_special_tokens: true or false")]:
        with pytest.raises(InvalidRequestError, match=message):
            sampling_params(row)
    from eagle_ray.engine.request import parse_row
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens: a scoring row's context is scored as it"):
        parse_row({"prompt": "w1 w2", "continuation": " w3", "sampling_params": {"truncate_prompt_tokens": 1}},
                  SamplingParams())


def test_stop_ids_and_an_allowed_list_that_leaves_nothing_are_refused(tiny_dir, tiny_head):
    engine = tiny_engine(tiny_dir, tiny_head, TREE)
    with pytest.raises(InvalidRequestError, match="stop_token_ids: token id 64 is not in the vocabulary"):
        engine.generate([[5, 6]], SamplingParams(stop_token_ids=[7, 64], min_tokens=2))
    with pytest.raises(ConfigError, match="stop_token_ids.0: Input should be greater than or equal to 0"):
        SamplingParams(stop_token_ids=[-5])
    with pytest.raises(InvalidRequestError, match="every allowed token is EOS or a stop token, which min_tokens"):
        engine.generate([[5, 6]], SamplingParams(allowed_token_ids=[EOS, 9], stop_token_ids=[9], min_tokens=2))
    word = engine.codec.bad_word_ids(["w5"])[0][0]   # a list that only the bars and the words together cover
    with pytest.raises(InvalidRequestError, match="every allowed token is EOS or a stop token, which min_tokens "
                                                  r"\(2\) bars or a bad word: nothing could be chosen"):
        engine.generate([[5, 6]], SamplingParams(allowed_token_ids=[EOS, word], min_tokens=2, bad_words=["w5"]))


def test_a_stop_string_ending_in_a_character_the_min_tokens_bound_splits_counts():
    """Byte-level tokens: "xé" is x, C3, A9; with ``min_tokens: 2`` the bound falls inside "é", so a stop "é",
    ending past it, stops the output (vLLM's rule: the text of the first two tokens is "x" and half a character)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from eagle_ray.engine.sequence import Sequence
    from eagle_ray.engine.text import Detokenizer, StopStrings
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    ids = fast("xéy")["input_ids"]
    assert len(ids) == 4
    for min_tokens, text in [(2, "x"), (3, "xéy")]:
        seq = Sequence("r", [], SamplingParams(min_tokens=min_tokens, stop=["é"]), frozenset(), 0,
                       detok=Detokenizer(fast), stops=StopStrings(["é"]))
        seq.output_ids = list(ids)
        seq.update_text()
        assert seq.text == text and seq.finish_reason == ("stop" if text == "x" else None)


def test_completions_token_texts_keep_special_tokens_when_asked(tiny_dir, tiny_head):
    """With ``skip_special_tokens: false`` each token's text (completions ``logprobs.tokens``) holds the special
    token's text too, so the tokens joined are still the choice's text."""
    from eagle_ray.serve.logprobs import TokenText, completion_logprobs
    from eagle_ray.speculative.logprobs import TokenLogprobs
    engine = tiny_engine(tiny_dir, tiny_head)
    out = engine.generate([[5, 6]], SamplingParams(max_new_tokens=3, ignore_eos=True, allowed_token_ids=[2, 9],
                                                   skip_special_tokens=False, logprobs=0))[0]
    lp = completion_logprobs(TokenLogprobs(out.logprobs.values, out.logprobs.top), out.token_ids, 0,
                             TokenText(engine.tokenizer), 0, (), [5, 6], skip_special=False)
    assert "".join(lp["tokens"]) == out.text and "<s>" in out.text


# ---- prompt_logprobs ----------------------------------------------------------------------------------------------
def test_a_jobs_rows_carry_their_prompts_log_probabilities_as_the_target_gives_them(tiny_dir, tiny_hf, tmp_path):
    """vLLM's ``prompt_logprobs``: per prompt token, the first's null, the target's raw log-probability after the
    tokens before it and the k most probable alternatives; the same for each of ``n`` samples (which share the
    prefill), and the output unchanged by asking."""
    from test_batch_faults import stage_for
    from test_job_output import run_rows

    from eagle_ray.engine.request import parse_row
    prompt = "w3 w9 w4 w12 w7 w30"
    stage = stage_for(tiny_dir, tmp_path)
    ids = stage.engine.codec.encode(prompt)
    with torch.no_grad():
        want = tiny_hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    one, *samples, plain = run_rows(stage, [
        {"prompt": prompt, "sampling_params": {"prompt_logprobs": 2}},
        {"prompt": prompt, "sampling_params": {"prompt_logprobs": 0, "n": 2, "temperature": 1.0, "seed": 3}},
        {"prompt": prompt}])
    assert one["prompt_logprobs"][0] is None and one["prompt_top_logprobs"][0] is None
    assert len(one["prompt_logprobs"]) == len(ids) == one["prompt_tokens"]
    for i in range(1, len(ids)):
        assert one["prompt_logprobs"][i] == pytest.approx(float(want[i - 1, ids[i]]), abs=1e-4)
        assert [t["token_id"] for t in one["prompt_top_logprobs"][i]] == torch.topk(want[i - 1], 2).indices.tolist()
    assert [s["sample_index"] for s in samples] == [0, 1]
    assert samples[0]["prompt_logprobs"] == samples[1]["prompt_logprobs"] == pytest.approx(one["prompt_logprobs"])
    assert one["output_token_ids"] == plain["output_token_ids"] and plain["prompt_logprobs"] is None
    for row, message in [({"turns": ["w1"], "sampling_params": {"prompt_logprobs": 1}},
                          "a conversation answered turn by"),
                         ({"prompt": "w1", "continuation": " w2", "sampling_params": {"prompt_logprobs": 1}},
                          "a scoring row scores its continuations")]:
        with pytest.raises(InvalidRequestError, match=f"sampling_params.prompt_logprobs: {message}"):
            parse_row(row, SamplingParams())
        inherited = {k: v for k, v in row.items() if k != "sampling_params"}   # the job's default: not theirs
        assert parse_row(inherited, SamplingParams(prompt_logprobs=1)).params.prompt_logprobs is None
    assert parse_row({"prompt": "w1"}, SamplingParams(prompt_logprobs=1)).params.prompt_logprobs == 1


# ---- bad_words ----------------------------------------------------------------------------------------------------
def bad_words_reference(hf, prompt: list[int], n: int, words: list[list[int]]) -> list[int]:
    """A full forward per token and vLLM's rule written out: a word's last token is barred where the output so far
    ends with its other tokens (a one-token word, always)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1].clone()
            out = ids[len(prompt):]
            for w in words:
                if len(w) == 1 or (len(out) >= len(w) - 1 and out[len(out) - len(w) + 1:] == w[:-1]):
                    logits[w[-1]] = float("-inf")
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def test_a_bad_words_last_token_is_barred_at_each_node_whose_path_ends_with_the_rest(tiny_dir, tiny_hf, tiny_head):
    """Two-token words taken from the free outputs (so they would occur), and a one-token word: greedy speculation
    equals greedy plain decoding and the reference; no output holds a word; trees are still accepted."""
    engine = tiny_engine(tiny_dir, tiny_head, TREE, max_batch_size=4)
    ps = prompts(4, seed=6)
    free = engine.generate(ps, SamplingParams(max_new_tokens=24, ignore_eos=True))
    pairs = [o.token_ids[i:i + 2] for o in free for i in (2, 7)]
    text = [engine.tokenizer.decode(p) for p in pairs] + [engine.tokenizer.decode(free[0].token_ids[:1])]
    words = engine.codec.bad_word_ids(text)
    assert sorted(map(len, words))[0] == 1 and max(map(len, words)) == 2
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, bad_words=text)
    spec = engine.generate(ps, params)
    plain = engine.generate(ps, params, speculative=False)
    for s, p, f, prompt in zip(spec, plain, free, ps):
        assert s.token_ids == p.token_ids == bad_words_reference(tiny_hf, prompt, 24, words)
        assert not any(s.token_ids[i:i + len(w)] == w for w in words for i in range(len(s.token_ids)))
    assert any(s.token_ids != f.token_ids for s, f in zip(spec, free))
    assert sum(sum(o.stats.accepted_per_depth) for o in spec) > 0


def test_a_nodes_path_reads_its_own_tokens_then_the_output_before_the_root():
    """Root 0 -> 1 -> 3, root -> 2; the output before the root is [7, 8] (8 latest)."""
    from eagle_ray.speculative.token_masks import path_tokens
    tokens = torch.tensor([[10, 11, 12, 13]])
    parents = torch.tensor([[0, 0, 0, 1]])
    depth = torch.tensor([[0, 1, 1, 2]])
    got = path_tokens(tokens, parents, depth, torch.tensor([[8, 7, -1]]))
    assert got[0].tolist() == [[10, 8, 7], [11, 10, 8], [12, 10, 8], [13, 11, 10]]


def test_words_sharing_a_last_token_each_bar_it_where_their_own_prefix_matches():
    """A word and its spaced form often end in the same token: a word whose prefix does not match must not undo the
    bar of one whose does, whatever their order."""
    class Seq:
        params, min_barred = SamplingParams(), frozenset()

        def __init__(self, words):
            self.output_ids, self.bad_words = [9, 3], words
    for words in (((3, 5), (4, 5)), ((4, 5), (3, 5))):
        batch = TokenMaskBatch.of([Seq(words)], 8, "cpu")
        tree = SimpleNamespace(tokens=torch.tensor([[3]]), parents=torch.tensor([[0]]), depth=torch.tensor([[0]]))
        out = apply_token_masks(torch.zeros(1, 1, 8), batch, tree)
        assert (out[0, 0] == float("-inf")).tolist() == [t == 5 for t in range(8)], words


def test_bad_words_are_refused_where_they_cannot_be_read(tiny_dir, tiny_head):
    with pytest.raises(ConfigError, match="bad_words.0: String should have at least 1 character"):
        SamplingParams(bad_words=[""])
    from eagle_ray.engine.request import sampling_params
    with pytest.raises(InvalidRequestError, match="bad_words: a list of strings is required"):
        sampling_params({"bad_words": "w1"})
    engine = tiny_engine(tiny_dir, tiny_head, TREE)
    for params, message in [(dict(bad_words=["  "]), "a word of whitespace alone bars nothing"),
                            (dict(bad_words=["w1"] * 129), "at most 128 words"),
                            (dict(bad_words=[" ".join(["w1"] * 33)]), "is 33 tokens, more than the 32"),
                            (dict(bad_words=["w5", "w6"], allowed_token_ids=[w[0] for w in engine.codec.bad_word_ids(
                                ["w5", "w6"])]), "every allowed token is a bad word")]:
        with pytest.raises(InvalidRequestError, match=message):
            engine.generate([[5, 6]], SamplingParams(**params))
