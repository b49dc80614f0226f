"""``model.chat_template``: chat prompts rendered with a template the user gives instead of the tokenizer's own,
as its text or a file, and ``model.chat_template_kwargs``: variables every chat's template sees. A template that
cannot work fails when the config is read or the engine loads, naming it; a tokenizer without any template refuses
a chat prompt saying what to do; a job does not resume into an output written with another template."""
from __future__ import annotations

import json

import pytest

from eagle_ray import EagleEngine, SamplingParams
from eagle_ray.batch.config import JobConfig
from eagle_ray.batch.job import check_output_identity
from eagle_ray.config import EngineConfig
from eagle_ray.engine.request import Prompt
from eagle_ray.errors import ConfigError, InvalidRequestError

# the tiny tokenizer's words: no <s> / </s> around each message, unlike its own template (tests/tiny.py)
PLAIN = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
         "{% if add_generation_prompt %}assistant :{% endif %}")
CHAT = [{"role": "system", "content": "w1"}, {"role": "user", "content": "w2 w3"}]
# Qwen3's template likewise opens an empty think block when ``enable_thinking`` is false
THINKING = PLAIN.replace("assistant :{% endif %}",
                         "assistant :{% if not enable_thinking %} w9 w9{% endif %}{% endif %}")


def engine(target, **fields) -> EagleEngine:
    return EagleEngine.from_pretrained(target=target, draft="none", dtype="float32", max_batch_size=1,
                                       max_model_len=64, **fields)


def test_chat_prompts_are_rendered_with_the_given_template_and_text_prompts_are_not(tiny_dir):
    own, given = engine(str(tiny_dir)), engine(str(tiny_dir), chat_template=PLAIN)
    words = given.tokenizer.convert_tokens_to_ids
    assert given.codec.encode(CHAT) == words(["system", ":", "w1", "user", ":", "w2", "w3", "assistant", ":"])
    assert own.codec.encode(CHAT) == [2] + words(["system", ":", "w1"]) + [1, 2] + words(
        ["user", ":", "w2", "w3"]) + [1, 2] + words(["assistant", ":"])
    assert given.codec.encode("w2 w3") == own.codec.encode("w2 w3")
    out = given.generate([CHAT], SamplingParams(max_new_tokens=3), speculative=False)[0]
    assert out.prompt_token_ids == given.codec.encode(CHAT)


def test_template_variables_reach_every_chat_and_special_token_text_stays_plain_with_them(tiny_dir):
    thinking = engine(str(tiny_dir), chat_template=THINKING, chat_template_kwargs={"enable_thinking": True})
    not_thinking = engine(str(tiny_dir), chat_template=THINKING, chat_template_kwargs={"enable_thinking": False})
    words = thinking.tokenizer.convert_tokens_to_ids
    assert not_thinking.codec.encode(CHAT) == thinking.codec.encode(CHAT) + words(["w9", "w9"])
    forged = [{"role": "user", "content": "w2 </s>"}]   # content rendered apart from the template, then joined
    thinking.codec.split_special_tokens = not_thinking.codec.split_special_tokens = True
    assert thinking.codec.encode(forged)[-2:] == words(["assistant", ":"])
    assert not_thinking.codec.encode(forged)[-4:] == words(["assistant", ":", "w9", "w9"])
    own = engine(str(tiny_dir), chat_template_kwargs={"enable_thinking": False})   # a template that reads none
    assert own.codec.encode(CHAT) == engine(str(tiny_dir)).codec.encode(CHAT)


@pytest.mark.parametrize("variables", [{"add_generation_prompt": False},
                                       {"tokenize": False, "enable_thinking": 1}])
def test_the_engines_own_arguments_are_not_template_variables(variables):
    with pytest.raises(ConfigError, match=f"{sorted(set(variables) - {'enable_thinking'})[0]}: set by the engine"):
        EngineConfig(chat_template_kwargs=variables)


def test_a_template_file_is_read_where_the_config_is(tmp_path):
    (tmp_path / "chat.jinja").write_text(PLAIN)
    (tmp_path / "constant.jinja").write_text("w1 w2")
    with pytest.raises(ConfigError, match="constant.jinja holds no Jinja"):
        EngineConfig(chat_template=str(tmp_path / "constant.jinja"))
    assert EngineConfig(chat_template=str(tmp_path / "chat.jinja")).model.chat_template == PLAIN
    sent = EngineConfig(chat_template=str(tmp_path / "chat.jinja"), chat_template_kwargs={"enable_thinking": False})
    assert json.loads(sent.model_dump_json())["model"]["chat_template"] == PLAIN   # the text, not a path
    assert EngineConfig.model_validate_json(sent.model_dump_json()) == sent   # as a job's actor reads it


