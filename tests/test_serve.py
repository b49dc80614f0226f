"""The Serve app over real HTTP on 127.0.0.1, driven by the official ``openai`` client: completions, chat,
streaming, stop sequences, greedy output equal to the offline engine's, OpenAI-style 4xx errors, and
mid-stream disconnects that leave no slot behind."""
import json
import socket
import threading
import time

import httpx
import pytest
import repo_scripts
from tiny import save_target, tiny_engine, wait_healthy

from eagle_ray.config import SamplingParams
from eagle_ray.serve.config import ServeConfig


pytestmark = pytest.mark.slow  # a real local Ray cluster
MODEL = "tiny-eagle"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(ray_local, tiny_dir, tiny_head, tmp_path_factory):
    from ray import serve

    from eagle_ray.serve.app import build_app
    head = tmp_path_factory.mktemp("serve-head")
    tiny_head.save(head)
    port = free_port()
    cfg = ServeConfig(engine={"target": str(tiny_dir), "draft": str(head), "dtype": "float32", "max_batch_size": 4,
                              "max_model_len": 128, "tree": {"total_tokens": 8, "depth": 3, "top_k": 3}},
                      model_name=MODEL, port=port, max_tokens_cap=64, default_max_tokens=16, num_cpus=1,
                      api_key_env="EAGLE_RAY_TEST_API_KEY")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(json.loads(cfg.model_dump_json())), name="eagle-test", route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, 120)
    yield (base, tiny_engine(tiny_dir, tiny_head, cfg.engine.speculation.tree, max_batch_size=4, max_model_len=128),
           str(tiny_dir), str(head))
    serve.delete("eagle-test")
    serve.shutdown()


@pytest.fixture()
def client(server):
    import openai
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="test-key", max_retries=0, timeout=60)


AUTH = {"authorization": "Bearer test-key"}


PROMPTS = ["w1 w2 w3", "w9 w8", "w20 w21 w22 w23 w24"]


def test_models_and_health(server, client):
    import openai
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-5")
    assert httpx.get(server[0] + "/health").json()["status"] == "ok"
    assert httpx.post(server[0] + "/ping").json()["status"] == httpx.get(server[0] + "/ping").json()["status"] == "ok"
    from eagle_ray import __version__
    assert httpx.get(server[0] + "/version").json() == {"version": __version__}
    for method, route, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)):
        r = httpx.request(method, server[0] + route, headers=AUTH)   # OpenAI's error shape, which clients parse
        assert r.status_code == status and r.json()["error"]["message"] and r.json()["error"]["type"], r.text
    # X-Request-Id (Ray Serve's own): the client's comes back, on errors too; without one, Serve's request id
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2}
    r = httpx.post(server[0] + "/v1/completions", json=body, headers={**AUTH, "X-Request-Id": "trace-7"}, timeout=60)
    assert r.headers["x-request-id"] == "trace-7"
    r = httpx.post(server[0] + "/v1/completions", json=body | {"max_tokens": "x"},
                   headers={**AUTH, "X-Request-Id": "trace-8"}, timeout=60)
    assert r.status_code == 400 and r.headers["x-request-id"] == "trace-8"
    assert client.completions.with_raw_response.create(**body).headers["x-request-id"]


def test_completion_equals_the_offline_engine(server, client):
    offline = server[1]
    for p in PROMPTS:
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=20, temperature=0,
                                      extra_body={"ignore_eos": True})
        want = offline.generate([p], SamplingParams(max_new_tokens=20, ignore_eos=True))[0]
        assert r.choices[0].text == want.text and r.usage.completion_tokens == 20
        assert r.choices[0].finish_reason == "length"
        extra = r.model_extra["eagle"]
        assert extra["verify_steps"] >= 1 and extra["tau"] >= 1.0


def test_chat_equals_the_offline_engine(server, client):
    offline = server[1]
    msgs = [{"role": "system", "content": "w5"}, {"role": "user", "content": "w1 w7"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0,
                                       extra_body={"ignore_eos": True,   # variables its template does not read
                                                   "chat_template_kwargs": {"enable_thinking": False}})
    want = offline.generate(msgs, SamplingParams(max_new_tokens=16, ignore_eos=True))[0]
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    as_it_stands = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1,
                                                  extra_body={"add_generation_prompt": False})
    assert as_it_stands.usage.prompt_tokens == r.usage.prompt_tokens - 3   # without "<s> assistant :"


