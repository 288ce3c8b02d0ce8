"""Structured outputs in the engine: a tiny random model's output matches the grammar
(the grammar forces validity regardless of weights), compiles run off the step loop,
and the grammar composes with prefix caching, preemption, resume, stop strings and seeds."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvroute.replica.llm import LLM
from kvroute.replica.sampling_params import SamplingParams
from kvroute.replica.structured_output import GrammarCache, StructuredOutput, from_request, validate
from tests.replica.helpers import assert_no_leak

BS = 16
# Every value is bounded (enum, integer range, short string, short array), so even a random
# model finishes the object within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "color", "ok"],
}
OTHER_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
PROMPT = "Describe a person as JSON. The person is called Ann and likes blue things very much."


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    return LLM(str(tiny_llama_path), block_size=BS, num_kv_blocks=256, dtype="float32", device="cpu")


def _json(schema=SCHEMA, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 200)
    kw.setdefault("temperature", 0.0)
    return SamplingParams(structured_output=StructuredOutput("json", schema), **kw)


def _valid(text: str, schema=SCHEMA) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


def test_json_schema_greedy_and_sampled_outputs_validate(llm):
    outs = llm.generate([PROMPT] * 3, [_json(), _json(temperature=1.0, seed=1), _json(temperature=1.0, seed=2)], use_tqdm=False)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        _valid(out.text)
    unconstrained = llm.generate(PROMPT, SamplingParams(max_tokens=30, temperature=0.0), use_tqdm=False)[0]
    with pytest.raises(ValueError):
        json.loads(unconstrained.text)  # the random model alone writes no JSON
    assert_no_leak(llm)


def test_regex_and_choice(llm):
    regex = r"[A-Z][a-z]{2,5}-\d{3}"
    outs = llm.generate(["Give a code:", "Pick a color:"], [
        SamplingParams(max_tokens=30, temperature=0.0, structured_output=StructuredOutput("regex", regex)),
        SamplingParams(max_tokens=30, temperature=0.7, seed=3, structured_output=StructuredOutput("choice", ["red", "green", "dark blue"])),
    ], use_tqdm=False)  # fmt: skip
    assert re.fullmatch(regex, outs[0].text) and outs[0].finish_reason == "stop"
    assert outs[1].text in ("red", "green", "dark blue") and outs[1].finish_reason == "stop"


def test_grammar_and_lark(llm):
    ebnf = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9]'
    lark = 'start: "yes" | "no" | "maybe"'
    outs = llm.generate(["Sum:", "Answer:"], [
        SamplingParams(max_tokens=40, temperature=0.0, structured_output=StructuredOutput("grammar", ebnf)),
        SamplingParams(max_tokens=10, temperature=0.0, structured_output=StructuredOutput("lark", lark)),
    ], use_tqdm=False)  # fmt: skip
    assert re.fullmatch(r"\([1-9](\+[1-9])*\)", outs[0].text) or outs[0].finish_reason == "length"
    assert outs[1].text in ("yes", "no", "maybe")


def test_prefix_shared_between_two_schemas(llm):
    prompt = list(range(1000, 1000 + 3 * BS + 5))
    first = llm.generate(prompt, _json(), use_tqdm=False)[0]
    second = llm.generate(prompt, _json(OTHER_SCHEMA), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 or first.num_cached_tokens < second.num_cached_tokens
    assert second.num_cached_tokens == 3 * BS  # the grammar is not part of the KV key
    _valid(first.text)
    _valid(second.text, OTHER_SCHEMA)


def test_n_choices_each_own_matcher_and_stop_string(llm):
    # n > 1 is fanned out above the engine: each choice is a request with its own matcher
    params = [_json(temperature=1.0, seed=s) for s in range(4)]
    outs = llm.generate([PROMPT] * 4, params, use_tqdm=False)
    values = [_valid(o.text) for o in outs]
    assert len({json.dumps(v) for v in values}) > 1  # the choices differ
    stopped = llm.generate(PROMPT, _json(stop=['"age"']), use_tqdm=False)[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == '"age"'
    assert stopped.text.startswith('{"name":') or stopped.text.startswith("{")


def test_preemption_keeps_the_grammar(tiny_llama_path):
    # 14 blocks for 4 requests of 6 blocks and more: preempted and recomputed on the way
    small = LLM(str(tiny_llama_path), block_size=BS, num_kv_blocks=14, dtype="float32", device="cpu")
    prompts = [list(range(2000 + 100 * i, 2000 + 100 * i + 80)) for i in range(4)]
    outs = small.generate(prompts, [_json(temperature=1.0, seed=i, max_tokens=140) for i in range(4)], use_tqdm=False)
    assert small.engine.stats().num_preemptions > 0
    for out in outs:
        assert out.finish_reason == "stop"
        _valid(out.text)
    assert_no_leak(small)


def test_compile_off_the_loop_others_progress(llm):
    """A request whose grammar compiles slowly waits; the others run meanwhile (by steps)."""
    engine = llm.engine
    slow = StructuredOutput("regex", r"[a-z]{1,230}")  # a bounded repeat: seconds to compile
    engine.add_request("slow", [5, 6, 7], SamplingParams(max_tokens=5, temperature=0.0, structured_output=slow))
    engine.add_request("plain", [8, 9, 10], SamplingParams(max_tokens=8, temperature=0.0))
    progressed_while_pending = 0
    done = {}
    while engine.has_unfinished():
        pending = not engine.requests["slow"].constraints.ready if "slow" in engine.requests else False
        for d in engine.step().deltas:
            if d.request_id == "plain" and pending:
                progressed_while_pending += len(d.token_ids)
            if d.finish_reason:
                done[d.request_id] = d
    assert progressed_while_pending == 8  # the plain request finished before the compile did
    assert done["slow"].finish_reason == "length"


def test_resume_replays_streamed_tokens(llm):
    engine = llm.engine
    full = llm.generate(PROMPT, _json(), use_tqdm=False)[0]
    ids = llm.tokenizer.encode(PROMPT)
    cut = len(full.token_ids) // 2
    engine.add_request("resumed", ids, _json(), resume_output=full.token_ids[:cut])
    tail = []
    while engine.has_unfinished():
        for d in engine.step().deltas:
            tail.extend(d.token_ids)
    assert full.token_ids[:cut] + tail == full.token_ids  # the matcher picked up where it was
    # tokens that break the grammar cannot be resumed
    engine.add_request("broken", ids, _json(), resume_output=llm.tokenizer.encode("hello"))
    deltas = [d for _ in range(3) for d in engine.step().deltas]
    assert deltas[-1].finish_reason == "abort" and "does not match" in deltas[-1].stop_reason


@pytest.mark.parametrize("kind,spec,reason", [
    ("json", "{not json", "not valid JSON"),
    ("json", {"type": "foo"}, "Unsupported type"),
    ("json", {"type": "array", "uniqueItems": True}, "uniqueItems"),
    ("json", {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "'not' (at /properties/a)"),
    ("regex", "(abc", "parenthesis"),
    ("grammar", "root ::= foo", "not defined"),
    ("choice", [], "non-empty"),
    ("toml", "x", "kind must be one of"),
])  # fmt: skip
def test_invalid_specs_name_field_and_reason(kind, spec, reason):
    with pytest.raises(ValueError, match=re.escape(reason)) as err:
        StructuredOutput(kind, spec, field="response_format").check()
    assert "response_format" in str(err.value)


def test_slow_compile_is_refused_by_time_limit(llm):
    cache = GrammarCache(llm.tokenizer, llm.engine.arch.vocab_size, {2}, timeout_s=0.05)
    slow = StructuredOutput("regex", r"[a-z]{1,240}", field="structured_outputs.regex")
    with pytest.raises(ValueError, match=r"structured_outputs.regex: compiling the regex took longer than 0.05 s"):
        validate(slow, cache)
    with pytest.raises(ValueError, match="took longer"):  # refused from then on, at once
        cache.submit(slow).result(timeout=0.01)
    validate(StructuredOutput("json", SCHEMA), cache, timeout_s=30)  # a typical schema passes
    cache.shutdown()


def test_invalid_spec_rejected_at_make_request(llm):
    with pytest.raises(ValueError, match="parenthesis"):
        llm.engine.make_request("x", [1, 2], SamplingParams(structured_output=StructuredOutput("regex", "(a")))


def test_chunked_prefill_long_prompt(tiny_llama_path):
    chunked = LLM(str(tiny_llama_path), block_size=BS, num_kv_blocks=64, max_num_batched_tokens=32, dtype="float32", device="cpu")
    prompts = [list(range(3000, 3000 + 150)), list(range(4000, 4000 + 40))]
    outs = chunked.generate(prompts, _json(), use_tqdm=False)
    for out in outs:
        assert out.finish_reason == "stop"
        _valid(out.text)


def test_from_request_maps_the_api_fields():
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}
    assert from_request(response_format=rf) == StructuredOutput("json", SCHEMA, "response_format.json_schema.schema")
    assert from_request(response_format={"type": "json_object"}).kind == "json_object"
    assert from_request(response_format={"type": "text"}) is None and from_request() is None
    assert from_request(structured_outputs={"choice": ["a", "b"]}).spec == ("a", "b")
    assert from_request(structured_outputs={"grammar": 'root ::= "a"'}).kind == "grammar"
    assert from_request(guided_grammar='start: "a"').kind == "lark"
    assert from_request(guided_regex="a+", guided_json=None).field == "guided_regex"
    with pytest.raises(ValueError, match="only one structured output may be given; got response_format, guided_regex"):
        from_request(response_format={"type": "json_object"}, guided_regex="a")
    with pytest.raises(ValueError, match="response_format: type must be"):
        from_request(response_format={"type": "yaml"})
    with pytest.raises(ValueError, match="structured_outputs.json: the schema is not valid JSON"):
        from_request(structured_outputs={"json": "{bad"}).check()