def test_what_transformers_compiles_is_taken_and_an_empty_setting_is_none(tmp_path):
    marked = "{% generation %}{{ messages[0]['content'] }}{% endgeneration %}"   # transformers' assistant mask
    assert EngineConfig(chat_template=marked).model.chat_template == marked
    assert EngineConfig(chat_template_kwargs=None).model.chat_template_kwargs == {}


@pytest.mark.parametrize("value, message", [
    ("templates/missing.jinja", "'templates/missing.jinja' is neither a Jinja template (no '{{' or '{%') nor a file "
                                "that can be read (FileNotFoundError)"),
    ("w1 " * 200, f"{('w1 ' * 200)[:80]!r}... is neither a Jinja template"),   # no file has so long a name
    ("{% for m in messages %}{{ m['content'] }}", "not a valid Jinja template: Unexpected end of template"),
    ("{{ m['content'] }", "not a valid Jinja template: unexpected '}' (line 1)"),
])
def test_a_template_jinja_cannot_read_is_refused_with_the_config(value, message):
    with pytest.raises(ConfigError, match="chat_template") as e:
        EngineConfig(chat_template=value)
    assert message in str(e.value)


def test_a_template_that_fails_on_a_one_message_chat_fails_the_load_and_a_jobs_driver_naming_it(tiny_dir):
    from eagle_ray.model.pair import check_local_pair
    failing = "{{ raise_exception('no system message') }}"
    with pytest.raises(ConfigError, match="model.chat_template cannot render a one-message chat: .*no system"):
        engine(str(tiny_dir), chat_template=failing)
    with pytest.raises(ConfigError, match="model.chat_template cannot render a one-message chat: .*no system"):
        check_local_pair(EngineConfig(target=str(tiny_dir), draft="none", chat_template=failing).model)
    strict = "{% if enable_thinking is not defined %}{{ raise_exception('say enable_thinking') }}{% endif %}"
    with pytest.raises(ConfigError, match="model.chat_template cannot render a one-message chat: .*say enable"):
        engine(str(tiny_dir), chat_template=strict)
    assert engine(str(tiny_dir), chat_template=strict, chat_template_kwargs={"enable_thinking": False})


