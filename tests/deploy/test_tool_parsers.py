"""Tool-call parsers (deploy/openai/tools/parsers.py) on realistic outputs: whole and streamed."""

import json
import random

import pytest

from kvroute.deploy.openai.tools.calls import NamedToolChoice, ToolFields, finish_reason
from kvroute.deploy.openai.tools.call_json import assemble
from kvroute.deploy.openai.tools.hermes import HermesParser
from kvroute.deploy.openai.tools.llama3_json import Llama3JsonParser
from kvroute.deploy.openai.tools.mistral import MistralParser
from kvroute.deploy.openai.tools.parsers import get_tool_parser, resolve_tool_choice

QWEN_TWO_CALLS = (
    "I'll look both up.\n\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'
)
HERMES_TRICKY = (
    '<tool_call>{"arguments": {"code": "if x: print(\\"}</tool_call>\\")", "n": [1, {"k": null}]}, '
    '"name": "run_python"}</tool_call>'
)
LLAMA_TWO_CALLS = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Zürich"}}; '
    '{"name": "get_time", "parameters": {}}'
)
MISTRAL_ARRAY = (
    'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Lyon"}}, '
    '{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}]'
)
MISTRAL_V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon"}[TOOL_CALLS]get_time[ARGS]{}'

CASES = [
    (HermesParser, QWEN_TWO_CALLS, "I'll look both up.",
     [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"tz": "Europe/Paris"})]),
    (HermesParser, HERMES_TRICKY, None, [("run_python", {"code": 'if x: print("}</tool_call>")', "n": [1, {"k": None}]})]),
    (HermesParser, '<tool_call>\n{"name": "get_time"}\n</tool_call>\n', None, [("get_time", {})]),
    (HermesParser, "Paris is sunny today.\n", "Paris is sunny today.\n", []),
    (HermesParser, "Use the <tool tag <tool_call", "Use the <tool tag <tool_call", []),
    (HermesParser, "<tool_call>not json</tool_call> then text", "<tool_call>not json</tool_call> then text", []),
    (HermesParser, '<tool_call>{"name": 7, "arguments": {}}</tool_call>', '<tool_call>{"name": 7, "arguments": {}}</tool_call>', []),
    (HermesParser, 'A <tool_call>{"name": "f", "arguments": [1]}</tool_call>', 'A <tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
    (Llama3JsonParser, LLAMA_TWO_CALLS, None, [("get_weather", {"city": "Zürich"}), ("get_time", {})]),
    (Llama3JsonParser, ' {"name": "get_time", "arguments": {"tz": "UTC"}}', None, [("get_time", {"tz": "UTC"})]),
    (Llama3JsonParser, "The answer is {x}.", "The answer is {x}.", []),
    (Llama3JsonParser, "{not json at all", "{not json at all", []),
    (MistralParser, MISTRAL_ARRAY, "Sure.", [("get_weather", {"city": "Lyon"}), ("get_time", {"tz": "UTC"})]),
    (MistralParser, MISTRAL_V11, None, [("get_weather", {"city": "Lyon"}), ("get_time", {})]),
    (MistralParser, "No tools needed [TOOL_CALLS", "No tools needed [TOOL_CALLS", []),
]  # fmt: skip


def _calls(parsed):
    content, calls = parsed
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def _stream(parser_cls, text, sizes):
    parser = parser_cls()
    deltas, i = [], 0
    while i < len(text):
        n = sizes[len(deltas) % len(sizes)] if sizes else 1
        deltas += parser.feed(text[i : i + n])
        i += n
    return deltas + parser.finish(), parser


@pytest.mark.parametrize("parser_cls,text,content,calls", CASES)
def test_full_parse(parser_cls, text, content, calls):
    assert _calls(parser_cls.parse(text)) == (content, calls)


@pytest.mark.parametrize("parser_cls,text,content,calls", CASES)
def test_streamed_char_by_char_and_in_chunks_equals_full_parse(parser_cls, text, content, calls):
    full = parser_cls.parse(text)
    rng = random.Random(len(text))
    for sizes in ([1], [2, 3, 1, 7], [rng.randint(1, 9) for _ in range(20)], [len(text)]):
        deltas, parser = _stream(parser_cls, text, sizes)
        streamed = assemble(deltas)
        assert streamed[0] == full[0], sizes
        assert [(c.name, c.arguments) for c in streamed[1]] == [(c.name, c.arguments) for c in full[1]], sizes
        assert parser.called == bool(calls)


