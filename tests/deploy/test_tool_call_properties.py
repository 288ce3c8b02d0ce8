"""Forced tool calls parse back, whatever the function's parameters: property tests.

Hypothesis draws parameter schemas (nested objects and arrays, enums, numbers, booleans,
strings, nulls) and arguments that satisfy each (``instances``: hypothesis-jsonschema
0.23.1, the newest, fails on hypothesis 6.170's internals). The output a
forced call constrains the model to, written with any JSON spacing, must parse into
``tool_calls`` whose arguments are those values, read whole and streamed in chunks of
any size; the streamed header and fragments always join into the whole parse. Then a
few drawn schemas run through the real engine (the tiny random model, its output forced
by the grammar): every call parses and validates against the function's parameters.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.deploy.openai.tools.calls import NamedToolChoice, ToolDefinition
from kvroute.deploy.openai.tools.forcing import ForcedToolParser, forced_tool_schema
from kvroute.deploy.openai.tools.call_json import assemble

NAME = st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)
NUMBER = st.just({"type": "number", "minimum": -10, "maximum": 10})
# what a model writes in few tokens: a number's digits are unbounded, so the engine's schemas have none
BOUNDED = st.one_of(
    st.integers(-50, 50).map(lambda lo: {"type": "integer", "minimum": lo, "maximum": lo + 100}),
    st.just({"type": "boolean"}),
    st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(st.text("abcxyz é\"\\{}[]", min_size=1, max_size=5), min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v}),
    st.just({"type": "null"}),
)

LEAVES = st.one_of(BOUNDED, NUMBER)


def _object(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.dictionaries(NAME, children, min_size=1, max_size=4).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda req: {"type": "object", "properties": props, "required": req, "additionalProperties": False}
        )
    )




def _schemas(leaves: st.SearchStrategy) -> st.SearchStrategy:
    array = lambda inner: st.builds(lambda i, n: {"type": "array", "items": i, "maxItems": n}, inner, st.integers(1, 3))  # noqa: E731
    return _object(st.recursive(leaves, lambda inner: st.one_of(array(inner), _object(inner)), max_leaves=6))


SCHEMAS = _schemas(LEAVES)


def instances(schema: dict) -> st.SearchStrategy:
    """Values valid under a schema that ``SCHEMAS`` draws."""
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema["type"]
    if kind == "object":
        props, required = schema["properties"], set(schema["required"])
        keep = st.sets(st.sampled_from(sorted(props))) if props else st.just(set())
        return keep.flatmap(lambda optional: st.fixed_dictionaries({k: instances(props[k]) for k in props if k in required | optional}))
    if kind == "array":
        return st.lists(instances(schema["items"]), max_size=schema["maxItems"])
    simple = {
        "integer": lambda: st.integers(schema.get("minimum"), schema.get("maximum")),
        "number": lambda: st.floats(schema["minimum"], schema["maximum"], allow_nan=False),
        "boolean": st.booleans,
        "string": lambda: st.text(max_size=schema["maxLength"]),
        "null": lambda: st.none(),
    }
    return simple[kind]()


SPACING = st.sampled_from([dict(), dict(separators=(",", ":")), dict(indent=2), dict(ensure_ascii=False, separators=(", ", ": "))])


def _tool(name: str, schema: dict) -> ToolDefinition:
    return ToolDefinition.model_validate({"type": "function", "function": {"name": name, "parameters": schema}})


def _streamed(parser: ForcedToolParser, text: str, sizes: list[int]) -> tuple:
    deltas, i, k = [], 0, 0
    while i < len(text):
        n = sizes[k % len(sizes)]
        deltas += parser.feed(text[i : i + n])
        i, k = i + n, k + 1
    return assemble(deltas + parser.finish())


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(schema=SCHEMAS, data=st.data(), spacing=SPACING, sizes=st.lists(st.integers(1, 12), min_size=1, max_size=6))
def test_every_forced_output_parses_back_whole_and_streamed(schema, data, spacing, sizes):
    args = data.draw(instances(schema), label="arguments")
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "f"}})
    outputs = [(named, json.dumps(args, **spacing)),
               ("required", json.dumps([{"name": "f", "parameters": args}, {"name": "g", "parameters": args}], **spacing))]  # fmt: skip
    for choice, text in outputs:
        whole = ForcedToolParser.parse(text, tool_choice=choice)
        streamed = _streamed(ForcedToolParser(tool_choice=choice), text, sizes)
        for content, calls in (whole, streamed):
            assert content is None, text
            assert [c.name for c in calls] == (["f"] if choice is named else ["f", "g"]), text
            for call in calls:
                assert json.loads(call.arguments) == args
                jsonschema.validate(json.loads(call.arguments), schema)
        assert [c.arguments for c in streamed[1]] == [c.arguments for c in whole[1]]


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    from kvroute.replica.llm import LLM

    return LLM(str(tiny_llama_path), num_kv_blocks=512, dtype="float32", device="cpu")


@settings(max_examples=5, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(schemas=st.lists(_schemas(BOUNDED), min_size=2, max_size=3), parallel=st.booleans())
def test_engine_forced_calls_validate(llm, schemas, parallel):
    """The grammar makes even a random model's output a valid call of a named function or
    of any of the tools; each parses into calls that validate, streamed as whole."""
    from kvroute.replica.sampling_params import SamplingParams
    from kvroute.replica.structured_output import StructuredOutput

    tools = [_tool(f"fn{i}", s) for i, s in enumerate(schemas)]
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "fn0"}})
    choices = [named, "required"]
    params = [SamplingParams(max_tokens=400, temperature=0.0,
                             structured_output=StructuredOutput("json", forced_tool_schema(tools, c, parallel), field="tool_choice"))
              for c in choices]  # fmt: skip
    outs = llm.generate(["Call the tools, please."] * 2, params, use_tqdm=False)
    by_name = {t.function.name: t.function.parameters_schema() for t in tools}
    for choice, out in zip(choices, outs):
        if out.finish_reason != "stop":
            continue  # the grammar allows any whitespace, which a random model may write to max_tokens
        whole = ForcedToolParser.parse(out.text, tool_choice=choice)
        assert whole[0] is None and whole[1], out.text
        for call in whole[1]:
            jsonschema.validate(json.loads(call.arguments), by_name[call.name])
        assert [c.arguments for c in _streamed(ForcedToolParser(tool_choice=choice), out.text, [3])[1]] == [c.arguments for c in whole[1]]
        if choice is named or not parallel:
            assert len(whole[1]) == 1
