"""The engine on tiny random models: speculative output is the target's own greedy output, exactly, for every
tree mode, batch size and Llama-family variant; stop rules cut where they should."""
import weakref

import pytest
import torch
from tiny import make_target, make_tokenizer, save_target, text_after, tiny_engine, trained_head

from eagle_ray.config import SamplingParams, TreeConfig
from eagle_ray.engine.queue import RequestQueue


_GREEDY: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def reference_greedy(hf, prompt: list[int], n: int, stop: set[int] = frozenset()) -> list[int]:
    """Independent reference: full forward without any cache, argmax, one token at a time.

    Many tests ask it for the same prompts of the same (never modified) model: what it computed is kept per model
    and prompt, and a shorter or equal request is answered from it, token for token what the loop would give."""
    known = _GREEDY.setdefault(hf, {}).setdefault((tuple(prompt), frozenset(stop)), [])
    ids = list(prompt) + known
    with torch.no_grad():
        while len(ids) - len(prompt) < n and not (len(ids) > len(prompt) and ids[-1] in stop):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    known[:] = ids[len(prompt):]
    return known[:n]


def greedy_after_each(hf, prompt: list[int], ids: list[int]) -> list[int]:
    """The target's argmax after ``prompt`` and each prefix of ``ids``, from one forward without cache (causal: a
    position sees only what precedes it). ``ids`` is the greedy output exactly when this returns ``ids``: the first
    token that differs would be the first one whose prefix is the greedy one. For outputs of hundreds of tokens,
    where :func:`reference_greedy`'s forward a token is quadratic."""
    with torch.no_grad():
        logits = hf(torch.tensor([list(prompt) + list(ids[:-1])])).logits[0, len(prompt) - 1:]
    return logits.argmax(-1).tolist()


def mixed_prompts(n: int, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 64, (int(k),), generator=g).tolist() for k in torch.randint(1, 24, (n,), generator=g)]


TREES = {
    "dynamic": TreeConfig(total_tokens=12, depth=3, top_k=3),
    "dynamic-wide": TreeConfig(total_tokens=24, depth=5, top_k=4),
    "dynamic-pruned": TreeConfig(total_tokens=16, depth=4, top_k=4, min_cum_prob=0.02),
    "static": TreeConfig(mode="static"),
    "chain": TreeConfig(mode="chain", depth=4),
}


@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("batch", [1, 3])
def test_speculative_greedy_equals_target_greedy(tiny_dir, tiny_hf, tiny_head, tree, batch):
    engine = tiny_engine(tiny_dir, tiny_head, TREES[tree], max_batch_size=batch)
    prompts = mixed_prompts(6)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=40, ignore_eos=True))
    for out, prompt in zip(outs, prompts):
        assert out.token_ids == reference_greedy(tiny_hf, prompt, 40)
        assert out.finish_reason == "length"
    # the trained head gets multi-token acceptance, so KV compaction of deep paths is exercised
    if tree != "dynamic-pruned":  # pruning at 2% keeps little when the head is unsure of random prompts
        assert any(len(o.stats.accept_hist) > 2 for o in outs), [o.stats.accept_hist for o in outs]
    assert all(o.stats.verify_steps > 0 and sum(o.stats.accept_hist) == o.stats.verify_steps for o in outs)


@pytest.mark.parametrize("cap", [4, 11, 20])
def test_a_batch_verify_budget_keeps_greedy_exact(tiny_dir, tiny_hf, tiny_head, cap):
    """Per-sequence tree sizes under a batch-wide cap (4 = roots only for a batch of 4)."""
    engine = tiny_engine(tiny_dir, tiny_head, TREES["dynamic"], max_batch_size=4)
    engine.config.speculation.verify_cap = cap
    prompts = mixed_prompts(6, seed=2)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=30, ignore_eos=True))
    for out, prompt in zip(outs, prompts):
        assert out.token_ids == reference_greedy(tiny_hf, prompt, 30)
    c = engine.counters
    assert c["tree_nodes"] <= cap * c["decode_passes"]


def test_prompt_chunks_fill_the_budget_oldest_first():
    """A step's prompt chunks are one padded pass of at most the budget; the row count that runs the most real
    tokens wins, and a short prompt does not narrow a long one's chunk to its own length."""
    from types import SimpleNamespace

    from eagle_ray.engine.scheduler import plan_chunks

    def seqs(*lengths, done=0):
        return [SimpleNamespace(prompt_ids=[0] * n, prefilled=done, fork=None) for n in lengths]

    def plan(prompts, budget):
        return [(c.start, c.end) for c in plan_chunks(prompts, budget)]
    assert plan(seqs(30, 2, 600, 5), 100) == [(0, 30), (0, 2), (0, 33)]     # 65 real tokens; 1 row: 30, 4: 57
    assert plan(seqs(600, 5), 100) == [(0, 100)]
    assert plan(seqs(10, 10, 10, 10, 10), 40) == [(0, 10)] * 4
    assert plan(seqs(700, done=650), 512) == [(650, 700)]


