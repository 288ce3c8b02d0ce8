"""Tool request fields, tool history and forced calls (deploy/openai/tools/calls.py, tool_forcing.py)."""

import json

import jsonschema
import pytest
import xgrammar
from pydantic import ValidationError
from xgrammar.testing import _is_grammar_accept_string

from kvroute.deploy.openai.tools.calls import NamedToolChoice, ToolChatMessage, ToolFields, template_messages
from kvroute.deploy.openai.tools.forcing import ForcedToolParser, forced_tool_schema, parse_forced
from kvroute.deploy.openai.tools.call_json import assemble

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time"}}


def _fields(**body):
    return ToolFields.model_validate(body)


def _error(body) -> str:
    with pytest.raises(ValidationError) as info:
        ToolFields.model_validate(body)
    return str(info.value)


def test_tool_fields_defaults_and_template_tools():
    fields = _fields(tools=[WEATHER, TIME])
    assert fields.choice() == "auto" and fields.parallel()
    assert _fields().choice() == "none" and _fields().template_tools() is None
    tools = fields.template_tools()
    assert tools[0] == WEATHER and tools[1] == TIME  # as given, nothing added
    assert _fields(tools=[WEATHER], tool_choice="none").template_tools() is None
    named = _fields(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
                    parallel_tool_calls=False)  # fmt: skip
    assert isinstance(named.choice(), NamedToolChoice) and not named.parallel()


@pytest.mark.parametrize("body,message", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice: function 'get_time' is not one of the tools ['get_weather']"),
    ({"tool_choice": "required"}, "tool_choice: 'required' needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice: function 'f' needs tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools: function names must be unique, 'get_weather'"),
    ({"tools": []}, "tools: an empty list"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "name must be 1-64 letters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "parameters must be a schema of type 'object'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"city": {"type": "str"}}}}}]},
     "parameters.properties.city.type 'str' is not a JSON schema type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": "city"}}}]}, "parameters.required must be a list"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "minProperties": -1}}}]}, "parameters is not a valid JSON schema"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])  # fmt: skip
def test_tool_field_errors_name_the_field(body, message):
    assert message in _error(body)


def test_history_converts_for_templates():
    messages = [ToolChatMessage.model_validate(m) for m in [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_b", "name": "clock", "content": "12:00"},
    ]]  # fmt: skip
    out = template_messages(messages)
    assert out[0] == {"role": "system", "content": "Be brief."}
    assert out[1] == {"role": "user", "content": "Weather in Paris?"}
    assert out[2]["content"] == "" and out[2]["tool_calls"] == [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": {}}},
    ]
    assert out[3] == {"role": "tool", "content": "18 C", "tool_call_id": "call_a", "name": "get_weather"}
    assert out[4]["name"] == "clock"  # the client's name stands


@pytest.mark.parametrize("message,error", [
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                           "function": {"name": "f", "arguments": "{oops"}}]},
     "function.arguments is not valid JSON"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]},
     "function.arguments must encode a JSON object"),
    ({"role": "tool", "content": "18 C"}, "tool_call_id: a tool message needs the id"),
    ({"role": "user", "content": "x", "tool_calls": []}, "tool_calls: only assistant messages"),
    ({"role": "user", "content": "x", "tool_call_id": "c"}, "tool_call_id: only tool messages"),
    ({"role": "tool", "tool_call_id": "c", "content": "bad \ud800"}, "(?s)content.*unpaired UTF-16 surrogate"),
])  # fmt: skip
def test_message_errors_name_the_field(message, error):
    with pytest.raises(ValidationError, match=error):
        ToolChatMessage.model_validate(message)


def test_tool_message_must_answer_an_earlier_call():
    messages = [ToolChatMessage.model_validate(m) for m in [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "call_a", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_z", "content": "?"},
    ]]  # fmt: skip
    with pytest.raises(ValueError, match=r"messages\[2\].tool_call_id: 'call_z' answers no tool call"):
        template_messages(messages)


def _required_schema(parallel=True):
    fields = _fields(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=parallel)
    return forced_tool_schema(fields.tools, fields.choice(), fields.parallel())


GOOD = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, {"name": "get_time", "parameters": {}}]'
BAD = [
    "[]",  # no call
    '[{"name": "get_news", "parameters": {}}]',  # not a tool
    '[{"name": "get_weather", "parameters": {"unit": "celsius"}}]',  # required city missing
    '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "kelvin"}}]',  # not in the enum
    '[{"name": "get_time", "parameters": {}, "why": "x"}]',  # an extra key
    '{"name": "get_time", "parameters": {}}',  # not an array
]