def test_streaming_chat_and_completion(server, client):
    offline = server[1]
    want = offline.generate([PROMPTS[0]], SamplingParams(max_new_tokens=24, ignore_eos=True))[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-2].choices[0].finish_reason == "length"   # OpenAI's shape: usage in a last chunk of its own
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert all(c.usage is None for c in chunks[:-1])
    chat = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}],
                                               max_tokens=12, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True}))
    assert chat[0].choices[0].delta.role == "assistant" and chat[-1].choices[0].finish_reason == "length"
    assert len(chat) > 2
    running = list(client.completions.create(   # vLLM's continuous_usage_stats: the usage so far on every chunk
        model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    made = [c.usage.completion_tokens for c in running]
    assert all(c.usage.prompt_tokens == 3 for c in running) and made == sorted(made) and made[-1] == 24
    assert 0 < made[1] < 24


def test_the_responses_api_answers_as_chat_does(server, client):
    """OpenAI's Responses API through the official client: the same greedy text as the offline engine's chat,
    streamed as events that add up to it, cut as incomplete at max_output_tokens, and a bad field a 400 naming it."""
    import openai
    offline = server[1]
    msgs = [{"role": "system", "content": "w5"}, {"role": "user", "content": PROMPTS[1]}]
    want = offline.generate([msgs], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    common = dict(model=MODEL, instructions="w5", input=PROMPTS[1], max_output_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})
    r = client.responses.create(**common)
    assert r.id.startswith("resp_") and r.output_text == want.text and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 12
    assert r.usage.input_tokens == len(offline.encode(msgs)) and r.output[0].type == "message"
    events = list(client.responses.create(**common, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want.text
    assert events[-1].response.output_text == want.text and events[-1].response.usage.output_tokens == 12
    logged = dict(common, include=["message.output_text.logprobs"], top_logprobs=2)
    lp = client.responses.create(**logged).output[0].content[0].logprobs
    assert len(lp) == 12 and all(len(t.top_logprobs) == 2 and t.token for t in lp)
    streamed = [e for e in client.responses.create(**logged, stream=True) if e.type == "response.output_text.delta"]
    assert [t.token for e in streamed for t in e.logprobs] == [t.token for t in lp]
    with pytest.raises(openai.BadRequestError, match="max_output_tokens=500 is above") as e:
        client.responses.create(**common | {"max_output_tokens": 500})
    assert e.value.body["param"] == "max_output_tokens"


def test_stop_sequences(server, client):
    full = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = " ".join(full.split()[4:6])
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=30, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"
    assert r.choices[0].stop_reason == stop   # vLLM's fields: which stop ended it, and the tokens
    assert len(r.choices[0].model_extra["token_ids"]) == r.usage.completion_tokens
    assert len(r.choices[0].model_extra["prompt_token_ids"]) == r.usage.prompt_tokens
    chunks = [c for c in client.completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=30, temperature=0, stop=[stop], stream=True,
        extra_body={"ignore_eos": True}) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].stop_reason == stop
    kept = {"ignore_eos": True, "include_stop_str_in_output": True}   # vLLM's field: the stop string stays
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=30, temperature=0, stop=[stop],
                                  extra_body=kept)
    assert r.choices[0].text == full[: full.index(stop) + len(stop)] and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=30, temperature=0, stop=[stop], stream=True,
        extra_body=kept) if c.choices)
    assert streamed == r.choices[0].text