def test_long_prompts_prefill_in_chunks_next_to_running_decodes(tiny_dir, tiny_hf, tiny_head):
    """With a small prefill budget every prompt is split over several steps while the others decode; output is
    unchanged and no pass holds more padded prompt tokens than the budget."""
    engine = tiny_engine(tiny_dir, tiny_head, TREES["dynamic"], max_batch_size=3)
    engine.scheduler.step_budget = 16
    widths = []
    run = engine.runner.run

    def spy(plan, *a, **kw):
        if plan.prefill:
            widths.append(len(plan.prefill) * max(c.end - c.start for c in plan.prefill))
        return run(plan, *a, **kw)
    engine.runner.run = spy
    prompts = mixed_prompts(6, seed=3)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outs] == [reference_greedy(tiny_hf, p, 12) for p in prompts]
    assert max(widths) <= 16 and engine.counters["prefill_sequences"] == 6
    assert engine.counters["prefill_passes"] > 6


@pytest.mark.parametrize("prefix", [9, 250, 300])
def test_bf16_on_cpu_computes_a_token_alone_as_inside_a_verify_block(prefix):
    """bf16 weights, fp32 activations: a token's hidden state is bit-identical whether it is decoded alone (one
    row) or verified inside a 13-token block next to another sequence, so speculative and plain decoding agree."""
    from eagle_ray.model.target import TargetModel
    hf = make_target(vocab_size=512, hidden=128, layers=2).to(torch.bfloat16)
    target = TargetModel(hf, 3, 512)
    g = torch.Generator().manual_seed(prefix)
    ids = torch.randint(3, 512, (prefix + 13,), generator=g)

    def run(tokens, slots, width):
        idx = torch.arange(width)
        causal = (idx.view(-1, 1) >= idx.view(1, -1)).expand(len(slots), width, width)
        hidden = target.forward(tokens, slots, idx.expand(len(slots), width), causal)
        target.cache.lengths[slots] += width
        return hidden

    for slot in range(3):
        target.cache.reset(slot)
        run(ids[:prefix].view(1, -1), [slot], prefix)
    alone = torch.cat([run(ids[prefix + i].view(1, 1), [0], 1)[0] for i in range(13)])
    other = torch.randint(3, 512, (13,), generator=g)
    block = run(torch.stack([other, ids[prefix:]]), [2, 1], 13)[1]
    assert torch.equal(alone, block)
    assert torch.equal(target.logits(alone), target.logits(block))


@pytest.mark.parametrize("speculative", [True, False])
def test_finished_sequences_leave_no_holes_in_the_kv_slots(tiny_dir, tiny_hf, tiny_head, speculative):
    """Sequences that outlive their neighbours move down into freed slots (KV and draft cache with them), so
    every decode pass reads slots 0..n-1 as one slice; outputs are unchanged."""
    engine = tiny_engine(tiny_dir, tiny_head, TREES["dynamic"], max_batch_size=4)
    run, seen = engine.runner.run, []

    def checked_run(plan, *a, **kw):
        slots = sorted(s.slot for s in engine.scheduler.running)
        seen.append(slots)
        assert slots == list(range(len(slots)))
        return run(plan, *a, **kw)
    engine.runner.run = checked_run
    prompts = mixed_prompts(7, seed=4)
    lengths = [5, 30, 8, 30, 12, 20, 3]
    outs = engine.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths],
                           speculative=speculative)
    assert [o.token_ids for o in outs] == [reference_greedy(tiny_hf, p, n) for p, n in zip(prompts, lengths)]
    assert [0, 1] in seen or [0] in seen  # the batch shrank and was packed
    assert sorted(engine.scheduler.free) == [0, 1, 2, 3]


def test_plain_decoding_on_the_same_runtime(tiny_dir, tiny_hf, tiny_head):
    engine = tiny_engine(tiny_dir, tiny_head, max_batch_size=4)
    prompts = mixed_prompts(5, seed=9)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=30, ignore_eos=True), speculative=False)
    for out, prompt in zip(outs, prompts):
        assert out.token_ids == reference_greedy(tiny_hf, prompt, 30)
        assert out.stats.tau == 1.0


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "mistral"])
def test_other_llama_family_targets(tmp_path, model_type):
    path = save_target(tmp_path / model_type, model_type=model_type, seed=3)
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    head = trained_head(hf, steps=150)
    engine = tiny_engine(path, head, TREES["dynamic"], max_batch_size=2)
    prompts = mixed_prompts(3, seed=2)
    for out, prompt in zip(engine.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True)), prompts):
        assert out.token_ids == reference_greedy(hf, prompt, 24)