def test_stream_deltas_have_openai_shape():
    deltas, _ = _stream(HermesParser, QWEN_TWO_CALLS, [1])
    assert deltas[0] == {"content": "I"}
    content_end = max(i for i, d in enumerate(deltas) if "content" in d)
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert all(len(d) == 1 for d in deltas) and all(len(d["tool_calls"]) == 1 for d in deltas[content_end + 1 :])
    heads = [c for c in calls if "id" in c]
    assert [h["index"] for h in heads] == [0, 1]
    for h in heads:  # the header: id, type and the whole name, arguments still empty
        assert h["type"] == "function" and h["function"]["arguments"] == "" and h["id"].startswith("call_")
        assert len(h["id"]) == len("call_") + 24
    assert heads[0]["id"] != heads[1]["id"]
    first = calls.index(heads[0])
    assert calls[first]["function"]["name"] == "get_weather"
    fragments = [c for c in calls if "id" not in c]
    assert all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in fragments)
    args0 = "".join(c["function"]["arguments"] for c in fragments if c["index"] == 0)
    assert json.loads(args0) == {"city": "Paris", "unit": "celsius"}
    assert len([c for c in fragments if c["index"] == 0]) > 10  # the arguments really stream


def test_arguments_stream_before_the_call_closes():
    parser = HermesParser()
    out = parser.feed('Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Par')
    assert out[0] == {"content": "Checking."}
    assert out[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in out[2:]) == '{"city": "Par'


def test_a_truncated_call_is_content_whole_but_stands_once_streamed():
    text = 'Hm. <tool_call>{"name": "get_weather", "arguments": {"city": "Pa'
    assert HermesParser.parse(text) == (text, [])
    deltas, parser = _stream(HermesParser, text, [1])
    content, calls = assemble(deltas)
    assert content == "Hm." and parser.called
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Pa')]


def test_whitespace_between_content_and_calls_is_dropped_but_kept_inside_content():
    text = "  Line one\n\nLine two \n<tool_call>{\"name\": \"f\"}</tool_call>\n\n"
    assert HermesParser.parse(text)[0] == "  Line one\n\nLine two"
    assert HermesParser.parse("a \n b \n")[0] == "a \n b \n"


def test_mistral_ids_and_special_tokens():
    _, calls = MistralParser.parse(MISTRAL_ARRAY)
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    assert MistralParser.needs_special_tokens and not HermesParser.needs_special_tokens


def test_parser_registry():
    assert get_tool_parser("hermes") is HermesParser and get_tool_parser("llama3_json") is Llama3JsonParser
    with pytest.raises(ValueError, match=r"--tool-call-parser: unknown parser 'qwen'.*hermes"):
        get_tool_parser("qwen")


def test_tool_call_to_openai():
    _, calls = HermesParser.parse(QWEN_TWO_CALLS)
    body = calls[0].to_openai()
    assert body == {"id": calls[0].id, "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}  # fmt: skip


def test_finish_reason():
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "f"}})
    assert finish_reason("stop", "auto", True) == "tool_calls"
    assert finish_reason("stop", "required", True) == "tool_calls"
    assert finish_reason("stop", named, True) == "stop"  # OpenAI's (and vLLM's) named-function rule
    assert finish_reason("stop", "auto", False) == "stop"
    assert finish_reason("length", "auto", True) == "length"


def test_resolve_tool_choice():
    tools = [{"type": "function", "function": {"name": "f"}}]
    omitted = ToolFields.model_validate({"tools": tools})
    assert resolve_tool_choice(omitted, "hermes", True) == "auto"
    assert resolve_tool_choice(omitted, None, False) == "none"
    auto = ToolFields.model_validate({"tools": tools, "tool_choice": "auto"})
    with pytest.raises(ValueError, match="tool_choice.*--enable-auto-tool-choice"):
        resolve_tool_choice(auto, "hermes", False)
    assert resolve_tool_choice(ToolFields.model_validate({"tools": tools, "tool_choice": "required"}), None, False) == "required"


def test_long_arguments_stream_in_linear_time():
    import time

    args = json.dumps({"text": "x" * 100_000, "list": list(range(3000))})
    text = '<tool_call>{"name": "f", "arguments": ' + args + "}</tool_call>"
    parser, deltas = HermesParser(), []
    t0 = time.perf_counter()
    for i in range(0, len(text), 4):  # about a token each
        deltas += parser.feed(text[i : i + 4])
    deltas += parser.finish()
    assert time.perf_counter() - t0 < 5.0  # quadratic copying took minutes here
    assert assemble(deltas)[1][0].arguments == args


def test_max_calls_keeps_the_first_call_only():
    content, calls = HermesParser.parse(QWEN_TWO_CALLS, max_calls=1)
    assert content == "I'll look both up." and [c.name for c in calls] == ["get_weather"]
    parser, deltas = HermesParser(max_calls=1), []
    for ch in QWEN_TWO_CALLS:
        deltas += parser.feed(ch)
    streamed = assemble(deltas + parser.finish())
    assert streamed[0] == content and [(c.name, c.arguments) for c in streamed[1]] == [(c.name, c.arguments) for c in calls]
    assert [c.name for c in MistralParser.parse(MISTRAL_ARRAY, max_calls=1)[1]] == ["get_weather"]