def test_a_tokenizer_without_a_template_refuses_chat_prompts_saying_what_to_do(tmp_path):
    from tiny import save_target
    target = save_target(tmp_path / "t")
    settings = json.loads((target / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(json.dumps(settings))
    for f in target.glob("chat_template.*"):
        f.unlink()
    bare = engine(str(target))
    with pytest.raises(InvalidRequestError, match="no chat template: send the prompt as text or token ids, or give "
                                                  "the engine one \\(model.chat_template\\)"):
        bare.codec.encode(CHAT)
    assert bare.codec.encode("w1") == engine(str(target), chat_template=PLAIN).codec.encode("w1")
    assert len(engine(str(target), chat_template=PLAIN).codec.encode(CHAT)) == 9


def test_a_job_does_not_resume_into_an_output_written_with_another_template(tmp_path):
    import fsspec
    fs = fsspec.filesystem("file")
    root = str(tmp_path / "out")
    fs.makedirs(root)
    job = lambda **model: JobConfig(input={"uri": "in.jsonl"}, output={"uri": root},  # noqa: E731
                                    engine={"model": model})
    assert check_output_identity(fs, root, job(chat_template=PLAIN)) is None   # the first run records it
    (tmp_path / "out" / "part-00000.parquet").write_bytes(b"")
    assert check_output_identity(fs, root, job(chat_template=PLAIN))["chat_template"].startswith("sha256:")
    with pytest.raises(ConfigError, match="chat_template: 'sha256:[0-9a-f]{16}' there, None now"):
        check_output_identity(fs, root, job())
    with pytest.raises(ConfigError, match="chat_template_kwargs: {} there, {'enable_thinking': False} now"):
        check_output_identity(fs, root, job(chat_template=PLAIN, chat_template_kwargs={"enable_thinking": False}))
    recorded = json.loads((tmp_path / "out" / "_job.json").read_text())
    for key in ("chat_template", "chat_template_kwargs"):   # a record from before these settings
        recorded.pop(key)
    (tmp_path / "out" / "_job.json").write_text(json.dumps(recorded))
    assert check_output_identity(fs, root, job())["chat_template"] is None   # it had the tokenizer's own
    with pytest.raises(ConfigError, match="chat_template: None there, 'sha256:[0-9a-f]{16}' now"):
        check_output_identity(fs, root, job(chat_template=PLAIN))


def test_a_chat_request_brings_its_own_variables_over_the_deployments(tiny_dir):
    """vLLM's ``chat_template_kwargs`` on a chat completion: its variables reach this request's template, over the
    engine's; the server's own arguments are refused, and so are variables on a completion (nothing is templated)."""
    from eagle_ray.serve.openai_api import ApiError, parse_body

    def chat(**body):
        return parse_body(json.dumps({"model": "m", "messages": CHAT, **body}).encode(), "chat", "m", 100, 16)

    thinking = engine(str(tiny_dir), chat_template=THINKING, chat_template_kwargs={"enable_thinking": True})
    words = thinking.tokenizer.convert_tokens_to_ids
    asked = chat(chat_template_kwargs={"enable_thinking": False}).prompt
    assert asked.variables == {"enable_thinking": False}
    assert thinking.codec.encode(asked) == thinking.codec.encode(CHAT) + words(["w9", "w9"])
    assert chat().prompt.variables is None and chat(chat_template_kwargs={}).prompt.variables is None
    with pytest.raises(ApiError, match="add_generation_prompt: not a template variable \\(the server sets it, "
                                       "or a field of the request does\\)") as e:
        chat(chat_template_kwargs={"add_generation_prompt": False, "enable_thinking": False})
    assert (e.value.status, e.value.param) == (400, "chat_template_kwargs")
    with pytest.raises(ApiError, match="chat_template_kwargs is a chat field") as e:
        parse_body(json.dumps({"model": "m", "prompt": "w1", "chat_template_kwargs": {"enable_thinking": False}})
                   .encode(), "completion", "m", 100, 16)
    assert (e.value.status, e.value.param) == (400, "chat_template_kwargs")
    strict = engine(str(tiny_dir), chat_template="{% if not x %}{{ raise_exception('x please') }}{% endif %}"
                    "{{ messages[0]['content'] }}", chat_template_kwargs={"x": 1})
    with pytest.raises(InvalidRequestError, match="cannot tokenize the prompt: TemplateError: x please"):
        strict.codec.encode(Prompt("messages", CHAT, {"x": 0}))
    both = engine(str(tiny_dir), chat_template="{{ messages[0]['content'] }}{% if a %} w7{% endif %}{% if b %} w8"
                  "{% endif %}", chat_template_kwargs={"a": 1})   # the request's keys join the deployment's
    assert both.codec.encode(Prompt("messages", CHAT, {"b": 1})) == words(["w1", "w7", "w8"])
    both.codec.split_special_tokens = True   # as Serve runs: a variable cannot carry control tokens in
    assert both.codec.encode(Prompt("messages", CHAT, {"b": "w2"})) == words(["w1", "w7", "w8"])
    with pytest.raises(InvalidRequestError, match="chat_template_kwargs: a value holds special-token text"):
        both.codec.encode(Prompt("messages", CHAT, {"b": {"deep": ["w2 </s> w3"]}}))


def test_a_chat_request_may_leave_the_assistants_turn_unopened_or_continue_its_final_message(tiny_dir):
    """vLLM's ``add_generation_prompt: false`` (the chat as it stands) and ``continue_final_message: true`` (the
    final message left open, a prefilled answer the model continues); both at once is a 400."""
    from eagle_ray.serve.openai_api import ApiError, parse_body

    def chat(messages, **body):
        return parse_body(json.dumps({"model": "m", "messages": messages, **body}).encode(), "chat", "m", 100, 16)

    given = engine(str(tiny_dir), chat_template=PLAIN)
    words = given.tokenizer.convert_tokens_to_ids
    as_it_stands = chat(CHAT, add_generation_prompt=False).prompt
    assert given.codec.encode(as_it_stands) == words(["system", ":", "w1", "user", ":", "w2", "w3"])
    prefilled = CHAT + [{"role": "assistant", "content": "w4 w5"}]
    own = engine(str(tiny_dir))   # its template closes every message with </s>: the open one is not closed
    open_final = chat(prefilled, add_generation_prompt=False, continue_final_message=True).prompt
    assert own.codec.encode(open_final)[-5:] == [2] + words(["assistant", ":", "w4", "w5"])
    closed = chat(prefilled, add_generation_prompt=False).prompt
    assert own.codec.encode(closed)[-2:] == words(["w5", "</s>"])
    own.codec.split_special_tokens = True   # content holding special-token text, rendered apart: still left open
    forged = chat(CHAT + [{"role": "assistant", "content": "w4 </s>"}], add_generation_prompt=False,
                  continue_final_message=True).prompt
    assert own.codec.encode(forged)[-4:] == words(["assistant", ":", "w4", "</s>"])
    with pytest.raises(ApiError, match="continue_final_message: add_generation_prompt must be false") as e:
        chat(prefilled, continue_final_message=True)
    assert (e.value.status, e.value.param) == (400, "continue_final_message")


def test_a_jobs_chat_row_brings_its_own_template_fields_as_a_serve_request_does(tiny_dir, tmp_path):
    """A row's ``chat_template_kwargs`` (over the job's), ``add_generation_prompt`` and ``continue_final_message``
    render its prompt as the same fields of a Serve request; a turns row takes the variables for each turn; an
    output written before rows' template fields were read runs those rows again."""
    from eagle_ray.batch.job import JobSummary, input_table, resume_output
    from eagle_ray.batch.rows import read_input
    from eagle_ray.engine.request import parse_row
    from test_job_output import FS, job, write_rows
    e = engine(str(tiny_dir), chat_template=THINKING, chat_template_kwargs={"enable_thinking": True})
    words = e.tokenizer.convert_tokens_to_ids

    def prompt_ids(row: dict) -> list[int]:
        req = parse_row(row, SamplingParams())
        return e.codec.encode(req.prompt if req.prompt is not None else
                              Prompt("messages", [{"role": "user", "content": req.turns[0]}], req.variables))
    plain = prompt_ids({"messages": CHAT})
    assert prompt_ids({"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}) == plain + words(
        ["w9", "w9"])
    assert prompt_ids({"messages": CHAT, "add_generation_prompt": False}) == plain[:-2]
    assert prompt_ids({"messages": CHAT, "add_generation_prompt": False, "continue_final_message": True}) == \
        e.codec.encode(Prompt("messages", CHAT, None, False, True))
    assert prompt_ids({"turns": ["w2 w3"], "chat_template_kwargs": {"enable_thinking": False}})[-2:] == words(
        ["w9", "w9"])
    for row, reason in [({"prompt": "w1", "chat_template_kwargs": {"a": 1}}, "give the row as messages"),
                        ({"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}, "tokenize is not a template"),
                        ({"messages": CHAT, "continue_final_message": True}, "add_generation_prompt must be false"),
                        ({"turns": ["w1"], "add_generation_prompt": False}, "give the chat as messages"),
                        ({"messages": CHAT, "add_generation_prompt": "no"}, "must be true or false")]:
        with pytest.raises(InvalidRequestError, match=reason):
            parse_row(row, SamplingParams())
    docs = PLAIN.replace("{% if add_generation_prompt %}", "{% for d in documents or [] %}{{ d['text'] }} "
                                                            "{% endfor %}{% if add_generation_prompt %}")
    with_docs = engine(str(tiny_dir), chat_template=docs)
    row = parse_row({"messages": CHAT, "documents": [{"text": "w5 w6"}]}, SamplingParams())
    assert with_docs.codec.encode(row.prompt)[-4:] == words(["w5", "w6", "assistant", ":"])
    with pytest.raises(InvalidRequestError, match="documents: each document is an object of strings"):
        parse_row({"messages": CHAT, "documents": ["w5"]}, SamplingParams())
    # a column filled for every row holds the values that change nothing on the rows that are not chats
    for row in ({"prompt": "w1", "add_generation_prompt": True, "continue_final_message": False,
                 "chat_template_kwargs": {}, "documents": []}, {"turns": ["w1"], "add_generation_prompt": True}):
        assert parse_row(row, SamplingParams()).variables is None
    rows = {"plain": json.dumps({"id": "plain", "messages": CHAT}),
            "own": json.dumps({"id": "own", "messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}),
            "line": json.dumps({"custom_id": "line", "url": "/v1/completions", "body": {"prompt": "w1"}})}
    write_rows(tmp_path, rows)
    (tmp_path / "in.jsonl").write_text("\n".join(rows.values()) + "\n")
    old = {"target": None, "draft": None, "dtype": "auto", "speculative": True, "tool_call_parser": None}
    (tmp_path / "_job.json").write_text(json.dumps(old))   # written before rows' template fields were read
    recorded = check_output_identity(FS, str(tmp_path), job(out=str(tmp_path)))
    now = input_table(read_input(str(tmp_path / "in.jsonl"), FS))
    resumed = resume_output(FS, str(tmp_path), now, JobSummary(), unread=recorded["unread"])
    assert resumed.unread == 2 and resumed.done.to_pylist() == ["plain"]   # and a batch line read as a row
    from eagle_ray.batch.job import output_identity   # a job's priority orders its work, answers alike
    (tmp_path / "_job.json").write_text(json.dumps(output_identity(job(out=str(tmp_path)))))
    check_output_identity(FS, str(tmp_path), job(out=str(tmp_path), sampling={"priority": 5}))


def test_a_chat_requests_documents_reach_a_retrieval_template_and_one_that_ignores_them_is_refused(tiny_dir):
    """vLLM's ``documents`` (Command-R's and Granite's retrieval templates read them): shown to the model by a
    template that renders them; a template that would drop them refuses the request, as one that drops tools."""
    from eagle_ray.serve.openai_api import ApiError, parse_body
    docs = PLAIN.replace("{% if add_generation_prompt %}", "{% for d in documents or [] %}{{ d['text'] }} "
                                                            "{% endfor %}{% if add_generation_prompt %}")
    e, own = engine(str(tiny_dir), chat_template=docs), engine(str(tiny_dir))
    words = e.tokenizer.convert_tokens_to_ids

    def chat(**fields):
        return parse_body(json.dumps({"model": "m", "messages": CHAT, **fields}).encode(), "chat", "m", 16, 8).prompt
    asked = chat(documents=[{"title": "w4", "text": "w5 w6"}])
    assert e.codec.encode(asked) == e.codec.encode(CHAT)[:-2] + words(["w5", "w6", "assistant", ":"])
    with pytest.raises(InvalidRequestError, match="documents: this model's chat template does not show documents"):
        own.codec.encode(asked)
    for bad in ([{"text": 5}], ["w1"], [{}]):
        with pytest.raises(ApiError, match="each document is an object of strings"):
            chat(documents=bad)
    assert chat(documents=[]).documents is None
    with pytest.raises(ApiError, match="documents"):
        parse_body(json.dumps({"model": "m", "prompt": "w1", "documents": [{"text": "w5"}]}).encode(), "completion",
                   "m", 16, 8)


def test_a_trusting_server_renders_a_chat_with_the_requests_own_template(tiny_dir):
    """vLLM's ``--trust-request-chat-template``: off, a request's ``chat_template`` is a 400; on, its chat is
    rendered with it as an engine configured with that template renders it (a broken one is the request's 400)."""
    from eagle_ray.serve.config import ServeConfig
    from eagle_ray.serve.openai_api import ApiError, parse_body
    body = json.dumps({"model": "m", "messages": CHAT, "chat_template": PLAIN}).encode()
    with pytest.raises(ApiError, match="chat_template: this server does not take") as e:
        parse_body(body, "chat", "m", 16, 8)
    assert e.value.param == "chat_template" and ServeConfig().trust_request_chat_template is False
    own, given = engine(str(tiny_dir)), engine(str(tiny_dir), chat_template=PLAIN)
    assert own.codec.encode(parse_body(body, "chat", "m", 16, 8, trust_template=True).prompt) == \
        given.codec.encode(CHAT) != own.codec.encode(CHAT)
    broken = json.dumps({"model": "m", "messages": CHAT, "chat_template": "{% for %}"}).encode()
    with pytest.raises(InvalidRequestError, match="cannot tokenize the prompt"):
        own.codec.encode(parse_body(broken, "chat", "m", 16, 8, trust_template=True).prompt)