def test_eos_stops_and_nothing_follows(tiny_dir, tiny_hf, tiny_head):
    engine = tiny_engine(tiny_dir, tiny_head)
    prompts = mixed_prompts(12, seed=11)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=60))
    for out, prompt in zip(outs, prompts):
        ref = reference_greedy(tiny_hf, prompt, 60, stop={1})
        assert out.token_ids == ref
        assert out.finish_reason == ("stop" if ref[-1] == 1 else "length")
        assert out.stop_reason is None   # EOS, as vLLM says it
    ended = next(i for i, (out, prompt) in enumerate(zip(outs, prompts)) if out.finish_reason == "stop")
    listed = engine.generate([prompts[ended]], SamplingParams(max_new_tokens=60, stop_token_ids=[1]))[0]
    assert listed.token_ids == outs[ended].token_ids and listed.stop_reason is None   # EOS first, as vLLM checks
    kept = engine.generate([prompts[ended]], SamplingParams(max_new_tokens=60, stop_token_ids=[1], ignore_eos=True))
    assert kept[0].token_ids == outs[ended].token_ids and kept[0].stop_reason == 1   # ignored EOS, named: its id


def test_stop_token_ids_and_max_new_tokens_never_overshoot(tiny_dir, tiny_hf, tiny_head):
    engine = tiny_engine(tiny_dir, tiny_head)
    prompt = mixed_prompts(1, seed=4)[0]
    full = reference_greedy(tiny_hf, prompt, 40)
    stop_tok = full[17]
    out = engine.generate([prompt], SamplingParams(max_new_tokens=40, stop_token_ids=[stop_tok], ignore_eos=True))[0]
    assert out.token_ids == full[: full.index(stop_tok) + 1] and out.finish_reason == "stop"
    assert out.stop_reason == stop_tok   # vLLM's stop_reason: the stop_token_ids id that ended it
    # the stop token's text is left out
    assert out.text == text_after(engine.tokenizer, out.prompt_token_ids, full[: full.index(stop_tok)])
    queue = RequestQueue(engine)
    streamed = "".join(d.text for d in queue.stream(
        prompt, SamplingParams(max_new_tokens=40, stop_token_ids=[stop_tok], ignore_eos=True)))
    queue.shutdown()
    assert streamed == out.text
    for n in (1, 2, 7):
        out = engine.generate([prompt], SamplingParams(max_new_tokens=n, ignore_eos=True))[0]
        assert out.token_ids == full[:n] and out.finish_reason == "length"


