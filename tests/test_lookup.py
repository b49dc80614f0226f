"""Prompt lookup: a sequence's own history proposes a chain, grafted onto the draft tree and verified with it.
Output stays the target's own, token for token; only accepted lengths grow."""
import pytest
import torch
from test_engine import reference_greedy
from test_tree import WORDS, example_tree
from tiny import tiny_engine

from eagle_ray.config import SamplingParams, TreeConfig
from eagle_ray.speculative.accept import accept
from eagle_ray.speculative.lookup import TokenHistory, lookup_rows
from eagle_ray.speculative.tree import graft_chain, root_to_leaf_paths


def history(ids: list[int]) -> TokenHistory:
    h = TokenHistory()
    h.sync(ids, [])
    return h


def test_a_lookup_proposes_what_followed_the_latest_earlier_occurrence():
    h = history([7, 1, 2, 3, 9, 1, 2, 4, 5, 6, 1, 2])
    assert h.propose(2, 3).tolist() == [4, 5, 6]          # "1 2" last seen before the end at index 5
    assert h.propose(3, 3).tolist() == []                  # "6 1 2" never occurred before
    assert h.propose(1, 2).tolist() == [4, 5]              # "2" -> what followed its latest earlier occurrence


def test_a_repeating_history_is_proposed_as_far_as_asked():
    h = history([5, 8, 9, 8, 9, 8])
    assert h.propose(2, 5).tolist() == [9, 8, 9, 8, 9]    # period 2 continued past the end of the history


def test_history_syncs_a_growing_prompt_and_output():
    h = TokenHistory()
    h.sync([1, 2, 3], [])
    h.sync([1, 2, 3], [4])
    h.sync([1, 2, 3], [4, 1, 2])
    assert h.ids[: h.n].tolist() == [1, 2, 3, 4, 1, 2]
    rows = lookup_rows([h, history([1, 2])], ngram=2, length=3)
    assert rows.tolist() == [[3, 4, 1, 3], [0, 0, 0, 0]]   # tokens, zero padded, then the length


def test_a_prediction_proposes_what_follows_the_outputs_end_where_the_output_has_reached_in_it():
    """OpenAI's predicted outputs: the output's last tokens found in the prediction, at the occurrence nearest
    where the output has got to (an edit shifts it), and what follows them there proposed."""
    import numpy as np
    prediction = np.array([10, 11, 12, 13, 11, 12, 14, 15, 16, 17])
    h = TokenHistory(prediction)
    h.sync([1, 2, 3], [10])                         # the output's first token: matched alone
    assert h.propose(2, 3).tolist() == [11, 12, 13]
    h.sync([1, 2, 3], [10, 11, 12, 13, 11, 12])     # "11 12" twice in it: the later one, where the output is
    assert h.propose(2, 3).tolist() == [14, 15, 16]
    h.sync([1, 2, 3], [10, 11, 12, 13, 11, 12, 99, 14, 15])   # an edit inserted 99: found one token later
    assert h.propose(2, 5).tolist() == [16, 17] and h.shift == -1
    h.sync([1, 2, 3], [10, 11, 12, 13, 11, 12, 99, 14, 15, 98])   # not in it: the history's own (none here)
    assert h.propose(2, 3).tolist() == []
    own = TokenHistory(np.array([5, 6, 7]))
    own.sync([4, 8, 9, 4], [8])                     # shorter than the n-gram: the history's whole match wins
    assert own.propose(2, 2).tolist() == [9, 4]
    from eagle_ray.speculative.lookup import PREDICTION_WINDOW
    far = TokenHistory(np.array([3] * (PREDICTION_WINDOW + 10) + [10, 11, 12]))
    far.sync([1], [10, 11])                         # nothing near the place: all of it searched (an edit moved far)
    assert far.propose(2, 1).tolist() == [12] and far.shift == PREDICTION_WINDOW + 10


