"""A reasoning model's thinking apart from its answer, as vLLM's ``--reasoning-parser`` returns it: whole
responses split once; streams split delta by delta to the same two texts however the deltas fall, a marker split
across deltas held back; tool calls read from the answer alone; structured output left whole. The streaming path is
the Serve app's own (``_sse``) over a queue that replays deltas."""
import asyncio
import itertools
import json
from types import SimpleNamespace

import pytest

from eagle_ray.engine.engine import RequestOutput
from eagle_ray.engine.queue import StreamDelta
from eagle_ray.serve.choices import ChoiceShape, PromptChoices
from eagle_ray.serve.openai_api import ApiError, parse_body
from eagle_ray.engine.reasoning import ReasoningStream, split_reasoning, thinking_mode

THOUGHT = "<think>\nThe user wants Paris' weather.\n</think>\n\nLet me check."
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
WEATHER = {"type": "function", "function": {"name": "get_weather"}}
QWEN3_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"   # the output may open a thinking
R1_PROMPT = "<｜User｜>hi<｜Assistant｜><think>\n"                            # the template opened it
OFF_PROMPT = "<|im_start|>assistant\n<think>\n\n</think>\n\n"              # thinking turned off


@pytest.mark.parametrize("parser, prompt, constrained, mode", [
    ("qwen3", QWEN3_PROMPT, False, "if_opened"), ("qwen3", R1_PROMPT, False, "until_close"),
    ("qwen3", OFF_PROMPT, False, "if_opened"), ("deepseek_r1", R1_PROMPT, False, "until_close"),
    ("deepseek_r1", QWEN3_PROMPT, False, "until_close"), ("deepseek_r1", OFF_PROMPT, False, "answer"),
    ("qwen3", R1_PROMPT, True, "answer"), ("deepseek_r1", R1_PROMPT, True, "answer"),
])
def test_a_requests_mode_comes_from_the_end_of_its_prompt(parser, prompt, constrained, mode):
    assert thinking_mode(parser, prompt, constrained) == mode


@pytest.mark.parametrize("mode, text, thought, answer", [
    ("if_opened", THOUGHT, "\nThe user wants Paris' weather.\n", "\n\nLet me check."),   # text kept as vLLM's
    ("if_opened", "Paris is sunny.", None, "Paris is sunny."),                    # enable_thinking: false
    ("if_opened", "<think>\nStill thinking when cut", "\nStill thinking when cut", None),
    ("if_opened", "Sunny</think> today", None, "Sunny</think> today"),            # thinking never opened
    ("until_close", "The template opened it.\n</think>\n\nSunny.", "The template opened it.\n", "\n\nSunny."),
    ("until_close", THOUGHT, "\nThe user wants Paris' weather.\n", "\n\nLet me check."),
    ("until_close", "Cut while thinking", "Cut while thinking", None),
    ("answer", THOUGHT, None, THOUGHT),
])
def test_a_whole_output_splits_into_thinking_and_answer(mode, text, thought, answer):
    assert split_reasoning(text, mode) == (thought, answer)


def streamed(mode: str, pieces: list[str], markers=("<think>", "</think>")) -> tuple[str | None, str | None]:
    s, thought, answer = ReasoningStream(mode, markers), "", ""
    for i, piece in enumerate(pieces):
        t, a = s.feed(piece, final=i == len(pieces) - 1)
        assert t is None or a is None or markers[1] in "".join(pieces[: i + 1])   # one side, but at the marker
        thought, answer = thought + (t or ""), answer + (a or "")
    return thought or None, answer or None


@pytest.mark.parametrize("mode", ["if_opened", "until_close", "answer"])
@pytest.mark.parametrize("text", [THOUGHT, "Paris is sunny.", "<think>x</thi", "\n<think></think>\n\nA", "<th"])
def test_a_stream_splits_as_the_whole_output_however_its_deltas_fall(mode, text):
    """Every way of cutting the text into three deltas (and each character alone)."""
    whole = split_reasoning(text, mode)
    for i, j in itertools.combinations(range(len(text) + 1), 2):
        assert streamed(mode, [text[:i], text[i:j], text[j:]]) == whole, (i, j)
    assert streamed(mode, list(text) + [""]) == whole