def test_required_schema_accepts_only_valid_calls():
    schema = _required_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(json.loads(GOOD), schema)
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema))
    assert _is_grammar_accept_string(grammar, GOOD)
    for bad in BAD:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(json.loads(bad), schema)
        assert not _is_grammar_accept_string(grammar, bad), bad


def test_required_without_parallel_calls_allows_exactly_one():
    schema = _required_schema(parallel=False)
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema))
    assert not _is_grammar_accept_string(grammar, GOOD)
    assert _is_grammar_accept_string(grammar, '[{"name": "get_time", "parameters": {}}]')


def test_named_schema_is_the_functions_parameters():
    fields = _fields(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    schema = forced_tool_schema(fields.tools, fields.choice())
    assert schema == WEATHER["function"]["parameters"]
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema))
    assert _is_grammar_accept_string(grammar, '{"city": "Oslo"}') and not _is_grammar_accept_string(grammar, '{"unit": "celsius"}')
    none = _fields(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert forced_tool_schema(none.tools, none.choice()) == {"type": "object", "properties": {}}
    assert forced_tool_schema(fields.tools, "auto") is None and forced_tool_schema(fields.tools, "none") is None


def test_required_schema_hoists_defs():
    point = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    tool = {"type": "function", "function": {"name": "move", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Point"}}, "required": ["to"], "$defs": {"Point": point}}}}  # fmt: skip
    fields = _fields(tools=[tool, TIME], tool_choice="required")
    schema = forced_tool_schema(fields.tools, "required")
    assert schema["$defs"] == {"Point": point} and "$defs" in fields.tools[0].function.parameters  # the tool is untouched
    jsonschema.validate([{"name": "move", "parameters": {"to": {"x": 1}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "move", "parameters": {"to": {"y": 1}}}], schema)
    other = json.loads(json.dumps(tool))
    other["function"]["name"] = "jump"
    other["function"]["parameters"]["$defs"]["Point"] = {"type": "string"}
    clash = _fields(tools=[tool, other], tool_choice="required")
    with pytest.raises(ValueError, match="tools: two tools define \\$defs 'Point' differently"):
        forced_tool_schema(clash.tools, "required")


def test_parse_forced_required_and_named():
    spaced = '[\n  {"name": "get_weather", "parameters": {"city": "Paris"}} ,\n  {"name": "get_time", "parameters": {}}\n]\n'
    calls = parse_forced(spaced, "required")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}})
    calls = parse_forced('{"city": "Oslo"}', named)
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Oslo"}')]
    assert parse_forced('[{"name": "get_time", "parameters": {', "required") == []  # cut short by max_tokens
    assert parse_forced('{"city": "Os', named) == []


@pytest.mark.parametrize("choice,text", [
    ("required", GOOD),
    ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Oslo", "unit": "celsius"}'),
])  # fmt: skip
def test_forced_stream_equals_whole_parse(choice, text):
    choice = NamedToolChoice.model_validate(choice) if isinstance(choice, dict) else choice
    parser, deltas = ForcedToolParser(tool_choice=choice), []
    for ch in text:
        deltas += parser.feed(ch)
    deltas += parser.finish()
    head = deltas[0]["tool_calls"][0]
    assert head["function"]["arguments"] == "" and head["type"] == "function" and "id" in head
    content, streamed = assemble(deltas)
    whole = parse_forced(text, choice)
    assert content is None and [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in whole]
    assert parser.called


def test_deeply_nested_parameters_are_refused_not_a_crash():
    node: dict = {"type": "string"}
    for _ in range(300):  # jsonschema's recursive check ran out of stack here: a 500
        node = {"type": "object", "properties": {"a": node}}
    tool = {"type": "function", "function": {"name": "deep", "parameters": node}}
    assert "parameters nests deeper than 64 levels" in _error({"tools": [tool]})
    ok = {"type": "string"}
    for _ in range(20):
        ok = {"type": "object", "properties": {"a": ok}}
    assert _fields(tools=[{"type": "function", "function": {"name": "fine", "parameters": ok}}]).tools


def test_forced_arguments_with_arrays_and_scalars_are_calls():
    """Every member kind after an array: the hand-written scanner this replaced found no call."""
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "f"}})
    text = '{"a": [1, {"b": null}], "c": true, "d": -12.5e1, "e": "x", "f": false}'
    [call] = parse_forced(text, named)
    assert json.loads(call.arguments) == json.loads(text)
    parser = ForcedToolParser(tool_choice=named)
    deltas = [d for ch in text for d in parser.feed(ch)] + parser.finish()
    assert assemble(deltas)[1][0].arguments == call.arguments