def test_stop_strings_cut_the_text_before_the_match(tiny_dir, tiny_hf, tiny_head):
    engine = tiny_engine(tiny_dir, tiny_head)
    tok = make_tokenizer(64)
    prompt = mixed_prompts(1, seed=4)[0]
    full = reference_greedy(tiny_hf, prompt, 40)
    ids = engine.encode(prompt)
    full_text = text_after(tok, ids, full)                 # " w.. w..": the output's text after its prompt
    stop = " " + tok.decode([full[12]]) + " "
    pos = full_text.find(stop)
    out = engine.generate([prompt], SamplingParams(max_new_tokens=40, stop=[stop], ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop   # the stop string that ended it
    assert out.text == full_text[:pos]
    n = next(n for n in range(1, 41) if len(text_after(tok, ids, full[:n])) > pos)  # fewest tokens reaching it
    assert out.token_ids == full[:n]


def test_context_limit_finishes_with_length_where_plain_decoding_does(tiny_dir, tiny_hf, tiny_head):
    """Near the end of its slot a speculative sequence decodes plainly (a tree no longer fits), so it fills the
    context like plain decoding: every slot position holds a token, and the last emitted token needs none."""
    engine = tiny_engine(tiny_dir, tiny_head, TreeConfig(total_tokens=32, depth=5, top_k=8), max_model_len=64)
    prompt = mixed_prompts(1, seed=4)[0]
    params = SamplingParams(max_new_tokens=500, ignore_eos=True)
    out = engine.generate([prompt], params)[0]
    plain = engine.generate([prompt], params, speculative=False)[0]
    assert out.finish_reason == plain.finish_reason == "length"
    assert len(prompt) + len(out.token_ids) == 64 + 1 and out.token_ids == plain.token_ids
    assert out.token_ids == reference_greedy(tiny_hf, prompt, len(out.token_ids))


def test_chat_messages_and_strings_are_accepted(tiny_dir, tiny_head):
    engine = tiny_engine(tiny_dir, tiny_head)
    outs = engine.generate([[{"role": "user", "content": "w1 w2 w3"}], "w4 w5"], SamplingParams(max_new_tokens=5))
    assert outs[0].prompt_token_ids == [2, 3, 6, 8, 9, 10, 1, 2, 4, 6]
    assert outs[1].prompt_token_ids == [11, 12]
    assert all(1 <= len(o.token_ids) <= 5 for o in outs)


@pytest.mark.parametrize("tree", ["dynamic-wide", "static"])
def test_tree_scores_equal_the_draft_head_recomputed_along_each_path(tiny_dir, tiny_hf, tiny_head, tree):
    """The batched tree drafting (draft KV cache, per-level masks, positions) gives every node the cumulative
    log-prob that a cache-free recomputation of the head along the node's path gives."""
    from eagle_ray.engine.scheduler import PrefillChunk
    from eagle_ray.train.trainer import head_forward_train

    engine = tiny_engine(tiny_dir, tiny_head, TREES[tree], max_batch_size=2)
    prompts = mixed_prompts(2, seed=21)
    seqs = [engine.make_sequence(p, SamplingParams(max_new_tokens=8)) for p in prompts]
    with torch.inference_mode():
        for slot, s in enumerate(seqs):
            s.slot = slot
        for r in engine.runner.prefill([PrefillChunk(s, 0, len(s.prompt_ids)) for s in seqs]):
            r.seq.append(r.tokens)
        features = [s.pending.features() for s in seqs]
        t = engine.runner.grow_trees(seqs, engine.config.speculation.tree)
    lm = tiny_hf.lm_head.weight
    for b, s in enumerate(seqs):
        toks0, feats0 = s.prompt_ids[1:] + [s.root], list(features[b])
        for i in range(1, t.tokens.shape[1]):
            path = t.ancestors[b, i].nonzero().flatten().tolist()  # root ... i
            toks, feats, score = list(toks0), list(feats0), 0.0
            with torch.no_grad():
                for node in path[1:]:
                    pred = head_forward_train(tiny_head, torch.tensor([toks]), torch.stack(feats)[None])[0, -1]
                    logp = torch.log_softmax(pred @ lm.T, -1)
                    tok = int(t.tokens[b, node])
                    assert tok in logp.topk(engine.config.speculation.tree.top_k if tree != "static" else 4).indices.tolist()
                    score += float(logp[tok])
                    toks.append(tok)
                    feats.append(pred)
            assert abs(score - float(t.scores[b, i])) < 1e-4


def test_a_draft_vocabulary_changes_speed_not_output(tiny_dir, tiny_hf, tiny_head):
    """With a token map the draft proposes only mapped ids; the target still decides, so output is unchanged."""
    import copy

    head = copy.deepcopy(tiny_head)
    head.token_map = torch.arange(63, 3, -2)  # 30 ids, most "frequent" first
    engine = tiny_engine(tiny_dir, head)
    engine.draft.bind_lm_head(engine.target.lm_head, 20)
    assert engine.draft.lm_score(torch.randn(3, 32)).shape == (3, 20)
    prompts = mixed_prompts(4, seed=13)
    seqs = engine.generate(prompts, SamplingParams(max_new_tokens=30, ignore_eos=True))
    for out, prompt in zip(seqs, prompts):
        assert out.token_ids == reference_greedy(tiny_hf, prompt, 30)
    logp, tok = engine.draft.topk(torch.randn(3, 32), 5)
    assert set(tok.flatten().tolist()) <= set(range(63, 23, -2))


def test_a_restarted_engine_runs_a_prompt_chunk_and_decode_rows_in_one_target_pass(tiny_dir):
    """A restart builds the scheduler and runner as the engine was built (engine/builder.py build_stepping): a step
    with a new prompt's chunk beside a decoding sequence is still one target pass."""
    engine = tiny_engine(tiny_dir, max_batch_size=2)
    passes = []
    run_parts = engine.target.run_parts

    def counted(blocks, *args, **kwargs):
        passes.append(len(blocks))
        return run_parts(blocks, *args, **kwargs)
    engine.target.run_parts = counted

    def joined_step() -> list[int]:
        first = engine.add_request([5, 6, 7, 8], SamplingParams(max_new_tokens=20, ignore_eos=True))
        while first.in_prefill or not first.output_ids:
            engine.step()
        engine.add_request([9, 10, 11], SamplingParams(max_new_tokens=4, ignore_eos=True))
        passes.clear()
        engine.step()   # the second prompt's chunk and the first sequence's verify
        return list(passes)
    assert joined_step() == [2]   # one pass of two blocks
    engine.restart()
    assert not engine.has_unfinished()
    assert joined_step() == [2]