@pytest.mark.parametrize("text, thought, answer", [
    ("[THINK]Paris, in June.[/THINK]Sunny.", "Paris, in June.", "Sunny."),
    ("Sunny.", None, "Sunny."),                       # no thinking opened
    ("[THINK]still thinking", "still thinking", None),  # cut while thinking
    ("<think>x</think>y", None, "<think>x</think>y")])  # another model's markers are text
def test_magistrals_thinking_splits_on_its_own_markers_whole_and_streamed(text, thought, answer):
    from eagle_ray.engine.reasoning import markers_of
    markers = markers_of("mistral")
    assert thinking_mode("mistral", "[INST]hi[/INST]") == "if_opened"
    assert thinking_mode("mistral", "[INST]hi[/INST][THINK]") == "until_close"
    system = "[SYSTEM_PROMPT]Think first, in [THINK] ... [/THINK].[/SYSTEM_PROMPT][INST]hi[/INST]"
    assert thinking_mode("mistral", system) == "if_opened"   # the system prompt's markers are not the turn's
    # its markers are control tokens: a chat under it keeps special tokens' text, or they would vanish
    assert chat({}, reasoning_parser="mistral").params.skip_special_tokens is False
    assert chat({}, reasoning_parser="qwen3").params.skip_special_tokens is True
    assert split_reasoning(text, "if_opened", markers) == (thought, answer)
    for i, j in itertools.combinations(range(len(text) + 1), 2):
        assert streamed("if_opened", [text[:i], text[i:j], text[j:]], markers) == (thought, answer), (i, j)


def chat(body, **parsers):
    body = {"model": "m", "messages": [{"role": "user", "content": "w1"}], **body}
    return parse_body(json.dumps(body).encode(), "chat", "m", 100, 16, **parsers)


def test_a_chat_carries_the_parser_and_its_thinking_fields():
    got = chat({"include_reasoning": False, "reasoning_effort": "low"}, reasoning_parser="qwen3")
    assert got.reasoning == "qwen3" and got.body.include_reasoning is False
    assert got.prompt.variables == {"reasoning_effort": "low"}       # to the template, as vLLM hands it
    completion = parse_body(b'{"model": "m", "prompt": "w1"}', "completion", "m", 100, 16,
                            reasoning_parser="qwen3")
    assert completion.reasoning is None
    for field, value in [("include_reasoning", False), ("reasoning_effort", "high")]:
        with pytest.raises(ApiError, match=f"{field} is a chat field"):
            parse_body(json.dumps({"model": "m", "prompt": "w1", field: value}).encode(), "completion", "m", 100, 16)


def auto_tools():
    """A chat's tools read by the hermes parser (``tool_choice`` auto)."""
    return chat({"tools": [WEATHER]}, tool_parser="hermes").tools


