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
from eagle_ray.serve.openai_api import parse_body
from eagle_ray.engine.reasoning import ReasoningStream, split_reasoning

THOUGHT = "<think>\nThe user wants Paris' weather.\n</think>\n\nLet me check."
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
WEATHER = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("parser, text, thought, answer", [
    ("qwen3", THOUGHT, "\nThe user wants Paris' weather.\n", "Let me check."),
    ("qwen3", "Paris is sunny.", None, "Paris is sunny."),                    # enable_thinking: false
    ("qwen3", "<think>\nStill thinking when cut", "\nStill thinking when cut", None),
    ("qwen3", "Sunny</think> today", None, "Sunny</think> today"),            # thinking never opened
    ("deepseek_r1", "The template opened it.\n</think>\n\nSunny.", "The template opened it.\n", "Sunny."),
    ("deepseek_r1", THOUGHT, "\nThe user wants Paris' weather.\n", "Let me check."),
    ("deepseek_r1", "Cut while thinking", "Cut while thinking", None),
])
def test_a_whole_output_splits_into_thinking_and_answer(parser, text, thought, answer):
    assert split_reasoning(text, parser) == (thought, answer)


def streamed(parser: str, pieces: list[str]) -> tuple[str | None, str | None]:
    s, thought, answer = ReasoningStream(parser), "", ""
    for i, piece in enumerate(pieces):
        t, a = s.feed(piece, final=i == len(pieces) - 1)
        assert t is None or a is None or "</think>" in "".join(pieces[: i + 1])   # one side, but at the marker
        thought, answer = thought + (t or ""), answer + (a or "")
    return thought or None, answer or None


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("text", [THOUGHT, "Paris is sunny.", "<think>x</thi", "\n<think></think>\n\nA", "<th"])
def test_a_stream_splits_as_the_whole_output_however_its_deltas_fall(parser, text):
    """Every way of cutting the text into three deltas (and each character alone)."""
    whole = split_reasoning(text, parser)
    for i, j in itertools.combinations(range(len(text) + 1), 2):
        assert streamed(parser, [text[:i], text[i:j], text[j:]]) == whole, (i, j)
    assert streamed(parser, list(text) + [""]) == whole


def test_structured_output_and_forced_calls_are_not_split():
    def chat(body):
        body = {"model": "m", "messages": [{"role": "user", "content": "w1"}], **body}
        return parse_body(json.dumps(body).encode(), "chat", "m", 100, 16, tool_parser="hermes",
                          reasoning_parser="qwen3")
    assert chat({}).reasoning == "qwen3" and chat({"tools": [WEATHER]}).reasoning == "qwen3"
    assert chat({"response_format": {"type": "json_object"}}).reasoning is None
    assert chat({"tools": [WEATHER], "tool_choice": "required"}).reasoning is None
    completion = parse_body(b'{"model": "m", "prompt": "w1"}', "completion", "m", 100, 16,
                            reasoning_parser="qwen3")
    assert completion.reasoning is None


def auto_tools():
    """A chat's tools read by the hermes parser (``tool_choice`` auto)."""
    return parse_body(json.dumps({"model": "m", "messages": [{"role": "user", "content": "w1"}],
                                  "tools": [WEATHER]}).encode(), "chat", "m", 100, 16, tool_parser="hermes").tools


def output(text: str) -> RequestOutput:
    return RequestOutput("r", [1, 2], list(range(len(text))), text, "stop")


def test_a_whole_chat_answer_carries_reasoning_content_and_calls_from_the_answer_alone():
    plan = auto_tools()
    shape = ChoiceShape("chat", False, None, None, plan, True, "qwen3")
    seqs = [SimpleNamespace(prompt_ids=[1, 2])]
    choice = shape.choice(0, PromptChoices(seqs, ""), output(THOUGHT + CALL), "stop")
    message = choice["message"]
    assert message["reasoning_content"] == "\nThe user wants Paris' weather.\n"
    assert message["content"] == "Let me check." and choice["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    plain = ChoiceShape("chat", False, None, None, None, True, "qwen3").choice(0, PromptChoices(seqs, ""),
                                                                             output("Sunny."), "stop")
    assert plain["message"] == {"role": "assistant", "content": "Sunny.", "reasoning_content": None}


class ReplayQueue:
    """Stands in for the replica's RequestQueue: each sequence's stream is the deltas given."""

    def __init__(self, deltas):
        self.deltas = deltas

    async def astream(self, seq):
        for d in self.deltas:
            yield d


def sse_chunks(pieces: list[str], tools=None, parser="qwen3") -> list[dict]:
    from eagle_ray.serve.app import EagleServer
    text = "".join(pieces)
    deltas = [StreamDelta("r", p, i + 1) for i, p in enumerate(pieces[:-1])]
    deltas.append(StreamDelta("r", pieces[-1], len(pieces), True, output(text)))
    server = SimpleNamespace(cfg=SimpleNamespace(model_name="m"), queue=ReplayQueue(deltas))
    body = SimpleNamespace(stream_options=None)
    seqs = [SimpleNamespace(prompt_ids=[1, 2], logprobs=None, output_ids=[], stops=None)]
    shape = ChoiceShape("chat", False, None, None, tools, True, parser)
    sse = EagleServer.func_or_class._sse(server, body, [PromptChoices(seqs, "")], shape, "rid")

    async def collect():
        return [line async for line in sse]
    lines = asyncio.run(collect())
    assert lines[-1] == "data: [DONE]\n\n"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def test_the_apps_stream_sends_thinking_as_reasoning_content_and_the_rest_as_content():
    pieces = ["<thi", "nk>\nThe user wants", " Paris' weather.\n</", "think>\n", "\nLet me", " check."]
    chunks = sse_chunks(pieces)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "\nThe user wants Paris' weather.\n"
    assert "".join(d.get("content") or "" for d in deltas) == "Let me check."
    assert not any("<think>" in json.dumps(d) or "</think>" in json.dumps(d) for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_streamed_answer_read_for_calls_keeps_its_thinking_apart():
    plan = auto_tools()
    chunks = sse_chunks([THOUGHT[:20], THOUGHT[20:], CALL], tools=plan)
    (first, last) = [c["choices"][0] for c in chunks]
    assert first["delta"]["reasoning_content"] == "\nThe user wants Paris' weather.\n"
    assert first["delta"]["content"] == "Let me check."
    assert first["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert last["finish_reason"] == "tool_calls"


# ---- the batch job ---------------------------------------------------------------------------------------------------
def test_a_jobs_rows_keep_the_thinking_in_their_reasoning_column():
    """The job splits as Serve does: ``output`` is the answer ("" where the output never left its thinking),
    ``reasoning`` the thinking; structured output stays whole; a job without a parser writes outputs whole."""
    from eagle_ray.batch.stage import GenerateStage
    from eagle_ray.config import SamplingParams

    def answer(parser, text, **params):
        return GenerateStage.answer(SimpleNamespace(cfg=SimpleNamespace(reasoning_parser=parser)), text,
                                    SamplingParams(**params))
    assert answer("qwen3", THOUGHT) == {"output": "Let me check.", "reasoning": "\nThe user wants Paris' weather.\n",
                                        "turn_outputs": ["Let me check."]}
    assert answer("deepseek_r1", "cut while thinking") == {"output": "", "reasoning": "cut while thinking",
                                                           "turn_outputs": [""]}
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
