"""Eval clients against the Serve app over real HTTP: the ``openai`` client reading logprobs and ``n`` choices
(streamed too), echo scoring a prompt, and lm-evaluation-harness's ``local-completions`` model running a
multiple-choice loglikelihood task from a local JSONL file, its accuracy equal to the same task scored with
transformers directly."""
import json

import httpx
import pytest
import torch
from test_serve import AUTH, MODEL, client, server  # noqa: F401 - the live server of test_serve.py

from eagle_ray.config import SamplingParams
from eagle_ray.engine.scoring import encode_pair

pytestmark = pytest.mark.slow  # a real local Ray cluster


def test_the_openai_client_reads_chat_and_completion_logprobs(server, client):
    offline = server[1]
    msgs = [{"role": "user", "content": "w1 w7 w9"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body={"ignore_eos": True})
    want = offline.generate(msgs, SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=3))[0]
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [offline.tokenizer.decode([t]) for t in want.token_ids]
    assert [c.logprob for c in content] == pytest.approx(want.logprobs.values, abs=1e-5)
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == c.logprob for c in content)   # greedy
    assert content[0].bytes == list(content[0].token.encode())
    r = client.completions.create(model=MODEL, prompt="w3 w4", max_tokens=6, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6 and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == r.choices[0].text        # each token's text is what it adds: offsets index it
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(6)]
    assert all(max(top.values()) == v for top, v in zip(lp.top_logprobs, lp.token_logprobs))


def test_n_choices_are_the_engines_samples_streamed_or_not(server, client):
    offline = server[1]
    kw = dict(model=MODEL, prompt="w5 w6 w7", max_tokens=10, temperature=1.0, seed=9, n=3,
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    want = offline.generate("w5 w6 w7", SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=1.0, seed=9,
                                                       n=3))
    assert [c.index for c in r.choices] == [0, 1, 2] and [c.text for c in r.choices] == [o.text for o in want]
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 30
    texts, logprobs = ["", "", ""], [[], [], []]
    for chunk in client.completions.create(stream=True, logprobs=0, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
            logprobs[c.index] += c.logprobs.token_logprobs if c.logprobs else []
    assert texts == [o.text for o in want]
    assert [len(x) for x in logprobs] == [10] * 3
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w2"}], max_tokens=5,
                                          temperature=0.9, n=2, seed=1)
    assert [c.index for c in chat.choices] == [0, 1]


def test_echo_with_no_new_tokens_scores_the_prompt(server, tiny_hf):
    offline = server[1]
    body = {"model": MODEL, "prompt": "w8 w9 w10 w11", "echo": True, "max_tokens": 0, "logprobs": 1}
    r = httpx.post(server[0] + "/v1/completions", json=body, headers=AUTH, timeout=60).json()
    choice = r["choices"][0]
    ids = offline.encode("w8 w9 w10 w11")
    with torch.no_grad():
        ref = tiny_hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    assert choice["text"] == "w8 w9 w10 w11" and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx([float(ref[i, t]) for i, t in enumerate(ids[1:])], abs=1e-5)
    assert r["usage"]["completion_tokens"] == 0
    streamed = httpx.post(server[0] + "/v1/completions", json=body | {"stream": True}, headers=AUTH, timeout=60)
    events = [json.loads(x[6:]) for x in streamed.text.split("\n\n") if x.startswith("data: {")]
    assert events[0]["choices"][0]["text"] == "w8 w9 w10 w11"
    assert events[0]["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"]


DOCS = [{"question": f"w{3 + i} w{9 + i} w{4 + 2 * i}", "choices": [f"w{10 + i}", f"w{20 + i} w{21 + i}", f"w{30 + i}",
                                                                     f"w{40 + (i % 9)}"],
         "label": i % 4} for i in range(12)]
TASK = """task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_target: label
doc_to_choice: choices
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def transformers_accuracy(hf, tokenizer) -> float:
    """The task scored as lm-evaluation-harness's HF model scores it: each choice's summed log-likelihood after
    the question (target delimiter " "), the best choice against the label."""
    right = 0
    for doc in DOCS:
        scores = []
        for choice in doc["choices"]:
            ctx, cont = encode_pair(tokenizer, doc["question"], " " + choice)
            with torch.no_grad():
                lp = hf(torch.tensor([ctx + cont])).logits[0, len(ctx) - 1:-1].float().log_softmax(-1)
            scores.append(float(lp.gather(-1, torch.tensor(cont).view(-1, 1)).sum()))
        right += max(range(len(scores)), key=scores.__getitem__) == doc["label"]
    return right / len(DOCS)


def test_lm_evaluation_harness_scores_a_local_task_against_serve(server, tiny_dir, tiny_hf, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager
    for k, v in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OPENAI_API_KEY": "test-key",
                 "HF_DATASETS_CACHE": str(tmp_path / "datasets")}.items():
        monkeypatch.setenv(k, v)
    data = tmp_path / "tiny_choice.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "tiny_choice.yaml").write_text(TASK.format(data=data))
    out = lm_eval.simple_evaluate(
        model="local-completions", tasks=["tiny_choice"], task_manager=TaskManager(include_path=str(tmp_path)),
        model_args={"model": MODEL, "base_url": server[0] + "/v1/completions", "tokenizer": str(tiny_dir),
                    "tokenizer_backend": "huggingface", "tokenized_requests": True, "batch_size": 4,
                    "max_retries": 1, "max_length": 128},
        log_samples=False)
    want = transformers_accuracy(tiny_hf, server[1].tokenizer)
    assert out["results"]["tiny_choice"]["acc,none"] == pytest.approx(want)