def test_vllms_further_sampling_fields_equal_the_offline_engine(server, client):
    """``min_tokens`` with stop ids, ``allowed_token_ids`` and ``truncate_prompt_tokens`` as vLLM's clients send
    them, on completions and chat: the same tokens as the offline engine given the same fields."""
    offline = server[1]
    fields = {"min_tokens": 6, "stop_token_ids": [9, 10, 11, 12], "allowed_token_ids": list(range(8, 40)),
              "truncate_prompt_tokens": 3}
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=0, extra_body=fields)
    want = offline.generate([PROMPTS[2]], SamplingParams(max_new_tokens=12, **fields))[0]
    assert r.choices[0].text == want.text and r.usage.prompt_tokens == 3
    assert r.usage.completion_tokens == len(want.token_ids) >= 6
    chat = [{"role": "user", "content": PROMPTS[1]}]
    r = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=12, temperature=0, extra_body=fields)
    want = offline.generate([chat], SamplingParams(max_new_tokens=12, **fields))[0]
    assert r.choices[0].message.content == want.text and r.usage.prompt_tokens == 3
    # vLLM's prompt_logprobs: on each completions choice, beside a chat's choices (tests/test_logprobs.py: values)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=2, extra_body={"prompt_logprobs": 1})
    listed = r.model_dump()["choices"][0]["prompt_logprobs"]
    assert listed[0] is None and len(listed) == r.usage.prompt_tokens and all(1 <= len(e) <= 2 for e in listed[1:])
    r = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=2, extra_body={"prompt_logprobs": 0})
    listed = r.model_dump()["prompt_logprobs"]
    assert listed[0] is None and len(listed) == r.usage.prompt_tokens and all(len(e) == 1 for e in listed[1:])


def test_tokenize_and_detokenize_as_vllm_answers_them(server, client):
    """A prompt's ids as a request would run them (a chat's count is its completion's prompt_tokens), and back."""
    offline = server[1]

    def post(route: str, body: dict, headers=AUTH) -> httpx.Response:
        return httpx.post(server[0] + route, json={"model": MODEL, **body}, headers=headers, timeout=60)
    r = post("/tokenize", {"prompt": PROMPTS[2]}).json()
    assert r == {"count": 5, "max_model_len": 128, "tokens": offline.codec.encode(PROMPTS[2]), "token_strs": None}
    chat = [{"role": "user", "content": PROMPTS[1]}]
    r = post("/tokenize", {"messages": chat, "return_token_strs": True}).json()
    ran = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=2)
    assert r["count"] == ran.usage.prompt_tokens and r["token_strs"][-3:] == ["<s>", "assistant", ":"]
    assert post("/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": offline.tokenizer.decode(r["tokens"])}
    for route, body, status, reason in [
            ("/tokenize", {"prompt": "w1", "messages": chat}, 400, "give one of prompt and messages"),
            ("/tokenize", {"messages": chat, "add_special_tokens": True}, 400, "add_special_tokens"),
            ("/tokenize", {"prompt": [1, 99]}, 400, "outside the vocabulary"),
            ("/tokenize", {"messages": chat, "chat_template": "{{ x }}"}, 400, "does not take a request's own"),
            ("/detokenize", {"tokens": [5, 64]}, 400, "ids [64] are outside the vocabulary"),
            ("/detokenize", {"tokens": "w1"}, 400, "tokens: Input should be a valid list"),
            ("/detokenize", {"model": "gpt-5", "tokens": [5]}, 404, "does not exist")]:
        got = post(route, body)
        assert got.status_code == status and reason in got.json()["error"]["message"], got.text
    assert post("/tokenize", {"prompt": "w1"}, headers={}).status_code == 401