def test_a_prediction_speeds_an_edit_and_leaves_its_output_the_targets(tiny_dir, tiny_hf, tiny_head):
    """Greedy output with a prediction is the target's own; predicting the output it gives (with one token
    changed) takes fewer verify steps than the tree alone."""
    engine = tiny_engine(tiny_dir, tiny_head, TreeConfig(total_tokens=6, depth=2, top_k=2, lookup=16,
                                                         lookup_ngram=2))
    prompt = torch.randint(3, 64, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    plain = engine.generate([prompt], params)[0]
    edited = list(plain.token_ids)
    edited[20] = 3 if edited[20] != 3 else 4
    guess = engine.tokenizer.decode(edited)
    out = engine.generate([prompt], params.model_copy(update={"prediction": guess}))[0]
    assert out.token_ids == plain.token_ids == reference_greedy(tiny_hf, prompt, 40)
    assert out.stats.verify_steps < plain.stats.verify_steps / 2, (out.stats.verify_steps, plain.stats.verify_steps)
    wrong = engine.generate([prompt], params.model_copy(update={"prediction": "w50 w51 w52 w53"}))[0]
    assert wrong.token_ids == plain.token_ids   # a prediction nothing like it changes nothing but the drafts
    from eagle_ray.errors import InvalidRequestError
    with pytest.raises(InvalidRequestError, match="prediction: 300 tokens, more than the model's context of 256"):
        engine.make_sequence(prompt, params.model_copy(update={"prediction": " ".join(["w5"] * 300)}))


def test_a_chain_follows_the_tree_while_it_spells_it_then_grows_new_nodes():
    """The EAGLE example tree (It -> is -> a -> good, ...); tokens are the words' indices."""
    tree = example_tree()
    B = 4
    tree = type(tree)(*(t.expand(B, *t.shape[1:]).clone() for t in
                        (tree.tokens, tree.parents, tree.depth, tree.valid, tree.ancestors, tree.scores)))
    tree.max_depth = 3
    chain = torch.tensor([[1, 3, 6, 20, 21], [2, 30, 0, 0, 0], [40, 41, 42, 0, 0], [1, 3, 0, 0, 0]])
    n = torch.tensor([5, 2, 3, 2])
    grafted = graft_chain(tree, chain, n)
    assert grafted.tokens.shape == (4, 13) and grafted.max_depth == 5
    names = {i: w for i, w in enumerate(WORDS)}

    def paths(b):
        return sorted(" ".join(names.get(int(grafted.tokens[b, i]), str(int(grafted.tokens[b, i]))) for i in p)
                      for p in root_to_leaf_paths(grafted)[b])

    assert paths(0) == ["It has to be", "It is a good 20 21", "It is the"]      # continues below "good"
    assert paths(1) == ["It has 30", "It has to be", "It is a good", "It is the"]  # a new sibling of "to"
    assert paths(2) == ["It 40 41 42", "It has to be", "It is a good", "It is the"]  # from the root
    assert paths(3) == ["It has to be", "It is a good", "It is the"]            # already in the tree
    assert grafted.valid.sum(1).tolist() == [10, 9, 11, 8]
    assert grafted.depth[0, 8:10].tolist() == [4, 5] and grafted.parents[0, 8:10].tolist() == [6, 8]
    assert bool((grafted.ancestors.sum(-1)[grafted.valid] == grafted.depth[grafted.valid] + 1).all())


def test_acceptance_walks_a_grafted_chain_past_the_drafted_depth():
    tree = example_tree()
    grafted = graft_chain(tree, torch.tensor([[1, 3, 6, 20, 21]]), torch.tensor([5]))
    # the target's choice at each node: the next chain token along "It is a good 20 21", then 99
    choice = torch.zeros(1, grafted.tokens.shape[1], dtype=torch.long)
    for node, nxt in [(0, 1), (1, 3), (3, 6), (6, 20), (8, 21), (9, 99)]:
        choice[0, node] = nxt
    acc = accept(grafted, choice)
    assert acc.count.tolist() == [6] and acc.bonus.tolist() == [99]
    assert grafted.tokens[0, acc.nodes[0]].tolist() == [0, 1, 3, 6, 20, 21]


@pytest.mark.parametrize("lookup", [0, 5])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_output_is_the_target_s_with_or_without_lookup(tiny_dir, tiny_hf, tiny_head, lookup, batch):
    engine = tiny_engine(tiny_dir, tiny_head, TreeConfig(total_tokens=6, depth=2, top_k=2, lookup=lookup,
                                                         lookup_ngram=2), max_batch_size=batch)
    g = torch.Generator().manual_seed(11)
    motif = torch.randint(3, 64, (5,), generator=g).tolist()
    prompts = [motif * 4, torch.randint(3, 64, (9,), generator=g).tolist(), motif * 2 + [7, 8]]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=48, ignore_eos=True))
    for out, prompt in zip(outs, prompts):
        assert out.token_ids == reference_greedy(tiny_hf, prompt, 48)
    deepest = max(len(o.stats.accept_hist) - 1 for o in outs)   # most drafts one step accepted
    if lookup:
        assert deepest > 3      # deeper than the head's tree (depth 2: three drafts) can reach
    else:
        assert deepest <= 3


def test_serve_reads_openais_prediction_field():
    import json

    from eagle_ray.serve.openai_api import ApiError, parse_body

    def chat(prediction):
        body = {"model": "m", "messages": [{"role": "user", "content": "w1"}], "prediction": prediction}
        return parse_body(json.dumps(body).encode(), "chat", "m", 100, 16)
    assert chat({"type": "content", "content": "w5 w6"}).params.prediction == "w5 w6"
    assert chat({"type": "content", "content": [{"type": "text", "text": "w5"}, {"type": "text", "text": " w6"}]
                 }).params.prediction == "w5 w6"
    for bad in ({"type": "content"}, {"type": "file", "content": "x"}, {"type": "content", "content": [{"a": 1}]}):
        with pytest.raises(ApiError, match="prediction must be") as e:
            chat(bad)
        assert e.value.param == "prediction"