class Prompted:
    """A tokenizer whose decoding of any prompt is ``text`` (the end of a templated prompt), and whose thinking
    markers are one token each (``markers``) or spelled a character a token."""
    MARKERS = {900: "<think>", 901: "</think>"}

    def __init__(self, text: str, markers: bool = False):
        self.text, self.markers = text, markers

    def encode(self, text, add_special_tokens=True):
        ids = {v: k for k, v in self.MARKERS.items()}
        return [ids[text]] if self.markers and text in ids else [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        ids = list(ids)
        return self.MARKERS[ids[0]] if len(ids) == 1 and ids[0] in self.MARKERS else self.text


def shape_for(prompt: str = QWEN3_PROMPT, tools=None, parser="qwen3", constrained=False, include=True,
              markers=False, token_ids=False, prefix=""):
    return ChoiceShape("chat", bool(prefix), None, SimpleNamespace(tokenizer=Prompted(prompt, markers)), tools, True,
                       parser, constrained, include, token_ids=token_ids, prefix=prefix)


def output(text: str) -> RequestOutput:
    return RequestOutput("r", [1, 2], list(range(len(text))), text, "stop")


def test_a_whole_chat_answer_carries_the_thinking_and_calls_from_the_answer_alone():
    seqs = [SimpleNamespace(prompt_ids=[1, 2])]
    choice = shape_for(tools=auto_tools()).choice(0, PromptChoices(seqs, ""), output(THOUGHT + CALL), "stop")
    message = choice["message"]
    assert message["reasoning_content"] == message["reasoning"] == "\nThe user wants Paris' weather.\n"
    assert message["content"] == "\n\nLet me check." and choice["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    plain = shape_for().choice(0, PromptChoices(seqs, ""), output("Sunny."), "stop")
    assert plain["message"] == {"role": "assistant", "content": "Sunny.", "reasoning_content": None,
                                "reasoning": None}
    opened = shape_for(R1_PROMPT).choice(0, PromptChoices(seqs, ""), output("Hmm.</think>Sunny."), "stop")
    assert (opened["message"]["reasoning"], opened["message"]["content"]) == ("Hmm.", "Sunny.")
    hidden = shape_for(include=False).choice(0, PromptChoices(seqs, ""), output(THOUGHT), "stop")
    assert hidden["message"]["reasoning"] is None and hidden["message"]["content"] == "\n\nLet me check."
    cut = shape_for(tools=auto_tools()).choice(0, PromptChoices(seqs, ""), output("<think>still"), "length")
    assert cut["message"] == {"role": "assistant", "content": None, "reasoning_content": "still",
                              "reasoning": "still"} and cut["finish_reason"] == "length"
    schema = shape_for(constrained=True).choice(0, PromptChoices(seqs, ""), output('{"a": 1}'), "stop")
    assert schema["message"] == {"role": "assistant", "content": '{"a": 1}', "reasoning_content": None,
                                 "reasoning": None}   # the same keys under structured output
    # where the markers are tokens, structured output waits for the thinking (speculative/grammar.py): it splits
    gated = shape_for(R1_PROMPT, constrained=True, markers=True).choice(
        0, PromptChoices(seqs, ""), output('Hmm.</think>{"a": 1}'), "stop")
    assert (gated["message"]["reasoning"], gated["message"]["content"]) == ("Hmm.", '{"a": 1}')


class ReplayQueue:
    """Stands in for the replica's RequestQueue: each sequence's stream is the deltas given."""

    def __init__(self, deltas):
        self.deltas = deltas

    async def astream(self, seq):
        for d in self.deltas:
            yield d


def sse_chunks(pieces: list[str], tools=None, stream_options=None, reason: str = "stop", **shape) -> list[dict]:
    from eagle_ray.serve.app import EagleServer
    text = "".join(pieces)
    deltas = [StreamDelta("r", p, i + 1) for i, p in enumerate(pieces[:-1])]
    deltas.append(StreamDelta("r", pieces[-1], len(pieces), True,
                              RequestOutput("r", [1, 2], list(range(len(text))), text, reason)))
    server = SimpleNamespace(cfg=SimpleNamespace(model_name="m"), queue=ReplayQueue(deltas))
    body = SimpleNamespace(stream_options=stream_options)
    seqs = [SimpleNamespace(prompt_ids=[1, 2], logprobs=None, output_ids=[], stops=None)]
    sse = EagleServer.func_or_class._sse(server, body, [PromptChoices(seqs, "")], shape_for(tools=tools, **shape),
                                         "rid")

    async def collect():
        return [line async for line in sse]
    lines = asyncio.run(collect())
    assert lines[-1] == "data: [DONE]\n\n"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def test_a_chat_echo_streams_the_last_message_first_and_answers_whole_with_it_in_front():
    chunks = sse_chunks(["Sun", "ny."], parser=None, prefix="It is")
    assert [c["choices"][0]["delta"] for c in chunks] == [{"role": "assistant", "content": "It is"},
                                                          {"content": "Sun"}, {"content": "ny."}, {}]
    seqs = [SimpleNamespace(prompt_ids=[1, 2])]
    whole = shape_for(parser=None, prefix="It is").choice(0, PromptChoices(seqs, ""), output("Sunny."), "stop")
    assert whole["message"] == {"role": "assistant", "content": "It isSunny."}


def test_vllms_chat_echo_takes_the_last_message_where_it_has_the_answers_role():
    from eagle_ray.serve.openai_api import parse_body

    def echoed(**body) -> str:
        req = parse_body(json.dumps({"model": "m", **body}).encode(), "chat", "m", 100, 16)
        return req.body.echoed(req.prompt.value)
    user = {"role": "user", "content": "w1"}
    prefill = {"role": "assistant", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}
    assert echoed(messages=[user, prefill], echo=True, add_generation_prompt=False,
                  continue_final_message=True) == "Hi\nthere"   # text parts joined as the prompt joins them
    assert echoed(messages=[user, prefill], echo=True) == "Hi\nthere"
    assert echoed(messages=[user], echo=True) == ""   # the assistant's turn opened: no echo
    assert echoed(messages=[user], echo=True, add_generation_prompt=False) == "w1"   # its own role
    assert echoed(messages=[user, prefill]) == ""


def test_a_stream_names_its_stop_and_with_return_token_ids_its_prompts_and_outputs_ids():
    """vLLM's ``stop_reason`` on the finishing chunk; ``return_token_ids``: the prompt's ids on a choice's first
    chunk (beside the choices, for chat), the output's on its finishing chunk (the deltas vLLM sends, added up)."""
    chunks = sse_chunks(["Sun", "ny."], parser=None, token_ids=True)
    assert chunks[0]["prompt_token_ids"] == [1, 2] and all("prompt_token_ids" not in c for c in chunks[1:])
    assert [c["choices"][0].get("token_ids") for c in chunks] == [None, None, list(range(6))]
    assert chunks[-1]["choices"][0]["stop_reason"] is None and "stop_reason" not in chunks[0]["choices"][0]
    assert all("prompt_token_ids" not in c and "token_ids" not in c["choices"][0] for c in sse_chunks(["a"]))


def test_the_apps_stream_sends_thinking_as_reasoning_and_the_rest_as_content():
    pieces = ["<thi", "nk>\nThe user wants", " Paris' weather.\n</", "think>\n", "\nLet me", " check."]
    chunks = sse_chunks(pieces)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("reasoning") or "" for d in deltas) == "\nThe user wants Paris' weather.\n"
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == "\n\nLet me check."
    assert not any("<think>" in json.dumps(d) or "</think>" in json.dumps(d) for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_streamed_answer_read_for_calls_sends_its_thinking_and_text_as_they_come():
    """The thinking goes out live (it may take minutes), then the answer's text, then the call once it is whole."""
    chunks = sse_chunks([THOUGHT[:20], THOUGHT[20:], CALL[:30], CALL[30:]], tools=auto_tools())
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    assert deltas[0]["role"] == "assistant" and deltas[0]["reasoning"] == THOUGHT[len("<think>"):20]
    assert "".join(d.get("reasoning") or "" for d in deltas) == "\nThe user wants Paris' weather.\n"
    assert "".join(d.get("content") or "" for d in deltas) == "\n\nLet me check."
    (call,) = [c for d in deltas for c in d.get("tool_calls", [])]
    assert (call["index"], call["function"]["name"]) == (0, "get_weather") and "tool_calls" in deltas[-1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("parser, prompt, mode", [
    ("qwen3", QWEN3_PROMPT, "if_opened"), ("qwen3", R1_PROMPT, "until_close"), ("qwen3", OFF_PROMPT, "answer"),
    ("deepseek_r1", QWEN3_PROMPT, "until_close"), ("deepseek_r1", OFF_PROMPT, "answer")])
def test_a_constrained_request_thinks_first_where_the_markers_are_tokens(parser, prompt, mode):
    """As vLLM reads the prompt: a thinking it closed (turned off) leaves the output all answer, held to the
    grammar from its first token; otherwise the grammar waits. Spelled in pieces, the markers wait for nothing."""
    from eagle_ray.engine.reasoning import mode_for
    assert mode_for(parser, Prompted(prompt, markers=True), [1, 2], constrained=True) == mode
    assert mode_for(parser, Prompted(prompt), [1, 2], constrained=True) == "answer"


def test_a_streamed_forced_call_opens_once_the_thinking_has_closed():
    """Where structured output waits for the thinking (one-token markers), a named call's stream sends the
    thinking first and opens the call with the answer; cut while thinking, it has no call, as read whole."""
    from test_tools import plan
    named = dict(tools=plan("named", "get_weather"), prompt=R1_PROMPT, constrained=True, markers=True)
    chunks = sse_chunks(["Hmm, Paris", ".</think>", '{"city": ', '"Paris"}'], **named)
    calls = [c["choices"][0]["delta"]["tool_calls"] for c in chunks if c["choices"][0]["delta"].get("tool_calls")]
    thought = "".join(c["choices"][0]["delta"].get("reasoning") or "" for c in chunks)
    assert thought == "Hmm, Paris." and calls[0][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(c[0]["function"]["arguments"] for c in calls) == '{"city": "Paris"}'
    cut = sse_chunks(["Hmm, let me", " think more"], reason="length", **named)
    assert not any(c["choices"][0]["delta"].get("tool_calls") for c in cut)
    assert cut[-1]["choices"][0]["finish_reason"] == "length"


def test_continuous_usage_counts_the_chunks_own_choice():
    options = SimpleNamespace(include_usage=None, continuous_usage_stats=True)   # continuous implies usage
    chunks = sse_chunks(["a", "b", "c"], stream_options=options)
    assert [c["usage"]["completion_tokens"] for c in chunks[:-1]] == [1, 2, 3, 3]
    assert all(c["usage"]["prompt_tokens"] == 2 for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


# ---- the batch job ---------------------------------------------------------------------------------------------------
def test_a_jobs_rows_keep_the_thinking_in_their_reasoning_column():
    """The job splits as Serve does: ``output`` is the answer ("" where the output never left its thinking),
    ``reasoning`` the thinking; structured output stays whole; a job without a parser writes outputs whole."""
    from eagle_ray.batch.stage import GenerateStage
    from eagle_ray.config import SamplingParams

    def answer(parser, text, prompt=QWEN3_PROMPT, **params):
        stage = SimpleNamespace(cfg=SimpleNamespace(reasoning_parser=parser),
                                engine=SimpleNamespace(tokenizer=Prompted(prompt)))
        got = GenerateStage.answer(stage, output(text), SimpleNamespace(params=SamplingParams(**params), tools=None))
        assert (got["finish_reason"], got["tool_calls"]) == ("stop", None)
        return {k: got[k] for k in ("output", "reasoning", "turn_outputs")}
    assert answer("qwen3", THOUGHT) == {"output": "\n\nLet me check.", "reasoning": "\nThe user wants Paris' "
                                        "weather.\n", "turn_outputs": ["\n\nLet me check."]}
    assert answer("deepseek_r1", "cut while thinking", R1_PROMPT) == {
        "output": "", "reasoning": "cut while thinking", "turn_outputs": [""]}
    assert answer("qwen3", THOUGHT, guided_json={"type": "object"})["output"] == THOUGHT
    assert answer(None, THOUGHT) == {"output": THOUGHT, "reasoning": None, "turn_outputs": [THOUGHT]}


def test_a_jobs_output_records_its_reasoning_parser(tmp_path):
    """A resume with another parser would mix split and whole outputs: refused, naming it."""
    from test_job_output import FS, job, write_rows

    from eagle_ray.batch.job import check_output_identity
    from eagle_ray.errors import ConfigError
    check_output_identity(FS, str(tmp_path), job(reasoning_parser="qwen3"))
    write_rows(tmp_path, {"row-0": '{"prompt": "a"}'})
    with pytest.raises(ConfigError, match="reasoning_parser: 'qwen3' there, None now"):
        check_output_identity(FS, str(tmp_path), job())


def test_a_job_runs_rows_through_the_parser(tiny_dir, tmp_path):
    from test_batch_faults import stage_for
    from test_job_output import run_rows
    stage = stage_for(tiny_dir, tmp_path)
    stage.cfg.reasoning_parser = "deepseek_r1"   # the tiny model never closes a thinking: all of it is thinking
    plain, turns = run_rows(stage, [{"prompt": "w1 w2"}, {"turns": ["w1", "w2"]}])
    assert plain["error"] is None and plain["output"] == "" and plain["reasoning"]
    assert turns["turn_outputs"] == ["", ""] and turns["reasoning"]
    assert json.loads(plain["sampling_params"])["skip_special_tokens"] is True
    stage = stage_for(tiny_dir, tmp_path / "magistral")
    stage.cfg.reasoning_parser = "mistral"   # Magistral's markers are control tokens: their text is kept
    magistral, = run_rows(stage, [{"prompt": "w1 w2"}])
    assert json.loads(magistral["sampling_params"])["skip_special_tokens"] is False