BAD = {
    "malformed JSON": (b'{"model": "tiny-eagle", "prompt": ', 400, "not valid JSON"),
    "not an object": (b'["w1"]', 400, "JSON object"),
    "unknown model": ({"model": "gpt-5", "prompt": "w1"}, 404, "does not exist"),
    "missing prompt": ({"model": MODEL}, 400, "prompt"),
    "negative temperature": ({"model": MODEL, "prompt": "w1", "temperature": -1}, 400, "temperature"),
    "top_p zero": ({"model": MODEL, "prompt": "w1", "top_p": 0}, 400, "top_p"),
    "max_tokens over the cap": ({"model": MODEL, "prompt": "w1", "max_tokens": 100000}, 400, "cap"),
    "max_tokens zero": ({"model": MODEL, "prompt": "w1", "max_tokens": 0}, 400, "max_tokens"),
    "n above the cap": ({"model": MODEL, "prompt": "w1", "n": 17}, 400, "n"),
    "prompt over the context": ({"model": MODEL, "prompt": " ".join(["w1"] * 300)}, 400, "tokens"),
    "empty prompt": ({"model": MODEL, "prompt": ""}, 400, "empty"),
    "bad role (chat)": ({"model": MODEL, "messages": [{"role": "wizard", "content": "w1"}]}, 400, "role"),
    "no messages (chat)": ({"model": MODEL, "messages": []}, 400, "messages"),
    "negative seed": ({"model": MODEL, "prompt": "w1", "seed": -1}, 400, "seed"),
    "seed over 63 bits": ({"model": MODEL, "prompt": "w1", "seed": 2**64}, 400, "seed"),
    "huge top_k": ({"model": MODEL, "prompt": "w1", "top_k": 2**40}, 400, "top_k"),
    "huge top_k streamed": ({"model": MODEL, "prompt": "w1", "top_k": 2**40, "stream": True}, 400, "top_k"),
    "negative seed streamed (chat)": ({"model": MODEL, "messages": [{"role": "user", "content": "w1"}], "seed": -1,
                                       "stream": True}, 400, "seed"),
    "nested 100,000 deep": (b'{"model": "tiny-eagle", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400,
                            "nested"),
    "lone surrogate": (b'{"model": "tiny-eagle", "prompt": "a \\ud800 b"}', 400, "surrogate"),
    "body over the size limit": (b'{"model": "tiny-eagle", "prompt": "' + b"w1 " * 2_000_000 + b'"}', 413, "limit"),
    "prompt far over the context": ({"model": MODEL, "prompt": "w1 " * 1_000_000}, 400, "bytes"),
    "max_tokens past the context": ({"model": MODEL, "prompt": "w1 " * 100, "max_tokens": 60}, 400,
                                    "at most 29 more fit"),
    "max_tokens past the context streamed": ({"model": MODEL, "prompt": "w1 " * 100, "max_tokens": 60,
                                              "stream": True}, 400, "at most 29 more fit"),
    "a vLLM field it does not serve": ({"model": MODEL, "prompt": "w1", "use_beam_search": True}, 400,
                                       "not supported"),
    "min_tokens over max_tokens": ({"model": MODEL, "prompt": "w1", "min_tokens": 9, "max_tokens": 3}, 400,
                                   "min_tokens (9) is more than the output may hold"),
    "an allowed token outside the vocabulary": ({"model": MODEL, "prompt": "w1", "allowed_token_ids": [3, 64]}, 400,
                                                "allowed_token_ids: token id 64 is not in the vocabulary"),
    "a malformed json_schema (chat)": ({"model": MODEL, "messages": [{"role": "user", "content": "w1"}],
                                        "response_format": {"type": "json_schema", "json_schema": {
                                            "name": "x", "schema": {"type": "objekt"}}}}, 400,
                                       "response_format.json_schema.schema: not a valid JSON schema"),
    "a regex the grammar engine refuses": ({"model": MODEL, "prompt": "w1", "guided_regex": "(w1"}, 400,
                                           "guided_regex: the grammar engine cannot compile it"),
    "a logit bias outside the vocabulary": ({"model": MODEL, "prompt": "w1", "logit_bias": {"64": 1}}, 400,
                                            "logit_bias: token id 64 is not in the vocabulary"),
    "a penalty out of range": ({"model": MODEL, "prompt": "w1", "frequency_penalty": 2.5}, 400,
                               "frequency_penalty: Input should be less than or equal to 2"),
    "more messages than the context has tokens (chat)": (
        {"model": MODEL, "messages": [{"role": "user", "content": "w1"}] * 200}, 400, "200 messages"),
    "stream as a string": ({"model": MODEL, "prompt": "w1", "stream": "yes"}, 400, "valid boolean"),
    "the server's own argument as a template variable (chat)": (
        {"model": MODEL, "messages": [{"role": "user", "content": "w1"}],
         "chat_template_kwargs": {"tokenize": False}}, 400, "tokenize: not a template variable"),
    "continuing the final message with the assistant's turn opened (chat)": (
        {"model": MODEL, "messages": [{"role": "user", "content": "w1"}], "continue_final_message": True}, 400,
        "add_generation_prompt must be false"),
    "template variables on a completion": ({"model": MODEL, "prompt": "w1", "chat_template_kwargs": {"x": 1}}, 400,
                                           "chat_template_kwargs is a chat field"),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_requests_get_4xx_with_a_reason(server, kind):
    body, status, reason = BAD[kind]
    route = "/v1/chat/completions" if "chat" in kind else "/v1/completions"
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server[0] + route, content=data, headers={"content-type": "application/json", **AUTH}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert reason in err["message"] and err["type"]


def test_streaming_prompt_over_the_context_is_a_400(server):
    body = {"model": MODEL, "prompt": " ".join(["w1"] * 300), "stream": True}
    r = httpx.post(server[0] + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400 and "tokens" in r.json()["error"]["message"]


def test_disconnects_leak_no_slots(server, client):
    """100 clients drop mid-stream; then every slot is free, the engine is idle (no dropped stream still decodes)
    and a request is served whole."""
    base = server[0]
    body = {"model": MODEL, "prompt": "w3 w4", "max_tokens": 64, "temperature": 0, "stream": True,
            "ignore_eos": True}

    def served():
        r = client.completions.create(model=MODEL, prompt="w3 w4", max_tokens=32, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 32

    def drop():
        with httpx.stream("POST", base + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and '"text": "w' in line:
                    break  # leave mid-stream: the connection closes here

    threads = [threading.Thread(target=drop) for _ in range(100)]
    for i in range(0, 100, 10):
        for t in threads[i:i + 10]:
            t.start()
        for t in threads[i:i + 10]:
            t.join()
    deadline = time.time() + 30
    while time.time() < deadline:
        stats = httpx.get(base + "/stats", timeout=60).json()
        if stats["free_slots"] == 4 and stats["pending"] == 0:
            break
        time.sleep(0.2)
    assert stats["free_slots"] == 4 and stats["pending"] == 0, stats
    time.sleep(0.5)
    again = httpx.get(base + "/stats", timeout=60).json()
    assert (again["decode_passes"], again["decode_sequences"]) == (stats["decode_passes"], stats["decode_sequences"])
    health = httpx.get(base + "/health", timeout=60).json()
    assert (health["status"], health["running"], health["waiting"]) == ("ok", 0, 0), health
    served()


def test_requests_without_the_api_key_get_401(server):
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic test-key"}):
        r = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "w1"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    for scheme in ("bearer", "BEARER"):  # the scheme is case-insensitive
        r = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "w1", "max_tokens": 2},
                       headers={"authorization": f"{scheme} test-key"})
        assert r.status_code == 200, r.text


def test_32_concurrent_streams_complete_and_share_verify_passes(server):
    """A short version of ``bench/load.py serve`` (README has the 60 s run on the embedded pair)."""
    import asyncio

    import httpx as hx

    run_load = repo_scripts.load("bench/load.py").run_load
    base = server[0]
    before = hx.get(base + "/stats").json()
    result = asyncio.run(run_load(base + "/v1", MODEL, PROMPTS, clients=32, duration_s=8, max_tokens=16,
                                  api_key="test-key"))
    after = hx.get(base + "/stats").json()
    assert result["errors"] == 0 and result["malformed"] == 0 and result["completed"] >= 32, result
    batch = (after["decode_sequences"] - before["decode_sequences"]) / (after["decode_passes"] - before["decode_passes"])
    assert batch > 1.5 and after["free_slots"] == 4


def test_metrics_add_up_to_what_the_responses_report(server, client):
    """/metrics (Prometheus text, vLLM's names, no API key) grows by exactly what the responses carry. The answers
    are sampled and run their 12 tokens (no end-of-sequence stop), so each one speculates and adds to the tau
    histogram: one whose first sampled token ended it would run no verify step."""
    from test_metrics import samples
    base = server[0]
    before = samples(httpx.get(base + "/metrics", timeout=60).content)
    resps = [client.completions.create(model=MODEL, prompt=p, max_tokens=12, extra_body={"ignore_eos": True})
             for p in PROMPTS]
    after = samples(httpx.get(base + "/metrics", timeout=60).content)

    def grew(name):
        return after.get((name, ()), 0) - before.get((name, ()), 0)

    eagle = [r.model_extra["eagle"] for r in resps]
    assert all(e["verify_steps"] >= 1 for e in eagle)
    assert grew("vllm:prompt_tokens_total") == sum(r.usage.prompt_tokens for r in resps)
    assert grew("vllm:generation_tokens_total") == sum(r.usage.completion_tokens for r in resps)
    assert grew("vllm:spec_decode_num_accepted_tokens_total") == sum(e["accepted_draft_tokens"] for e in eagle)
    assert grew("vllm:spec_decode_num_drafts_total") == sum(e["verify_steps"] for e in eagle)
    assert grew("eagle_ray:tau_count") == len(resps)


@pytest.fixture(scope="module")
def two_replicas(server, tmp_path_factory):
    """A second app on the same Serve: two replicas behind /two, long answers allowed (8,000 tokens: the tiny
    target saved again with room for them, its weights the same)."""
    from ray import serve

    from eagle_ray.serve.app import build_app
    target = save_target(tmp_path_factory.mktemp("tiny-long"), max_positions=8192)
    cfg = json.loads(ServeConfig(engine={"target": str(target), "draft": server[3], "dtype": "float32",
                                         "max_batch_size": 4, "max_model_len": 8192,
                                         "tree": {"total_tokens": 8, "depth": 3, "top_k": 3}},
                                 model_name="two", num_replicas=2, num_cpus=0.25, max_tokens_cap=8000,
                                 default_max_tokens=16).model_dump_json())
    serve.run(build_app(cfg), name="eagle-two", route_prefix="/two", blocking=False)
    base = server[0] + "/two"
    wait_healthy(base, 300)
    yield base
    serve.delete("eagle-two")


def scrape(base: str) -> dict:
    from test_metrics import samples
    return samples(httpx.get(base + "/metrics", timeout=60).content)


def test_cancelled_streams_count_as_aborted_requests(two_replicas):
    """Clients that leave mid-stream (asking 8,000 tokens, seconds of work, gone after the first): /metrics counts
    their requests with ``finished_reason="abort"`` and the tokens they made (no counter moved before)."""
    base = two_replicas
    body = {"model": "two", "prompt": "w3 w4", "max_tokens": 8000, "temperature": 0, "stream": True,
            "ignore_eos": True}
    key = ("vllm:request_success_total", (("finished_reason", "abort"),))
    before = scrape(base)
    for _ in range(6):
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and any(c.get("text") for c in json.loads(line[6:])["choices"]):
                    break   # the first token's text: the connection closes here
    deadline = time.time() + 60
    while time.time() < deadline:
        after = scrape(base)
        if after.get(key, 0) - before.get(key, 0) >= 6:
            break
        time.sleep(1)
    assert after.get(key, 0) - before.get(key, 0) == 6
    assert 6 <= after[("vllm:generation_tokens_total", ())] - before.get(("vllm:generation_tokens_total", ()), 0) \
        < 6 * 8000


def test_every_scrape_of_a_two_replica_app_reads_its_totals(two_replicas):
    """Two replicas behind one route: every scrape, whichever replica answers it, reads the app's totals (each
    used to read its own registry, so counters went up and down between scrapes)."""
    from eagle_ray.serve.metrics import PUSH_EVERY_S
    base = two_replicas
    key = ("vllm:request_success_total", (("finished_reason", "length"),))
    before = scrape(base).get(key, 0)
    for i in range(8):   # spread over both replicas by Serve's router
        r = httpx.post(base + "/v1/completions", json={"model": "two", "prompt": f"w{i} w2", "max_tokens": 4,
                                                      "ignore_eos": True}, timeout=120)
        assert r.status_code == 200, r.text
    deadline = time.time() + 6 * PUSH_EVERY_S   # until each replica has sent its counts (a push may be late)
    while scrape(base).get(key, 0) - before != 8 and time.time() < deadline:
        time.sleep(0.5)
    seen = [scrape(base).get(key, 0) - before for _ in range(10)]
    assert seen == [8] * 10, seen
